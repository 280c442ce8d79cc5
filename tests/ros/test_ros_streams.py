"""One robot's ROS side (physis_ros.ros.stream_topics) as a controller sees it: a chunk that takes over where it
disagrees with the chunk the robot runs reaches the JointTrajectory eased from it, and the telemetry says so.

The real node and real rclpy topics; no engine: the test hands the stream its chunks as the engine would."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from rosprobe import served_stream

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

PERIOD = 0.02     # serve.yaml: 50 Hz


def publish_two_chunks(*ros_args: str) -> tuple[list, list, list, object]:
    """Chunk 0 (all zeros) runs; chunk 1 (0.2 rad everywhere, 6 steps later, its first 3 rows already due:
    past the 2 frozen rows it assumed) takes over. What a subscriber received: (trajectories, telemetry,
    action chunks, the stream)."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from trajectory_msgs.msg import JointTrajectory

    from physis_ros.msg import ActionChunk, ChunkTelemetry
    from physis_ros.ros.conversions import time_msg
    from physis_ros.runtime.streams import ChunkOutput
    from physis_ros.telemetry import ChunkRecord

    with served_stream(*ros_args, armed=True) as (node, name, st):
        probe = rclpy.create_node("seam_probe", context=node.context)
        executor = SingleThreadedExecutor(context=node.context)
        executor.add_node(probe)
        trajectories, telemetry, chunks = [], [], []
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        probe.create_subscription(JointTrajectory, st.topic("joint_trajectory"), trajectories.append, reliable)
        probe.create_subscription(ChunkTelemetry, "/telemetry", telemetry.append, reliable)
        probe.create_subscription(ActionChunk, st.topic("action_chunk"), chunks.append, reliable)
        deadline = time.monotonic() + 10.0
        publishers = (st.pub_traj, st.pub_chunk, node.pub_telemetry)
        while any(pub.get_subscription_count() == 0 for pub in publishers) and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        horizon, dof = st.model.output_shape
        for chunk, first_step, rows_due, value in ((0, 0, -5.0, 0.0), (1, 6, 2.5, 0.2)):
            now = time.time()
            rec = ChunkRecord(name, chunk, now - 0.05, now - 0.05, now, math.nan, [1.0], 0.0, [], [1])
            rec.first_step, rec.step0, rec.delay_steps, rec.shift = first_step, now - rows_due * PERIOD, 2, first_step
            st.session.deliver(ChunkOutput(name, chunk, np.full((horizon, dof), value, np.float32), rec, time_msg(now)))
        deadline = time.monotonic() + 10.0
        while min(len(trajectories), len(telemetry), len(chunks)) < 2 and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        executor.shutdown()
        probe.destroy_node()
        return trajectories, telemetry, chunks, st


def test_a_takeover_past_its_frozen_rows_reaches_the_controller_eased_from_where_the_robot_is():
    """Was: it went out as computed, a 0.2 rad step between the point the robot was at and the trajectory's
    first point (make demo: 0.2-0.3 rad after a 71 ms latency spike)."""
    trajectories, telemetry, chunks, st = publish_two_chunks()
    assert len(trajectories) == len(telemetry) == len(chunks) == 2, "the subscriber did not get both chunks"
    traj = trajectories[1]
    first = np.array([p.positions for p in traj.points])
    assert len(first) == 16 - 3                               # rows 0..2 were due: dropped
    np.testing.assert_array_equal(first[0], 0.0)              # row 3: where chunk 0 had the robot
    eased = 0.2 * (1 - 0.5 * (1 + np.cos(np.pi * np.arange(3) / 3)))   # rows 3..5, up to the next chunk's step 6
    np.testing.assert_allclose(first[:3, 0], eased, atol=1e-6)
    np.testing.assert_allclose(first[3:], np.float32(0.2))   # from row 6 (the next chunk keeps it): as computed
    vel = np.array([p.velocities for p in traj.points])
    assert np.isfinite(vel).all() and not vel[-1].any()       # a controller's kinematics; at rest at the end
    # the velocities follow the eased positions (up, at most 3.75 rad/s), from where the robot came: point 0's
    # central difference reaches back to row 2, the previous chunk's 0 the robot ran, not the dropped 0.2
    # (which made it -3.75 rad/s: a spline that first heads the wrong way)
    np.testing.assert_allclose(vel[:4, 0], [1.25, 3.75, 3.75, 1.25], atol=1e-5)
    t = telemetry[1]
    assert t.chunk_index == 1 and t.late_points == 3 and t.inference_delay_steps == 2
    assert t.seam_position_jump == pytest.approx(0.2)        # the seam as computed: what the easing absorbed
    assert t.seam_blended_rows == 3 and telemetry[0].seam_blended_rows == 0
    assert st.delivery.blended_chunks == 1
    # the ActionChunk is the chunk as computed (a replay compares it with the reference bit for bit)
    assert np.frombuffer(bytes(chunks[1].actions), np.float32).tolist() == [np.float32(0.2)] * (16 * 7)


def test_with_seam_blend_steps_zero_the_chunk_goes_out_as_computed():
    trajectories, telemetry, _, st = publish_two_chunks("-p", "streams.robot0.seam_blend_steps:=0")
    assert len(trajectories) == len(telemetry) == 2
    np.testing.assert_allclose([p.positions[0] for p in trajectories[1].points], np.float32(0.2))
    assert telemetry[1].seam_position_jump == pytest.approx(0.2) and telemetry[1].seam_blended_rows == 0
    assert st.delivery.blended_chunks == 0
