"""Streams joining and leaving a running server (:class:`StreamHub`).

Every stream comes in the same way, from the serve config at start-up or from a ServeStream goal:
its request is checked (name, namespace, joints, topics), its model resolved with a cost profile
(off the executor thread: a first profile takes a second or two), the model checked against the
robot, the stream admitted by the joint scheduler over the server's workers
(:class:`~physis_ros.serving.capacity.ServerAdmission`), its ROS side made, and finally the engine
places it on its workers and feeds it, paced at its SLO interval: what admission assumed is what
runs. A stream that cannot come in is refused with a named reason and nothing running changes.
Leaving frees its capacity; the other streams never move.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from physis_ros.config import ConfigError
from physis_ros.ros import health
from physis_ros.serving.capacity import Admitted, Rejected, server_admission
from physis_ros.serving.config import (StreamConfig, check_stream_name, resolve_topic, stream_namespace,
                                   stream_topics)
from physis_ros.serving.fit import check_fit, slo_interval_ms
from physis_ros.serving.catalog import ModelCatalog
from physis_ros.ros.streams import RosStream
from physis_ros.ros.tasks import Ticker
from physis_ros.timeline import release_pace_ms

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer

class StreamHub:
    def __init__(self, node: PhysisServer):
        self.node = node
        cfg = node.config
        self.admission, device = server_admission(cfg)
        self.catalog = ModelCatalog(cfg.model, "cpu" if device == "cpu" else "cuda", cfg.admission,
                                    cfg.engine.checkpoint)
        # a few threads: a goal for a model resolved already is not held up by another model being measured
        self.loader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="model-catalog")
        self.joining: dict[str, StreamConfig] = {}   # streams being admitted now (they hold their names and topics)
        self.rejections: list[tuple[str, str, str]] = []   # (stream, reason, detail), newest last

    def close(self) -> None:
        self.loader.shutdown(wait=False, cancel_futures=True)
        self.catalog.close()

    def check(self, name: str, stream: StreamConfig, origin: str = "config") -> None:
        """What no placement can fix, checked before anything is done (Rejected naming it). A bad request is
        refused for what is wrong with it whether or not the server has room: capacity comes later."""
        try:
            check_stream_name(name, "stream")
            stream.check(f"streams.{name}")
            stream.check_topics(name, f"streams.{name}")
        except ConfigError as exc:
            raise Rejected("invalid-request", str(exc)) from None
        if name in self.node.streams or name in self.joining:
            raise Rejected("name-in-use", f"stream '{name}' is already served")
        ns = stream_namespace(name, stream)
        # Streams still being admitted hold their namespace too: two goals racing for one namespace
        # would otherwise both pass this check while the first resolves its model.
        used = {**{st.namespace: other for other, st in self.node.streams.items()},
                **{stream_namespace(other, cfg): other for other, cfg in self.joining.items()}}
        if ns in used:
            raise Rejected("namespace-in-use", f"namespace '{ns}' is used by stream '{used[ns]}'")
        self._check_topics(name, stream, origin)

    def _check_topics(self, name: str, stream: StreamConfig, origin: str) -> None:
        """A stream publishes only on topics nobody else uses: not another stream's inputs or outputs, not the
        server's own. It may read any topic (a world model imagining what another stream commands)."""
        node_ns = self.node.get_namespace()
        outputs, _ = stream_topics(name, stream, node_ns)
        owner = {t: "the server" for t in self.server_topics()}
        for other, cfg in [*((n, st.config) for n, st in self.node.streams.items()), *self.joining.items()]:
            theirs_out, theirs_in = stream_topics(other, cfg, node_ns)
            owner.update({t: f"stream '{other}' ({k} input)" for k, t in theirs_in.items()})
            owner.update({t: f"stream '{other}' ({k} output)" for k, t in theirs_out.items()})
        for which, topic in outputs.items():
            if topic in owner:
                raise Rejected("topic-collision", f"topics.{which} {topic} belongs to {owner[topic]}: a stream "
                                                  f"publishes only on topics of its own")
        if origin != "config" and not self.node.config.admission.goal_outputs_outside_namespace:
            home = resolve_topic((stream.namespace or name).rstrip("/"), node_ns) + "/"
            for which, topic in outputs.items():
                if not topic.startswith(home):
                    raise Rejected("topic-collision", f"topics.{which} {topic} is outside the stream's namespace "
                                                      f"{home[:-1]}: a goal publishes only under its own (the server "
                                                      f"allows more with admission.goal_outputs_outside_namespace)")

    def server_topics(self) -> list[str]:
        """Topics the server itself publishes on (no stream may)."""
        return [resolve_topic(self.node.config.telemetry_topic, self.node.get_namespace()),
                "/diagnostics", "/rosout", "/parameter_events"]

    def check_room(self) -> None:
        """Room for one more stream in the engine (its running streams: goals still being checked hold none)."""
        limit = self.node.config.engine.max_streams
        if len(self.node.streams) >= limit:
            raise Rejected("capacity", f"the server holds engine.max_streams={limit} streams already (remove "
                                       f"one, or raise engine.max_streams)", cause="stream-limit")

    async def join(self, name: str, stream: StreamConfig, origin: str, ticker: Ticker) -> tuple[RosStream, Admitted]:
        """Admit and start a stream (a coroutine on the executor); Rejected with the reason if it cannot."""
        node = self.node
        if node.engine is None or not node.engine.ready.is_set() or node.engine.failure is not None:
            raise Rejected("not-serving", f"the server is {node.state}")
        self.check(name, stream, origin)
        pending = node.config.admission.max_pending_goals
        if len(self.joining) >= pending:
            raise Rejected("busy", f"{len(self.joining)} goals are being admitted already "
                                   f"(admission.max_pending_goals={pending}): ask again shortly")
        self.joining[name] = stream
        try:
            # What one stream of the model needs against all the workers' memory, from its shape alone: a model
            # that can never fit is refused before anything builds or profiles it (a 14B preset once took the
            # server to 20 GB of a 24 GB host while it was measured in-process).
            self.admission.check_memory(self.catalog.config_of(stream.model))
            # serving: a profile measured now yields the CPU to the streams served; with none yet it need not
            resolving = self.loader.submit(self.catalog.resolve, stream.model, bool(node.streams))
            served = await ticker.wait(resolving)
            check_fit(name, stream, served.config)
            slo = slo_interval_ms(stream, served.config)
            pace = release_pace_ms(slo, node.config.admission.pace_margin, stream.control_rate_hz,
                                   stream.cadence == "timeline")    # what runs is what is admitted
            # From here to node.streams[name] nothing awaits: no other goal can take the room checked here.
            self.check_room()
            admitted = self.admission.admit(name, served, pace, slo, paced=stream.cadence == "timeline")
            try:
                st = RosStream(node, name, stream, served, origin, admitted.workers)
                node.streams[name] = st
                node.params.add_stream(name, stream)   # a joined stream's parameters, as a configured one has
                # cadence timeline: one release per admitted interval, the freshest observation each time
                release = pace if stream.cadence == "timeline" else None
                await ticker.wait(node.engine.add_stream(name, st.observe, st.on_output, model=served,
                                                         plan=admitted.plan, slo_interval_ms=slo,
                                                         release_interval_ms=release, timeline=st.timeline,
                                                         release_phase_ms=admitted.placed.phase_ms))
            except Exception as exc:
                self._forget(name)
                node.params.remove_stream(name)
                raise Rejected("not-serving", f"the engine could not start stream '{name}': {exc}") from None
        except Rejected as exc:
            self.rejections.append((name, exc.reason, exc.detail))
            del self.rejections[:-100]
            raise
        finally:
            self.joining.pop(name, None)
        node.get_logger().info(f"stream {name} admitted ({origin}): {st.model_label}, SLO {slo:g} ms, paced "
                               f"every {pace:g} ms, on "
                               f"{', '.join(admitted.workers)}; worker utilisation {self.admission.utilisation()}")
        return st, admitted

    def leave(self, name: str):
        """Stop serving a stream and free its capacity; a future of the engine's removal."""
        st = self.node.streams.get(name)
        if st is not None:
            st.health.gone = True
        future = self.node.engine.remove_stream(name) if self.node.engine is not None else None
        self._forget(name)
        self.node.params.remove_stream(name)   # its parameters leave with it (a configured one's too)
        if name in self.node.configured:       # not waited for again (a restart of the engine reads the config)
            self.node.configured.remove(name)
        self.node.departed.append(name)        # /diagnostics says so once
        self.node.get_logger().info(f"stream {name} removed; worker utilisation {self.admission.utilisation()}")
        return future

    def forget_all(self) -> None:
        """The engine stops: every stream is dropped; the configured ones keep their parameters (the engine
        admits them again when it restarts), those that joined through goals lose theirs."""
        for name in list(self.node.streams):
            joined = self.node.streams[name].origin != "config"
            self._forget(name)
            if joined:
                self.node.params.remove_stream(name)

    def _forget(self, name: str) -> None:
        st = self.node.streams.pop(name, None)
        if st is not None:
            # its totals stay in the exit summary
            self.node.ended[name] = st.report(health.engine_snapshot(self.node)["resets"].get(name, {}))
            st.destroy()
        self.admission.remove(name)
