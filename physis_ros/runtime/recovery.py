"""Liveness and recovery of the engine's streams.

Every chunk in flight has a bound: ``chunk_timeout_factor`` x the stream's
in-flight limit x its SLO interval (1 s without one), at least
``chunk_timeout_floor_s``, plus ``warmup_grace_s`` until the stream's current
incarnation has emitted its first chunk. A chunk past its bound, or reported
lost (a worker dropped it, could not send it, or its stage failed), or one that
arrives malformed or non-finite, resets its stream exactly as a lost worker
does: the epoch advances (so nothing of the old incarnation can leak into the
new one), the chunks in flight are counted as lost, and the stream is placed
again with fresh KV as soon as all of its workers are up; then feeding resumes.
A stream only fails for good when a worker it needs cannot be brought back
(the pool's restart budget).

A flood of garbage on a socket (malformed messages on the engine's output or
control socket, or on a worker's: counted by the engine, the pool and the
workers' heartbeats) queues the real messages behind it: their chunks are late,
not lost. While garbage keeps arriving (and for ``FLOOD_QUIET_S`` after), a chunk
past its bound gets one more bound instead of resetting its stream; it resets
only if it is still missing once the sockets are quiet. Before, the first of
three 2 s floods on a worker's socket reset a stream (chunk_timeout, 2 lost).

The watcher also publishes the engine's health snapshot several times a
second, so readers in other threads never touch the engine's live state.

Recovery is the engine's supervisor: it decides about streams through the chunk
scheduler's public interface (which chunks are overdue, reset, re-admitted,
failed for good) and acts through the engine's (pause a stream's feeder, place
it again, wake its waiters); it keeps its own re-admission tasks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING

from physis_ros.runtime import protocol as p
from physis_ros.runtime.streams import EngineHealth, StreamEvent, StreamHealth, StreamState, WorkerHealth
from physis_ros.runtime.workers import EngineError, WorkerPool, WorkerProc

if TYPE_CHECKING:
    from physis_ros.runtime.engine import Engine

log = logging.getLogger("physis.engine")
WATCH_PERIOD_S = 0.05
SNAPSHOT_PERIOD_S = 0.1
READMIT_BACKOFF_S = (0.05, 2.0)
FLOOD_QUIET_S = 1.0   # garbage seen this recently: a late chunk is waited for, not reset


class Recovery:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.snapshot = EngineHealth(time.monotonic(), None, [], {}, {})
        self.garbage = 0                  # malformed/unknown messages counted so far (see garbage_count)
        self.garbage_at = -FLOOD_QUIET_S  # time.monotonic() the count last moved
        self.flood_waits = 0              # deadlines extended because the sockets were flooded
        self.readmissions: dict[str, asyncio.Task] = {}   # stream -> its re-admission under way

    def attach(self, pool: WorkerPool) -> None:
        pool.on_lost = self.worker_lost
        pool.on_gone = self.worker_gone
        pool.on_task_lost = self.task_lost

    def forget(self, name: str) -> None:
        """The stream left: stop re-admitting it."""
        task = self.readmissions.pop(name, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        for name in list(self.readmissions):
            self.forget(name)

    # ---- bounds ----------------------------------------------------------------------------------
    def garbage_count(self) -> int:
        """Malformed or unknown messages seen so far on the engine's sockets and the workers'."""
        e = self.engine
        n = e.dropped["malformed"]
        pool = e.pool
        if pool is not None:
            n += pool.counts["unknown_sender"] + pool.counts["bad_control"]
            n += sum(w.stats.bad_messages for w in pool.workers.values() if w.stats is not None)
        return n

    def flooded(self, now: float) -> bool:
        """Garbage arrived within the last FLOOD_QUIET_S."""
        count = self.garbage_count()
        if count != self.garbage:
            self.garbage, self.garbage_at = count, now
        return now - self.garbage_at < FLOOD_QUIET_S

    def check_deadlines(self, now: float) -> None:
        """Reset each stream whose oldest chunk in flight is past its bound, unless the sockets are flooded."""
        flooded = self.flooded(now)
        for s, c in self.engine.scheduler.overdue(now):
            if flooded:
                self.engine.scheduler.extend(s, c, now)   # behind the garbage in a socket's queue: late, not lost
                self.flood_waits += 1
                self.engine.throttle.log(log, logging.WARNING, "flood_wait",
                                         f"stream {s.name}: chunk {c} is late while garbage floods the sockets "
                                         f"({self.garbage} malformed messages so far): waiting, not resetting")
            else:
                self.reset(s, f"chunk {c} did not come out of its pipeline within {s.inflight[c].bound_s:.2f} s",
                           "chunk_timeout")

    async def watch(self) -> None:
        next_snapshot = 0.0
        while True:
            now = time.monotonic()
            self.check_deadlines(now)
            if now >= next_snapshot:
                self.snapshot = self.take_snapshot()
                next_snapshot = now + SNAPSHOT_PERIOD_S
            await asyncio.sleep(WATCH_PERIOD_S)

    # ---- resets ----------------------------------------------------------------------------------
    def reset(self, s: StreamState, reason: str, cause: str) -> None:
        """Drop a stream's current incarnation and place it again (see the module docstring)."""
        engine = self.engine
        lost = engine.scheduler.reset(s, reason, cause)
        if lost is None:  # a reset is already under way (or the stream failed for good)
            return
        engine.pause(s.name)
        engine.throttle.log(log, logging.ERROR, f"reset:{s.name}:{cause}",
                            f"stream {s.name} reset ({cause}): {reason}; {lost} chunk(s) lost")
        engine.event(StreamEvent(s.name, "failed", reason, lost, cause))
        if engine.scheduler.done(s):
            engine.finish(s.name)
            return
        self.readmissions[s.name] = asyncio.create_task(self._readmit(s), name=f"readmit-{s.name}")

    async def _readmit(self, s: StreamState) -> None:
        engine = self.engine
        delay = READMIT_BACKOFF_S[0]
        try:
            while engine.streams.get(s.name) is s and not s.gone:
                await engine.pool.wait_up([w.name for w in engine.workers_of(s)])
                try:
                    await engine.resume(s)  # start_stream under the new epoch: fresh KV, old tasks dropped
                except EngineError as exc:
                    engine.throttle.log(log, logging.WARNING, f"readmit:{s.name}",
                                        f"re-admitting stream {s.name} failed, retrying: {exc}")
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, READMIT_BACKOFF_S[1])
                    continue
                engine.event(StreamEvent(s.name, "readmitted", f"epoch {s.epoch}: fresh KV on "
                                                               f"{', '.join(w.name for w in engine.workers_of(s))}"))
                return
        finally:
            if self.readmissions.get(s.name) is asyncio.current_task():
                del self.readmissions[s.name]

    def task_lost(self, msg: p.TaskLost) -> None:
        links = self.engine.links
        if msg.reason == "link_failed" and msg.peer and links is not None:
            links.link_failed(msg.worker, msg.peer)  # the stream's next start builds the pair afresh
        s = self.engine.scheduler.owner(msg.stream, msg.epoch, msg.chunk)
        if s is not None:
            self.reset(s, f"chunk {msg.chunk} lost on {msg.worker} ({msg.reason}): {msg.detail}", msg.reason)

    def worker_lost(self, w: WorkerProc, reason: str) -> None:
        if self.engine.links is not None:
            self.engine.links.worker_lost(w.name)
        for s in self.engine.scheduler.streams_on(w.index):
            self.reset(s, reason, "worker_lost")

    def worker_gone(self, w: WorkerProc, reason: str) -> None:
        """A worker that cannot come back: its streams fail for good and the engine reports failure."""
        engine = self.engine
        log.error("%s", reason)
        engine.fail(reason)
        for s in engine.scheduler.streams_on(w.index):
            engine.scheduler.fail(s, reason)
            self.forget(s.name)
            engine.finish(s.name)

    # ---- health ----------------------------------------------------------------------------------
    def take_snapshot(self) -> EngineHealth:
        engine, now = self.engine, time.monotonic()
        host = socket.gethostname()
        workers = []
        if engine.pool is not None:
            for w in engine.pool.workers.values():
                state = "up" if w.alive else "restarting" if w.restarting else \
                    "starting" if not engine.started else "down"
                stats = {f: getattr(w.stats, f) for f in w.stats.__struct_fields__}
                workers.append(WorkerHealth(w.name, state, w.host or host, w.device or engine.config.device_of(w.index),
                                            w.pid, now - w.last_seen if w.last_seen else float("inf"), w.restarts,
                                            w.queue, stats))
        streams = {s.name: StreamHealth(s.name, s.failed, s.gone, s.epoch, s.lost_chunks, dict(s.resets),
                                        len(s.inflight), [f"w{i}" for i in s.plan.workers_used],
                                        None if s.last_output_mono is None else now - s.last_output_mono)
                   for s in engine.streams.values()}
        dropped = dict(engine.dropped)
        if engine.pool is not None:
            dropped.update(engine.pool.counts)
        return EngineHealth(now, None if engine.failure is None else str(engine.failure), workers, streams, dropped)
