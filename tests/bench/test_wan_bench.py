"""``physis-bench wan`` end to end on a few chunks: the Wan WAM beside tiny-wam, each through the pipeline
(sequential and stage plans, the cost model's prediction) and time-sharing, every number real: the pipeline
equals the sequential reference bit for bit, time-shared batches within the stated fp32 tolerance."""

import json

import pytest

from physis_ros.cli import bench

pytestmark = pytest.mark.slow   # starts worker processes: not in `make test-fast`


def test_wan_bench_writes_each_models_ratios_predictions_and_plot(tmp_path):
    out, png = tmp_path / "wan.json", tmp_path / "wan.png"
    assert bench.main(["wan", "--models", "tiny-wam,tiny-wan-wam", "--rounds", "1", "--chunks", "12",
                       "--json", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())
    assert list(r["models"]) == ["tiny-wam", "tiny-wan-wam"] and r["rounds"] == 1
    for name, entry in r["models"].items():
        s = entry["summary"]
        for plan in ("sequential", "stage"):
            assert s[f"{plan}_interval_ms"] > 0 and s[f"{plan}_predicted_ms"] > 0
        for ratio in ("stage_vs_sequential", "batching_on_vs_off"):
            assert s[ratio]["min"] <= s[ratio]["median"] <= s[ratio]["max"] and s[ratio]["median"] > 0
        assert s["pipeline_max_abs_diff_vs_reference"] == 0.0, name
        assert s["timeshare_max_abs_diff_vs_reference"] < 1e-4, name
        (one,) = entry["rounds"]
        assert one["timeshare_modes"]["batching_on"]["mean_batch"] > 1.0      # one model's stages batched
    assert png.stat().st_size > 10_000


def test_wan_bench_refuses_no_models_and_unknown_ones_before_any_run(capsys):
    assert bench.main(["wan", "--models", ",", "--rounds", "1"]) == 2
    assert "--models: give at least one model" in capsys.readouterr().err
    assert bench.main(["wan", "--models", "tiny-wam,nope", "--rounds", "1"]) == 2
    err = capsys.readouterr()
    assert "--models nope: " in err.err and "unknown model preset 'nope'" in err.err and "[round" not in err.out
