"""How a world-action model's chunk reaches the robot it is for, whatever front end sends it (:class:`Delivery`).

A chunk lands on the stream's control timeline (:meth:`ControlTimeline.land
<physis_ros.timeline.ControlTimeline.land>`): the rows already due when it arrives are not executed, and a
chunk whose every row is due is late and not sent. A chunk that is not late is measured against the
expert's chunk for the same observation (where one was given: the tracking error) and against the chunk
the robot was executing (the seam); where the seam is a jump, the rows sent ease from the previous chunk
onto this one. What the robot then runs is what the next chunk's seam is measured against. The front end
sends the rows (:meth:`Delivery.trajectory`) and says when they went out (:meth:`Delivery.executed`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from physis_ros.serving.config import StreamConfig
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ChunkLanding, ControlTimeline, kinematics, rms

EXPERTS_KEPT = 64   # experts' chunks waiting for their observation's chunk (oldest dropped first)


@dataclass
class Rows:
    """A chunk's rows as sent (eased from the previous chunk where its seam jumped): positions, velocities and
    accelerations [horizon, dof]; row 0 is control step ``first_step``, and the robot is sent the rows from
    ``first_row`` on (:meth:`ahead`)."""
    positions: np.ndarray
    velocities: np.ndarray
    accelerations: np.ndarray
    first_step: int
    first_row: int

    def ahead(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions, velocities and accelerations of the rows the robot is sent."""
        k = self.first_row
        return self.positions[k:], self.velocities[k:], self.accelerations[k:]


class Delivery:
    """One stream's chunks onto its control timeline, with its late, blended and expert bookkeeping. The
    experts come in on a front end's thread (:meth:`expert`); the chunks on the engine's (the others)."""

    def __init__(self, timeline: ControlTimeline):
        self.timeline = timeline
        self.late_points = self.late_chunks = self.blended_chunks = 0
        self._experts: dict[int, np.ndarray] = {}    # observation stamp (ns) -> the expert's actions for it
        self._lock = threading.Lock()

    def expert(self, stamp_ns: int, actions: np.ndarray) -> None:
        """The expert's chunk for the observation stamped ``stamp_ns``: kept (briefly) for its chunk's tracking
        error."""
        with self._lock:
            self._experts[stamp_ns] = actions
            while len(self._experts) > EXPERTS_KEPT:      # oldest first (dicts keep insertion order)
                self._experts.pop(next(iter(self._experts)))

    def land(self, record: ChunkRecord, actions: np.ndarray, stamp_s: float, stamp_ns: int, now: float,
             stream: StreamConfig) -> ChunkLanding:
        """Where a chunk observed at ``stamp_s`` and arriving at ``now`` (s, the stream's clock) lands: fills the
        record's late fields and, where the expert's chunk for ``stamp_ns`` was given, its tracking error."""
        s = stream
        placement = self.timeline.land(record.first_step, record.step0, record.delay_steps, stamp_s, now,
                                       s.trajectory_start, s.trajectory_start_offset_s, s.trajectory_min_lead_s)
        k = placement.first_row
        record.late_points, record.late = k, placement.late
        self.late_points += k
        self.late_chunks += placement.late
        with self._lock:
            expert = self._experts.pop(stamp_ns, None)
        if expert is not None and not placement.late:
            record.tracking_error = rms(actions[k:], expert[k:])
        return placement

    def trajectory(self, record: ChunkRecord, actions: np.ndarray, placement: ChunkLanding,
                   blend_steps: int) -> Rows:
        """The rows of a chunk that is not late, from its first executed row: its seam against what the robot was
        running goes into the record, and a jump is eased over ``blend_steps`` rows."""
        timeline, k = self.timeline, placement.first_row
        vel, acc = kinematics(actions, timeline.period)
        seam = timeline.seams.seam(record.first_step, k, actions, vel)
        record.seam_position_jump, record.seam_velocity_jump = seam.position_jump, seam.velocity_jump
        sent, record.seam_blended_rows = timeline.seams.blend(record.first_step, k, actions, blend_steps,
                                                              timeline.keep_from(record.shift))
        if record.seam_blended_rows:
            self.blended_chunks += 1
            vel, acc = kinematics(sent, timeline.period)
        return Rows(sent, vel, acc, record.first_step, k)

    def executed(self, rows: Rows) -> None:
        """The robot now runs these rows (they were sent)."""
        self.timeline.seams.executed(rows.first_step, rows.positions, rows.velocities)
