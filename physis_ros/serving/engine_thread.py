"""The engine's asyncio loop (uvloop) in a thread of its own, beside the front end's threads (the rclpy
executor, a caller of the Server API).

A front end's thread never waits on the engine: streams are added and removed through
:meth:`EngineThread.submit` (a ``concurrent.futures.Future`` the caller polls), observations reach
the engine through ``observe`` callbacks and outputs leave through ``on_output`` callbacks (both
called on the engine's loop, non-blocking), and health is the engine's own snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from physis_ros.runtime.engine import Engine, EngineHealth, ObserveFn, OutputFn, ServedModel, StreamEvent
from physis_ros.runtime.plans import Plan
from physis_ros.runtime.settings import EngineConfig
from physis_ros.timeline import ControlTimeline

log = logging.getLogger("physis.ros")


class EngineThread:
    def __init__(self, config: EngineConfig, clock: Callable[[], float],
                 on_event: Callable[[StreamEvent], None] | None = None):
        self.config = config
        self.clock = clock
        self.on_event = on_event
        self.engine: Engine | None = None
        self.ready = threading.Event()      # the workers are up (or the start failed: see ``failure``)
        self.finished = threading.Event()   # the thread's loop is done (engine stopped)
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        self._thread = threading.Thread(target=self._run, name="physis-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        """Why the engine cannot serve: a start error, or a lost worker it could not (or may not)
        restart. A worker it restarts only resets its streams for a while (see ``on_event``)."""
        if self.error is not None:
            return self.error
        return self.engine.failure if self.engine is not None else None

    def health(self) -> EngineHealth | None:
        return self.engine.health() if self.engine is not None else None

    def snapshot(self) -> dict[str, Any]:
        """The workers and each stream's workers and resets, as plain data, from the engine's own
        :meth:`health` snapshot (taken on its loop: the one place a front end reads the engine)."""
        h = self.health()
        if h is None:
            return {"workers": {}, "streams": {}, "resets": {}}
        workers = {w.name: {"pid": w.pid, "state": w.state, "alive": w.state in ("up", "starting"),
                            "last_seen": h.taken - w.heartbeat_age_s if math.isfinite(w.heartbeat_age_s) else 0.0,
                            "host": w.host, "device": w.device,
                            "stats": {**dict(w.stats), "restarts": w.restarts, "queue": w.queue}}
                   for w in h.workers}
        return {"workers": workers, "streams": {name: list(s.workers) for name, s in h.streams.items()},
                "resets": {name: dict(s.resets) for name, s in h.streams.items()}}

    # ---- streams (any thread) -------------------------------------------------------------------
    def submit(self, make: Callable[[Engine], Coroutine[Any, Any, Any]]) -> concurrent.futures.Future:
        """Run ``make(engine)`` on the engine's loop; its future completes there (poll it, do not block)."""
        if not self.ready.is_set() or self.failure is not None or self._loop is None:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(RuntimeError(f"the engine is not serving ({self.failure or 'not started'})"))
            return failed
        return asyncio.run_coroutine_threadsafe(make(self.engine), self._loop)

    def add_stream(self, name: str, observe: ObserveFn, on_output: OutputFn, *, model: ServedModel, plan: Plan,
                   slo_interval_ms: float | None, release_interval_ms: float | None = None,
                   timeline: ControlTimeline | None = None, release_phase_ms: float | None = None
                   ) -> concurrent.futures.Future:
        return self.submit(lambda engine: engine.add_stream(
            name, observe, on_output, model=model, plan=plan, slo_interval_ms=slo_interval_ms,
            release_interval_ms=release_interval_ms, timeline=timeline, release_phase_ms=release_phase_ms))

    def remove_stream(self, name: str) -> concurrent.futures.Future:
        async def remove(engine: Engine) -> None:
            if name in engine.streams:
                await engine.remove_stream(name)
        return self.submit(remove)

    def observed(self, stream: str) -> None:
        """An observation for ``stream`` is ready: if its feeder waits for one, it takes it now instead of at
        its next poll (nothing is sent to the loop otherwise)."""
        engine, loop = self.engine, self._loop
        if engine is None or loop is None or not engine.waiting_for_observation(stream):
            return
        try:
            loop.call_soon_threadsafe(engine.observed, stream)
        except RuntimeError:
            pass   # the loop is closed: the stream is gone

    def set_slo(self, stream: str, slo_interval_ms: float | None) -> None:
        """Change a stream's SLO interval at run time (deadline-miss flags, task deadlines, its bound)."""
        async def update(engine: Engine) -> None:
            s = engine.streams.get(stream)
            if s is not None:
                s.slo_interval_ms = slo_interval_ms
        self.submit(update)

    # ---- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        # Worker processes are forked from this thread and inherit its signal mask: with SIGINT blocked
        # they ignore a terminal's Ctrl-C (sent to the whole foreground process group), which reaches
        # only the server, which then stops them in order. SIGTERM still reaches them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            if self._stop_requested.is_set():
                return
            self._task = loop.create_task(self._main())
            loop.run_until_complete(self._task)
        except BaseException as exc:  # cancelled during start-up, or an unexpected error
            if self.error is None and not isinstance(exc, asyncio.CancelledError):
                self.error = exc
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self.ready.set()
                self.finished.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        engine = Engine(self.config, clock=self.clock, on_event=self.on_event)
        self.engine = engine
        try:
            await engine.start()  # stops its own workers if it fails
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
        try:
            self.ready.set()
            if not self._stop_requested.is_set():
                await self._stop.wait()
        finally:
            await asyncio.shield(engine.stop())

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop the engine and its workers; True if the thread finished within ``timeout``."""
        self._stop_requested.set()
        loop = self._loop
        if loop is not None and not self.finished.is_set():
            def _stop() -> None:
                if self.ready.is_set() and self._stop is not None:
                    self._stop.set()
                elif self._task is not None:
                    self._task.cancel()  # still starting: Engine.start cleans up its workers
            try:
                loop.call_soon_threadsafe(_stop)
            except RuntimeError:
                pass  # loop already closed
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()
