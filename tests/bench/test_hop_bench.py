"""``physis-bench hop`` end to end on a small run: every CPU transport between two spawned processes,
memcpy beside them, and the JSON the issue asks for with exactly its keys; bad ``--sizes`` is exit 2."""

from __future__ import annotations

import json
import math

import pytest

from physis_ros.bench.hop import CPU_TRANSPORTS, CUDA_TRANSPORTS, sizes_arg
from physis_ros.bench.hop_ends import FLOOR_MODES
from physis_ros.cli import bench

SIZES = [64 << 10, 1 << 20]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_small_hop_run(tmp_path, capsys):
    out, png = tmp_path / "hop.json", tmp_path / "hop.png"
    code = bench.main(["hop", "--sizes", "64K,1M", "--repeats", "5", "--json", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    assert code == 0, captured.err            # missing the 3x target is a result, not a failure
    r = json.loads(out.read_text())
    assert {"hops", "memcpy", "ratio_best_to_memcpy", "target", "machine", "command", "skipped", "errors"} <= set(r)
    assert r["errors"] == {}
    assert r["command"].startswith("physis-bench hop --sizes 64K,1M --repeats 5")
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["torch"]
    measured = set(CPU_TRANSPORTS) | (set(CUDA_TRANSPORTS) - set(r["skipped"]))
    assert set(r["transports"]) == measured
    if not r["machine"]["cuda"]:
        assert set(r["skipped"]) == set(CUDA_TRANSPORTS) and all("CUDA" in why for why in r["skipped"].values())

    # hops: exactly one row per (size, transport), exactly the keys, p50 <= p99
    assert all(set(h) == {"bytes", "transport", "p50_us", "p99_us"} for h in r["hops"]), r["hops"]
    assert sorted((h["bytes"], h["transport"]) for h in r["hops"]) == sorted((n, t) for n in SIZES for t in measured)
    for h in r["hops"]:
        assert _positive(h["p50_us"]) and _positive(h["p99_us"]) and h["p50_us"] <= h["p99_us"], h
    # memcpy: one row per size, a copy of 1 MiB takes longer than one of 64 KiB
    assert all(set(m) == {"bytes", "p50_us"} for m in r["memcpy"])
    memcpy = {m["bytes"]: m["p50_us"] for m in r["memcpy"]}
    assert sorted(memcpy) == SIZES and all(_positive(v) for v in memcpy.values())
    assert memcpy[1 << 20] > memcpy[64 << 10]
    # best transport over memcpy, per size
    assert all(set(x) == {"bytes", "transport", "ratio"} for x in r["ratio_best_to_memcpy"])
    assert [x["bytes"] for x in r["ratio_best_to_memcpy"]] == SIZES
    for x in r["ratio_best_to_memcpy"]:
        best = min((h for h in r["hops"] if h["bytes"] == x["bytes"]), key=lambda h: h["p50_us"])
        assert x["transport"] == best["transport"]
        assert x["ratio"] == pytest.approx(best["p50_us"] / memcpy[x["bytes"]], rel=1e-2)
    target = r["target"]
    assert target["ratio_max"] == 3.0 and target["from_bytes"] == 1048576 and isinstance(target["met"], bool)
    assert target["met"] == all(x["ratio"] <= 3.0 for x in r["ratio_best_to_memcpy"] if x["bytes"] >= 1 << 20)
    # the floor beside them: both modes at every size, never counted as a transport (nor as the best one)
    assert sorted((f["bytes"], f["mode"]) for f in r["floor"]) == sorted((n, m) for n in SIZES for m in FLOOR_MODES)
    for f in r["floor"]:
        assert set(f) == {"bytes", "mode", "p50_us", "p99_us", "ratio_to_memcpy"}, f
        assert _positive(f["p50_us"]) and f["p50_us"] <= f["p99_us"]
        assert f["ratio_to_memcpy"] == pytest.approx(f["p50_us"] / memcpy[f["bytes"]], rel=1e-2)
    assert not set(FLOOR_MODES) & set(r["transports"]) and not set(FLOOR_MODES) & {h["transport"] for h in r["hops"]}
    assert "floor-spin" in captured.out
    # the table on stdout, progress per size on stderr, the plot
    assert "memcpy" in captured.out and "best/memcpy" in captured.out
    assert all(f"{t}" in captured.err for t in measured) and "64K" in captured.err and "1M" in captured.err
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("sizes", ["0", "lots", "2G", ",", "64K,-1M"])
def test_bad_sizes_exit_2(sizes, capsys):
    assert bench.main(["hop", f"--sizes={sizes}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--sizes" in err, err


def test_sizes_parse():
    assert sizes_arg("64K,1M,64M") == [65536, 1 << 20, 64 << 20]
    assert sizes_arg("1M, 64KB,1MiB,4096,1.5M") == [4096, 65536, 1 << 20, 3 << 19]
