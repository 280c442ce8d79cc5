"""A robot's control timeline: where each chunk lands on the robot's clock, what the hand-off keeps from the
previous chunk, which rows are already late, the kinematics a trajectory controller is given, and how
consecutive chunks meet (the seam). :class:`ControlTimeline` is one stream's; nothing else computes a
position on it.

Row ``i`` of a chunk is control step ``first_step + i``, due at ``step0 + i * period``. When a chunk
is published some of its first rows may already be due: the robot kept executing the previous chunk
meanwhile (the inference delay ``d``), so those rows are history, not commands. A controller that is
handed such points either jumps to catch up or replays the past (docs/ros2_control.md), so they are
dropped and counted; a chunk whose every row is due is *late* and is not sent at all.

Pure Python and numpy, no I/O: the engine asks it where a released chunk starts and what its hand-off
assumes (:meth:`ControlTimeline.place`, :meth:`ControlTimeline.emitted`), the front end where a published
chunk lands and how it meets the last one (:meth:`ControlTimeline.land`, :attr:`ControlTimeline.seams`),
and the benchmarks' simulated robot the same arithmetic (:mod:`physis_ros.bench.robot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def release_pace_ms(slo_ms: float, pace_margin: float, rate_hz: float, timeline: bool = True) -> float:
    """How often a stream with interval SLO ``slo_ms`` is released (and so admitted): ``pace_margin`` early,
    for the chunks' latency jitter; on the control timeline, in the largest whole number of control steps
    (at least one) within that, so consecutive chunks start exactly that many steps apart and chunk ``c``
    is for steps ``[c * s', c * s' + H)`` (``s' = s`` with no margin)."""
    if not timeline:
        return slo_ms * (1.0 - pace_margin)
    return release_steps(slo_ms, pace_margin, rate_hz) / rate_hz * 1e3


def release_steps(slo_ms: float, pace_margin: float, rate_hz: float) -> int:
    """The whole control steps s' between two releases of a timeline stream (:func:`release_pace_ms`): chunk
    ``c + 1`` starts at row s' of chunk ``c``."""
    return max(1, math.floor(slo_ms * (1.0 - pace_margin) * rate_hz / 1e3 + 1e-9))


def first_due_row(step0: float, period: float, now: float, horizon: int) -> int:
    """The first row still ahead at ``now`` (rows due at or before ``now`` are past); ``horizon`` when
    every row is past."""
    if now < step0:
        return 0
    return min(horizon, math.floor((now - step0) / period) + 1)


def kinematics(positions: np.ndarray, period: float) -> tuple[np.ndarray, np.ndarray]:
    """Velocities and accelerations [rows, dof] (float64) consistent with ``positions`` sampled every
    ``period``: central differences inside, one-sided at the first row; the last row at rest
    (velocity and acceleration zero) as joint_trajectory_controller requires by default. Computed on
    the whole chunk, so rows dropped as late still shape the velocity at the first kept one."""
    pos = np.asarray(positions, dtype=np.float64)
    vel = np.zeros_like(pos)
    acc = np.zeros_like(pos)
    n = len(pos)
    if n > 1:
        vel[0] = (pos[1] - pos[0]) / period
    if n > 2:
        vel[1:-1] = (pos[2:] - pos[:-2]) / (2.0 * period)
        acc[1:-1] = (pos[2:] - 2.0 * pos[1:-1] + pos[:-2]) / (period * period)
        acc[0] = acc[1]
    vel[-1:] = 0.0
    return vel, acc


@dataclass(frozen=True)
class Seam:
    """How a new chunk meets the one the robot was executing, at the new chunk's first executed step:
    the largest joint difference in position and in velocity (nan: nothing to compare with)."""

    position_jump: float = math.nan
    velocity_jump: float = math.nan


class SeamTracker:
    """One robot's last executed chunk, to measure each new chunk's seam against it."""

    def __init__(self):
        self._first_step: int | None = None
        self._pos: np.ndarray | None = None
        self._vel: np.ndarray | None = None

    def reset(self) -> None:
        self._first_step = self._pos = self._vel = None

    def seam(self, first_step: int, row: int, positions: np.ndarray, velocities: np.ndarray) -> Seam:
        """The seam of a chunk starting at control step ``first_step`` whose row ``row`` is the first
        the robot executes, against what the previous chunk prescribed for that step."""
        if self._pos is None:
            return Seam()
        j = first_step + row - self._first_step
        if not 0 <= j < len(self._pos) or row >= len(positions):
            return Seam()
        return Seam(float(np.max(np.abs(positions[row] - self._pos[j]))),
                    float(np.max(np.abs(velocities[row] - self._vel[j]))))

    def blend(self, first_step: int, row: int, positions: np.ndarray, rows: int, keep_from: int
              ) -> tuple[np.ndarray, int]:
        """A chunk the robot takes over at ``row`` where it differs from what the previous chunk prescribed
        for that step (a jump), eased from the previous chunk onto its own rows: row ``row`` is the previous
        chunk's, and the weight of the previous chunk fades out (cosine) over ``rows`` rows, never at or past
        row ``keep_from`` (the next chunk's first step: its hand-off keeps this chunk's rows from there as
        computed). The rows before ``row`` (not sent: the robot ran the previous chunk's) become the previous
        chunk's too, so the kinematics at the first row sent continue what the robot did rather than point
        back at the rows it never ran. Returns (the rows, how many were eased). A takeover that agrees at
        ``row`` (a frozen row of the hand-off) is returned as it is: its later rows are the chunk's own, not a
        seam. So is one with no previous chunk, or a window shorter than two rows (one row would only move
        the jump a row later)."""
        if self._pos is None or rows < 2:
            return positions, 0
        j = first_step + row - self._first_step
        n = min(rows, keep_from - row, len(self._pos) - j, len(positions) - row)
        if j < 0 or n < 2:
            return positions, 0
        new = np.asarray(positions[row:row + n], dtype=np.float64)
        diff = self._pos[j:j + n] - new
        if not diff[0].any():
            return positions, 0
        weight = 0.5 * (1.0 + np.cos(np.pi * np.arange(n) / n))   # 1 at the takeover row, to 0 after the window
        out = np.array(positions, dtype=np.float64)
        out[row:row + n] = new + weight[:, None] * diff
        lo = max(0, row - j)            # rows before the takeover that the previous chunk covers
        out[lo:row] = self._pos[j - row + lo:j]
        return out, n

    def executed(self, first_step: int, positions: np.ndarray, velocities: np.ndarray) -> None:
        """The robot now follows this chunk (a chunk sent as a trajectory)."""
        self._first_step = first_step
        self._pos = np.array(positions, dtype=np.float64)
        self._vel = np.array(velocities, dtype=np.float64)


@dataclass(frozen=True)
class Slot:
    """A released chunk's place on the timeline: its first control step, the steps since the previous
    chunk's first (``shift``; 0 for the first) and the inference delay its hand-off assumes (steps)."""

    first_step: int
    shift: int
    delay_steps: int


@dataclass(frozen=True)
class ChunkLanding:
    """Where a chunk lands on the robot's timeline when it is published: row ``i`` is control step
    ``first_step + i``, due at ``row0_due + i * period`` (the front end's clock); rows before ``first_row``
    are already due (late points)."""

    first_step: int
    row0_due: float
    period: float
    first_row: int
    horizon: int
    delay_steps: int = 0

    @property
    def late(self) -> bool:
        """Every row is due: nothing left to send."""
        return self.first_row >= self.horizon

    @property
    def start(self) -> float:
        """When the first row still ahead is due: the trajectory's header stamp."""
        return self.row0_due + self.first_row * self.period


TRAJECTORY_STARTS = ("timeline", "observation", "emit")


@dataclass
class ControlTimeline:
    """One stream's control timeline: row i of chunk c is control step sigma(c) + i, where sigma(c) is the
    step at which the chunk was due for release (its observation taken then, or up to a step ahead with a
    hand-off), counted from the stream's first release at ``rate_hz``; a stream released every whole
    number of steps s' (``release_steps``, :func:`release_steps`) has sigma(c) = c * s'. It keeps the
    recent chunk latencies the hand-off's delay is estimated from (physis_ros.model.handoff), and the chunk
    the robot executes (:attr:`seams`).

    Two sides use it, each its own state: the engine (:meth:`capture_lead_s`, :meth:`place`,
    :meth:`emitted`, on its loop) and the front end that delivers chunks (:meth:`land`,
    :meth:`keep_from`, :attr:`seams`, on its thread)."""

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
    # chunk's frozen rows (the one it switches at), not up to two (None: at the slot). See capture_lead_s.
    capture_margin: float | None = 0.3
    release_steps: int = 0         # s': steps between two releases (0: cadence free, released when ready)
    # the engine's side
    t0: float | None = field(default=None, init=False)        # engine clock of control step 0 (first release)
    last_step: int | None = field(default=None, init=False)   # first step of the last chunk released
    latencies: list[float] = field(default_factory=list, init=False)   # recent release -> take-over (s)
    # the front end's side: the chunk the robot executes, to measure and ease the next one's seam against
    seams: SeamTracker = field(default_factory=SeamTracker, init=False)

    @property
    def period(self) -> float:
        """Seconds between two control steps."""
        return 1.0 / self.rate_hz

    @property
    def max_delay(self) -> int:
        """d <= s <= H - d: the delay the hand-off can honour."""
        return max(0, min(self.execution, self.horizon - self.execution))

    # ---- the engine's side ----------------------------------------------------------------------------
    def latency_steps(self) -> float | None:
        """The hand-off's estimate of a chunk's latency, release to robot take-over, in control steps: the
        largest of the recent ones (a percentile of them, if less); None while too few are known."""
        recent = self.latencies[-self.delay_window:]
        if len(recent) < self.delay_warmup:
            return None
        return _quantile(recent, self.delay_quantile) * self.rate_hz

    def capture_lead_s(self) -> float:
        """How far ahead of its slot a paced stream's next observation is taken (s). The robot switches to a
        chunk at the first row due after it arrives, and the switch row must be one the hand-off froze; with
        the latency spread over a step boundary (a 2-core host: 0.7-1.8 steps) a capture at the slot made the
        robot run 1.2-1.6 frozen rows a chunk on average where one is enough. Taken ahead by the fraction of a
        step that puts the estimated arrival ``capture_margin`` steps before a step boundary, it freezes
        one row fewer whenever the estimate is not whole, and the robot runs about one: the chunk is built
        on an observation up to a step older but acts on it sooner. 0 without a hand-off (nothing is frozen,
        the robot takes a chunk whenever it lands) or while the latency is not known."""
        if self.handoff == "none" or self.capture_margin is None:
            return 0.0
        est = self.latency_steps()
        if est is None:
            return 0.0
        return ((est + self.capture_margin) % 1.0) / self.rate_hz

    def place(self, release: float, taken: float) -> Slot:
        """Place a chunk released now: its first step (from its slot ``release``, engine clock; the first
        release is step 0), the shift since the last one, and the delay the hand-off assumes: the rows due
        before it is expected at the robot, from where its observation (taken at ``taken``) sits ahead of or
        behind its row 0 and the largest of the recent latencies, plus any injected extra; the largest it can
        honour while too few latencies are known."""
        if self.t0 is None:
            self.t0 = release
        first_step = round((release - self.t0) * self.rate_hz)
        first = self.last_step is None     # nothing before it to hand off from
        shift = 0 if first else first_step - self.last_step
        self.last_step = first_step
        est = self.latency_steps()
        if first and not self.latencies:
            measured = 0
        elif est is None:
            measured = self.max_delay
        else:
            # Rows the robot takes from the previous chunk: those due by the time this one arrives (x steps
            # after row 0: the latency counted from the observation, less how far it was taken ahead of row
            # 0; rows 0..floor(x)) plus the row it switches at, so that the switch itself lands on a point
            # the previous chunk committed to; at least row 0 when it arrives before row 0 is due.
            x = est - (self.t0 + first_step / self.rate_hz - taken) * self.rate_hz
            measured = max(1, math.floor(x) + 2)
        return Slot(first_step, shift, min(self.max_delay, measured + self.extra_delay))

    def emitted(self, slot: Slot, taken: float, emit: float) -> float:
        """A placed chunk left the pipeline at ``emit``: when its row 0 is due (step0, engine clock). Its
        latency (from its observation at ``taken`` to the robot taking it, ``lead_s`` after the emit) is kept
        for the next chunks' hand-off. Counted from the observation, not from row 0: the compute starts
        there, and the next chunk's observation may sit elsewhere relative to its row 0 (taken ahead by a
        different :meth:`capture_lead_s`, or a release between steps), which :meth:`place` adds back."""
        self.latencies.append(emit + self.lead_s - taken)
        del self.latencies[:-self.delay_window]
        return self.t0 + slot.first_step / self.rate_hz

    # ---- the front end's side -------------------------------------------------------------------------
    def keep_from(self, shift: int) -> int:
        """The row of a chunk at which the next one starts: one release later (``release_steps``); released
        when ready, as far as this chunk came after the last (``shift``; the horizon for the first)."""
        return self.release_steps or shift or self.horizon

    def land(self, first_step: int, step0: float, delay_steps: int, observed: float, now: float,
             start: str = "timeline", offset_s: float = 0.0, min_lead_s: float = 0.0) -> ChunkLanding:
        """Where a chunk published at ``now`` lands. Row 0 is due at, by ``start`` (the stream's
        ``trajectory_start``): its step on the timeline (``step0``; the observation's stamp ``observed``
        for a chunk without one), the observation's stamp (``observation``), or one control period after
        publication (``emit``: nothing is late, the chunk runs behind the robot's timeline by its latency);
        plus ``offset_s``. Rows due before ``now + min_lead_s`` are already due (late points)."""
        if start not in TRAJECTORY_STARTS:
            raise ValueError(f"trajectory start '{start}': one of {', '.join(TRAJECTORY_STARTS)}")
        if start == "emit":
            row0 = now + self.period
        elif start == "timeline" and math.isfinite(step0):
            row0 = step0
        else:
            row0 = observed
        row0 += offset_s
        # a row due before the message is out is history too (min_lead_s)
        first = first_due_row(row0, self.period, now + min_lead_s, self.horizon)
        return ChunkLanding(first_step, row0, self.period, first, self.horizon, delay_steps)


def _quantile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values``, interpolated as ``np.percentile`` does. Not ``np.percentile``
    itself: its first call imports ``numpy.ma`` (13 ms here), and this runs on a release's path (it
    made the first chunk after the warm-up 9-12 ms late)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jerk(positions: np.ndarray, period: float) -> np.ndarray:
    """Third derivative of consecutive positions sampled every ``period`` ([rows - 3, dof]; empty below 4
    rows)."""
    pos = np.asarray(positions, dtype=np.float64)
    return np.diff(pos, n=3, axis=0) / period ** 3 if len(pos) >= 4 else np.zeros((0, *pos.shape[1:]))


def rms(a: np.ndarray, b: np.ndarray | float = 0.0) -> float:
    """Root mean square of ``a - b`` (nan when there is nothing to compare)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(np.sqrt(np.mean(d * d))) if d.size else math.nan
