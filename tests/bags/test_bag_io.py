"""Bag files without a ROS graph: the bundled bag, two independent readers, custom types, broken bags."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from rclpy.serialization import deserialize_message, serialize_message

from physis_ros.bags.bagio import (BagError, BagWriter, bag_info, ensure_type, read_all, read_with_mcap,
                                   typestore)
from physis_ros.cdr import header_stamp_ns, with_header_stamp
from physis_ros.bags.replay import parse_remaps, remap_topic
from physis_ros.bags.scene import SceneSpec, scene_messages
from physis_ros.bags.serveconf import load_serve_info
from physis_ros.cli import bag as bag_cli
from physis_ros.msg import ActionChunk, ChunkTelemetry


def test_bundled_bag_is_small_and_up_to_date(scene_bag):
    size = sum(p.stat().st_size for p in scene_bag.rglob("*") if p.is_file())
    assert size < 3_000_000
    serve = load_serve_info()
    spec = SceneSpec(namespaces=tuple(s.namespace for s in serve.streams), joint_names=serve.streams[0].joint_names)
    assert read_all(scene_bag) == scene_messages(spec), "regenerate with tools/make_scene_bag.py"


def test_bundled_bag_content(scene_bag):
    from sensor_msgs.msg import Image, JointState

    info = bag_info(scene_bag)
    assert info.storage == "mcap" and 3.0 < info.duration_s < 5.0
    assert {(t.topic, t.msgtype, t.count) for t in info.topics} == {
        (f"/robot{r}/{name}", msgtype, 40) for r in (0, 1)
        for name, msgtype in (("camera/image_raw", "sensor_msgs/msg/Image"),
                              ("joint_states", "sensor_msgs/msg/JointState"))}
    stamps = {}
    for topic, _, log_ns, raw in read_all(scene_bag):
        stamp = header_stamp_ns(raw)
        assert log_ns > stamp                    # logged after it was stamped
        stamps.setdefault(topic.split("/")[1], {}).setdefault(stamp, []).append(topic)
        if topic.endswith("image_raw"):
            img = deserialize_message(raw, Image)
            assert (img.width, img.height, img.encoding, img.step) == (64, 48, "rgb8", 192)
            pixels = np.frombuffer(img.data, np.uint8).reshape(48, 64, 3)
            assert pixels.max() > 200 and pixels.min() < 60     # a bright target on a dim background
        else:
            js = deserialize_message(raw, JointState)
            assert list(js.name) == [f"joint{i}" for i in range(1, 8)] and len(js.velocity) == 7
    for ns, by_stamp in stamps.items():        # every image has the joint state with the same stamp
        assert len(by_stamp) == 40 and all(len(v) == 2 for v in by_stamp.values()), ns


def test_two_independent_readers_agree(scene_bag):
    ours = read_all(scene_bag)
    theirs = read_with_mcap(scene_bag)
    assert [(t, ns, raw) for t, _, ns, raw in ours] == [(t, ns, raw) for t, _, _, ns, raw in theirs]
    assert {(name, enc) for _, name, enc, _, _ in theirs} == {("sensor_msgs/msg/Image", "ros2msg"),
                                                             ("sensor_msgs/msg/JointState", "ros2msg")}


def _chunk(i: int) -> ActionChunk:
    m = ActionChunk()
    m.header.stamp.sec, m.header.stamp.nanosec = 1_700_000_000 + i, 5
    m.stream, m.chunk_index, m.horizon, m.dof = "robot0", i, 2, 3
    m.joint_names = ["a", "b", "c"]
    m.actions = np.arange(6, dtype=np.float32) + i
    return m


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_custom_types_round_trip(tmp_path, storage):
    out = tmp_path / "custom"
    tele = ChunkTelemetry()
    tele.stream, tele.chunk_index, tele.batch_sizes = "robot1", 2**40, [1, 2]
    with BagWriter(out, storage) as w:
        w.add_topic("/robot0/action_chunk", "physis_ros/msg/ActionChunk")
        w.add_topic("/telemetry", "physis_ros/msg/ChunkTelemetry")
        for i in range(3):
            w.write("/robot0/action_chunk", 1000 + i, serialize_message(_chunk(i)))
        w.write("/telemetry", 2000, serialize_message(tele))
    msgs = read_all(out)
    assert [m[0] for m in msgs] == ["/robot0/action_chunk"] * 3 + ["/telemetry"]
    # rosbags decodes with the definitions it registered from msg/ (no rclpy involved) ...
    for _, msgtype, _, raw in msgs:    # strict: rosbags rejects bytes after the message (not rclpy)
        typestore().deserialize_cdr(raw, msgtype)
    decoded = typestore().deserialize_cdr(msgs[2][3], "physis_ros/msg/ActionChunk")
    assert decoded.chunk_index == 2 and decoded.actions.tolist() == [2, 3, 4, 5, 6, 7]
    assert deserialize_message(msgs[3][3], ChunkTelemetry).chunk_index == 2**40
    if storage == "mcap":  # ... and the mcap library finds the full definitions in the file
        theirs = read_with_mcap(out)
        assert [raw for *_, raw in theirs] == [raw for *_, raw in msgs]
        from mcap.reader import make_reader
        with next(out.glob("*.mcap")).open("rb") as f:
            schemas = {s.name: s for s in make_reader(f).get_summary().schemas.values()}
        text = schemas["physis_ros/msg/ActionChunk"].data.decode()
        assert "float32[] actions" in text and "MSG: std_msgs/Header" in text


def test_definitions_from_rclpy_match_msg_files():
    """Types missing from the typestore are learned from rclpy introspection: same definition as msg/."""
    store = typestore()
    from_files = store.generate_msgdef("physis_ros/msg/ChunkTelemetry", ros_version=2)[0]
    saved = store.fielddefs.pop("physis_ros/msg/ChunkTelemetry")
    try:
        ensure_type("physis_ros/msg/ChunkTelemetry")
        assert store.generate_msgdef("physis_ros/msg/ChunkTelemetry", ros_version=2)[0] == from_files
    finally:
        store.fielddefs["physis_ros/msg/ChunkTelemetry"] = saved


def test_header_stamp_patch_in_place():
    raw = serialize_message(_chunk(1))
    assert header_stamp_ns(raw) == 1_700_000_001_000_000_005
    patched = with_header_stamp(raw, 42_000_000_007)
    m = deserialize_message(patched, ActionChunk)
    assert (m.header.stamp.sec, m.header.stamp.nanosec, m.chunk_index) == (42, 7, 1)
    assert len(patched) == len(raw)


def test_truncated_bag_gives_a_clear_error(scene_bag, tmp_path, capsys):
    bag = tmp_path / "truncated"
    shutil.copytree(scene_bag, bag)
    mcap = next(bag.glob("*.mcap"))
    with mcap.open("r+b") as f:
        f.truncate(mcap.stat().st_size // 2)
    with pytest.raises(BagError, match="truncated or corrupt"):
        bag_info(bag)
    with pytest.raises(BagError, match="truncated or corrupt"):
        read_with_mcap(bag)
    assert bag_cli.main(["replay", str(bag)]) == 2
    err = capsys.readouterr().err
    assert "physis-bag: error: cannot read bag" in err and "truncated or corrupt" in err


def test_missing_or_foreign_bag(tmp_path, capsys):
    assert bag_cli.main(["replay", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert bag_cli.main(["info", str(tmp_path)]) == 2
    assert "no metadata.yaml" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello")
    assert bag_cli.main(["replay", str(tmp_path / "notes.txt")]) == 2
    assert "is not a bag" in capsys.readouterr().err
    assert bag_cli.main(["replay", str(tmp_path / "nope"), "--rate", "0"]) == 2
    assert "--rate must be > 0" in capsys.readouterr().err


def test_remaps():
    remaps = parse_remaps(["/robot0:=/arm", "robot1/joint_states:=/r1/js"])
    assert remap_topic("/robot0/camera/image_raw", remaps) == "/arm/camera/image_raw"
    assert remap_topic("/robot1/joint_states", remaps) == "/r1/js"
    assert remap_topic("/robot1/camera/image_raw", remaps) == "/robot1/camera/image_raw"
    assert remap_topic("/robot00/x", remaps) == "/robot00/x"
    with pytest.raises(BagError, match="FROM:=TO"):
        parse_remaps(["/a=/b"])


def test_generate_cli(tmp_path, capsys):
    out = tmp_path / "gen"
    assert bag_cli.main(["generate", str(out), "--duration", "1", "--rate", "20", "--size", "40x30",
                         "--encoding", "mono8", "--storage", "sqlite3", "--namespaces", "arm"]) == 0
    info = bag_info(out)
    assert info.storage == "sqlite3"
    assert {(t.topic, t.count) for t in info.topics} == {("/arm/camera/image_raw", 20), ("/arm/joint_states", 20)}
    assert bag_cli.main(["generate", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


def test_generate_cli_tracking_records_an_arm_that_follows_the_expert(tmp_path):
    from physis_ros.bags.bagio import read_all, typestore
    from physis_ros.observations import TrackingScene

    out = tmp_path / "tracking"
    assert bag_cli.main(["generate", str(out), "--duration", "0.5", "--namespaces", "arm", "--tracking"]) == 0
    store, arm = typestore(), TrackingScene({"state": (7,)})
    joints = [store.deserialize_cdr(raw, t).position for topic, t, _, raw in read_all(out) if "joint" in topic]
    assert len(joints) == 5
    assert all(np.allclose(q, arm.observation_state("arm", i, 7), atol=1e-6) for i, q in enumerate(joints))


def test_predicted_frames_are_known_to_the_bag_io(tmp_path):
    """A world model's output, physis_ros/PredictedFrames, is typed by name like ActionChunk (so a recorder
    subscribes before its publisher exists), and round-trips through a bag with its definition."""
    from physis_ros.bags.bagio import known_topic_type
    from physis_ros.msg import PredictedFrames

    assert known_topic_type("/robot1/predicted_frames") == "physis_ros/msg/PredictedFrames"
    assert known_topic_type("/robot1/actions") is None      # ActionChunk or JointTrajectory: the config says
    m = PredictedFrames()
    m.header.stamp.sec, m.stream, m.chunk_index = 1_700_000_000, "robot1", 3
    m.frames, m.channels, m.height, m.width = 2, 4, 8, 8
    m.latents = np.arange(512, dtype=np.float32)
    out = tmp_path / "frames"
    with BagWriter(out) as w:
        w.add_topic("/robot1/predicted_frames", "physis_ros/msg/PredictedFrames")
        w.write("/robot1/predicted_frames", 1000, serialize_message(m))
    (topic, msgtype, _, raw), = read_all(out)
    assert (topic, msgtype) == ("/robot1/predicted_frames", "physis_ros/msg/PredictedFrames")
    decoded = typestore().deserialize_cdr(raw, msgtype)
    assert decoded.chunk_index == 3 and decoded.latents.tolist() == list(range(512))
    assert deserialize_message(raw, PredictedFrames).width == 8
    (_, schema, encoding, _, data), = read_with_mcap(out)
    assert (schema, encoding, data) == ("physis_ros/msg/PredictedFrames", "ros2msg", raw)


def test_scene_actions_follow_the_config(tmp_path):
    """generate writes a world-model stream's actions topic (type and horizon from its config and model),
    one per camera frame with the frame's stamp; the default config (WAM streams only) gets none."""
    from physis_ros.bags.scene import ActionsSpec, scene_actions

    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny-wam\nstreams:\n  robot0: {joint_names: [joint1, joint2, joint3, joint4, joint5, "
                      "joint6, joint7]}\n  arm: {model: tiny-acwm, namespace: arm, actions_type: joint_trajectory, "
                      "slo_interval_ms: 80.0, joint_names: [joint1, joint2, joint3, joint4, joint5, joint6, joint7]}\n")
    serve = load_serve_info(config)
    assert scene_actions(serve, ("robot0", "arm")) == (
        ActionsSpec("arm", "/arm/actions", "trajectory_msgs/msg/JointTrajectory", 8),)
    assert scene_actions(serve, ("robot0",)) == ()
    assert scene_actions(load_serve_info(), ("robot0", "robot1")) == ()
    messages = scene_messages(SceneSpec(namespaces=("robot0", "arm"), duration_s=0.5,
                                        actions=scene_actions(serve, ("robot0", "arm"))))
    stamps = {}
    for topic, _, _, raw in messages:
        stamps.setdefault(topic, []).append(header_stamp_ns(raw))
    assert stamps["/arm/actions"] == stamps["/arm/camera/image_raw"] and len(stamps["/arm/actions"]) == 5
    assert "/robot0/actions" not in stamps
