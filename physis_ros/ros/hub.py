"""Streams joining and leaving the node (:class:`StreamHub`).

Every stream comes in the same way, from the serve config at start-up or from a ServeStream goal: what
ROS adds to a request is checked here first (the stream's name, namespace and topics: a stream publishes
only on topics of its own), then the server admits it (:meth:`physis_ros.serving.server.Server.admit`, on
a loader thread: a first profile takes a second or two) and its ROS side is made
(:class:`~physis_ros.ros.stream_topics.RosStream`). A stream that cannot come in is refused with a named reason
and nothing running changes. Leaving frees its capacity; the other streams never move. The hub keeps who is
served on the node's topics, who left and which config streams the engine admits when it starts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from physis_ros.config import ConfigError
from physis_ros.ros.stream_topics import RosStream
from physis_ros.ros.ticker import Ticker
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import (StreamConfig, check_stream_name, resolve_topic, stream_namespace,
                                       stream_topics)

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer
    from physis_ros.serving.session import Chunk


class StreamHub:
    def __init__(self, node: PhysisServer):
        self.node = node
        # a few threads: a goal for a model resolved already is not held up by another model being measured
        self.loader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="admission")
        self.joining: dict[str, StreamConfig] = {}   # streams being admitted now (they hold their names and topics)
        self.streams: dict[str, RosStream] = {}      # the streams served on the node's topics
        self.configured: list[str] = list(node.config.streams)   # the streams the engine admits when it starts
        self.departed: list[str] = []                # streams that left since the last /diagnostics (said there once)

    def close(self) -> None:
        self.loader.shutdown(wait=False, cancel_futures=True)

    def check(self, name: str, stream: StreamConfig, origin: str = "config") -> None:
        """What no placement can fix, checked before anything is done (Rejected naming it). A bad request is
        refused for what is wrong with it whether or not the server has room: capacity comes later."""
        try:
            check_stream_name(name, "stream")
            stream.check(f"streams.{name}")
            stream.check_topics(name, f"streams.{name}")
        except ConfigError as exc:
            raise Rejected("invalid-request", str(exc)) from None
        if name in self.streams or name in self.joining:
            raise Rejected("name-in-use", f"stream '{name}' is already served")
        ns = stream_namespace(name, stream)
        # Streams still being admitted hold their namespace too: two goals racing for one namespace
        # would otherwise both pass this check while the first resolves its model.
        used = {**{st.namespace: other for other, st in self.streams.items()},
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
        for other, cfg in [*((n, st.config) for n, st in self.streams.items()), *self.joining.items()]:
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

    async def join(self, name: str, stream: StreamConfig, origin: str, ticker: Ticker) -> RosStream:
        """Admit and start a stream (a coroutine on the executor); Rejected with the reason if it cannot."""
        node, server = self.node, self.node.server
        if server is None or server.state != "serving":
            raise Rejected("not-serving", f"the server is {node.state}")
        self.check(name, stream, origin)
        pending = node.config.admission.max_pending_goals   # goals wait here for the loader's threads
        if len(self.joining) >= pending:
            raise Rejected("busy", f"{len(self.joining)} goals are being admitted already "
                                   f"(admission.max_pending_goals={pending}): ask again shortly")
        self.joining[name] = stream
        try:
            made: list[RosStream] = []

            def on_chunk(chunk: Chunk) -> None:   # (none before its RosStream: only its subscriptions feed it)
                made[0].on_chunk(chunk)

            session = await ticker.wait(self.loader.submit(server.admit, name, stream, origin=origin,
                                                           on_chunk=on_chunk))
            try:
                made.append(RosStream(node, session))
            except Exception as exc:
                server.leave(name, timeout_s=None, reason="failed")
                raise Rejected("not-serving", f"stream '{name}' could not be set up: {exc}") from None
            self.streams[name] = made[0]
            node.params.add_stream(name, stream)   # a joined stream's parameters, as a configured one has
        finally:
            self.joining.pop(name, None)
        return made[0]

    def leave(self, name: str) -> None:
        """Stop serving a stream and free its capacity (the engine lets go of it in the background)."""
        st = self.streams.get(name)
        if st is not None:
            st.health.gone = True
        if self.node.server is not None:
            try:
                self.node.server.leave(name, timeout_s=None)
            except KeyError:
                pass   # the server dropped it already (its engine failed)
        self._forget(name)
        self.node.params.remove_stream(name)   # its parameters leave with it (a configured one's too)
        if name in self.configured:       # not waited for again (a restart of the engine reads the config)
            self.configured.remove(name)
        self.departed.append(name)        # /diagnostics says so once

    def forget_all(self) -> None:
        """The engine stops: every stream is dropped; the configured ones keep their parameters (the engine
        admits them again when it restarts), those that joined through goals lose theirs."""
        for name in list(self.streams):
            joined = self.streams[name].origin != "config"
            self._forget(name)
            if joined:
                self.node.params.remove_stream(name)

    def _forget(self, name: str) -> None:
        st = self.streams.pop(name, None)
        if st is not None:
            st.destroy()
