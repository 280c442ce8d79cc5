"""Pre-serialized outputs deserialize to exactly the messages conversions.py builds."""

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from rclpy.serialization import deserialize_message
from trajectory_msgs.msg import JointTrajectory

from physis_ros.msg import ActionChunk
from physis_ros.ros import conversions as conv
from physis_ros.ros.config import serve_config
from physis_ros.ros.raw import ActionChunkRaw, TrajectoryRaw

JOINTS = ["shoulder", "elbow", "wrist_a", "wrist_b", "j5", "j6", "gripper_joint"]


@pytest.mark.parametrize("frame_id, rate", [("", 50.0), ("base_link", 33.3)])
def test_raw_outputs_equal_built_messages(frame_id, rate):
    s = serve_config({"streams": {"arm": {"joint_names": JOINTS, "frame_id": frame_id,
                                          "control_rate_hz": rate}}}).streams["arm"]
    chunk_raw, traj_raw = ActionChunkRaw("arm", s, 16, 7), TrajectoryRaw(s, 16, 7)
    rng = np.random.default_rng(3)
    for chunk in (0, 1, 2**40 + 5):
        actions = rng.standard_normal((16, 7)).astype(np.float32)
        stamp = Time(sec=int(rng.integers(0, 2**31 - 1)), nanosec=int(rng.integers(0, 10**9)))
        got = deserialize_message(chunk_raw.render(chunk, actions, stamp), ActionChunk)
        assert got == conv.action_chunk_msg("arm", s, chunk, actions, stamp)
        traj = deserialize_message(traj_raw.render(actions, stamp), JointTrajectory)
        assert traj == conv.trajectory_msg(s, actions, stamp)
    with pytest.raises(ValueError):
        chunk_raw.render(0, np.zeros((15, 7), np.float32), Time())
