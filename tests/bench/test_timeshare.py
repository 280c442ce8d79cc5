"""``physis-bench timeshare`` end to end on a few chunks: the JSON the issue asks for, every number real."""

import json

import pytest

from physis_ros.cli import bench

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`


def test_timeshare_writes_every_mode_with_prediction_and_drift(tmp_path):
    out = tmp_path / "ts.json"
    assert bench.main(["timeshare", "--model", "tiny-wam", "--workers", "1", "--chunks", "12", "--repeats", "1",
                           "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "tiny-wam" and r["workers"] == 1
    for key in ("batching_off", "batching_on", "adaptive"):
        mode = r[key]
        assert mode["interval_ms_p50"] > 0 and mode["chunks_per_s"] > 0 and mode["predicted_interval_ms"] > 0
        run = mode["runs"][0]
        assert run["traced_vs_profile"] > 0 and 1.0 <= run["predicted_mean_batch"] <= 4.0
    assert r["batching_off"]["max_abs_diff_vs_reference"] == 0.0  # unbatched: bit-identical
    for key in ("batching_on", "adaptive"):  # batched: the stated fp32 tolerance, 1e-5 x max |x|
        assert r[key]["max_abs_diff_relative"] <= 1e-5
    assert r["speedup_adaptive_vs_off"] > 0 and r["predicted_interval_ms"] > 0
