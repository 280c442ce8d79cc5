"""What the engine keeps per stream, what it hands to its users (observations in, chunks out), and
the health snapshot it publishes for them."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.config import to_mapping
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime import protocol as p
from physis_ros.runtime.plans import Plan, Stage
from physis_ros.scheduling.profiles import CostProfile
from physis_ros.telemetry import ChunkRecord


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


@dataclass(frozen=True)
class Timeline:
    """A stream's control timeline: row i of chunk c is control step sigma(c) + i, where sigma(c) is the
    step at which the chunk was due for release (its observation taken then, or up to a step ahead with a
    hand-off), counted from the stream's first release at ``rate_hz``; a stream released every whole
    number of steps s' (the server's timeline cadence, :func:`physis_ros.timeline.release_pace_ms`) has
    sigma(c) = c * s'. And the hand-off between consecutive chunks (physis_ros.model.handoff)."""

    rate_hz: float                 # control steps per second
    horizon: int                   # rows of a chunk (H)
    execution: int                 # s: steps a chunk is executed for
    handoff: str = "none"          # none | hard | soft
    extra_delay: int = 0           # steps added to the measured inference delay (benchmarks)
    delay_window: int = 20         # chunks the delay estimate looks back over (older spikes are forgotten)
    # Conservative: the largest delay in the window (a percentile of it, if less). A chunk later than the
    # estimate takes over past its frozen rows; with the 90th percentile about 1 in 10 did whenever the
    # delays sat just below a step boundary (physis-bench handoff: 11 of 120 chunks, seam p99 0.05-0.09 rad).
    delay_quantile: float = 100.0
    # Delays the estimate needs before it is trusted: until then the hand-off assumes the largest delay it can
    # honour. The largest of 1-3 start-up delays was often one step short (physis-bench handoff: a seam of
    # 0.11 rad at chunk 3; make demo: 0.24-0.26 rad in a robot's first second).
    delay_warmup: int = 5
    lead_s: float = 0.0            # rows due sooner than this after a chunk's emit are not sent (the node's
                                   # trajectory_min_lead_s): the delay counts it
    # With a hand-off, take each observation ahead of its chunk's slot by the fraction of a step that makes the
    # latest expected arrival land this far (steps) before a control step: the robot then runs one of the
    # chunk's frozen rows (the one it switches at), not up to two (None: at the slot). StreamState.capture_lead_s.
    capture_margin: float | None = 0.3

    @property
    def max_delay(self) -> int:
        """d <= s <= H - d: the delay the hand-off can honour."""
        return max(0, min(self.execution, self.horizon - self.execution))


@dataclass
class InFlight:
    """A chunk between entering the pipeline and leaving it."""

    obs_stamp: float       # engine clock
    enqueue: float         # engine clock
    tag: Any
    bound_s: float         # how long it may take
    deadline: float        # time.monotonic() by which it must have left, else its stream is reset
    first_step: int = 0    # on the stream's timeline (see Timeline)
    delay_steps: int = 0
    shift: int = 0


@dataclass
class StreamState:
    name: str
    model: ServedModel
    plan: Plan
    observe: ObserveFn
    on_output: OutputFn | None
    limit: int | None
    slo_interval_ms: float | None
    credits: asyncio.Semaphore
    keep_outputs: bool = False
    epoch: int = 0
    next_chunk: int = 0
    next_emit: int = 0
    last_emit: float | None = None
    last_output_mono: float | None = None
    epoch_started: bool = False        # the current epoch has emitted a chunk (warm-up grace is over)
    pending: dict[int, ChunkOutput] = field(default_factory=dict)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    feeder: asyncio.Task | None = None
    readmission: asyncio.Task | None = None
    outputs: list[ChunkOutput] = field(default_factory=list)
    failed: str | None = None          # why the stream is not serving now (reset under way, or for good)
    gone: bool = False                 # failed for good: a worker it needs cannot come back
    lost_chunks: int = 0
    resets: Counter = field(default_factory=Counter)   # cause -> count
    first_addr: str = ""
    timeline: Timeline | None = None
    timeline_t0: float | None = None   # engine clock of the stream's first release: control step 0
    last_step: int | None = None       # first step of the last chunk released
    latencies: list = field(default_factory=list)   # recent release -> robot take-over times (s), newest last
    release_interval_s: float | None = None  # pace: one release per interval, anchored at release_t0
    release_t0: float | None = None          # time.monotonic() of the first release (moved on after a late one)
    releases: int = 0
    release_due: dict[int, float] = field(default_factory=dict)  # chunk -> when it was due (jitter buffer)
    emit_delay_s: float | None = None  # jitter buffer: chunk c leaves no earlier than its release + this
    emit_scheduled: bool = False

    async def pace(self, wake: Callable[[], Awaitable[None]] | None = None, lead_s: float = 0.0) -> float | None:
        """Wait for the stream's next release on its schedule (one every release interval, anchored at its
        first release), :meth:`capture_lead_s` ahead of it; the time it was due (time.monotonic()), or None
        for an unpaced stream. ``wake`` is awaited ``lead_s`` before a release it has to wait for (the engine
        wakes the first worker then)."""
        if self.release_interval_s is None:
            return None
        if self.release_t0 is None:
            return time.monotonic()
        due = self.release_t0 + self.releases * self.release_interval_s
        delay = due - self.capture_lead_s() - time.monotonic()
        if wake is not None and delay > lead_s:
            await asyncio.sleep(delay - lead_s)
            await wake()
            delay = due - self.capture_lead_s() - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        return due

    def released(self, due: float) -> float:
        """A chunk is released (its observation taken) now: keep the schedule; after a late release (a
        camera that was silent, credits held up) the next ones do not catch up in a burst: the next
        comes at the first slot of the same phase at least half an interval away (the phase keeps
        streams that share a worker apart, :func:`staggered_anchor`)."""
        now = time.monotonic()
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

    def scheduled(self, chunk: int, now: float) -> float:
        """When chunk ``chunk``, released at ``now`` (engine clock), was due on its stream's pace: on the
        timeline a paced chunk starts at its slot (whole steps after the one before), not when the loop got
        to it (a few ms late, or on purpose ahead: :meth:`capture_lead_s`), so its rows stay on the grid.
        ``now`` for an unpaced stream, or a release so late it left the schedule (:meth:`released`)."""
        due = self.release_due.get(chunk)
        return now if due is None else now - (time.monotonic() - due)

    def _latency_steps(self) -> float | None:
        """The hand-off's estimate of a chunk's latency, release to robot take-over, in control steps: the
        largest of the recent ones (a percentile of them, if less); None while too few are known."""
        tl = self.timeline
        recent = self.latencies[-tl.delay_window:]
        if len(recent) < tl.delay_warmup:
            return None
        return _quantile(recent, tl.delay_quantile) * tl.rate_hz

    def capture_lead_s(self) -> float:
        """How far ahead of its slot the next chunk's observation is taken (s). The robot switches to a chunk
        at the first row due after it arrives, and the switch row must be one the hand-off froze; with the
        latency spread over a step boundary (a 2-core host: 0.7-1.8 steps) a capture at the slot made the
        robot run 1.2-1.6 frozen rows a chunk on average where one is enough. Taken ahead by the fraction of a
        step that puts the estimated arrival ``capture_margin`` steps before a step boundary, it freezes
        one row fewer whenever the estimate is not whole, and the robot runs about one: the chunk is built
        on an observation up to a step older but acts on it sooner. 0 without a hand-off (nothing is frozen,
        the robot takes a chunk whenever it lands) or while the latency is not known."""
        tl = self.timeline
        if tl is None or tl.handoff == "none" or tl.capture_margin is None or self.release_interval_s is None:
            return 0.0
        est = self._latency_steps()
        if est is None:
            return 0.0
        return ((est + tl.capture_margin) % 1.0) / tl.rate_hz

    def place_on_timeline(self, f: InFlight, release: float) -> p.HandoffSpec | None:
        """Place a chunk released now on the control timeline (its first step, the shift since the last
        one, the delay the hand-off assumes: the rows due before it is expected at the robot, from its
        observation's place ahead of or behind its row 0 and the largest of the recent latencies, plus any
        injected extra; the largest it can honour while too few latencies are known); its hand-off, if the
        stream asks for one. ``release``: its slot (:meth:`scheduled`); ``f.enqueue``: when it was taken."""
        tl = self.timeline
        if tl is None:
            return None
        if self.timeline_t0 is None:
            self.timeline_t0 = release
        f.first_step = round((release - self.timeline_t0) * tl.rate_hz)
        first = self.last_step is None     # nothing before it to hand off from
        f.shift = 0 if first else f.first_step - self.last_step
        self.last_step = f.first_step
        est = self._latency_steps()
        if first and not self.latencies:
            measured = 0
        elif est is None:
            measured = tl.max_delay
        else:
            # Rows the robot takes from the previous chunk: those due by the time this one arrives (x steps
            # after row 0: the latency counted from the observation, less how far it was taken ahead of row
            # 0; rows 0..floor(x)) plus the row it switches at, so that the switch itself lands on a point
            # the previous chunk committed to; at least row 0 when it arrives before row 0 is due.
            x = est - (self.timeline_t0 + f.first_step / tl.rate_hz - f.enqueue) * tl.rate_hz
            measured = max(1, math.floor(x) + 2)
        f.delay_steps = min(tl.max_delay, measured + tl.extra_delay)
        if tl.handoff == "none":
            return None
        return p.HandoffSpec(tl.handoff, f.delay_steps, min(f.shift, 65535))

    def timeline_done(self, f: InFlight, emit: float) -> float:
        """A chunk placed on the timeline left the pipeline at ``emit``: when its row 0 was due (step0). Its
        latency (from its observation to the robot taking it, ``lead_s`` after the emit) is recorded for the
        next chunks' hand-off. Counted from the observation, not from row 0: the compute starts there, and
        the next chunk's observation may sit elsewhere relative to its row 0 (taken ahead by a different
        :meth:`capture_lead_s`, or a release between steps), which :meth:`place_on_timeline` adds back."""
        step0 = self.timeline_t0 + f.first_step / self.timeline.rate_hz
        self.latencies.append(emit + self.timeline.lead_s - f.enqueue)
        del self.latencies[:-self.timeline.delay_window]
        return step0


def _quantile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values``, interpolated as ``np.percentile`` does. Not ``np.percentile``
    itself: its first call imports ``numpy.ma`` (13 ms here), and this runs on a release's path (it
    made the first chunk after the warm-up 9-12 ms late)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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
