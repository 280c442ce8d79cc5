"""A simulated robot that executes action chunks on its control timeline, for the benchmarks.

It stands in for joint_trajectory_controller with a perfect arm: a chunk reaches it ``link_delay``
control steps after the server handed it out (a slower link or controller, the benchmarks' injected
delay), replaces the running one on arrival (what JTC does, docs/ros2_control.md) and from then on
the arm is, at each control step, where the chunk's row for that step says; rows already due on
arrival are skipped (late points); past its last row it holds it. A chunk that takes over where it
differs from the running one is eased from it over ``blend_steps`` rows, as the node sends it (the
stream key ``seam_blend_steps``, up to the next chunk's first row). Why simulated: no arm or
ros2_control hardware loop runs on these machines; where a chunk lands, what is late and how it meets the
last one is asked of a :class:`~physis_ros.timeline.ControlTimeline` of the stream, as the node asks its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from physis_ros.timeline import ControlTimeline, Seam, jerk, kinematics, rms


@dataclass(frozen=True)
class Executed:
    """A chunk the robot switched to: from ``arrival`` it follows ``rows`` (row i = step first_step + i)."""

    arrival: float
    first_step: int
    first_row: int
    rows: np.ndarray


class SimulatedRobot:
    def __init__(self, q0: np.ndarray, timeline: ControlTimeline, link_delay_steps: int = 0, blend_steps: int = 0):
        self.q0 = np.asarray(q0, dtype=np.float64)
        self.timeline = timeline         # the stream's: its seams are this robot's
        self.blend_steps = blend_steps
        self.eased_chunks = 0
        self.period = timeline.period
        self.link_delay_s = link_delay_steps * self.period
        self.t0: float | None = None     # when control step 0 is due (the timeline's origin)
        self.chunks: list[Executed] = []
        self.late_points = 0
        self.late_chunks = 0

    def receive(self, handed_out: float, first_step: int, step0: float, actions: np.ndarray, shift: int = 0
                ) -> tuple[int, Seam]:
        """A chunk handed out at ``handed_out`` (its rows due from ``step0``; ``shift`` steps after the last
        one's first): (the rows it arrived too late for, its seam against the chunk the robot was running). A
        chunk with every row due is dropped."""
        self.t0 = step0 - first_step * self.period if self.t0 is None else self.t0
        arrival = handed_out + self.link_delay_s
        rows = np.asarray(actions, dtype=np.float64)
        landing = self.timeline.land(first_step, step0, 0, step0, arrival)
        k = landing.first_row
        self.late_points += k
        if landing.late:
            self.late_chunks += 1
            return k, Seam()
        seams = self.timeline.seams
        vel, _ = kinematics(rows, self.period)
        seam = seams.seam(first_step, k, rows, vel)
        rows, eased = seams.blend(first_step, k, rows, self.blend_steps, self.timeline.keep_from(shift))
        if eased:
            self.eased_chunks += 1
            vel, _ = kinematics(rows, self.period)
        seams.executed(first_step, rows, vel)
        self.chunks.append(Executed(arrival, first_step, k, rows))
        return k, seam

    def command(self, step: int) -> np.ndarray:
        """Where the arm is at control ``step``: the row for it of the last chunk that had arrived when
        the step was due (holding a chunk's last row past its end); the start pose before any chunk."""
        if self.t0 is None:
            return self.q0
        due = self.t0 + step * self.period
        for c in reversed(self.chunks):
            if c.arrival <= due:
                row = min(max(step - c.first_step, 0), len(c.rows) - 1)
                return c.rows[row]
        return self.q0

    def position(self, t: float) -> np.ndarray:
        """Where the arm is at time ``t``: the command of the last step due by then."""
        if self.t0 is None:
            return self.q0
        return self.command(math.floor((t - self.t0) / self.period))

    @property
    def first_executed_step(self) -> int:
        """The control step of :meth:`trajectory`'s first row: the first row the first chunk arrived in time for."""
        return self.chunks[0].first_step + self.chunks[0].first_row

    def trajectory(self) -> np.ndarray:
        """The commanded positions at every control step from the first chunk's arrival to the last
        chunk's end [steps, dof]."""
        if not self.chunks:
            return np.zeros((0, len(self.q0)))
        last = self.chunks[-1].first_step + len(self.chunks[-1].rows)
        return np.array([self.command(n) for n in range(self.first_executed_step, last)])

    def max_command_step(self) -> float:
        """The largest change of any joint's command from one control step to the next (rad)."""
        steps = np.abs(np.diff(self.trajectory(), axis=0))
        return float(steps.max()) if steps.size else math.nan

    def jerk_rms(self) -> float:
        """RMS of the commanded trajectory's third derivative (finite differences at the control rate)."""
        return rms(jerk(self.trajectory(), self.period))
