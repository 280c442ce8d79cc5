"""``physis-bench openpi`` end to end on a short run: both servers start, the real openpi-client gets
chunks from each, closed-loop and paced runs, ratios and goals in the JSON, the plot written."""

from __future__ import annotations

import json
import math

import pytest

from physis_ros.cli.bench import main

pytestmark = pytest.mark.slow


def test_a_short_run_measures_both_servers_and_writes_ratios(tmp_path):
    out, png = tmp_path / "openpi.json", tmp_path / "openpi.png"
    code = main(["openpi", "--clients", "1,2", "--paced-clients", "1,2", "--duration", "1", "--warmup", "0.3",
                 "--peer-threads", "1", "--json", str(out), "--plot", str(png), "--logs", str(tmp_path / "logs")])
    assert code == 0
    result = json.loads(out.read_text())
    for who in ("peer", "ours"):
        closed = result[who]["closed"]
        assert [r["clients"] for r in closed] == [1, 2]
        for r in closed:
            assert r["connected"] == r["clients"] and r["errors"] == [] and r["chunks"] > 0
            assert 0 < r["rtt_ms_p50"] <= r["rtt_ms_p99"] <= r["rtt_ms_max"]
            assert r["server_cpu_ms_per_chunk"] > 0
            assert len(r["per_client_chunks"]) == r["clients"] and min(r["per_client_chunks"]) > 0
        assert [r["clients"] for r in result[who]["paced"]][:1] == [1]
        assert result[who]["paced_max_clients"] in (0, 1, 2)
    ratio = result["ratio_ours_over_peer"]["closed"]
    assert set(ratio) == {"1", "2"} and all(math.isfinite(v) and v > 0 for r in ratio.values() for v in r.values())
    assert set(result["goals"]) == {"aggregate_at_4_ge_1.5x", "rtt_p99_at_1_no_worse", "paced_ge_2.0x"}
    assert result["goals"]["aggregate_at_4_ge_1.5x"] is None   # 4 clients were not measured
    assert png.stat().st_size > 10_000


def test_bad_client_counts_are_refused_before_anything_starts(capsys):
    assert main(["openpi", "--clients", "0,x"]) == 2
    assert "--clients: give client counts >= 1" in capsys.readouterr().err
