"""`make demo`'s command end to end: physis-demo starts the synthetic robots and the server, shows the
live table, stops at --duration and leaves no process behind. Plus the ROS benchmark's analysis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from rosprobe import JOINTS, TAG, child_env, processes_with_marker, write_config


@pytest.mark.slow
def test_demo_runs_and_exits_cleanly(tmp_path):
    marker = uuid.uuid4().hex
    config = write_config(tmp_path / "serve.yaml", {
        name: {"namespace": f"{TAG}_demo_{name}", "joint_names": JOINTS}
        for name in ("robot0", "robot1")}, telemetry_topic=f"{TAG}_demo_telemetry",
        engine={"workers": 1, "plan": "sequential"},  # the 2-worker pipeline is covered by test_node
        model="tiny-wam-demo")                         # the shipped default: the trained checkpoint
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "physis_ros.cli.demo", "--config", str(config), "--duration", "2",
                           "--rate", "20", "--json", str(out), "--logs", str(tmp_path / "logs")],
                          env=child_env(marker), capture_output=True, text=True, timeout=150)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text + (tmp_path / "logs" / "serve.log").read_text()
    assert "interval p50/p99 ms" in text and "latency p50/p99 ms" in text and "track err" in text  # the live table
    result = json.loads(out.read_text())
    for name in ("robot0", "robot1"):
        s = result["streams"][name]
        assert s["chunks"] > 0 and s["first_chunk"] <= 5 and s["gaps"] == 0
        # the synthetic robots publish their expert's chunks: the server measures the policy against them.
        # The trained policy follows the expert (about 0.12 rad RMS served here); the random-init tiny-wam
        # is about 1.3 rad off (config/checkpoints/tiny-wam-demo.json).
        assert s["tracking_error"] is not None and 0.0 <= s["tracking_error"] < 0.5, s
    serve_log = (tmp_path / "logs" / "serve.log").read_text()
    assert "stopping (SIGINT)" in serve_log
    deadline = time.monotonic() + 5
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(marker) == []


def test_bench_analysis_counts_lost_chunks_and_splits_the_delay():
    from physis_ros.bench.ros import analyse

    class Rec:
        pass

    rec = Rec()
    ms = 1_000_000
    # chunk c: the node takes it over 0.05 ms after emit, DDS write 0.1 ms after emit, received 0.1 ms later,
    # callback 0.1 ms after that; chunk 7 lost.
    rec.emits = {"r": {c: (c * 40 * ms, 40.0, c * 40 * ms + ms // 20) for c in range(10)}}
    rec.chunks = {"r": {c: (c * 40 * ms + 3 * ms // 10, c * 40 * ms + 2 * ms // 10, c * 40 * ms + ms // 10)
                        for c in range(10) if c != 7}}
    rec.trajs = {"r": {c: (c * 40 * ms + ms, 0, 0) for c in range(10)}}
    r = analyse(rec, (0, 10 * 40 * ms))
    s = r["streams"]["r"]
    assert (s["chunks_emitted"], s["chunks_received"], s["lost"]) == (10, 9, 1)
    assert not s["contiguous_indices"]
    assert abs(s["emit_to_callback"]["p50_ms"] - 0.3) < 1e-9 and abs(s["dds_transport"]["p50_ms"] - 0.1) < 1e-9
    assert abs(s["engine_handover"]["p50_ms"] - 0.05) < 1e-9 and abs(s["node_publish"]["p50_ms"] - 0.05) < 1e-9
    assert abs(s["ros_layer_to_receipt"]["p50_ms"] - 0.15) < 1e-9
    assert abs(s["ros_layer_to_callback"]["p50_ms"] - 0.25) < 1e-9
    assert abs(s["chunks_per_s"] - 25.0) < 1e-9 and r["overall"]["lost"] == 1
