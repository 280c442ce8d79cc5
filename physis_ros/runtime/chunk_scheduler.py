"""The engine's chunk scheduler: what each stream does next, decided from its state and the clock alone.

Pure: no sockets, no threads, no asyncio and no clock of its own, so a fake clock drives it exactly
(tests/runtime/test_chunk_scheduler.py). The engine's I/O loop (:mod:`~physis_ros.runtime.engine`) asks it
when a stream's next chunk is due and whether the stream may release one (its chunks in flight within the
plan's limit), tells it what was released, what came out, and does what it answers (send the task, hand
the outputs out in order, wake the stream's feeder); the supervisor (:mod:`~physis_ros.runtime.recovery`)
asks it which chunks are past their bound and resets, re-admits or fails streams through it. Each method
takes the times it needs: ``now`` on the monotonic clock (pacing, bounds, the jitter buffer) and ``stamp``
on the engine's clock (observation and emit stamps, the control timeline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from physis_ros.runtime import protocol as p
from physis_ros.runtime.plans import check_clean, Plan
from physis_ros.runtime.settings import EngineConfig
from physis_ros.runtime.streams import ChunkOutput, InFlight, ServedModel, StreamState, staggered_anchor


@dataclass(frozen=True)
class Release:
    """A chunk released: its index, its stream's epoch, how long it may take to keep its stream's interval
    (the ``edf`` policy's slack, s) and its hand-off to its predecessor (None: none asked)."""

    chunk: int
    epoch: int
    slack_s: float
    handoff: p.HandoffSpec | None


class ChunkScheduler:
    """The streams' chunk schedule (see the module's docstring). ``streams``: each stream's state, by name
    (read it; change it only through these methods)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.streams: dict[str, StreamState] = {}

    # ---- streams ---------------------------------------------------------------------------------
    def in_flight_limit(self, plan: Plan) -> int:
        """Chunks a stream placed by ``plan`` may have in flight (config override, else from the plan)."""
        return self.config.max_in_flight or plan.in_flight(self.config.batching != "off", self.config.max_batch)

    def check(self, name: str, model: ServedModel, plan: Plan) -> None:
        """ValueError unless a stream ``name`` of ``model`` placed by ``plan`` can be added now."""
        cfg = self.config
        if name in self.streams:
            raise ValueError(f"stream '{name}' already exists")
        if len(self.streams) >= cfg.max_streams:
            raise ValueError(f"the engine holds max_streams={cfg.max_streams} streams already")
        if (plan.steps, plan.blocks) != (model.config.steps, model.config.blocks):
            raise ValueError(f"plan of {plan.steps}x{plan.blocks} stages does not fit model '{model.config.name}' "
                             f"({model.config.steps}x{model.config.blocks})")
        if max(plan.workers_used) >= cfg.workers:
            raise ValueError(f"plan uses worker w{max(plan.workers_used)} but only {cfg.workers} exist")
        if plan.clean != model.config.clean_pass:
            raise ValueError(f"plan '{plan.name}' is {'' if plan.clean else 'not '}made for the clean history rule "
                             f"but model '{model.config.name}' reads history by '{model.config.history}'")
        check_clean(plan)
        held = sum(self.in_flight_limit(s.plan) for s in self.streams.values())
        if held + self.in_flight_limit(plan) > cfg.max_ready:
            raise ValueError(f"stream '{name}' would bring the chunks in flight to "
                             f"{held + self.in_flight_limit(plan)}, beyond a worker's ready queue (max_ready "
                             f"{cfg.max_ready})")

    def add(self, state: StreamState, now: float, release_interval_ms: float | None = None,
            emit_delay_ms: float | None = None, release_phase_ms: float | None = None,
            phase_epoch: float = 0.0) -> StreamState:
        """Take a stream (checked by :meth:`check`) from ``now``: paced every ``release_interval_ms`` from the
        first slot of its phase (:meth:`anchor`), its outputs held until release + ``emit_delay_ms``."""
        self.check(state.name, state.model, state.plan)
        if release_interval_ms:
            state.release_interval_s = release_interval_ms / 1e3
            if emit_delay_ms is not None:
                state.emit_delay_s = emit_delay_ms / 1e3
            state.release_t0 = self.anchor(state, now, release_phase_ms, phase_epoch)
        self.streams[state.name] = state
        return state

    def anchor(self, s: StreamState, now: float, phase_ms: float | None, phase_epoch: float) -> float:
        """When a paced stream's first release falls: at ``phase_ms`` of its interval (admission's choice,
        counted from ``phase_epoch``) if given, else at its batching mates' phase, else as far as it can from
        the streams sharing its workers."""
        interval = s.release_interval_s
        if phase_ms is not None:
            t0 = phase_epoch + phase_ms / 1e3
        else:
            others = [o for o in self.streams.values() if o.release_t0 is not None and o.release_interval_s
                      and set(s.plan.workers_used) & set(o.plan.workers_used)]
            # Batching workers run same-model stages together only if they arrive together (and admission
            # credits that): join such a stream's phase. Everything else is spread apart, so it does not queue.
            mates = [o for o in others if self.config.batching != "off" and o.model.id == s.model.id
                     and math.isclose(o.release_interval_s, interval)]
            if not mates:
                return staggered_anchor(now, interval, [(o.release_t0, o.release_interval_s) for o in others]) or now
            t0 = mates[0].release_t0
        return t0 + math.ceil((now - t0) / interval) * interval   # the first slot of that phase from now on

    def remove(self, name: str) -> StreamState:
        return self.streams.pop(name)

    def streams_on(self, worker: int) -> list[StreamState]:
        """The streams with a stage on worker index ``worker``."""
        return [s for s in self.streams.values() if worker in s.plan.workers_used]

    def chunk_bound_s(self, s: StreamState) -> float:
        """How long one of the stream's chunks may take through its pipeline (s) before the stream is reset:
        ``chunk_timeout_factor`` x its in-flight limit x its SLO interval (1 s without one), at least
        ``chunk_timeout_floor_s``."""
        cfg = self.config
        interval_s = (s.slo_interval_ms or 1000.0) / 1e3
        return max(cfg.chunk_timeout_floor_s, cfg.chunk_timeout_factor * self.in_flight_limit(s.plan) * interval_s)

    # ---- releases --------------------------------------------------------------------------------
    def finished(self, s: StreamState) -> bool:
        """A finite stream has released all its chunks."""
        return s.limit is not None and s.next_chunk >= s.limit

    def may_release(self, s: StreamState) -> bool:
        """The stream may release its next chunk now: it is serving, not finished, and has fewer chunks in
        flight than its plan's limit (a chunk in flight less is a credit)."""
        return s.failed is None and not self.finished(s) and len(s.inflight) < self.in_flight_limit(s.plan)

    def release_at(self, s: StreamState, now: float) -> float | None:
        """When the stream's next chunk's observation is to be taken (monotonic s): its slot on its pace less
        the timeline's capture lead; ``now`` for a paced stream's very first; None for an unpaced stream (at
        once)."""
        if s.release_interval_s is None:
            return None
        if s.release_t0 is None:
            return now
        return s.release_t0 + s.releases * s.release_interval_s - s.capture_lead_s()

    def release(self, s: StreamState, now: float, stamp: float, obs_stamp: float, tag=None) -> Release:
        """Release the stream's next chunk at ``now`` (its observation taken at engine time ``stamp``, stamped
        ``obs_stamp``): it is in flight from here, bounded by :meth:`chunk_bound_s` (plus the warm-up grace
        until the stream's incarnation has emitted), placed on its control timeline."""
        c = s.next_chunk
        if s.release_interval_s is not None:
            due = now if s.release_t0 is None else s.release_t0 + s.releases * s.release_interval_s
            s.release_due[c] = s.released(due, now)
        s.next_chunk += 1
        bound = self.chunk_bound_s(s) + (0.0 if s.epoch_started else self.config.warmup_grace_s)
        f = InFlight(obs_stamp, stamp, tag, bound, now + bound)
        handoff = s.place_on_timeline(f, s.scheduled(c, stamp, now))
        s.inflight[c] = f
        return Release(c, s.epoch, s.slack_s(c, stamp), handoff)

    # ---- outputs ---------------------------------------------------------------------------------
    def owner(self, name: str, epoch: int, chunk: int) -> StreamState | None:
        """The stream a message about (``epoch``, ``chunk``) of stream ``name`` concerns (its output, its loss),
        if that chunk is in flight there now; None: stale (a removed stream, an incarnation before a reset, a
        chunk already out)."""
        s = self.streams.get(name)
        if s is None or epoch != s.epoch or chunk not in s.inflight:
            return None
        return s

    def take(self, s: StreamState, output: ChunkOutput, now: float) -> None:
        """A chunk in flight came out (checked by the engine): it waits to be emitted in order; a credit frees."""
        s.inflight.pop(output.chunk)
        s.pending[output.chunk] = output
        s.epoch_started = True
        s.last_output_mono = now

    def emit(self, s: StreamState, now: float, stamp: float) -> tuple[list[ChunkOutput], float | None]:
        """The outputs to hand out now, in chunk order (each with its interval since the last and its
        deadline miss), and how long until the next one held by the jitter buffer may go (None: none held).
        With an emit delay a chunk leaves no earlier than its release plus the delay, stamped ``stamp``; a
        chunk that came out before an earlier one is stamped ``stamp`` too, when it leaves after it (its
        interval is never negative)."""
        out = []
        while s.next_emit in s.pending:
            if s.emit_delay_s is not None:
                wait = s.release_due.get(s.next_emit, 0.0) + s.emit_delay_s - now
                if wait > 0:
                    return out, wait
            chunk = s.pending.pop(s.next_emit)
            s.release_due.pop(s.next_emit, None)
            rec = chunk.record
            if s.emit_delay_s is not None or out:   # held (by the buffer, or behind an earlier chunk): leaves now
                rec.emit = stamp
            if s.last_emit is not None:
                rec.interval_ms = (rec.emit - s.last_emit) * 1e3
                rec.deadline_miss = s.slo_interval_ms is not None and rec.interval_ms > s.slo_interval_ms
            s.last_emit = rec.emit
            s.next_emit += 1
            out.append(chunk)
        return out, None

    def done(self, s: StreamState) -> bool:
        """The stream is over: failed for good, or a finite one has emitted (or lost) all its chunks."""
        return s.gone or (s.limit is not None and s.next_emit >= s.limit)

    # ---- supervision -----------------------------------------------------------------------------
    def overdue(self, now: float) -> list[tuple[StreamState, int]]:
        """(stream, chunk) for each serving stream whose oldest chunk in flight is past its bound."""
        late = []
        for s in self.streams.values():
            if s.failed is None and s.inflight:
                c = min(s.inflight)
                if now > s.inflight[c].deadline:
                    late.append((s, c))
        return late

    def extend(self, s: StreamState, chunk: int, now: float) -> None:
        """Give a late chunk one more bound from ``now`` (it is queued behind garbage, not lost)."""
        f = s.inflight[chunk]
        f.deadline = now + f.bound_s

    def reset(self, s: StreamState, reason: str, cause: str) -> int | None:
        """Drop the stream's current incarnation: the epoch advances, its chunks in flight and waiting are lost
        (returned, and counted in ``lost_chunks``), the next emitted is the next released. None when a reset
        is under way already (or the stream failed for good): only the cause is counted."""
        s.resets[cause] += 1
        if s.failed is not None:
            return None
        lost = len(s.inflight) + len(s.pending)
        s.lost_chunks += lost
        s.failed = reason
        s.epoch += 1
        s.inflight.clear()
        s.pending.clear()
        s.release_due.clear()
        s.next_emit = s.next_chunk
        s.epoch_started = False
        return lost

    def readmitted(self, s: StreamState) -> None:
        """The stream's new incarnation is placed: it serves again."""
        s.failed = None

    def fail(self, s: StreamState, reason: str) -> None:
        """The stream fails for good (a worker it needs cannot come back)."""
        s.gone = True
        s.failed = reason

    def status(self, name: str) -> dict:
        s = self.streams[name]
        return {"failed": s.failed, "epoch": s.epoch, "lost_chunks": s.lost_chunks, "next_chunk": s.next_chunk,
                "in_flight": len(s.inflight), "resets": dict(s.resets),
                "workers": [f"w{i}" for i in s.plan.workers_used]}


