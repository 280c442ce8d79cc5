"""/diagnostics statuses from snapshots (no ROS graph needed)."""

import math
import time

from diagnostic_msgs.msg import DiagnosticStatus

from physis_ros.ros import diagnostics as diag


def values(status):
    return {kv.key: kv.value for kv in status.values}


def test_stream_ok_warn_and_counts():
    stats = {"total": 50, "chunks_per_s": 25.0, "interval_ms_p50": 40.0, "interval_ms_p99": 60.0,
             "latency_ms_p50": 120.0, "latency_ms_p99": 150.0, "deadline_misses_total": 2}
    inputs = {"received": {"images": 60, "joints": 60}, "rejected": {"encoding": 2, "queue_full": 1},
              "used": 50, "queued": 0}
    ok = diag.stream_status("robot0", stats, inputs, 50.0, 0, True, None)
    assert ok.level == DiagnosticStatus.OK and ok.name == "physis_server: robot0" and ok.hardware_id == "robot0"
    v = values(ok)
    assert v["rejected.encoding"] == "2" and v["rejected_total"] == "3" and v["dropped_total"] == "1"
    assert v["slo_rate_hz"] == "20.000" and v["chunks_per_s"] == "25.000"
    assert diag.stream_status("robot0", stats, inputs, 50.0, 2, True, None).level == DiagnosticStatus.WARN
    assert diag.stream_status("robot0", stats, inputs, 30.0, 0, True, None).level == DiagnosticStatus.WARN
    silent = diag.stream_status("robot0", stats, inputs, 50.0, 0, True, 3.0)
    assert silent.level == DiagnosticStatus.WARN and "no fresh observation" in silent.message
    assert diag.stream_status("robot0", {"chunks": 0}, inputs, None, 0, False, None).level == DiagnosticStatus.STALE


def test_worker_and_engine_status():
    now = time.monotonic()
    assert diag.worker_status("w0", 12, now, {"tasks": 5}, 1.0, True).level == DiagnosticStatus.OK
    assert diag.worker_status("w0", 12, now - 5, {}, 1.0, True).level == DiagnosticStatus.ERROR
    assert diag.worker_status("w0", 12, now, {}, 1.0, False).level == DiagnosticStatus.ERROR
    assert diag.engine_status("serving", "tiny-wam", "stage", 2, None).level == DiagnosticStatus.OK
    failed = diag.engine_status("failed", "tiny-wam", "stage", 2, "worker w1 exited")
    assert failed.level == DiagnosticStatus.ERROR and failed.message == "worker w1 exited"
    assert values(diag.engine_status("starting", "m", "stage", 2, None))["state"] == "starting"
    assert not math.isnan(float(values(diag.worker_status("w0", 1, now, {}, 1.0, True))["heartbeat_age_s"]))
