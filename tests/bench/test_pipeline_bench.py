"""``physis-bench pipeline`` end to end on a few chunks: the hidden-state transport and the idle spin are
chosen from the command line, every entry is verified against the sequential reference."""

import json

import pytest

from physis_ros.cli import bench

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`


def pipeline(tmp_path, workers: int, chunks: int, *variant: str) -> dict:
    """``physis-bench pipeline`` on the stage plan of tiny-wam, verified, one repeat: its JSON."""
    out = tmp_path / "p.json"
    assert bench.main(["pipeline", "--model", "tiny-wam", "--workers", str(workers), "--plans", "stage", "--chunks",
                       str(chunks), "--repeats", "1", "--no-parallel-limit", *variant, "--verify",
                       # (a worker starved past 1 s on a host loaded beyond its cores reset the stream: CI run)
                       "--heartbeat-timeout", "10",
                       "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_transports_zmq_and_torch_are_both_bit_identical_and_compared(tmp_path):
    r = pipeline(tmp_path, 3, 12, "--transport", "zmq,torch")
    assert r["transports"] == ["zmq", "torch"] and set(r["plans"]) == {"stage@zmq", "stage@torch"}
    for key, hops in (("stage@zmq", "zmq"), ("stage@torch", "torch")):
        entry = r["plans"][key]
        assert entry["hops"] == hops and entry["max_abs_diff_vs_reference"] == 0.0 and entry["hop_ms_p50"] > 0
    cmp = r["torch_vs_zmq"]["stage"]
    assert cmp["chunks_per_s_ratio"] > 0 and len(cmp["hop_ms_p50"]) == 2


def test_spin_variants_are_entries_with_their_comparison(tmp_path):
    r = pipeline(tmp_path, 2, 10, "--spin-us", "0,300")
    assert set(r["plans"]) == {"stage@spin0", "stage@spin300"}
    assert r["plans"]["stage@spin300"]["spin_us"] == 300 and r["plans"]["stage@spin300"]["max_abs_diff_vs_reference"] == 0
    assert r["spin_vs_block"]["stage"]["spin_us"] == 300
