"""What the engine keeps per stream, what it hands to its users (observations in, chunks out), and
the health snapshot it publishes for them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.config import to_mapping
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime import protocol as p
from physis_ros.runtime.plans import Plan, Stage
from physis_ros.runtime.costs import CostProfile
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ControlTimeline, Slot


@dataclass(frozen=True)
class ServedModel:
    """A model as the engine serves it: its config, its weights (a checkpoint, or the seeded init) and
    the profile that seeds the workers' adaptive batching. Streams of one ``id`` share weights."""

    config: ModelConfig
    checkpoint: str | None = None
    profile: CostProfile | None = None

    @property
    def id(self) -> str:
        return self.config.name if not self.checkpoint else f"{self.config.name}@{self.checkpoint}"

    def ref(self, stages: list[Stage]) -> p.ModelRef:
        """What a worker hosting ``stages`` needs to know of the model."""
        costs = None if self.profile is None else self.profile.block_costs(stages)
        return p.ModelRef(id=self.id, config=to_mapping(self.config), checkpoint=self.checkpoint, batch_costs=costs)


@dataclass
class Observation:
    data: dict[str, np.ndarray]
    stamp: float        # seconds, on the engine's clock
    tag: Any = None     # opaque to the engine; returned on the ChunkOutput that used this observation


@dataclass
class ChunkOutput:
    stream: str
    chunk: int
    output: np.ndarray  # float32, model output shape, all finite
    record: ChunkRecord
    tag: Any = None     # the tag of the observation this chunk used


@dataclass
class StreamEvent:
    """Something that happened to a stream: ``failed`` (with the chunks lost and the reset's ``cause``),
    ``readmitted``."""

    stream: str
    kind: str
    reason: str
    lost_chunks: int = 0
    cause: str = ""
    time: float = 0.0


# Returns the observation for the next chunk (its index is given), or None if none is available yet.
ObserveFn = Callable[[int], Observation | None]
OutputFn = Callable[[ChunkOutput], None]


@dataclass
class InFlight:
    """A chunk between entering the pipeline and leaving it."""

    obs_stamp: float       # engine clock
    enqueue: float         # engine clock
    tag: Any
    bound_s: float         # how long it may take
    deadline: float        # time.monotonic() by which it must have left, else its stream is reset
    slot: Slot | None = None   # its place on the stream's control timeline (None: the stream has none)


@dataclass
class StreamState:
    """One stream's schedule, as the chunk scheduler (:mod:`~physis_ros.runtime.chunk_scheduler`) keeps it:
    data and arithmetic on the times it is given, no I/O (the engine keeps the stream's callbacks and tasks)."""

    name: str
    model: ServedModel
    plan: Plan
    limit: int | None                  # chunks to serve (None: until removed)
    slo_interval_ms: float | None
    timeline: ControlTimeline | None = None
    epoch: int = 0
    next_chunk: int = 0
    next_emit: int = 0
    last_emit: float | None = None
    last_output_mono: float | None = None
    epoch_started: bool = False        # the current epoch has emitted a chunk (warm-up grace is over)
    pending: dict[int, ChunkOutput] = field(default_factory=dict)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    failed: str | None = None          # why the stream is not serving now (reset under way, or for good)
    gone: bool = False                 # failed for good: a worker it needs cannot come back
    lost_chunks: int = 0
    resets: Counter = field(default_factory=Counter)   # cause -> count
    release_interval_s: float | None = None  # pace: one release per interval, anchored at release_t0
    release_t0: float | None = None          # time.monotonic() of the first release (moved on after a late one)
    releases: int = 0
    release_due: dict[int, float] = field(default_factory=dict)  # chunk -> when it was due (jitter buffer)
    emit_delay_s: float | None = None  # jitter buffer: chunk c leaves no earlier than its release + this

    def released(self, due: float, now: float) -> float:
        """A chunk due at ``due`` is released (its observation taken) at ``now``: keep the schedule; after a
        late release (a camera that was silent, credits held up) the next ones do not catch up in a burst:
        the next comes at the first slot of the same phase at least half an interval away (the phase keeps
        streams that share a worker apart, :func:`staggered_anchor`)."""
        interval = self.release_interval_s
        if self.release_t0 is None:
            self.release_t0, due = now, now
        elif now - due > interval / 2:
            slots = math.ceil((now + interval / 2 - self.release_t0) / interval)
            self.release_t0 += (slots - (self.releases + 1)) * interval
            due = now
        self.releases += 1
        return due

    def slack_s(self, chunk: int, now: float) -> float:
        """How long chunk ``chunk``, released at ``now`` (engine clock), may take (the ``edf`` policy's
        deadline): one SLO interval after the previous chunk left, when it has, so that a chunk whose
        predecessor left early runs first on a shared worker and the published interval holds; else
        one SLO interval from now."""
        slo_s = (self.slo_interval_ms or 1000.0) / 1e3
        if self.last_emit is None or self.next_emit != chunk:
            return slo_s
        return min(slo_s, self.last_emit + slo_s - now)

    def scheduled(self, chunk: int, stamp: float, now: float) -> float:
        """When chunk ``chunk``, released at engine time ``stamp`` (monotonic ``now``), was due on its
        stream's pace, in engine time: on the timeline a paced chunk starts at its slot (whole steps after the
        one before), not when the loop got to it (a few ms late, or on purpose ahead: :meth:`capture_lead_s`),
        so its rows stay on the grid. ``stamp`` for an unpaced stream, or a release so late it left the
        schedule (:meth:`released`)."""
        due = self.release_due.get(chunk)
        return stamp if due is None else stamp - (now - due)

    def capture_lead_s(self) -> float:
        """How far ahead of its slot the next chunk's observation is taken (s): the timeline's
        (:meth:`ControlTimeline.capture_lead_s`) for a paced stream on one, else 0."""
        if self.timeline is None or self.release_interval_s is None:
            return 0.0
        return self.timeline.capture_lead_s()

    def place_on_timeline(self, f: InFlight, release: float) -> p.HandoffSpec | None:
        """Place a chunk released now on the control timeline (:meth:`ControlTimeline.place`; ``release``: its
        slot, :meth:`scheduled`; ``f.enqueue``: when its observation was taken); its hand-off, if the stream
        asks for one."""
        tl = self.timeline
        if tl is None:
            return None
        f.slot = tl.place(release, f.enqueue)
        if tl.handoff == "none":
            return None
        return p.HandoffSpec(tl.handoff, f.slot.delay_steps, min(f.slot.shift, 65535))


def staggered_anchor(now: float, interval: float, others: list[tuple[float, float]], candidates: int = 32,
                     lookahead: int = 4) -> float | None:
    """When a paced stream should make its first release so that its releases fall as far as possible
    from those of ``others`` (their (anchor, interval) on the same workers): on a shared worker two
    chunks released together queue behind each other, and the second one's latency grows by the
    first one's compute. None (release now) when nothing shares its workers."""
    if not others:
        return None
    horizon = now + lookahead * interval
    theirs = [a + k * i for a, i in others
              for k in range(max(0, math.ceil((now - a) / i)), math.ceil((horizon - a) / i) + 1)]

    def gap(offset: float) -> float:
        mine = [now + offset + k * interval for k in range(lookahead)]
        return min(abs(m - t) for m in mine for t in theirs)

    return now + max((interval * j / candidates for j in range(candidates)), key=gap)


@dataclass(frozen=True)
class WorkerHealth:
    name: str
    state: str                 # up | restarting | down | starting
    host: str
    device: str
    pid: int
    heartbeat_age_s: float
    restarts: int
    queue: int
    stats: dict[str, float]


@dataclass(frozen=True)
class StreamHealth:
    name: str
    failed: str | None
    gone: bool
    epoch: int
    lost_chunks: int
    resets: dict[str, int]
    in_flight: int
    workers: list[str]
    output_age_s: float | None  # since its last chunk left the pipeline (None: none yet)


@dataclass(frozen=True)
class EngineHealth:
    """A consistent picture of the engine, taken on its own loop; safe to read from any thread."""

    taken: float               # time.monotonic() when taken: an old snapshot means a stalled loop
    failure: str | None
    workers: list[WorkerHealth]
    streams: dict[str, StreamHealth]
    dropped: dict[str, int]    # messages the engine dropped, by reason (malformed, stale, ...)
