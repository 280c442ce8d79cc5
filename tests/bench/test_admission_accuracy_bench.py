"""``physis-bench admission-accuracy`` end to end on a small run: robots added with admission off until one
misses its SLO (or the cap), then through Server.join with admission on; the JSON's figures are checked
against its own per-robot measurements, as a strict reader would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from physis_ros.cli import bench
from physis_ros.serving.capacity import REASONS

PROFILES = str(Path(__file__).resolve().parents[2] / "config" / "profiles")
SHORT = ["--profiles", PROFILES, "--settle-s", "0.5", "--window-s", "2", "--measure-s", "3"]


def check_consistent(r: dict) -> None:
    slo = r["slo_ms"]
    steps = r["off"]
    assert [s["robots"] for s in steps] == list(range(1, len(steps) + 1))
    for s in steps:
        assert len(s["streams"]) == s["robots"]
        met = all(v["chunks"] >= 2 and v["interval_ms_p99"] is not None and v["interval_ms_p99"] <= slo
                  for v in s["streams"].values())
        assert s["all_meet_slo"] == met, s
    # feasible: the robots of the last step where all met the SLO, every step before it met too
    assert r["feasible"] == sum(1 for s in steps if s["all_meet_slo"])
    assert all(s["all_meet_slo"] for s in steps[:r["feasible"]])
    assert r["admitted"] == len(r["on"]) <= r["max_robots"]
    if r["rejected"] is not None:
        assert r["rejected"]["reason"] in REASONS and r["rejected"]["detail"]
    meeting = [v["meets_slo"] for v in r["on"].values()]
    for v in r["on"].values():
        assert v["meets_slo"] == (v["chunks"] >= 2 and v["interval_ms_p99"] is not None
                                  and v["interval_ms_p99"] <= slo), v
        assert v["workers"] and all(w in ("w0", "w1") for w in v["workers"])
    if r["admitted"]:
        assert r["admitted_meeting_slo"] == pytest.approx(sum(meeting) / len(meeting), abs=1e-3)
        assert not r["too_small"]
    if r["feasible"]:
        assert r["admitted_over_feasible"] == pytest.approx(r["admitted"] / r["feasible"], abs=1e-3)
    assert r["goals"]["admitted_meeting_slo_1.0"] == (r["admitted_meeting_slo"] == 1.0)


@pytest.mark.slow
def test_a_small_mixed_run_reports_feasible_admitted_and_each_robot(tmp_path):
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    code = bench.main(["admission-accuracy", "--slo-ms", "300", "--models", "tiny-wam,tiny-acwm",
                       "--max-robots", "2", *SHORT, "--json", str(out), "--plot", str(png)])
    assert code == 0
    r = json.loads(out.read_text())
    check_consistent(r)
    assert r["models"] == ["tiny-wam", "tiny-acwm"] and r["workers"] == 2
    # the robots alternate models in both phases
    assert [v["model"] for v in r["off"][-1]["streams"].values()] == ["tiny-wam", "tiny-acwm"][:len(r["off"])]
    assert [v["model"] for v in r["on"].values()] == ["tiny-wam", "tiny-acwm"][:r["admitted"]]
    assert r["admitted"] >= 1      # one robot at 300 ms fits two CPU workers with room to spare
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_an_slo_no_stage_meets_says_the_machine_is_too_small_instead_of_failing(tmp_path):
    out = tmp_path / "acc.json"
    code = bench.main(["admission-accuracy", "--slo-ms", "1", "--max-robots", "2", *SHORT, "--json", str(out),
                       "--policy", "base"])
    assert code == 0
    r = json.loads(out.read_text())
    check_consistent(r)
    assert r["policy"] == "base"
    assert r["too_small"] and r["admitted"] == 0 and r["admitted_over_feasible"] is None
    assert r["feasible"] == 0 and r["off_refused"]["reason"] == "slo-too-tight"
    assert r["rejected"]["reason"] == "slo-too-tight"
    assert "too small for one robot at 1 ms" in r["note"]


def test_bad_flags_are_refused_before_anything_starts(capsys):
    assert bench.main(["admission-accuracy", "--slo-ms", "100", "--models", "no-such-model"]) == 2
    assert "--models" in capsys.readouterr().err
    assert bench.main(["admission-accuracy", "--slo-ms", "0"]) == 2
    assert "--slo-ms must be > 0" in capsys.readouterr().err
    assert bench.main(["admission-accuracy", "--slo-ms", "100", "--max-robots", "0"]) == 2
    assert bench.main(["admission-accuracy"]) == 2     # --slo-ms is required: one SLO per run
    assert bench.main(["admission-accuracy", "--slo-ms", "100", "--policy", "fastest"]) == 2
    assert "admission.policy" in capsys.readouterr().err
