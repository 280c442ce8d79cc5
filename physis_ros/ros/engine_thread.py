"""The engine's asyncio loop (uvloop) in a thread of its own, beside the rclpy executor.

The executor thread never waits on the engine: observations reach it through
``observe`` callbacks (called on the engine's loop, non-blocking) and outputs
leave through ``on_output`` callbacks (also on the engine's loop).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvloop

from physis_ros.runtime.settings import EngineConfig
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.engine import Engine, ObserveFn, OutputFn, ServedModel, StreamEvent
from physis_ros.runtime.planner import resolve_plan

log = logging.getLogger("physis.ros")


@dataclass
class StreamSpec:
    name: str
    observe: ObserveFn
    on_output: OutputFn
    slo_interval_ms: float | None = None


class EngineThread:
    def __init__(self, model: ModelConfig, config: EngineConfig, streams: list[StreamSpec],
                 clock: Callable[[], float], on_event: Callable[[StreamEvent], None] | None = None):
        self.model = model
        self.on_event = on_event
        self.config = config
        self.specs = streams
        self.clock = clock
        self.engine: Engine | None = None
        self.ready = threading.Event()      # engine started and all streams added
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
        restart. A worker it restarts only fails its streams for a while (see ``on_event``)."""
        if self.error is not None:
            return self.error
        return self.engine.failure if self.engine is not None else None

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
        try:
            resolved = resolve_plan(self.model, self.config)
            self.served = ServedModel(self.model, self.config.checkpoint, resolved.profile)
            self.plan = resolved.plan
            engine = Engine(self.config, clock=self.clock, on_event=self.on_event)
            self.engine = engine
            await engine.start()  # stops its own workers if it fails
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
        try:
            for spec in self.specs:
                await engine.add_stream(spec.name, spec.observe, spec.on_output, model=self.served, plan=self.plan,
                                        slo_interval_ms=spec.slo_interval_ms)
            self.ready.set()
            if not self._stop_requested.is_set():
                await self._stop.wait()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
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

    def set_slo(self, stream: str, slo_interval_ms: float | None) -> None:
        """Change a stream's SLO interval at run time (deadline-miss flags, task deadlines), from any
        thread: the spec (for a stream not added yet) and, on the loop, the engine's stream state."""
        for spec in self.specs:
            if spec.name == stream:
                spec.slo_interval_ms = slo_interval_ms
        loop, engine = self._loop, self.engine
        if loop is None or engine is None:
            return

        def _set() -> None:
            s = engine.streams.get(stream)
            if s is not None:
                s.slo_interval_ms = slo_interval_ms
        try:
            loop.call_soon_threadsafe(_set)
        except RuntimeError:
            pass  # loop already closed
