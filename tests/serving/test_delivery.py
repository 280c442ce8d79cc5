"""A world-action model's chunks onto the robot's control timeline, without ROS (serving/delivery.py): late rows
and late chunks counted, the tracking error against the expert's chunk of the same observation, seams measured
against what the robot ran and eased where they jump, and at most EXPERTS_KEPT experts waiting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from physis_ros.serving.config import StreamConfig
from physis_ros.serving.delivery import EXPERTS_KEPT, Delivery
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ControlTimeline

H, DOF, RATE = 16, 7, 50.0


def record(first_step: int, shift: int) -> ChunkRecord:
    return ChunkRecord(stream="r0", chunk=0, obs_stamp=0.0, enqueue=0.0, emit=0.0, interval_ms=math.nan,
                       stage_ms=[], queue_ms=0.0, hops_ms=[], batch_sizes=[], first_step=first_step,
                       step0=first_step / RATE, shift=shift)


def ramp(first_step: int, offset: float = 0.0) -> np.ndarray:
    """Rows of one straight trajectory from control step ``first_step`` (plus ``offset`` rad)."""
    return np.tile(((first_step + np.arange(H)) * 0.01 + offset)[:, None], (1, DOF)).astype(np.float32)


@pytest.fixture()
def delivery():
    return Delivery(ControlTimeline(rate_hz=RATE, horizon=H, execution=5))


@pytest.fixture()
def stream():
    return StreamConfig(joint_names=[f"j{i}" for i in range(DOF)], seam_blend_steps=4)


def test_a_chunk_on_time_is_sent_from_row_0_and_its_tracking_error_is_the_experts(delivery, stream):
    rec, actions = record(0, 0), ramp(0)
    delivery.expert(123, actions + 0.1)
    landing = delivery.land(rec, actions, 0.0, 123, now=-1.0, stream=stream)   # a second before row 0 is due
    assert landing.first_row == 0 and not landing.late and rec.late_points == 0
    assert rec.tracking_error == pytest.approx(0.1, abs=1e-6)
    rows = delivery.trajectory(rec, actions, landing, stream.seam_blend_steps)
    assert np.array_equal(rows.positions, actions) and rows.velocities.shape == (H, DOF)
    assert math.isnan(rec.seam_position_jump)      # nothing ran before it
    delivery.executed(rows)


def test_late_rows_and_late_chunks_are_counted_and_a_late_chunk_has_no_tracking_error(delivery, stream):
    rec = record(0, 0)
    delivery.expert(5, ramp(0))
    landing = delivery.land(rec, ramp(0), 0.0, 5, now=3.5 / RATE, stream=stream)   # rows 0..3 due
    assert landing.first_row == rec.late_points == delivery.late_points == 4 and not rec.late
    late = record(5, 5)
    landing = delivery.land(late, ramp(5), 5 / RATE, 6, now=1.0, stream=stream)     # every row due
    assert landing.late and late.late and delivery.late_chunks == 1 and delivery.late_points == 4 + H
    assert math.isnan(late.tracking_error)


def test_a_seam_that_jumps_is_measured_and_eased_and_the_next_seam_is_against_what_ran(delivery, stream):
    first = record(0, 0)
    delivery.executed(delivery.trajectory(first, ramp(0), delivery.land(first, ramp(0), 0.0, 0, -1.0, stream), 4))
    smooth = record(5, 5)
    rows = delivery.trajectory(smooth, ramp(5), delivery.land(smooth, ramp(5), 0.1, 1, -1.0, stream), 4)
    assert smooth.seam_position_jump == pytest.approx(0.0, abs=1e-6) and smooth.seam_blended_rows == 0
    delivery.executed(rows)
    jump = record(10, 5)
    actions = ramp(10, offset=0.3)
    rows = delivery.trajectory(jump, actions, delivery.land(jump, actions, 0.2, 2, -1.0, stream), 4)
    assert jump.seam_position_jump == pytest.approx(0.3, abs=1e-6)
    assert jump.seam_blended_rows == 4 and delivery.blended_chunks == 1
    assert np.allclose(rows.positions[0], ramp(10)[0])          # row 0 is where the robot was
    assert np.allclose(rows.positions[4:], actions[4:])         # then the chunk's own rows
    delivery.executed(rows)
    after = record(15, 5)
    actions = ramp(15, offset=0.3)
    delivery.trajectory(after, actions, delivery.land(after, actions, 0.3, 3, -1.0, stream), 4)
    assert after.seam_position_jump == pytest.approx(0.0, abs=1e-5)   # against the eased rows that ran


def test_experts_wait_for_their_chunk_at_most_experts_kept_of_them(delivery, stream):
    for n in range(EXPERTS_KEPT + 3):
        delivery.expert(n, ramp(0))
    old, new = record(0, 0), record(0, 0)
    delivery.land(old, ramp(0), 0.0, 0, -1.0, stream)
    delivery.land(new, ramp(0), 0.0, EXPERTS_KEPT + 2, -1.0, stream)
    assert math.isnan(old.tracking_error) and new.tracking_error == 0.0
