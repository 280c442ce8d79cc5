"""``physis-bench churn``, short: streams join and leave a real server 120 times (3 a cycle); the RSS of the
server and of its worker after the last cycle stays within 8 % of its value after cycle 40. Was: every
join froze the collector's generations (gc.freeze), so each stream's reference cycles stayed for good when
it left, and the worker grew 0.47 MB a cycle (+18 % from cycle 50 to 150), the server 0.13 MB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ros"))
from domains import domain as domain_of  # noqa: E402


@pytest.mark.slow
def test_join_leave_churn_does_not_grow_memory(tmp_path):
    out = tmp_path / "churn.json"
    env = {**os.environ, "ROS_DOMAIN_ID": str(domain_of("bench")), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "physis_ros.cli.bench", "churn", "--cycles", "120", "--baseline",
                           "40", "--tolerance", "0.08", "--json", str(out), "--logs", str(tmp_path / "logs")],
                          env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr + (tmp_path / "logs" / "serve.log").read_text(errors="replace")[-3000:]
    r = json.loads(out.read_text())
    print(f"\ngrowth over cycle 40: {r['growth_over_baseline']}")
    assert set(r["growth_over_baseline"]) == {"server", "w0"}, r
    assert r["admitted_first"] >= 1 and r["cycles_admitting_fewer"] == [], r
    assert proc.returncode == 0, text
    assert all(g is not None and g <= 0.08 for g in r["growth_over_baseline"].values()), r["growth_over_baseline"]
    # /diagnostics reports each process's RSS (the engine's rss_mb, each worker's rss_bytes), as /proc says
    for name, reported in r["diagnostics_rss_mb"].items():
        last = r["rss_mb"][name][-1][1]
        assert reported is not None and abs(reported / last - 1.0) < 0.2, (name, reported, last)
