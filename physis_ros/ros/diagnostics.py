"""Health on ``/diagnostics``: one status per stream (rate vs SLO, drops, rejected inputs), one per
worker (heartbeat age, stats) and one for the engine, named ``<node name>: <what>`` (``physis_server:
robot0``, ``physis_server: worker w0``, ``physis_server: engine``). Pure functions of snapshots, so they
are tested without ROS and the node only gathers the numbers."""

from __future__ import annotations

import math
import time
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

OK, WARN, ERROR, STALE = (DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR,
                          DiagnosticStatus.STALE)
PREFIX = "physis_server"


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, float):
        text = "nan" if math.isnan(value) else f"{value:.3f}"
    else:
        text = str(value)
    return KeyValue(key=key, value=text)


def _status(name: str, hardware_id: str, level: bytes, message: str, values: dict[str, Any],
            prefix: str = PREFIX) -> DiagnosticStatus:
    return DiagnosticStatus(level=level, name=f"{prefix}: {name}", message=message, hardware_id=hardware_id,
                            values=[_kv(k, v) for k, v in values.items()])


def stream_status(name: str, stats: dict[str, Any], inputs: dict[str, Any], slo_interval_ms: float | None,
                  new_rejects: int, serving: bool, idle_s: float | None, prefix: str = PREFIX) -> DiagnosticStatus:
    """``stats``: RollingStats.summary(); ``inputs``: StreamInput.snapshot(); ``new_rejects``: rejected
    inputs since the last report; ``idle_s``: seconds since the stream last had an observation for
    its next chunk (None: not waiting)."""
    rate = stats.get("chunks_per_s", math.nan)
    p50 = stats.get("interval_ms_p50", math.nan)
    p99 = stats.get("interval_ms_p99", math.nan)
    rejected = inputs.get("rejected", {})
    values: dict[str, Any] = {
        "chunks_total": stats.get("total", 0),
        "chunks_per_s": float(rate),
        "interval_ms_p50": float(p50),
        "interval_ms_p99": float(p99),
        "latency_ms_p50": float(stats.get("latency_ms_p50", math.nan)),
        "latency_ms_p99": float(stats.get("latency_ms_p99", math.nan)),
        "slo_interval_ms": float(slo_interval_ms) if slo_interval_ms else "none",
        "slo_rate_hz": float(1000.0 / slo_interval_ms) if slo_interval_ms else "none",
        "deadline_misses_total": stats.get("deadline_misses_total", 0),
        # node-side: engine emit -> output callback, and callback -> ActionChunk published
        "handover_ms_p50": float(stats.get("handover_ms_p50", math.nan)),
        "handover_ms_p99": float(stats.get("handover_ms_p99", math.nan)),
        "publish_ms_p50": float(stats.get("publish_ms_p50", math.nan)),
        "publish_ms_p99": float(stats.get("publish_ms_p99", math.nan)),
        "images_received": inputs.get("received", {}).get("images", 0),
        "joint_states_received": inputs.get("received", {}).get("joints", 0),
        "observations_used": inputs.get("used", 0),
        "observations_queued": inputs.get("queued", 0),
        "dropped_total": rejected.get("queue_full", 0) + rejected.get("unpaired", 0),
        "rejected_total": sum(rejected.values()),
        "failures_total": inputs.get("failures", 0),          # worker lost under this stream
        "lost_chunks_total": inputs.get("lost_chunks", 0),    # chunks in flight when it happened
        # matched subscribers (a controller connected?); a RELIABLE one is needed for ros2_control
        "action_chunk_subscribers": inputs.get("action_chunk_subscribers", 0),
        "joint_trajectory_subscribers": inputs.get("joint_trajectory_subscribers", 0),
    }
    values.update({f"rejected.{reason}": n for reason, n in sorted(rejected.items())})
    if not serving:
        return _status(name, name, STALE, "engine not serving", values, prefix)
    if inputs.get("failed"):
        return _status(name, name, ERROR, f"stream failed: {inputs['failed']}", values, prefix)
    if idle_s is not None and idle_s > 1.0:
        level, msg = WARN, f"no fresh observation for {idle_s:.1f} s (camera or joint_states silent or stale)"
    elif slo_interval_ms and not math.isnan(p50) and p50 > slo_interval_ms:
        level, msg = WARN, f"{rate:.1f} chunks/s, interval p50 {p50:.1f} ms over SLO {slo_interval_ms:.1f} ms"
    elif new_rejects:
        level, msg = WARN, f"{new_rejects} input message(s) rejected since last report"
    else:
        slo = f" (SLO {slo_interval_ms:.1f} ms)" if slo_interval_ms else ""
        level, msg = OK, f"{rate:.1f} chunks/s, interval p50 {p50:.1f} / p99 {p99:.1f} ms{slo}"
    return _status(name, name, level, msg, values, prefix)


def worker_status(name: str, pid: int, last_seen: float, stats: dict[str, Any], timeout_s: float,
                  alive: bool, prefix: str = PREFIX) -> DiagnosticStatus:
    age = time.monotonic() - last_seen if last_seen else math.inf
    values: dict[str, Any] = {"pid": pid, "heartbeat_age_s": float(age)}
    for key, value in sorted(stats.items()):
        if isinstance(value, (int, float, str, bool)):
            values[key] = value
    if not alive:
        return _status(f"worker {name}", name, ERROR, "worker process exited", values, prefix)
    if age > timeout_s:
        return _status(f"worker {name}", name, ERROR, f"no heartbeat for {age:.1f} s", values, prefix)
    return _status(f"worker {name}", name, OK, "alive", values, prefix)


def engine_status(state: str, model: str, plan: str, workers: int, failure: str | None,
                  telemetry_subscribers: int = 0, prefix: str = PREFIX) -> DiagnosticStatus:
    values = {"state": state, "model": model, "plan": plan, "workers": workers,
              "telemetry_subscribers": telemetry_subscribers}
    if failure:
        return _status("engine", "engine", ERROR, failure, values, prefix)
    level = OK if state == "serving" else (WARN if state in ("starting", "stopping") else ERROR)
    return _status("engine", "engine", level, state, values, prefix)


def diagnostic_array(stamp, statuses: list[DiagnosticStatus]) -> DiagnosticArray:
    msg = DiagnosticArray()
    msg.header.stamp = stamp
    msg.status = statuses
    return msg
