"""Replay and record through real rclpy publishers and subscriptions, in separate processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from physis_ros.bags.bagio import BagWriter, bag_info, known_topic_type, read_all, read_with_mcap, typestore
from physis_ros.bags.record import Recorder, wait_until
from physis_ros.bags.replay import ReplayOptions, Replayer
from physis_ros.bags.rosnode import RosSession
from physis_ros.bags.scene import SceneSpec, scene_messages

UNKNOWN_TYPE = "acme_msgs/msg/Widget"
SCENE_TOPICS = ["/robot0/camera/image_raw", "/robot0/joint_states", "/robot1/camera/image_raw",
                "/robot1/joint_states"]


def _short_bag(path, with_unknown: bool):
    """1.5 s of the scene (15 observations per robot), optionally plus a topic of a type not installed here."""
    messages = scene_messages(SceneSpec(duration_s=1.5))
    if with_unknown:
        from rosbags.typesys import get_types_from_msg
        store = typestore()
        if UNKNOWN_TYPE not in store.fielddefs:
            store.register(get_types_from_msg("string label\nfloat64 value\n", UNKNOWN_TYPE))
        widget = store.types[UNKNOWN_TYPE]
        start = messages[0][2]
        messages += [("/acme/widget", UNKNOWN_TYPE, start + i * 150_000_000 + 1,
                      bytes(store.serialize_cdr(widget(label=f"w{i}", value=float(i)), UNKNOWN_TYPE)))
                     for i in range(10)]
        messages.sort(key=lambda m: m[2])
    with BagWriter(path, "mcap") as w:
        for topic, msgtype, ns, raw in messages:
            w.add_topic(topic, msgtype)
            w.write(topic, ns, raw)
    return messages


def _bag_cli(*args) -> list[str]:
    return [sys.executable, "-m", "physis_ros.cli.bag", *map(str, args)]


@pytest.mark.slow
def test_replay_cli_skips_unknown_topic_and_keeps_timing(tmp_path):
    bag = tmp_path / "with_unknown"
    messages = _short_bag(bag, with_unknown=True)
    recorded = tmp_path / "recorded"
    with RosSession("test_replay_recorder") as ros:
        recorder = Recorder(ros.node, recorded, {t: known_topic_type(t) for t in SCENE_TOPICS})
        wait_for = [a for t in SCENE_TOPICS for a in ("--wait-for", t)]
        proc = subprocess.run(_bag_cli("replay", bag, *wait_for, "--json", tmp_path / "replay.json"),
                              capture_output=True, text=True, timeout=60)
        expected = {t: sum(1 for m in messages if m[0] == t) for t in SCENE_TOPICS}
        wait_until(lambda: recorder.counts == expected, 5.0)
        counts = recorder.close()
    # The unknown topic is skipped and reported; the rest is replayed; exit 3 says "replayed, but skipped some".
    assert proc.returncode == 3, proc.stderr
    assert "skipping /acme/widget (acme_msgs/msg/Widget, 10 messages): message type acme_msgs/msg/Widget is " \
           "not installed" in proc.stderr
    assert "skipped /acme/widget" in proc.stdout and "--skip-unknown" in proc.stderr
    report = json.loads((tmp_path / "replay.json").read_text())
    assert report["counts"] == expected and report["skipped"][0]["topic"] == "/acme/widget"  # publisher: exact
    # Sensor topics travel best effort (sensor-data QoS), as on a robot: on a loaded machine DDS may drop
    # one. Nearly all must arrive, and everything that arrives must be the bag's bytes.
    for topic, n in expected.items():
        assert counts.get(topic, 0) >= n - max(1, n // 10), (topic, counts.get(topic), n)
    # The bytes on the wire are the bag's bytes, and the recording opens with both readers.
    ours, theirs = read_all(recorded), read_with_mcap(recorded)
    assert [m[3] for m in ours] == [m[4] for m in theirs]
    sent = {(t, raw): ns for t, _, ns, raw in messages if t in expected}
    assert all((t, raw) in sent for t, _, _, raw in ours)
    # Original timing: arrival times at the recorder vs the bag's log times (matched by content), each topic
    # against its median offset (measuring from its first message alone made one late first arrival, e.g.
    # while discovery settles on a busy machine, shift every later message: p50 6.9 ms once in CI-like runs).
    errors = []
    for topic in SCENE_TOPICS:
        pairs = [(ns, sent[(t, raw)]) for t, _, ns, raw in ours if t == topic]
        rec_ns = np.array([p[0] for p in pairs], dtype=np.int64)
        bag_ns = np.array([p[1] for p in pairs], dtype=np.int64)
        offset = np.median(rec_ns - bag_ns)
        errors += list(np.abs((rec_ns - bag_ns) - offset) / 1e6)
    p50, worst = float(np.percentile(errors, 50)), max(errors)
    print(f"replay timing at the recorder: |error| p50 {p50:.3f} ms, max {worst:.3f} ms; "
          f"publisher side {report['timing']}")
    # The median says whether replay keeps the bag's timing; single late messages say how busy this shared
    # machine is, not whether the timing is right. The bound tells kept timing (about 0.1 ms on a quiet
    # host, a few ms beside a CPU hog) from lost timing (off by the scene's 100 ms spacing); how precise
    # replay is belongs to the replay benchmark (bench/RESULTS.md), not to this test.
    assert p50 < 25.0


@pytest.mark.slow
def test_record_cli_sqlite3_with_remap_clock_offset_and_loop(tmp_path):
    bag = tmp_path / "short"
    messages = _short_bag(bag, with_unknown=False)
    out = tmp_path / "rec_sqlite"
    rec = subprocess.Popen(_bag_cli("record", out, "--topics", "/arm/joint_states", "/clock", "--storage", "sqlite3"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with RosSession("test_record_replayer", spin=False) as ros:
            replayer = Replayer(bag, ros.node, ReplayOptions(
                rate=2.0, loop=True, max_loops=2, start_offset_s=0.5, remaps={"/robot0": "/arm"}, clock_hz=50.0,
                topics=["/robot0/joint_states"], wait_for=["/arm/joint_states"], wait_timeout_s=30.0, delay_s=0.3,
                progress=False, reliable=True))  # reliable: the recorder matches it, so every message counts
            result = replayer.run()
            time.sleep(0.5)
    finally:
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=30)
    assert rec.returncode == 0, stderr
    info = bag_info(bag)
    origin = info.start_ns + 500_000_000
    per_pass = sum(1 for t, _, ns, _ in messages if t == "/robot0/joint_states" and ns >= origin)
    assert per_pass == 10 and result.passes == 2
    assert result.counts == {"/arm/joint_states": 2 * per_pass}
    assert 0.9 * 2 * (info.end_ns - origin) / 2e9 < result.wall_s < 5.0     # twice as fast, two passes
    recorded = read_all(out)
    assert bag_info(out).storage == "sqlite3"
    joints = [m for m in recorded if m[0] == "/arm/joint_states"]
    assert len(joints) == 2 * per_pass
    clock = [m for m in recorded if m[0] == "/clock"]
    assert len(clock) >= 10
    from rclpy.serialization import deserialize_message
    from rosgraph_msgs.msg import Clock
    ticks = [deserialize_message(raw, Clock).clock for *_, raw in clock]
    bag_times = [t.sec * 10**9 + t.nanosec for t in ticks]
    assert all(origin <= t <= info.end_ns for t in bag_times)      # bag time, not wall time
    assert "/arm/joint_states" in stdout and "wrote" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--clock", "0"], "--clock rate must be > 0"),
    (["--start-offset", "99"], "past the end of the bag"),
    (["--topics", "/nope"], "topics not in bag"),
])
def test_replay_argument_errors(scene_bag, argv, message, capsys):
    from physis_ros.cli import bag as bag_cli
    assert bag_cli.main(["replay", str(scene_bag), "--quiet", "--delay", "0", *argv]) == 2
    assert message in capsys.readouterr().err
