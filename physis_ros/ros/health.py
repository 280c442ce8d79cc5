"""Gathering ``/diagnostics`` for ``physis_server``: the node's streams, the engine's workers (through
:meth:`~physis_ros.ros.node.PhysisServer.engine_health`, the one place that reads engine internals)
and the lifecycle state, turned into statuses by the pure functions of
:mod:`physis_ros.ros.diagnostics`. Runs on the executor thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from diagnostic_msgs.msg import DiagnosticStatus

from physis_ros.ros import diagnostics as diag
from physis_ros.telemetry import percentile

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer


def stream_stats(node: PhysisServer, name: str, now: float) -> dict[str, Any]:
    """Windowed stats of one stream (node clock ``now``) plus the node-side handover/publish times."""
    st = node.streams[name]
    with st.stats_lock:
        records, total, misses = list(st.stats.records), st.stats.total, st.stats.deadline_misses
        handover, publish = list(st.handover_ms), list(st.publish_ms)
    out = diag.window_stats(records, now, node.config.diagnostics_window_s, st.config.slo_interval_ms,
                            total=total, misses_total=misses)
    out.update(handover_ms_p50=percentile(handover, 50), handover_ms_p99=percentile(handover, 99),
               publish_ms_p50=percentile(publish, 50), publish_ms_p99=percentile(publish, 99))
    return out


def statuses(node: PhysisServer) -> list[DiagnosticStatus]:
    cfg, ecfg = node.config, node.config.engine
    snap = node.engine_health() or {"workers": {}, "streams": {}}
    mono = time.monotonic()
    worker_hw, down, out = {}, [], []
    for wname, w in snap["workers"].items():
        worker_hw[wname] = diag.hardware_id(w["host"] or node.hostname, str(w["device"]))
        stale = w["state"] == "up" and w["last_seen"] and mono - w["last_seen"] > ecfg.heartbeat_timeout_s
        if not w["alive"] or stale:
            down.append(wname)
        out.append(diag.worker_status(wname, w["pid"], w["last_seen"], w["stats"], ecfg.heartbeat_timeout_s,
                                      w["alive"], hardware_id=worker_hw[wname], state=w["state"],
                                      prefix=node.diag_prefix))
    failure = node.engine.failure if node.engine is not None else None
    engine = diag.engine_status(node.state, node.model.name, ecfg.plan, ecfg.workers,
                                str(failure) if failure else None,
                                telemetry_subscribers=node.pub_telemetry.get_subscription_count(),
                                armed=node.armed, lifecycle=node.lifecycle, workers_down=sorted(down),
                                hardware_id=node.hostname, prefix=node.diag_prefix)
    now = node.now()
    since = None if node.serving_since is None else mono - node.serving_since
    streams = []
    for name, st in node.streams.items():
        inputs = st.input.snapshot()
        total_rejects = sum(inputs["rejected"].values())
        new = total_rejects - st.rejects_reported
        st.rejects_reported = total_rejects
        waiting = inputs["waiting_since"]
        idle = None if waiting is None else mono - waiting
        if node.state == "serving" and idle is not None and idle > cfg.diagnostics_starved_s:
            node._warn(st, "idle", f"stream {name}: no fresh observation for {idle:.1f} s (images "
                                   f"{inputs['received'].get('images', 0)}, joint states "
                                   f"{inputs['received'].get('joints', 0)} received so far)")
        inputs.update(failed=st.failed, failures=st.failures, lost_chunks=st.lost_chunks,
                      action_chunk_subscribers=st.pub_chunk.get_subscription_count(),
                      joint_trajectory_subscribers=st.pub_traj.get_subscription_count())
        hw = diag.stream_hardware_id(node.hostname, [worker_hw[w] for w in snap["streams"].get(name, [])
                                                     if w in worker_hw])
        streams.append(diag.stream_status(
            name, stream_stats(node, name, now), inputs, slo_interval_ms=st.config.slo_interval_ms,
            new_rejects=new, engine_state=node.state, idle_s=idle, armed=node.armed, hardware_id=hw,
            miss_rate_warn=cfg.diagnostics_miss_rate_warn, starved_s=cfg.diagnostics_starved_s,
            since_s=since, prefix=node.diag_prefix))
    return [engine, *streams, *out]
