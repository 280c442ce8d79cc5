"""Pre-serialized outputs: exactly the CDR bytes of the messages outputs.py builds.

The reference is an independent serializer, rosbags (pure Python, strict about
message size), with the physis_ros types registered from msg/*.msg; rclpy's
deserializer is lenient about trailing bytes, so it alone would not notice them.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from rclpy.serialization import deserialize_message
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from trajectory_msgs.msg import JointTrajectory

from physis_ros.msg import ActionChunk
from physis_ros.ros import outputs
from physis_ros.serving.config import serve_config
from physis_ros.ros.raw import ActionChunkRaw, TrajectoryRaw
from physis_ros.timeline import kinematics
from domains import domain

JOINTS = ["shoulder", "elbow", "wrist_a", "wrist_b", "j5", "j6", "gripper_joint"]
MSG_DIR = Path(__file__).resolve().parents[2] / "msg"
CHUNK_T, TRAJ_T = "physis_ros/msg/ActionChunk", "trajectory_msgs/msg/JointTrajectory"


@pytest.fixture(scope="module")
def store():
    store = get_typestore(Stores.ROS2_KILTED)
    for path in sorted(MSG_DIR.glob("*.msg")):
        store.register(get_types_from_msg(path.read_text(), f"physis_ros/msg/{path.stem}"))
    return store


def _stream(frame_id: str, dof: int, rate: float = 50.0):
    # Joint names of 2..6 characters: each string moves the padding that follows it.
    names = [("j" * (1 + (3 * i) % 5)) + str(i) for i in range(dof)]
    return serve_config({"streams": {"arm": {"joint_names": names, "frame_id": frame_id,
                                             "control_rate_hz": rate}}}).streams["arm"]


def _header(store, h):
    T = store.types
    return T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=h.stamp.sec, nanosec=h.stamp.nanosec),
                                    frame_id=h.frame_id)


def rosbags_chunk(store, m: ActionChunk) -> bytes:
    """The rclpy message field by field into rosbags, serialized by rosbags."""
    T = store.types
    msg = T[CHUNK_T](header=_header(store, m.header), stream=m.stream, chunk_index=m.chunk_index,
                     control_period=m.control_period, joint_names=list(m.joint_names),
                     horizon=m.horizon, dof=m.dof, actions=np.array(m.actions, np.float32),
                     first_step=m.first_step,
                     step0_stamp=T["builtin_interfaces/msg/Time"](sec=m.step0_stamp.sec, nanosec=m.step0_stamp.nanosec),
                     inference_delay_steps=m.inference_delay_steps, late_points=m.late_points, late=m.late)
    return bytes(store.serialize_cdr(msg, CHUNK_T))


def rosbags_traj(store, m: JointTrajectory) -> bytes:
    T = store.types
    points = [T["trajectory_msgs/msg/JointTrajectoryPoint"](
        positions=np.array(p.positions, np.float64), velocities=np.array(p.velocities, np.float64),
        accelerations=np.array(p.accelerations, np.float64), effort=np.array(p.effort, np.float64),
        time_from_start=T["builtin_interfaces/msg/Duration"](sec=p.time_from_start.sec,
                                                             nanosec=p.time_from_start.nanosec))
        for p in m.points]
    msg = T[TRAJ_T](header=_header(store, m.header), joint_names=list(m.joint_names), points=points)
    return bytes(store.serialize_cdr(msg, TRAJ_T))


def placement(rng, horizon: int, period: float) -> outputs.ChunkLanding:
    first = int(rng.integers(0, horizon + 1))
    return outputs.ChunkLanding(first_step=int(rng.integers(0, 2**63)), row0_due=float(rng.uniform(0, 2e9)),
                             period=period, first_row=first, horizon=horizon, delay_steps=int(rng.integers(0, 9)))


def ahead(actions: np.ndarray, period: float, k: int):
    """The trajectory rows from row k: positions, velocities, accelerations."""
    vel, acc = kinematics(actions, period)
    return actions[k:].astype(np.float64), vel[k:], acc[k:]


@pytest.mark.parametrize("frame_id, rate", [("", 50.0), ("base_link", 33.3)])
def test_raw_outputs_equal_built_messages(frame_id, rate):
    s = serve_config({"streams": {"arm": {"joint_names": JOINTS, "frame_id": frame_id,
                                          "control_rate_hz": rate}}}).streams["arm"]
    chunk_raw, traj_raw = ActionChunkRaw("arm", s, 16, 7), TrajectoryRaw(s, 16, 7)
    rng = np.random.default_rng(3)
    for chunk in (0, 1, 2**40 + 5):
        actions = rng.standard_normal((16, 7)).astype(np.float32)
        stamp = Time(sec=int(rng.integers(0, 2**31 - 1)), nanosec=int(rng.integers(0, 10**9)))
        where = placement(rng, 16, s.control_period)
        got = deserialize_message(chunk_raw.render(chunk, actions, stamp, where), ActionChunk)
        assert got == outputs.action_chunk_msg("arm", s, chunk, actions, stamp, where)
        for k in (0, 3, 15):
            rows = ahead(actions, s.control_period, k)
            traj = deserialize_message(traj_raw.render(*rows, stamp), JointTrajectory)
            assert traj == outputs.trajectory_msg(s, *rows, stamp)
    with pytest.raises(ValueError):
        chunk_raw.render(0, np.zeros((15, 7), np.float32), Time(), where)
    with pytest.raises(ValueError, match="1 to 16"):
        traj_raw.render(*ahead(actions, s.control_period, 16), Time())   # nothing ahead: no trajectory


# Frame ids and stream names of 0..4 (mod 4) characters change every padding run after them.
@pytest.mark.parametrize("horizon, dof, frame_id", list(itertools.product(
    (1, 16, 50), (1, 6, 7), ("", "a", "ab", "abc", "base_link"))))
def test_raw_bytes_equal_an_independent_serializer(store, horizon, dof, frame_id):
    s = _stream(frame_id, dof)
    name = "r" * (1 + len(frame_id) % 4)
    chunk_raw, traj_raw = ActionChunkRaw(name, s, horizon, dof), TrajectoryRaw(s, horizon, dof)
    rng = np.random.default_rng(horizon * 100 + dof)
    for chunk in (0, 2**64 - 1):
        actions = rng.standard_normal((horizon, dof)).astype(np.float32)
        stamp = Time(sec=int(rng.integers(0, 2**31 - 1)), nanosec=int(rng.integers(0, 10**9)))
        where = placement(rng, horizon, s.control_period)
        raw = chunk_raw.render(chunk, actions, stamp, where)
        want = rosbags_chunk(store, outputs.action_chunk_msg(name, s, chunk, actions, stamp, where))
        assert len(raw) == len(want) and raw == want
        got = store.deserialize_cdr(raw, CHUNK_T)                            # strict size check
        assert (got.chunk_index, got.late_points, got.late) == (chunk, where.first_row, where.late)
        k = min(where.first_row, horizon - 1)
        raw = traj_raw.render(*ahead(actions, s.control_period, k), stamp)
        want = rosbags_traj(store, outputs.trajectory_msg(s, *ahead(actions, s.control_period, k), stamp))
        assert len(raw) == len(want) and raw == want
        assert len(store.deserialize_cdr(raw, TRAJ_T).points) == horizon - k


def test_template_is_checked_against_the_rmw():
    """A layout that disagrees with the rmw's serialization (here: a field left out) fails at construction."""
    from rclpy.serialization import serialize_message

    from physis_ros.cdr import CdrWriter

    msg = outputs.action_chunk_msg("arm", _stream("base_link", 7), 3, np.ones((2, 7), np.float32), Time(sec=4))
    w = CdrWriter()
    w.header(msg.header)
    w.string(msg.stream)
    w.put("Q", msg.chunk_index)
    w.check_against(serialize_message(msg), "ActionChunk")   # a prefix that agrees so far
    w.strings(msg.joint_names)               # control_period skipped
    with pytest.raises(RuntimeError, match="disagrees with the rmw"):
        w.check_against(serialize_message(msg), "ActionChunk")


def test_render_returns_a_snapshot():
    """A rendered message must not change when the next one is rendered (publish may hold on to it)."""
    s = _stream("base_link", 7)
    traj_raw = TrajectoryRaw(s, 16, 7)
    first = traj_raw.render(*ahead(np.ones((16, 7), np.float32), 0.02, 0), Time(sec=1))
    copy = bytes(first)
    traj_raw.render(*ahead(np.zeros((16, 7), np.float32), 0.02, 0), Time(sec=2))
    assert first == copy


@pytest.mark.slow
def test_recorded_outputs_decode_strictly(store, tmp_path, monkeypatch):
    """Raw outputs published over DDS and written by the project's recorder: every message decodes with
    rosbags (strict size) and reads back with the mcap library, byte for byte what was published."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from physis_ros.bags.bagio import read_all, read_with_mcap
    from physis_ros.bags.record import Recorder, wait_until
    from physis_ros.bags.rosnode import RosSession

    monkeypatch.setenv("ROS_DOMAIN_ID", str(domain("raw")))
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    tag = f"raw_{uuid.uuid4().hex[:8]}"
    cases = [("", 1, 7), ("a", 16, 6), ("base_link", 50, 7), ("abc", 16, 1)]
    qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    sent: list[tuple[str, bytes]] = []
    with RosSession(f"{tag}_node") as ros:
        topics = {}
        for i, (frame_id, horizon, dof) in enumerate(cases):
            topics[f"/{tag}/s{i}/action_chunk"] = CHUNK_T
            topics[f"/{tag}/s{i}/joint_trajectory"] = TRAJ_T
        recorder = Recorder(ros.node, tmp_path / "bag", topics)
        pubs = {t: ros.node.create_publisher(ActionChunk if t.endswith("chunk") else JointTrajectory, t, qos)
                for t in topics}
        assert wait_until(lambda: all(p.get_subscription_count() == 1 for p in pubs.values()), 10.0)
        rng = np.random.default_rng(0)
        for i, (frame_id, horizon, dof) in enumerate(cases):
            s = _stream(frame_id, dof)
            chunk_raw, traj_raw = ActionChunkRaw(f"s{i}", s, horizon, dof), TrajectoryRaw(s, horizon, dof)
            for chunk in range(3):
                actions = rng.standard_normal((horizon, dof)).astype(np.float32)
                stamp = Time(sec=1_700_000_000 + chunk, nanosec=chunk)
                where = placement(rng, horizon, s.control_period)
                rows = ahead(actions, s.control_period, min(where.first_row, horizon - 1))
                for topic, raw in ((f"/{tag}/s{i}/action_chunk", chunk_raw.render(chunk, actions, stamp, where)),
                                   (f"/{tag}/s{i}/joint_trajectory", traj_raw.render(*rows, stamp))):
                    pubs[topic].publish(raw)
                    sent.append((topic, raw))
        assert wait_until(lambda: sum(recorder.counts.values()) == len(sent), 10.0), recorder.counts
        recorder.close()
    ours, theirs = read_all(tmp_path / "bag"), read_with_mcap(tmp_path / "bag")
    assert sorted((t, raw) for t, _, _, raw in ours) == sorted(sent)
    assert sorted((t, raw) for t, *_, raw in theirs) == sorted(sent)
    for topic, msgtype, _, raw in ours:
        msg = store.deserialize_cdr(raw, msgtype)          # raises "CDR message size mismatch" on extra bytes
        assert msg.header.stamp.sec >= 1_700_000_000
        assert bytes(store.serialize_cdr(msg, msgtype)) == raw
