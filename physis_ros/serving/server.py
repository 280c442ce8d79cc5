"""The serving application without ROS (:class:`Server`): workers, admission, streams joining and
leaving, observations in and chunks out.

::

    from physis_ros.serving import Server, Rejected
    with Server.from_config("config/serve.yaml") as server:     # starts the workers it configures
        session = server.join("r0", model="tiny-wam", slo_ms=150, joint_names=[...])   # or Rejected
        session.observe(images={"camera": frame}, state=joints, stamp_s=time.time())
        chunk = session.next_chunk(timeout_s=5.0)                 # Chunk: .index, .epoch, .actions, ...
        server.leave("r0")

Every stream comes in the same way, whether named in the config (admitted at :meth:`Server.start`) or
joining later (:meth:`Server.join`): its request is checked for what no placement can fix (a field, its
name), its model resolved with a cost profile (:mod:`~physis_ros.serving.catalog`), checked against the
stream (:mod:`~physis_ros.serving.fit`), admitted by the joint scheduler over the server's workers
(:mod:`~physis_ros.serving.capacity`) and handed to the engine with the placement admission chose, paced
at the interval admission booked. A stream that cannot come in raises :class:`Rejected` with one of the
documented reason labels, and nothing running changes; leaving frees its capacity and the other
streams never move. A housekeeping thread feeds admission what the workers and streams measure (its
load and spread calibrations) and notices an engine failure. Listeners (:meth:`Server.subscribe`) hear
each stream joined, rejected, reset, re-admitted and ended, with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from physis_ros import heap
from physis_ros.config import ConfigError, from_mapping
from physis_ros.runtime.streams import StreamEvent
from physis_ros.serving.capacity import Rejected, worker_index
from physis_ros.serving.catalog import ModelCatalog, check_config_models
from physis_ros.serving.config import ServeConfig, StreamConfig, check_stream_name, load_serve_config, serve_config
from physis_ros.serving.engine_thread import EngineThread
from physis_ros.serving.policies import server_admission
from physis_ros.serving.config_keys import check_runtime_change
from physis_ros.serving.file_inputs import read_file_inputs
from physis_ros.serving.fit import check_fit, check_stream_model, slo_interval_ms, stream_timeline, whole_steps
from physis_ros.serving.intake import StreamInput
from physis_ros.serving.session import Chunk, Session, Source
from physis_ros.timeline import release_pace_ms

EVENT_KINDS = ("joined", "rejected", "reset", "readmitted", "ended")


@dataclass(frozen=True)
class ServerEvent:
    """Something that happened to a stream: ``kind`` one of :data:`EVENT_KINDS`; ``reason`` a reason
    label for ``rejected`` (:data:`~physis_ros.serving.capacity.REASONS`), the cause for ``reset``, and
    ``left``, ``failed`` or ``shutdown`` for ``ended``; ``detail`` says more; ``time`` on the server clock."""

    stream: str
    kind: str
    reason: str
    detail: str = ""
    time: float = 0.0
    lost_chunks: int = 0    # for ``reset``: the chunks in flight it lost


class Server:
    """The serving application (see the module's docstring). ``config``: a validated ServeConfig;
    ``clock``: the server clock in seconds (``time.time``; a front end may give its own, e.g. simulated
    time), on which observation stamps, chunk telemetry and the control timeline are counted."""

    def __init__(self, config: ServeConfig, *, clock: Callable[[], float] | None = None,
                 log: logging.Logger | None = None):
        self.config = config
        self.clock = clock or time.time
        self.log = log or logging.getLogger("physis.serving")
        self.model = check_config_models(config)
        self.admission, device, self.policy = server_admission(config)
        self.catalog = ModelCatalog(config.model, "cpu" if device == "cpu" else "cuda", config.admission,
                                    config.engine.checkpoint, corun_slowdown=self.policy.corun_slowdown(config))
        self.engine: EngineThread | None = None
        self._stopped = False
        self.startup: dict[str, str] = {}     # config stream -> "admitted" or its rejection
        self.ended: dict[str, dict[str, Any]] = {}   # totals of streams that left
        self.rejections: list[tuple[str, str, str]] = []   # (stream, reason, detail), newest last
        self._sessions: dict[str, Session] = {}
        self._joining: set[str] = set()
        self._lock = threading.RLock()      # the streams, admission's books
        self._listeners: list[Callable[[ServerEvent], None]] = []
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: str | Path | Mapping[str, Any] | ServeConfig | None = None,
                    overrides: Mapping[str, Any] | None = None, **kwargs: Any) -> Server:
        """A server (not started: ``with`` or :meth:`start` starts it) of a serve config file (None: the
        shipped one), a mapping of one, or a ServeConfig; ``overrides`` (a nested mapping) over the file's
        keys. ConfigError names the dotted key of a bad value."""
        if isinstance(config, ServeConfig):
            cfg = config
        elif isinstance(config, Mapping):
            cfg = serve_config({**config, **(overrides or {})})
        else:
            cfg = load_serve_config(config, dict(overrides or {}))
        return cls(cfg, **kwargs)

    # ---- life ------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``unstarted``, ``starting`` (the workers are coming up), ``serving``, ``failed`` (the workers could
        not start, or one was lost for good: :attr:`failure` says why) or ``stopped``."""
        engine = self.engine
        if engine is None:
            return "stopped" if self._stopped else "unstarted"
        if engine.failure is not None:
            return "failed"
        if self._stopped:
            return "stopped"
        return "serving" if engine.ready.is_set() else "starting"

    @property
    def failure(self) -> BaseException | None:
        return self.engine.failure if self.engine is not None else None

    def __enter__(self) -> Server:
        if self.state == "unstarted":
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the workers (RuntimeError if they cannot), then admit the config's streams one by one (a
        stream refused is logged, recorded in :attr:`startup` and heard as a ``rejected`` event)."""
        self.launch()
        if not self.engine.ready.wait(timeout_s) or self.engine.failure is not None:
            failure = self.engine.failure or f"the workers did not start within {timeout_s:g} s"
            self.close()
            raise RuntimeError(f"the engine could not start: {failure}")
        for name, stream in self.config.streams.items():
            try:
                self.admit(name, stream, origin="config")
                self.startup[name] = "admitted"
            except Rejected as exc:
                self.startup[name] = f"{exc.reason}: {exc.detail}"
                self.log.error(f"config stream {name} NOT admitted ({exc.reason}): {exc.detail}")

    def launch(self) -> None:
        """Start the workers and return at once (:attr:`state` is ``starting`` until they serve); what
        :meth:`start` does first, for a front end that must not wait (it admits the config's streams
        itself, through :meth:`admit`, once :attr:`state` is ``serving``)."""
        if self.state != "unstarted":
            raise RuntimeError(f"the server is {self.state}; a server starts once")
        engine = dataclasses.replace(self.config.engine, cpu_host="on" if self.policy.cpu_host else "off")  # policy
        self.engine = EngineThread(engine, clock=self.clock, on_event=self.on_engine_event)
        self.engine.start()
        self._housekeeper = threading.Thread(target=self._housekeeping, name="physis-housekeeping", daemon=True)
        self._housekeeper.start()

    def close(self, timeout_s: float = 20.0) -> bool:
        """Stop every stream (``ended``: shutdown) and the workers; True if the engine stopped in time."""
        self._stop.set()
        self._stopped = True
        with self._lock:
            names = list(self._sessions)
        for name in names:
            self._drop(name, "shutdown", "the server is stopping")
        done = self.engine.stop(timeout_s) if self.engine is not None else True
        self.catalog.close()
        return done

    # ---- streams ------------------------------------------------------------------------------------
    def join(self, name: str, model: str = "", slo_ms: float | None = None, *,
             on_chunk: Callable[[Chunk], None] | None = None, source: Source | None = None,
             **fields: Any) -> Session:
        """Admit stream ``name`` of ``model`` (a preset, model YAML or checkpoint; empty: the config's
        default) with SLO interval ``slo_ms`` (None: its control timeline's); ``fields``: the stream's other
        keys as a serve config names them (``joint_names=[...]``, ``control_rate_hz=``,
        ``execution_horizon=``, ``handoff=``, ``image={...}``, ``max_age_s=``, ...). ``on_chunk``: called
        with each finished chunk on the engine's thread (it must not block), instead of queueing it for
        :meth:`Session.next_chunk`. ``source``: for a simulator, called with the chunk's index when its
        observation is due, it returns the model's observation tensors and their stamp (instead of
        :meth:`Session.observe`). Raises :class:`Rejected` (``.reason`` a documented label)."""
        mapping = {**fields, "model": model}
        if slo_ms is not None:
            mapping["slo_interval_ms"] = slo_ms
        try:
            check_stream_name(name, "stream")
            stream = from_mapping(StreamConfig, mapping, f"streams.{name}")
        except ConfigError as exc:
            self._rejected(name, Rejected("invalid-request", str(exc)))
        return self.admit(name, stream, on_chunk=on_chunk, source=source)

    def admit(self, name: str, stream: StreamConfig, *, origin: str = "api",
              on_chunk: Callable[[Chunk], None] | None = None, source: Source | None = None) -> Session:
        """Admit a stream given as a StreamConfig (what :meth:`join` builds from its keywords)."""
        try:
            session = self._admit(name, stream, origin, on_chunk, source)
        except Rejected as exc:
            self._rejected(name, exc)
        self.log.info(f"stream {name} admitted ({origin}): {session.model.name}, SLO {session.slo_interval_ms:g} "
                      f"ms, on {', '.join(session.workers)}; worker utilisation {self.admission.utilisation()}")
        self._emit(ServerEvent(name, "joined", origin, f"on {', '.join(session.workers)}", self.clock()))
        return session

    def _admit(self, name: str, stream: StreamConfig, origin: str, on_chunk, source) -> Session:
        # What is wrong with the request first, whether or not there is room: capacity comes later.
        try:
            check_stream_name(name, "stream")
            stream.check(f"streams.{name}")
        except ConfigError as exc:
            raise Rejected("invalid-request", str(exc)) from None
        engine = self.engine
        if self.state != "serving" or engine is None or engine.failure is not None:
            raise Rejected("not-serving", f"the server is {self.state}")
        pending = self.config.admission.max_pending_goals
        with self._lock:
            if name in self._sessions or name in self._joining:
                raise Rejected("name-in-use", f"stream '{name}' is already served")
            if len(self._joining) >= pending:
                raise Rejected("busy", f"{len(self._joining)} streams are being admitted already "
                                       f"(admission.max_pending_goals={pending}): ask again shortly")
            self._joining.add(name)
        try:
            # The stream against its model (joints, timeline, the files it reads) before anything is measured;
            # a model that can never fit the workers' memory is refused from its shape, before it is profiled.
            model = self.catalog.config_of(stream.model)
            check_fit(name, stream, model)
            try:
                fixed = read_file_inputs(f"streams.{name}", stream.inputs, model)
            except ConfigError as exc:
                raise Rejected("invalid-request", str(exc)) from None
            self.admission.check_memory(model)
            served = self.catalog.resolve(stream.model, bool(self._sessions))
            if source is None and fixed and set(fixed) == set(served.config.observation_shapes):
                source = self._file_source      # every input from a file: a chunk whenever the timeline says
            slo = slo_interval_ms(stream, served.config)
            paced = stream.cadence == "timeline"
            pace = release_pace_ms(slo, self.config.admission.pace_margin, stream.control_rate_hz,
                                   whole_steps(stream, model))
            with self._lock:
                self._check_room()
                admitted = self.admission.admit(name, served, pace, slo, paced=paced,
                                                latency_bound=stream.cadence == "request")
            cfg = self.config
            paired = [k for k in served.config.observation_shapes if k != "image" and k not in fixed]
            timeline = stream_timeline(stream, served.config, cfg.deterministic, slo, cfg.admission.pace_margin)
            session = Session(name, stream, served, origin, admitted.workers, slo,
                              StreamInput(cfg.deterministic, cfg.deterministic_queue, cfg.pair_timeout_s,
                                          stream.max_age_s, self.clock, paired),
                              self.clock, on_chunk, cfg.stats_window, source, timeline,
                              wake=lambda: engine.observed(name), fixed=fixed, log=self.log,
                              warn_period_s=cfg.warn_throttle_s)
            future = engine.add_stream(name, session.take, session.deliver, model=served, plan=admitted.plan,
                                       slo_interval_ms=slo, release_interval_ms=pace if paced else None,
                                       timeline=timeline,
                                       release_phase_ms=admitted.placed.phase_ms)
            try:
                future.result(timeout=cfg.admission.profile_timeout_s)
            except (Exception, FutureTimeout) as exc:
                with self._lock:
                    self.admission.remove(name)
                engine.remove_stream(name)
                raise Rejected("not-serving", f"the engine could not start stream '{name}': {exc}") from None
            with self._lock:
                self._sessions[name] = session
            return session
        finally:
            with self._lock:
                self._joining.discard(name)

    def _file_source(self, chunk: int) -> tuple[dict, float]:
        """The observation of a stream whose every input is read from a file: nothing more (the session adds
        its files' tensors), stamped now."""
        return {}, self.clock()

    def _check_room(self) -> None:
        limit = self.config.engine.max_streams
        if len(self.admission.admitted) >= limit:
            raise Rejected("capacity", f"the server holds engine.max_streams={limit} streams already (remove "
                                       f"one, or raise engine.max_streams)", cause="stream-limit")

    def leave(self, name: str, timeout_s: float | None = 10.0, reason: str = "left") -> None:
        """Stop serving stream ``name`` and free its capacity at once (KeyError if it is not served); its
        readers hear it ended (``reason``). Waits up to ``timeout_s`` for the engine to let go of it (None:
        not at all)."""
        if not self._drop(name, reason, f"the stream {reason}", timeout_s):
            raise KeyError(f"no stream '{name}' is served (served: {', '.join(self.streams()) or 'none'})")

    def _drop(self, name: str, reason: str, detail: str, timeout_s: float | None = 10.0) -> bool:
        with self._lock:
            session = self._sessions.pop(name, None)
            if session is None:
                return False
            self.admission.remove(name)
        session.end(reason)
        resets = self.engine.snapshot()["resets"].get(name) if self.engine is not None else None   # before it goes
        if self.engine is not None:
            future = self.engine.remove_stream(name)
            if timeout_s is not None:
                try:
                    future.result(timeout=timeout_s)
                except (Exception, FutureTimeout):
                    pass   # the engine is gone or failed: nothing of the stream runs any more
        self.ended[name] = session.totals(resets)
        self.log.info(f"stream {name} removed ({reason}); worker utilisation {self.admission.utilisation()}")
        self._emit(ServerEvent(name, "ended", reason, detail, self.clock()))
        return True

    def session(self, name: str) -> Session:
        """The session of a served stream (a config stream's, too); KeyError if it is not served."""
        with self._lock:
            if name not in self._sessions:
                raise KeyError(f"no stream '{name}' is served")
            return self._sessions[name]

    def streams(self) -> dict[str, dict[str, Any]]:
        """The streams served: model, origin, SLO interval (ms), workers, and state (serving, resetting)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return {s.name: {"model": s.model.name, "origin": s.origin, "slo_interval_ms": s.slo_interval_ms,
                         "workers": list(s.workers), "state": "resetting" if s.health.failed else "serving"}
                for s in sessions}

    # ---- run-time changes ---------------------------------------------------------------------------
    def check_update(self, config: ServeConfig) -> None:
        """ConfigError (naming the key) if ``config`` changes a key that does not change at run time
        (:func:`~physis_ros.serving.config_keys.is_runtime`), or does not fit a served stream's model (its SLO
        within its control timeline)."""
        check_runtime_change(self.config, config)
        with self._lock:
            sessions = dict(self._sessions)
        for name, s in config.streams.items():
            if name in sessions:
                check_stream_model(f"streams.{name}", s, sessions[name].model)

    def update(self, config: ServeConfig) -> None:
        """Take a changed config at run time: each served stream whose keys changed reads them from its next
        observation and chunk on (input age, SLO interval); placements do not move."""
        old, self.config = self.config, config
        with self._lock:
            sessions = dict(self._sessions)
        for session in sessions.values():
            session.throttle.period_s = config.warn_throttle_s
        for name, s in config.streams.items():
            session = sessions.get(name)
            if session is None or s == old.streams.get(name):
                continue
            session.config = s
            session.input.max_age_s = s.max_age_s
            slo = slo_interval_ms(s, session.model)
            if slo != session.slo_interval_ms:
                session.slo_interval_ms = slo
                if self.engine is not None:
                    self.engine.set_slo(name, slo)

    # ---- events ---------------------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[ServerEvent], None]) -> Callable[[], None]:
        """Call ``listener`` with every :class:`ServerEvent` from now on (on the thread where it happened:
        it must not block); returns a function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _emit(self, event: ServerEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                self.log.exception(f"an event listener failed on {event}")

    def _rejected(self, name: str, exc: Rejected):
        self.rejections.append((name, exc.reason, exc.detail))
        del self.rejections[:-100]
        self._emit(ServerEvent(name, "rejected", exc.reason, exc.detail, self.clock()))
        raise exc

    def on_engine_event(self, event: StreamEvent) -> None:
        session = self._sessions.get(event.stream)
        if session is None:
            return
        session.on_event(event)
        kind = "reset" if event.kind == "failed" else event.kind
        self._emit(ServerEvent(event.stream, kind, event.cause or event.kind, event.reason, self.clock(),
                               event.lost_chunks))

    # ---- health -------------------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        """Admission's calibrations fed at the diagnostics period; an engine failure ends every stream."""
        while not self._stop.wait(self.config.diagnostics_period_s):
            try:
                self.calibrate()
            except Exception:
                self.log.exception("housekeeping failed")

    def calibrate(self) -> None:
        """Feed admission what the workers and streams measured (its load and spread calibrations), and
        end every stream if the engine failed."""
        engine = self.engine
        if engine is None:
            return
        failure = engine.failure
        if failure is not None:
            with self._lock:
                names = list(self._sessions)
            for name in names:
                self._drop(name, "failed", str(failure), timeout_s=None)
            return
        if not engine.ready.is_set():
            return
        mono, now = time.monotonic(), self.clock()
        for wname, w in engine.snapshot()["workers"].items():
            index = worker_index(wname)
            if index >= 0 and w["state"] == "up" and "compute_ms" in w["stats"]:
                with self._lock:
                    self.admission.observe_load(index, mono, float(w["stats"]["compute_ms"]))
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            records = s.records()[0]
            with self._lock:
                self.admission.observe_intervals(s.name, now, [(r.emit, r.interval_ms) for r in records])

    def stats(self) -> dict[str, Any]:
        """What /diagnostics shows, as plain data: ``engine`` (state, failure, the server's RSS),
        ``workers`` (per worker: pid, state, host, device, its counters, memory included, and admission's
        load factor) and ``streams`` (per stream: rate, intervals, latency and deadline misses over
        ``diagnostics_window_s``, inputs received and rejected, resets, chunks lost, its SLO interval, cadence and
        seconds since it was admitted)."""
        engine = self.engine
        snap = engine.snapshot() if engine is not None else {"workers": {}, "streams": {}, "resets": {}}
        failure = engine.failure if engine is not None else None
        workers = {}
        for wname, w in snap["workers"].items():
            index = worker_index(wname)
            workers[wname] = {**w, "admission_load_factor": round(self.admission.load_factor(index), 3)
                              if index >= 0 else None}
        now = self.clock()
        with self._lock:
            sessions = list(self._sessions.values())
        mono = time.monotonic()
        streams = {s.name: {**s.figures(now, self.config.diagnostics_window_s, snap["resets"].get(s.name)),
                            "admission_spread_ms": self.admission.spread_ms(s.name),
                            "slo_interval_ms": s.slo_interval_ms, "cadence": s.config.cadence,
                            "serving_s": mono - s.admitted_mono} for s in sessions}
        return {"engine": {"state": self.state, "failure": None if failure is None else str(failure),
                           "model": self.model.name, "rss_mb": heap.rss_mb(os.getpid()),
                           "utilisation": self.admission.utilisation()},
                "workers": workers, "streams": streams}

    def report(self) -> dict[str, dict[str, Any]]:
        """Totals per stream for an exit summary (:meth:`Session.totals`): every stream served now or before,
        and each config stream not admitted (``not_admitted``: its rejection)."""
        engine = self.engine
        resets = engine.snapshot()["resets"] if engine is not None else {}
        with self._lock:
            sessions = list(self._sessions.values())
        out = {**self.ended, **{s.name: s.totals(resets.get(s.name)) for s in sessions}}
        for name, verdict in self.startup.items():
            if verdict != "admitted":
                out.setdefault(name, {"chunks": 0, "rejected": {}, "received": {}, "failures": 0, "lost_chunks": 0,
                                      "not_admitted": verdict})
        return out
