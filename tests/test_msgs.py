"""The generated physis_ros message interfaces, through real rclpy.

Checks that `physis_ros.msg` is importable from the venv (make setup generates
it), that every field survives CDR serialization, and that an ActionChunk goes
through a real publisher/subscription pair.
"""

import time
import uuid

import numpy as np
import pytest
import rclpy
from builtin_interfaces.msg import Time
from rclpy.serialization import deserialize_message, serialize_message

from physis_ros.msg import ActionChunk, ChunkTelemetry
from domains import domain

H, DOF = 16, 7
JOINTS = [f"joint_{i}" for i in range(DOF)]


def _time(sec, nanosec):
    return Time(sec=sec, nanosec=nanosec)


def make_action_chunk(chunk_index=3, seed=0):
    rng = np.random.default_rng(seed)
    actions = rng.standard_normal((H, DOF)).astype(np.float32)
    msg = ActionChunk()
    msg.header.stamp = _time(1_700_000_000, 123_456_789)
    msg.header.frame_id = "base_link"
    msg.stream = "arm_left"
    msg.chunk_index = chunk_index
    msg.control_period = 0.02
    msg.joint_names = list(JOINTS)
    msg.horizon = H
    msg.dof = DOF
    msg.actions = actions.reshape(-1)
    return msg, actions


def make_telemetry():
    msg = ChunkTelemetry()
    msg.header.stamp = _time(1_700_000_001, 5)
    msg.header.frame_id = "physis"
    msg.stream = "arm_right"
    msg.chunk_index = 2**40 + 7  # uint64 beyond 32 bits
    msg.observation_stamp = _time(1_700_000_000, 900_000_000)
    msg.enqueue_stamp = _time(1_700_000_000, 910_000_000)
    msg.emit_stamp = _time(1_700_000_001, 5)
    msg.response_latency_ms = 100.000005
    msg.output_interval_ms = 33.25
    msg.observation_age_ms = 10.0
    msg.stage_compute_ms_min = 1.5
    msg.stage_compute_ms_max = 12.75
    msg.stage_compute_ms_sum = 30.125
    msg.queue_ms = 0.5
    msg.transport_ms = 0.25
    msg.batch_sizes = [1, 4, 4, 2]
    msg.deadline_miss = True
    return msg


def _assert_chunk_equal(got, msg, actions):
    assert got.header.stamp.sec == msg.header.stamp.sec
    assert got.header.stamp.nanosec == msg.header.stamp.nanosec
    assert got.header.frame_id == msg.header.frame_id
    assert got.stream == msg.stream
    assert got.chunk_index == msg.chunk_index
    assert got.control_period == msg.control_period
    assert list(got.joint_names) == JOINTS
    assert got.horizon == H and got.dof == DOF
    arr = np.frombuffer(got.actions, dtype=np.float32)
    assert arr.shape == (H * DOF,)
    np.testing.assert_array_equal(arr.reshape(got.horizon, got.dof), actions)


def test_action_chunk_roundtrip():
    msg, actions = make_action_chunk()
    data = serialize_message(msg)
    assert isinstance(data, bytes) and len(data) > H * DOF * 4
    got = deserialize_message(data, ActionChunk)
    _assert_chunk_equal(got, msg, actions)
    assert got == msg


def test_chunk_telemetry_roundtrip():
    msg = make_telemetry()
    got = deserialize_message(serialize_message(msg), ChunkTelemetry)
    assert got == msg
    for field in msg.get_fields_and_field_types():
        if field == "batch_sizes":
            assert list(got.batch_sizes) == [1, 4, 4, 2]
        else:
            assert getattr(got, field) == getattr(msg, field), field
    assert got.chunk_index == 2**40 + 7
    assert got.deadline_miss is True


def test_field_types():
    assert ActionChunk.get_fields_and_field_types() == {
        "header": "std_msgs/Header",
        "stream": "string",
        "chunk_index": "uint64",
        "control_period": "double",
        "joint_names": "sequence<string>",
        "horizon": "uint32",
        "dof": "uint32",
        "actions": "sequence<float>",
        "first_step": "uint64",
        "step0_stamp": "builtin_interfaces/Time",
        "inference_delay_steps": "uint32",
        "late": "boolean",
        "late_points": "uint32",
    }
    fields = ChunkTelemetry.get_fields_and_field_types()
    assert fields["batch_sizes"] == "sequence<uint32>"
    assert fields["emit_stamp"] == fields["handover_stamp"] == "builtin_interfaces/Time"
    assert fields["deadline_miss"] == fields["late"] == "boolean"
    assert fields["first_step"] == "uint64" and fields["late_points"] == "uint32"
    assert fields["seam_position_jump"] == fields["tracking_error"] == "double"
    assert fields["seam_blended_rows"] == "uint32"
    assert len(fields) == 25


@pytest.fixture
def ros_context():
    context = rclpy.Context()
    # A domain of its own so that concurrent test runs do not cross-talk.
    rclpy.init(context=context, domain_id=domain("msgs"))
    try:
        yield context
    finally:
        rclpy.shutdown(context=context)


@pytest.mark.slow
def test_pubsub_action_chunk(ros_context):
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    topic = f"/physis_test_{uuid.uuid4().hex[:8]}/chunks"
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    node = rclpy.create_node("physis_msgs_test", context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(node)
    received = []
    try:
        pub = node.create_publisher(ActionChunk, topic, qos)
        node.create_subscription(ActionChunk, topic, received.append, qos)
        msg, actions = make_action_chunk(chunk_index=11, seed=1)
        deadline = time.monotonic() + 5.0
        next_pub = 0.0
        while not received and time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_pub:  # re-publish until discovery has matched
                pub.publish(msg)
                next_pub = now + 0.05
            executor.spin_once(timeout_sec=0.01)
        assert received, "no ActionChunk received within 5 s"
        _assert_chunk_equal(received[0], msg, actions)
    finally:
        executor.shutdown()
        node.destroy_node()
