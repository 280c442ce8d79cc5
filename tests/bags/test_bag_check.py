"""The replay harness: the bundled bag through the real server (separate process), then the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from physis_ros.bags.analysis import Outputs, OutputChunk, analyse, reference_outputs
from physis_ros.bags.bagio import bag_info, read_all, read_with_mcap
from physis_ros.bags.inputs import input_observations
from physis_ros.bags.serveconf import load_serve_info


@pytest.mark.slow
def test_bundled_bag_passes_the_deterministic_check(bag_check):
    print("\n" + bag_check.summary())
    assert bag_check.error is None, bag_check.summary()
    failed = [f"{i.name}: {i.detail}" for i in bag_check.analysis.items if not i.ok]
    assert not failed, bag_check.summary()
    names = {i.name for i in bag_check.analysis.items}
    for stream in ("robot0", "robot1"):
        for check in ("every chunk accounted for", "indices contiguous", "chunk c used observation c",
                      "equals reference", "one telemetry per chunk", "one joint_trajectory per chunk"):
            assert f"{stream}: {check}" in names
        stats = bag_check.analysis.stats[stream]
        assert stats["chunks"] == stats["observations"] == 40
        assert 0 < stats["e2e_ms_p50"] < 5000 and 0 < stats["latency_ms_p50"] < 5000
        assert 50 < stats["interval_ms_p50"] < 1000      # ~100 ms: deterministic mode follows the 10 Hz bag
    assert "bit-for-bit" in next(i.detail for i in bag_check.analysis.items if i.name == "robot0: equals reference")
    assert bag_check.replay["messages"] == 160
    assert json.loads(json.dumps(bag_check.as_dict()))["ok"]     # what --out DIR/check.json holds


@pytest.mark.slow
def test_recorded_outputs_open_with_both_readers(bag_check):
    from rclpy.serialization import deserialize_message

    from physis_ros.msg import ActionChunk, ChunkTelemetry

    rec = bag_check.recorded
    topics = {t.topic: t for t in bag_info(rec).topics}
    assert topics["/robot0/action_chunk"].msgtype == "physis_ros/msg/ActionChunk"
    ours, theirs = read_all(rec), read_with_mcap(rec)
    telemetry = [deserialize_message(raw, ChunkTelemetry) for t, *_, raw in ours if t == "/telemetry"]
    # a chunk whose every row was due when it came out (a busy host) is not sent as a trajectory
    late = sum(m.late for m in telemetry if m.stream == "robot1")
    assert topics["/telemetry"].count == 80 and topics["/robot1/joint_trajectory"].count == 40 - late
    assert [(t, ns, raw) for t, _, ns, raw in ours] == [(t, ns, raw) for t, _, _, ns, raw in theirs]
    schemas = {t: name for t, name, *_ in theirs}
    assert schemas["/telemetry"] == "physis_ros/msg/ChunkTelemetry"
    chunk = deserialize_message(next(raw for t, *_, raw in ours if t == "/robot1/action_chunk"), ActionChunk)
    assert chunk.stream == "robot1" and (chunk.horizon, chunk.dof) == (16, 7)


@pytest.mark.slow
def test_recorded_outputs_are_exact_cdr(bag_check):
    """Every message the server published decodes with rosbags, which rejects bytes after the message
    (the raw JointTrajectory once carried 8 stray bytes per point), and its outputs re-serialize to the
    same bytes (padding zeroed, no leftover memory on the wire)."""
    from physis_ros.bags.bagio import typestore

    store = typestore()
    ours = read_all(bag_check.recorded)
    assert {t for t, *_ in ours} >= {"/robot0/action_chunk", "/robot1/joint_trajectory", "/telemetry"}
    for topic, msgtype, _, raw in ours:
        msg = store.deserialize_cdr(raw, msgtype)         # SerdeError "CDR message size mismatch" if too long
        if topic.endswith(("/action_chunk", "/joint_trajectory")):
            assert bytes(store.serialize_cdr(msg, msgtype)) == raw, topic
    theirs = read_with_mcap(bag_check.recorded)           # the mcap library reads the same bytes back
    assert [raw for *_, raw in theirs] == [raw for *_, raw in ours]


@pytest.mark.slow
def test_report_from_the_recorded_run(bag_check, tmp_path, capsys):
    from physis_ros.cli import report as report_cli

    out = tmp_path / "report"
    assert report_cli.main([str(bag_check.recorded), "--out", str(out), "--slo-ms", "100"]) == 0
    table = capsys.readouterr().out
    assert "latency p50" in table and "robot0" in table and "all" in table
    for png in ("interval", "latency", "stages", "observation_age", "control", "executed"):
        data = (out / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 150_000   # palette PNGs
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["robot0"]["chunks"] == 40 and summary["all"]["chunks"] == 80
    assert "| latency p99 (ms) |" in (out / "summary.md").read_text()


def test_report_needs_telemetry(scene_bag, tmp_path, capsys):
    from physis_ros.cli import report as report_cli

    assert report_cli.main([str(scene_bag), "--out", str(tmp_path)]) == 2
    assert "has no /telemetry topic" in capsys.readouterr().err


@pytest.fixture(scope="module")
def few_observations(scene_bag):
    serve = load_serve_info()
    inputs = {"robot0": input_observations(scene_bag, serve)["robot0"][:4]}
    return serve, inputs, reference_outputs(inputs, serve)["robot0"]


def _outputs(serve, inputs, actions, indices, late=(), trajectories=None) -> Outputs:
    obs = inputs["robot0"]
    joints = serve.streams[0].joint_names
    chunks = [OutputChunk("robot0", i, obs[i].stamp_ns, actions[i], 0, joints) for i in indices]
    tele = [{"stream": "robot0", "chunk": i, "response_latency_ms": 1.0, "output_interval_ms": 1.0,
             "observation_age_ms": 1.0, "late": i in late} for i in indices]
    sent = len(chunks) if trajectories is None else trajectories
    return Outputs({"robot0": chunks}, {"robot0": [(0, 16)] * sent}, tele, 0)


def test_a_late_chunk_owes_no_trajectory_and_a_missing_one_is_flagged(few_observations):
    """A chunk whose every row was due when it came out is not sent as a trajectory (the node's rule): the
    check excuses it by its telemetry, and only it."""
    serve, inputs, refs = few_observations
    name = "robot0: one joint_trajectory per chunk"
    late = analyse(inputs, _outputs(serve, inputs, refs, [0, 1, 2, 3], late={2}, trajectories=3), serve)
    assert late.ok and "1 of them late" in next(i.detail for i in late.items if i.name == name)
    lost = analyse(inputs, _outputs(serve, inputs, refs, [0, 1, 2, 3], trajectories=3), serve)
    assert [i.name for i in lost.items if not i.ok] == [name]


def test_analysis_detects_missing_reordered_and_wrong_chunks(few_observations):
    serve, inputs, refs = few_observations
    good = analyse(inputs, _outputs(serve, inputs, refs, [0, 1, 2, 3]), serve)
    assert good.ok, [i for i in good.items if not i.ok]

    bad = analyse(inputs, _outputs(serve, inputs, refs, [0, 2, 1]), serve)
    failed = {i.name: i.detail for i in bad.items if not i.ok}
    assert "missing 3" in failed["robot0: every chunk accounted for"]
    assert "robot0: indices contiguous" in failed

    flipped = [a.copy() for a in refs]
    flipped[2].view(np.uint32)[0, 0] ^= 1          # one ulp in one action of chunk 2
    bad = analyse(inputs, _outputs(serve, inputs, flipped, [0, 1, 2, 3]), serve)
    failed = {i.name: i.detail for i in bad.items if not i.ok}
    assert list(failed) == ["robot0: equals reference"] and "first chunk 2" in failed["robot0: equals reference"]


def test_check_cli_reports_a_missing_bag(tmp_path, capsys):
    from physis_ros.cli import bag as bag_cli

    assert bag_cli.main(["check", str(tmp_path / "nope")]) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and "does not exist" in out


# ---------------------------------------------------------------------------- rejected inputs, NaN outputs

# One bag with every kind of message the server rejects (the fault is named after the server's
# counter; see physis_ros.bags.scene.FAULTS). robot1's first joint state lacks a joint, so its first
# image has no joint state at or before it: "unpaired".
FAULTS = ("nonfinite@3:robot0", "size@5:robot0", "encoding@2:robot1", "missing_joints@0:robot1",
          "missing_joints@6:robot1")
FAULT_TICKS = 10
EXPECTED_REJECTED = {"robot0": {"nonfinite": 1, "size": 1},
                     "robot1": {"encoding": 1, "missing_joints": 2, "unpaired": 1}}
EXPECTED_CHUNKS = {"robot0": FAULT_TICKS - 1, "robot1": FAULT_TICKS - 2}


def _small_bag(path, faults=()):
    from physis_ros.bags.scene import Fault, SceneSpec, write_scene_bag

    spec = SceneSpec(duration_s=FAULT_TICKS / 10, rate_hz=10.0, width=40, height=30,
                     faults=tuple(Fault.parse(f) for f in faults))
    write_scene_bag(path, spec)
    return path


@pytest.fixture(scope="module")
def fault_bag(tmp_path_factory):
    return _small_bag(tmp_path_factory.mktemp("faults") / "bag", FAULTS)


def test_checker_applies_the_servers_acceptance_rule(fault_bag):
    """Every rejected message is excluded (by the node's own rule) and listed with the node's reason;
    the reference runs on the accepted ones (the checker used to crash here with InputRejected)."""
    from physis_ros.bags.inputs import collect_inputs

    serve = load_serve_info()
    inputs = collect_inputs(fault_bag, serve)
    for name, want in EXPECTED_REJECTED.items():
        assert dict(inputs.expected_rejections(name)) == want, inputs.rejected[name]
        assert len(inputs.observations[name]) == EXPECTED_CHUNKS[name]
    details = {r.reason: r.detail for rs in inputs.rejected.values() for r in rs}
    assert set(details) == {"nonfinite", "size", "encoding", "missing_joints", "unpaired"}
    assert all(details.values())         # the node's own wording (conversions.py), e.g. which joint is NaN
    # robot0's image 3 uses the joint state of tick 2 (its own was NaN): the latest at or before it
    obs = inputs.observations["robot0"]
    assert obs[3].joint_stamp_ns == obs[2].stamp_ns and obs[3].stamp_ns != obs[2].stamp_ns
    refs = reference_outputs({"robot0": obs[:4]}, serve)["robot0"]
    assert len(refs) == 4 and all(np.all(np.isfinite(r)) for r in refs)


@pytest.mark.slow
def test_fault_bag_passes_and_rejections_agree_with_the_server(fault_bag, tmp_path):
    """The real server in deterministic mode: it rejects exactly what the checker excluded (its
    --summary-json counters), and every accepted observation gets its chunk, equal to the reference."""
    from physis_ros.bags.check import CheckOptions, run_check

    result = run_check(CheckOptions(bag=fault_bag, out=str(tmp_path / "out"), timeout_s=150.0))   # own ROS domain
    print("\n" + result.summary())
    assert result.ok, result.summary()
    items = {i.name: i for i in result.analysis.items}
    for name, want in EXPECTED_REJECTED.items():
        assert result.server["rejected"][name] == want
        assert "the server counted the same" in items[f"{name}: rejected inputs"].detail
        assert items[f"{name}: outputs finite"].ok
        assert result.analysis.stats[name]["chunks"] == EXPECTED_CHUNKS[name]
    assert "bit-for-bit" in items["robot1: equals reference"].detail


def test_analysis_flags_rejection_disagreement_and_nonfinite_outputs(few_observations):
    from physis_ros.bags.inputs import Inputs, Rejection

    serve, inputs, refs = few_observations
    rejected = {"robot0": [Rejection("robot0", "/robot0/joint_states", "joint_states", 1, "nonfinite", "NaN")]}
    outputs = _outputs(serve, inputs, refs, [0, 1, 2, 3])
    agree = analyse(Inputs(inputs, rejected), outputs, serve, server_rejected={"robot0": {"nonfinite": 1}})
    assert agree.ok, [i for i in agree.items if not i.ok]
    disagree = analyse(Inputs(inputs, rejected), outputs, serve, server_rejected={"robot0": {"size": 2}})
    failed = {i.name: i.detail for i in disagree.items if not i.ok}
    assert list(failed) == ["robot0: rejected inputs"]
    assert "checker expects nonfinite 1, server counted size 2" in failed["robot0: rejected inputs"]

    nan = [np.full_like(a, np.nan) for a in refs]
    # NaN chunks that equal a NaN reference bit for bit used to pass; without the reference they
    # passed too. Either way a non-finite output fails.
    bad = analyse(inputs, _outputs(serve, inputs, nan, [0, 1, 2, 3]), serve, reference=False)
    failed = {i.name: i.detail for i in bad.items if not i.ok}
    assert list(failed) == ["robot0: outputs finite"] and "4 action_chunk(s) with NaN/inf" in failed[
        "robot0: outputs finite"]
    traj = _outputs(serve, inputs, refs, [0, 1, 2, 3])
    traj.nonfinite_trajectories["robot0"] = [2]
    failed = {i.name: i.detail for i in analyse(inputs, traj, serve, reference=False).items if not i.ok}
    assert "joint_trajectory" in failed["robot0: outputs finite"]


FAKE_SERVER = r'''
"""A stand-in for physis-serve that publishes a NaN ActionChunk (and NaN JointTrajectory) for every
camera frame it receives, with the server's topics, stamps and "serving" diagnostics."""
import array
import math

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.executors import ExternalShutdownException
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from physis_ros.bags.serveconf import load_serve_info
from physis_ros.msg import ActionChunk, ChunkTelemetry

HORIZON, DOF = 16, 7
serve = load_serve_info()
rclpy.init()
node = rclpy.create_node("fake_nan_server")
reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
sensor = QoSProfile(depth=1000, reliability=ReliabilityPolicy.BEST_EFFORT)
telemetry = node.create_publisher(ChunkTelemetry, serve.telemetry_topic, reliable)
diagnostics = node.create_publisher(DiagnosticArray, "/diagnostics", reliable)


def serving():
    diagnostics.publish(DiagnosticArray(status=[DiagnosticStatus(name="physis_server: engine",
                                                                 message="serving")]))


node.create_timer(0.2, serving)


def stream(s):
    chunk_pub = node.create_publisher(ActionChunk, s.topics["action_chunk"], reliable)
    traj_pub = node.create_publisher(JointTrajectory, s.topics["joint_trajectory"], reliable)
    count = [0]

    def on_image(img):
        c = count[0]
        count[0] += 1
        msg = ActionChunk(stream=s.name, chunk_index=c, control_period=0.02, joint_names=s.joint_names,
                          horizon=HORIZON, dof=DOF)
        msg.header.stamp = img.header.stamp
        msg.actions = array.array("f", [math.nan] * (HORIZON * DOF))
        chunk_pub.publish(msg)
        traj = JointTrajectory(joint_names=s.joint_names, points=[
            JointTrajectoryPoint(positions=[math.nan] * DOF, velocities=[0.0] * DOF) for _ in range(HORIZON)])
        traj.header.stamp = img.header.stamp
        traj_pub.publish(traj)
        telemetry.publish(ChunkTelemetry(stream=s.name, chunk_index=c, observation_stamp=img.header.stamp))

    node.create_subscription(Image, s.topics["image"], on_image, sensor)
    node.create_subscription(JointState, s.topics["joint_states"], lambda _msg: None, sensor)  # replay waits for it


for s in serve.streams:
    stream(s)
try:
    rclpy.spin(node)
except (KeyboardInterrupt, ExternalShutdownException):
    pass
'''


@pytest.mark.slow
def test_check_fails_a_run_with_nan_outputs(tmp_path, capsys):
    """A server whose chunks are NaN must fail the check, through the CLI (exit 1).

    The real server will soon refuse to publish non-finite chunks, so the honest way to exercise the
    checker's output check is a fake server (``--server-cmd``, a tiny rclpy script written here) that
    publishes a NaN ActionChunk and a NaN JointTrajectory for each observation."""
    import sys

    from physis_ros.cli import bag as bag_cli

    bag = _small_bag(tmp_path / "bag")
    script = tmp_path / "fake_nan_server.py"
    script.write_text(FAKE_SERVER)
    out = tmp_path / "out"
    code = bag_cli.main(["check", str(bag), "--out", str(out), "--timeout", "90",     # own ROS domain (conftest)
                         "--server-cmd", f"{sys.executable} {script}"])
    captured = capsys.readouterr()
    print(captured.out)
    assert code == 1, captured.out + captured.err
    report = json.loads((out / "check.json").read_text())
    assert report["error"] is None and not report["ok"]
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("robot0", "robot1"):
        finite = checks[f"{name}: outputs finite"]
        assert not finite["ok"] and "NaN/inf actions" in finite["detail"] and "joint_trajectory" in finite["detail"]
    assert "check failed" in captured.err and "outputs finite" in captured.err
    assert len([line for line in captured.err.splitlines() if line.strip()]) == 1
