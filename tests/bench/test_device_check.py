"""``bench/device_check.sh --device cpu``: the GPU check's own smoke test, the same script and code on CPU
(profile, 1 worker, then 2 time-sharing per hop transport, equivalence, memory, hop bench)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_runs_on_cpu_and_writes_every_figure(tmp_path):
    env = {**os.environ, "PY": sys.executable, "CHUNKS": "12"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), "--device", "cpu", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "device_check.json").read_text())
    assert r["device"] == "cpu" and r["equivalent"] is True and r["skipped"] == {}
    runs = {(x["workers"], x["hops"]): x for x in r["runs"]}
    assert set(runs) == {(1, "zmq"), (2, "zmq"), (2, "torch"), (2, "shm")}
    assert runs[(1, "zmq")]["max_abs_diff_vs_reference"] == 0.0 and runs[(1, "zmq")]["batching"] == "off"
    for x in runs.values():
        assert x["chunks"] == 12 and x["interval_ms_p50"] > 0 and x["stage_ms_p50"] > 0
        assert all(m["kv_bytes"] > 0 and m["weight_bytes"] > 0 and m["device_bytes"] == 0
                   for m in x["memory"].values()), x["memory"]
    assert runs[(2, "torch")]["hop_ms_p50"] > 0 and set(r["hop_ms_p50_by_transport"]) == {"zmq", "torch", "shm"}
    assert r["profile"]["stage_ms_batch1_p50"] > 0 and r["profile"]["block_weight_bytes"] > 0
    hops = r["hop_bench"]["hops"]
    assert {h["transport"] for h in hops} == {"zmq-tcp", "zmq-ipc", "gloo", "shm"} and r["hop_bench"]["memcpy"]
