"""The replay harness: the bundled bag through the real server (separate process), then the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from physis_ros.bags.analysis import Outputs, OutputChunk, analyse, input_observations, reference_outputs
from physis_ros.bags.bagio import bag_info, read_all, read_with_mcap
from physis_ros.bags.serveconf import load_serve_info


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


def test_recorded_outputs_open_with_both_readers(bag_check):
    from rclpy.serialization import deserialize_message

    from physis_ros.msg import ActionChunk

    rec = bag_check.recorded
    topics = {t.topic: t for t in bag_info(rec).topics}
    assert topics["/robot0/action_chunk"].msgtype == "physis_ros/msg/ActionChunk"
    assert topics["/telemetry"].count == 80 and topics["/robot1/joint_trajectory"].count == 40
    ours, theirs = read_all(rec), read_with_mcap(rec)
    assert [(t, ns, raw) for t, _, ns, raw in ours] == [(t, ns, raw) for t, _, _, ns, raw in theirs]
    schemas = {t: name for t, name, *_ in theirs}
    assert schemas["/telemetry"] == "physis_ros/msg/ChunkTelemetry"
    chunk = deserialize_message(next(raw for t, *_, raw in ours if t == "/robot1/action_chunk"), ActionChunk)
    assert chunk.stream == "robot1" and (chunk.horizon, chunk.dof) == (16, 7)


def test_report_from_the_recorded_run(bag_check, tmp_path, capsys):
    from physis_ros.cli import report as report_cli

    out = tmp_path / "report"
    assert report_cli.main([str(bag_check.recorded), "--out", str(out), "--slo-ms", "100"]) == 0
    table = capsys.readouterr().out
    assert "latency p50" in table and "robot0" in table and "all" in table
    for png in ("interval", "latency", "stages", "observation_age"):
        data = (out / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["robot0"]["chunks"] == 40 and summary["all"]["chunks"] == 80
    assert "| latency p99 |" in (out / "summary.md").read_text()


def test_report_needs_telemetry(scene_bag, tmp_path, capsys):
    from physis_ros.cli import report as report_cli

    assert report_cli.main([str(scene_bag), "--out", str(tmp_path)]) == 2
    assert "has no /telemetry topic" in capsys.readouterr().err


@pytest.fixture(scope="module")
def few_observations(scene_bag):
    serve = load_serve_info()
    inputs = {"robot0": input_observations(scene_bag, serve)["robot0"][:4]}
    return serve, inputs, reference_outputs(inputs, serve)["robot0"]


def _outputs(serve, inputs, actions, indices) -> Outputs:
    obs = inputs["robot0"]
    joints = serve.streams[0].joint_names
    chunks = [OutputChunk("robot0", i, obs[i].stamp_ns, actions[i], 0, joints) for i in indices]
    tele = [{"stream": "robot0", "chunk": i, "response_latency_ms": 1.0, "output_interval_ms": 1.0,
             "observation_age_ms": 1.0} for i in indices]
    return Outputs({"robot0": chunks}, {"robot0": [(0, 16)] * len(chunks)}, tele, 0)


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
