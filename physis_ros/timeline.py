"""Chunks on a robot's control timeline: which rows are still ahead of the robot, the kinematics a
trajectory controller is given, and how consecutive chunks meet (the seam).

Row ``i`` of a chunk is control step ``first_step + i``, due at ``step0 + i * period``. When a chunk
is published some of its first rows may already be due: the robot kept executing the previous chunk
meanwhile (the inference delay ``d``), so those rows are history, not commands. A controller that is
handed such points either jumps to catch up or replays the past (docs/ros2_control.md), so they are
dropped and counted; a chunk whose every row is due is *late* and is not sent at all.

Pure numpy, shared by the node (:mod:`physis_ros.ros.outputs`) and the benchmarks' simulated robot
(:mod:`physis_ros.bench.handoff`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def jerk(positions: np.ndarray, period: float) -> np.ndarray:
    """Third derivative of consecutive positions sampled every ``period`` ([rows - 3, dof]; empty below 4
    rows)."""
    pos = np.asarray(positions, dtype=np.float64)
    return np.diff(pos, n=3, axis=0) / period ** 3 if len(pos) >= 4 else np.zeros((0, *pos.shape[1:]))


def rms(a: np.ndarray, b: np.ndarray | float = 0.0) -> float:
    """Root mean square of ``a - b`` (nan when there is nothing to compare)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(np.sqrt(np.mean(d * d))) if d.size else math.nan
