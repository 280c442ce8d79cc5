"""``physis-bench handoff`` end to end on a small run: a real engine and worker serving the shipped trained
policy to a simulated robot on its control timeline; the JSON the issue asks for, and the hand-off's
promise as the robot sees it (with ``hard``, where a new chunk takes over it continues exactly what the
previous one committed)."""

from __future__ import annotations

import json
import math

import pytest

from physis_ros.cli import bench

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`


def test_small_handoff_run(tmp_path, capsys):
    out = tmp_path / "handoff.json"
    code = bench.main(["handoff", "--workers", "1", "--robots", "1", "--chunks", "8", "--delays", "0,2",
                       "--modes", "none,hard,soft", "--json", str(out), "--plot", str(tmp_path / "handoff.png")])
    assert code in (0, 1), capsys.readouterr()            # 1: a target missed (this machine is shared)
    r = json.loads(out.read_text())
    keys = {"mode", "delay_steps", "seam_jump_p50", "seam_jump_p99", "seam_velocity_jump_p99", "jerk_rms",
            "late_points", "tracking_error", "target_tracking_error"}
    trained = [x for x in r["runs"] if x["model"] == "trained"]
    assert {(x["mode"], x["delay_steps"]) for x in trained} == {(m, d) for m in ("none", "hard", "soft") for d in (0, 2)}
    for x in r["runs"]:
        assert keys <= set(x) and all(math.isfinite(x[k]) for k in keys - {"mode"}), x
        # the server's overhead runs from the frame being ready; from its capture it adds the camera's render
        for robot, server in x["response_overhead_ms_p50"].items():
            assert 0 < server <= x["response_overhead_from_capture_ms_p50"][robot] and x["sensor_ms_p50"][robot] > 0
        assert x["overhead_queue_ms_p50"] >= 0 and x["overhead_hops_ms_p50"] > 0, x     # its parts
        # observations are taken at the slot without a hand-off, up to a step ahead of it with one
        lead = x["capture_lead_steps_p50"]
        assert (abs(lead) < 0.5 if x["mode"] == "none" else -0.5 < lead < 1.05), x
        assert x["unfrozen_takeovers"] + x["frozen_takeovers"] <= x["chunks"], x
    # Where a chunk takes over at a row the hand-off froze (the robot's first executed row < the delay it
    # assumed, the previous chunk executed), it continues the committed actions bit for bit: seam exactly 0,
    # however loaded the machine (exact on every plan in test_engine). A chunk later than its assumed delay (a
    # load spike on this shared machine; in one CI run most chunks of every run) takes over past its frozen
    # rows, so seam medians are timing, not a property of the hand-off. A run whose stream was reset (a
    # worker that missed its heartbeat while the host was overloaded) restarts its timeline: it says so
    # ("resets") and is not a hand-off measurement.
    clean = [x for x in trained if x["resets"] == 0]
    handed = [x for x in clean if x["mode"] != "none"]
    for x in handed:
        assert x["frozen_takeover_jump_max"] == 0.0, x
    assert not handed or sum(x["frozen_takeovers"] for x in handed) > 0, trained
    # without a hand-off nothing is frozen: the same takeovers jump (the check above can fail), and the robot is
    # sent them eased (as the node sends them, seam_blend_steps 4 by default)
    assert any(x["frozen_takeover_jump_max"] > 0 for x in clean if x["mode"] == "none"), trained
    # (not every such run: easing stops short of the next chunk's first step, so a run whose takeovers all came
    # within a row of it, on a loaded host, eases none)
    assert any(x["eased_chunks"] > 0 for x in clean if x["mode"] == "none" and x["frozen_takeover_jump_max"] > 0)
    assert r["seam_blend_steps"] == 4 and all(math.isfinite(x["max_command_step"]) for x in r["runs"])
    # the tracking error split where the hand-off froze the executed rows and where it did not: without a
    # hand-off every row is free; a takeover at a frozen row runs at least that row of the previous chunk
    for x in trained:
        if x["mode"] == "none":
            assert x["frozen_rows_executed_mean"] == 0 and x["tracking_error_frozen_rows"] is None, x
            assert math.isclose(x["tracking_error_free_rows"], x["tracking_error"]), x
        elif x["frozen_takeovers"] > 0:
            assert x["frozen_rows_executed_mean"] > 0 and x["tracking_error_frozen_rows"] >= 0, x
    # the shipped checkpoint has learned the expert; the random init has not
    assert r["tracking_error_trained"] < 0.3 * r["tracking_error_random"]
    # closed loop: the trained policy's arm follows the moving target, the random one's does not
    random_arm = r["random"]["target_tracking_error"]
    assert all(x["target_tracking_error"] < 0.5 * random_arm for x in trained), (random_arm, trained)
    assert r["targets"]["trained_vs_random_tracking"] < 0.3 and r["passed"] in (True, False)
    assert (tmp_path / "handoff.png").read_bytes()[:4] == b"\x89PNG"
