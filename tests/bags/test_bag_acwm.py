"""The bag tools on world-model (ACWM) streams: a mixed config (robot0 a world-action model, robot1 an
action-conditioned world model) recorded, replayed and checked like a WAM-only one.

robot1 takes the camera, the joint state and the actions to imagine (/robot1/actions, one ActionChunk
per camera frame in the generated bag) and publishes physis_ros/PredictedFrames; the check pairs each
image with its joint state and its actions by the server's rule and compares every chunk with the
sequential reference fed the same three inputs, bit for bit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from physis_ros.bags.analysis import Outputs, OutputChunk, analyse, observation_tensors, reference_outputs
from physis_ros.bags.bagio import bag_info, read_all, read_with_mcap, typestore
from physis_ros.bags.inputs import collect_inputs
from physis_ros.bags.serveconf import load_serve_info
from physis_ros.cli import bag as bag_cli

ROOT = Path(__file__).resolve().parents[2]
JOINTS = [f"joint{i}" for i in range(1, 8)]
TICKS = 10
# robot1's first actions are malformed (so its first image has no actions at or before it: unpaired)
# and its fifth hold a NaN (image 4 then imagines the actions of tick 3, the latest at or before it).
FAULTS = ("actions_malformed@0:robot1", "actions_nonfinite@4:robot1")
EXPECTED_REJECTED = {"robot0": {}, "robot1": {"malformed": 1, "unpaired": 1, "nonfinite": 1}}
EXPECTED_CHUNKS = {"robot0": TICKS, "robot1": TICKS - 1}


def write_config(path: Path, **robot1) -> Path:
    """robot0: tiny-wam (the server's model); robot1: tiny-acwm. The CPU profiles shipped in config/profiles
    spare the server measuring both models at start-up."""
    config = {
        "model": "tiny-wam",
        "engine": {"workers": 2, "plan": "stage", "devices": ["cpu"]},
        "admission": {"profiles": str(ROOT / "config" / "profiles")},
        "streams": {
            "robot0": {"joint_names": JOINTS, "slo_interval_ms": 100.0},
            "robot1": {"model": "tiny-acwm", "joint_names": JOINTS, "slo_interval_ms": 80.0, **robot1},
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def generate(bag: Path, config: Path, *faults: str, duration: float = TICKS / 10) -> Path:
    argv = ["generate", str(bag), "--config", str(config), "--duration", str(duration), "--size", "40x30"]
    assert bag_cli.main(argv + [a for f in faults for a in ("--fault", f)]) == 0
    return bag


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    config = write_config(d / "serve.yaml")
    return config, generate(d / "bag", config, *FAULTS)


@pytest.fixture(scope="module")
def mixed_check(mixed, tmp_path_factory, ros_domain):
    """The real server (physis-serve --deterministic, separate process) on the mixed bag."""
    from physis_ros.bags.check import CheckOptions, run_check

    config, bag = mixed
    return run_check(CheckOptions(bag=bag, config=str(config), out=str(tmp_path_factory.mktemp("mixed_out")),
                                  timeout_s=150.0))


# ---------------------------------------------------------------------------- the whole harness

@pytest.mark.slow
def test_mixed_bag_passes_the_deterministic_check(mixed_check):
    print("\n" + mixed_check.summary())
    assert mixed_check.ok, mixed_check.summary()
    items = {i.name: i for i in mixed_check.analysis.items}
    for name in ("robot0", "robot1"):
        for check in ("every chunk accounted for", "indices contiguous", "chunk c used observation c",
                      "chunk fields", "outputs finite", "one telemetry per chunk", "rejected inputs"):
            assert items[f"{name}: {check}"].ok
        assert "bit-for-bit" in items[f"{name}: equals reference"].detail
        assert mixed_check.analysis.stats[name]["chunks"] == EXPECTED_CHUNKS[name]
        assert mixed_check.server["rejected"][name] == EXPECTED_REJECTED[name]
    assert "robot0: one joint_trajectory per chunk" in items                 # a WAM's trajectory...
    assert "robot1: one joint_trajectory per chunk" not in items             # ... a world model has none
    assert "2x4x8x8" in items["robot1: chunk fields"].detail
    assert "the server counted the same" in items["robot1: rejected inputs"].detail
    assert mixed_check.replay["counts"]["/robot1/actions"] == TICKS          # actions replayed, all of them


@pytest.mark.slow
def test_mixed_check_recorded_predicted_frames(mixed_check):
    """The check's recording holds robot1's PredictedFrames with their definition, exact CDR, readable by
    rclpy, rosbags and the mcap library; robot1 publishes no actions of its own."""
    from rclpy.serialization import deserialize_message

    from physis_ros.msg import PredictedFrames

    rec = mixed_check.recorded
    topics = {t.topic: t for t in bag_info(rec).topics}
    assert topics["/robot1/predicted_frames"].msgtype == "physis_ros/msg/PredictedFrames"
    assert topics["/robot1/predicted_frames"].count == EXPECTED_CHUNKS["robot1"]
    assert topics["/robot0/action_chunk"].count == EXPECTED_CHUNKS["robot0"]
    assert "/robot1/action_chunk" not in topics and "/robot1/joint_trajectory" not in topics
    assert topics["/telemetry"].count == sum(EXPECTED_CHUNKS.values())
    ours, theirs = read_all(rec), read_with_mcap(rec)
    assert [raw for *_, raw in theirs] == [raw for *_, raw in ours]
    assert {t: name for t, name, *_ in theirs}["/robot1/predicted_frames"] == "physis_ros/msg/PredictedFrames"
    frames = [raw for t, *_, raw in ours if t == "/robot1/predicted_frames"]
    for raw in frames:
        typestore().deserialize_cdr(raw, "physis_ros/msg/PredictedFrames")   # strict: no stray bytes
    m = deserialize_message(frames[0], PredictedFrames)
    assert m.stream == "robot1" and m.chunk_index == 0
    assert (m.frames, m.channels, m.height, m.width) == (2, 4, 8, 8) and len(m.latents) == 2 * 4 * 8 * 8


# ---------------------------------------------------------------------------- offline: pairing, rejection, reference

def test_checker_pairs_actions_and_excludes_corrupted_ones(mixed):
    """Each image of robot1 pairs with the joint state and the actions of its stamp; the corrupted actions
    are excluded by the server's rule (acceptance.accept_actions) and counted by its reason, and an image
    with no accepted actions at or before it is unpaired."""
    from physis_ros.bags.scene import planned_actions, scene_phase

    config, bag = mixed
    serve = load_serve_info(config)
    inputs = collect_inputs(bag, serve)
    for name, want in EXPECTED_REJECTED.items():
        assert dict(inputs.expected_rejections(name)) == want, inputs.rejected[name]
        assert len(inputs.observations[name]) == EXPECTED_CHUNKS[name]
    by_reason = {r.reason: r for r in inputs.rejected["robot1"]}
    assert by_reason["malformed"].kind == "actions" and "ActionChunk" in by_reason["malformed"].detail
    assert by_reason["nonfinite"].kind == "actions" and by_reason["nonfinite"].topic == "/robot1/actions"
    assert by_reason["unpaired"].kind == "image" and "no accepted actions" in by_reason["unpaired"].detail
    assert by_reason["unpaired"].stamp_ns == by_reason["malformed"].stamp_ns      # tick 0's image
    obs = inputs.observations["robot1"]                  # ticks 1..9
    assert set(obs[0].paired) == {"state", "actions"}
    assert inputs.observations["robot0"][0].paired.keys() == {"state"}
    period = obs[1].stamp_ns - obs[0].stamp_ns
    for o in obs:
        assert o.joint_stamp_ns == o.stamp_ns
        tick = (o.stamp_ns - obs[0].stamp_ns) // period + 1
        used = tick - 1 if tick == 4 else tick           # tick 4's actions hold a NaN: those of tick 3
        assert o.paired["actions"].stamp_ns == o.stamp_ns - (tick - used) * period
        t = (o.paired["actions"].stamp_ns - 1_700_000_000_000_000_000) / 1e9
        np.testing.assert_array_equal(o.actions, planned_actions(7, 8, t, scene_phase("robot1"), 10.0))


def test_reference_imagines_the_paired_actions(mixed):
    """The reference of a world-model chunk depends on the actions it was fed, so a wrong pairing cannot pass;
    the comparison catches one ulp in a latent; NaN latents fail whatever the reference says."""
    config, bag = mixed
    serve = load_serve_info(config)
    obs = collect_inputs(bag, serve).observations["robot1"][:3]
    refs = reference_outputs({"robot1": obs}, serve)["robot1"]
    assert [r.shape for r in refs] == [(2, 4, 8, 8)] * 3 and all(np.all(np.isfinite(r)) for r in refs)
    stream = serve.stream("robot1")
    assert observation_tensors(obs[0], stream, serve).keys() == {"image", "state", "actions"}
    swapped = [obs[0], obs[1], obs[2]]
    swapped[1] = type(obs[1])(**{**obs[1].__dict__, "paired": {**obs[1].paired, "actions": obs[2].paired["actions"]}})
    other = reference_outputs({"robot1": swapped}, serve)["robot1"]
    assert other[0].tobytes() == refs[0].tobytes() and other[1].tobytes() != refs[1].tobytes()

    def outputs(values) -> Outputs:
        chunks = [OutputChunk("robot1", i, o.stamp_ns, v, 0, [], "predicted_frames") for i, (o, v) in
                  enumerate(zip(obs, values))]
        tele = [{"stream": "robot1", "chunk": i, "response_latency_ms": 1.0, "output_interval_ms": 1.0,
                 "observation_age_ms": 1.0} for i in range(len(values))]
        return Outputs({"robot1": chunks}, {"robot1": []}, tele, 0)

    inputs = {"robot1": obs}
    good = analyse(inputs, outputs(refs), serve)
    assert good.ok, [i for i in good.items if not i.ok]
    flipped = [r.copy() for r in refs]
    flipped[2].view(np.uint32)[1, 3, 4, 5] ^= 1
    failed = {i.name: i.detail for i in analyse(inputs, outputs(flipped), serve).items if not i.ok}
    assert list(failed) == ["robot1: equals reference"] and "first chunk 2" in failed["robot1: equals reference"]
    nan = [np.full_like(r, np.nan) for r in refs]
    failed = {i.name: i.detail for i in analyse(inputs, outputs(nan), serve, reference=False).items if not i.ok}
    assert list(failed) == ["robot1: outputs finite"]
    assert "3 predicted_frames message(s) with NaN/inf latents" in failed["robot1: outputs finite"]
    wrong_shape = [r.reshape(4, 2, 8, 8) for r in refs]
    failed = {i.name for i in analyse(inputs, outputs(wrong_shape), serve).items if not i.ok}
    assert failed == {"robot1: chunk fields", "robot1: equals reference"}


def test_joint_trajectory_actions(tmp_path):
    """actions_type: joint_trajectory: the bag carries trajectories on the actions topic, typed so in the
    config's topic types; the checker accepts them as the node does (positions of the first points), the
    same actions as the ActionChunk form, and counts a point short of a position as malformed."""
    config = write_config(tmp_path / "serve.yaml", actions_type="joint_trajectory")
    serve = load_serve_info(config)
    assert serve.topic_types["/robot1/actions"] == "trajectory_msgs/msg/JointTrajectory"
    bag = generate(tmp_path / "bag", config, "actions_malformed@2:robot1", duration=0.5)
    assert {t.topic: t.msgtype for t in bag_info(bag).topics}["/robot1/actions"] == \
        "trajectory_msgs/msg/JointTrajectory"
    inputs = collect_inputs(bag, serve)
    assert dict(inputs.expected_rejections("robot1")) == {"malformed": 1}
    obs = inputs.observations["robot1"]
    assert len(obs) == 5 and obs[2].paired["actions"].stamp_ns == obs[1].stamp_ns
    chunk_config = write_config(tmp_path / "chunk.yaml")
    as_chunks = collect_inputs(generate(tmp_path / "chunk_bag", chunk_config, duration=0.5),
                               load_serve_info(chunk_config)).observations["robot1"]
    np.testing.assert_array_equal(obs[0].actions, as_chunks[0].actions)


# ---------------------------------------------------------------------------- record and replay

def test_record_topics_follow_each_streams_model(mixed):
    from physis_ros.bags.record import server_topics

    config, _ = mixed
    serve = load_serve_info(config)
    assert [s.produces for s in serve.streams] == ["actions", "frames"]
    assert serve.stream("robot1").model == "tiny-acwm" and serve.stream("robot0").model == "tiny-wam"
    assert server_topics(serve) == {
        "/robot0/camera/image_raw": "sensor_msgs/msg/Image",
        "/robot0/joint_states": "sensor_msgs/msg/JointState",
        "/robot1/camera/image_raw": "sensor_msgs/msg/Image",
        "/robot1/joint_states": "sensor_msgs/msg/JointState",
        "/robot1/actions": "physis_ros/msg/ActionChunk",
        "/robot0/action_chunk": "physis_ros/msg/ActionChunk",
        "/robot0/joint_trajectory": "trajectory_msgs/msg/JointTrajectory",
        "/robot1/predicted_frames": "physis_ros/msg/PredictedFrames",
        "/telemetry": "physis_ros/msg/ChunkTelemetry",
        "/diagnostics": "diagnostic_msgs/msg/DiagnosticArray",
        "/robot0/expert_actions": "physis_ros/msg/ActionChunk",   # the WAM's expert, for the tracking error
    }
    assert list(server_topics(serve, inputs=False)) == ["/robot0/action_chunk", "/robot0/joint_trajectory",
                                                        "/robot1/predicted_frames", "/telemetry", "/diagnostics"]


def test_actions_replay_reliable_into_the_servers_subscription():
    """An actions topic carries commands: replayed reliable (deep, volatile), which matches the server's
    actions subscription (its qos.action_chunk profile) whatever reliability that asks for."""
    from rclpy.qos import DurabilityPolicy, QoSCompatibility, ReliabilityPolicy, qos_check_compatible

    from physis_ros.bags.rosnode import qos_for
    from physis_ros.ros import qos
    from physis_ros.serving.config import QoSConfig

    for msgtype in ("physis_ros/msg/ActionChunk", "trajectory_msgs/msg/JointTrajectory"):
        for reliable in (False, True):
            pub = qos_for(msgtype, "/robot1/actions", reliable)
            assert pub.reliability == ReliabilityPolicy.RELIABLE and pub.durability == DurabilityPolicy.VOLATILE
            assert pub.depth >= 1000
            for sub in (QoSConfig(), QoSConfig("best_effort", 10)):
                verdict, why = qos_check_compatible(pub, qos.profile(sub))
                assert verdict != QoSCompatibility.ERROR, why   # (WARNING: a policy left at the RMW default)


@pytest.mark.slow
def test_record_cli_records_an_acwm_streams_inputs(mixed, tmp_path):
    """physis-bag record --config (a separate process) subscribes robot1's actions topic with its type from
    the config and records every replayed ActionChunk (reliable: exact count), byte for byte (as a recorder
    on the wire sees them)."""
    from physis_ros.bags.replay import ReplayOptions, Replayer
    from physis_ros.bags.rosnode import RosSession

    config, bag = mixed
    out = tmp_path / "recorded"
    rec = subprocess.Popen([sys.executable, "-m", "physis_ros.cli.bag", "record", str(out), "--config", str(config)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    inputs = ["/robot1/actions", "/robot1/camera/image_raw", "/robot1/joint_states"]
    try:
        with RosSession("test_record_acwm_replayer", spin=False) as ros:
            Replayer(bag, ros.node, ReplayOptions(topics=inputs, wait_for=inputs, wait_timeout_s=30.0, delay_s=0.3,
                                                  progress=False, reliable=True)).run()
            time.sleep(0.5)
    finally:
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=30)
    assert rec.returncode == 0, stderr
    types = {t.topic: t.msgtype for t in bag_info(out).topics}
    assert types["/robot1/actions"] == "physis_ros/msg/ActionChunk"
    assert types["/robot1/predicted_frames"] == "physis_ros/msg/PredictedFrames"   # subscribed at once, by type
    sent = [raw for t, *_, raw in read_all(bag) if t == "/robot1/actions"]
    got = [raw for t, *_, raw in read_all(out) if t == "/robot1/actions"]
    assert len(got) == len(sent) == TICKS
    for g, b in zip(got, sent):    # the bag's bytes, plus the zero padding DDS adds to a 4-byte boundary
        assert g[:len(b)] == b and len(g) == (len(b) + 3) // 4 * 4 and not any(g[len(b):])
    assert "/robot1/actions" in stdout


# ---------------------------------------------------------------------------- what the tools refuse

def test_check_refuses_actions_fed_by_the_servers_own_output(tmp_path):
    """A world model imagining what a WAM stream of the same server commands cannot be replayed
    deterministically: one line naming the stream and the fix, nothing started; generate writes no
    actions topic for it."""
    from physis_ros.bags.check import CheckOptions, run_check

    config = write_config(tmp_path / "serve.yaml", topics={"actions": "/robot0/action_chunk"})
    bag = generate(tmp_path / "bag", config, duration=0.3)
    assert "/robot0/action_chunk" not in {t.topic for t in bag_info(bag).topics}
    result = run_check(CheckOptions(bag=bag, config=str(config), timeout_s=30.0))
    assert not result.ok and "stream robot1 takes /robot0/action_chunk, an output of this server" in result.error
    assert "server_start" not in result.seconds


def test_generate_refuses_actions_faults_without_an_actions_topic(tmp_path, capsys):
    assert bag_cli.main(["generate", str(tmp_path / "bag"), "--fault", "actions_nonfinite@1"]) == 2
    assert "no robot has an actions topic" in capsys.readouterr().err
