"""Outputs as a strict consumer reads them: ActionChunk with its timeline fields, JointTrajectory of the
rows still ahead (stamped when its point 0 is due, strictly increasing times, at rest at the end),
and ChunkTelemetry."""

import math

import numpy as np
import pytest
from builtin_interfaces.msg import Time

from physis_ros.ros import conversions as conv
from physis_ros.ros import outputs
from physis_ros.serving.config import serve_config
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ChunkLanding, kinematics

JOINTS = [f"joint{i}" for i in range(1, 8)]
RNG = np.random.default_rng(0)


def stream(**kw):
    return serve_config({"streams": {"r": {"joint_names": JOINTS, **kw}}}).streams["r"]


def record(**kw) -> ChunkRecord:
    base = dict(stream="r", chunk=4, obs_stamp=100.0, enqueue=100.01, emit=100.15, interval_ms=math.nan,
                stage_ms=[1.0, 3.0, 2.0], queue_ms=0.5, hops_ms=[0.1], batch_sizes=[1, 2, 1])
    return ChunkRecord(**{**base, **kw})


def seconds(t) -> float:
    return t.sec + t.nanosec * 1e-9


def test_action_chunk_carries_its_place_on_the_timeline():
    s = stream(control_rate_hz=50.0, frame_id="base")
    actions = RNG.standard_normal((16, 7)).astype(np.float32)
    stamp = Time(sec=5, nanosec=7)
    msg = outputs.action_chunk_msg("r", s, 3, actions, stamp)
    assert (msg.stream, msg.chunk_index, msg.horizon, msg.dof) == ("r", 3, 16, 7)
    assert msg.header.stamp == stamp and msg.header.frame_id == "base"
    assert list(msg.joint_names) == JOINTS and msg.control_period == pytest.approx(0.02)
    np.testing.assert_array_equal(np.frombuffer(msg.actions, np.float32).reshape(16, 7), actions)
    assert (msg.first_step, msg.late_points, msg.late) == (0, 0, False)

    placement = ChunkLanding(first_step=42, row0_due=7.5, period=0.02, first_row=3, horizon=16, delay_steps=2)
    msg = outputs.action_chunk_msg("r", s, 3, actions, stamp, placement)
    assert (msg.first_step, msg.inference_delay_steps, msg.late_points, msg.late) == (42, 2, 3, False)
    assert seconds(msg.step0_stamp) == pytest.approx(7.5)


def test_trajectory_of_the_rows_ahead():
    s = stream(control_rate_hz=50.0, frame_id="base")
    actions = RNG.standard_normal((16, 7)).astype(np.float32)
    vel, acc = kinematics(actions, s.control_period)
    k = 5
    traj = outputs.trajectory_msg(s, actions[k:], vel[k:], acc[k:], conv.time_msg(12.34))
    assert seconds(traj.header.stamp) == pytest.approx(12.34) and list(traj.joint_names) == JOINTS
    assert len(traj.points) == 16 - k
    pos = np.array([p.positions for p in traj.points])
    np.testing.assert_array_equal(pos, actions[k:].astype(np.float64))
    np.testing.assert_array_equal(np.array([p.velocities for p in traj.points]), vel[k:])
    np.testing.assert_array_equal(np.array([p.accelerations for p in traj.points]), acc[k:])
    last = traj.points[-1]
    assert not any(last.velocities) and not any(last.accelerations)   # ends at rest
    times = [seconds(p.time_from_start) for p in traj.points]
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))   # what JTC validates
    np.testing.assert_allclose(times, 0.02 * np.arange(16 - k), atol=1e-9)


def test_telemetry_msg():
    rec = record(deadline_miss=True)
    msg = outputs.telemetry_msg(rec)
    assert msg.stream == "r" and msg.chunk_index == 4 and msg.deadline_miss
    assert msg.output_interval_ms == 0.0  # first chunk: no interval
    assert msg.response_latency_ms == pytest.approx(150.0) and msg.observation_age_ms == pytest.approx(10.0)
    assert (msg.stage_compute_ms_min, msg.stage_compute_ms_max, msg.stage_compute_ms_sum) == (1.0, 3.0, 6.0)
    assert list(msg.batch_sizes) == [1, 2, 1] and msg.header.stamp == msg.emit_stamp
    assert conv.stamp_to_sec(msg.emit_stamp) == pytest.approx(100.15)
    assert msg.handover_stamp == msg.emit_stamp  # no handover time given
    assert conv.stamp_to_sec(outputs.telemetry_msg(rec, handover=100.1503).handover_stamp) == pytest.approx(100.1503)
    assert math.isnan(msg.seam_position_jump) and math.isnan(msg.tracking_error)   # nan: not known


def test_telemetry_carries_the_timeline_metrics():
    rec = record(first_step=77, delay_steps=3, late_points=4, late=False, seam_position_jump=0.01,
                 seam_velocity_jump=0.5, tracking_error=0.02)
    msg = outputs.telemetry_msg(rec)
    assert (msg.first_step, msg.inference_delay_steps, msg.late_points, msg.late) == (77, 3, 4, False)
    assert (msg.seam_position_jump, msg.seam_velocity_jump, msg.tracking_error) == (0.01, 0.5, 0.02)
