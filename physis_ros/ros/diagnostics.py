"""``/diagnostics`` for ``physis_server``: the node's streams, the engine's workers (from
:meth:`Server.stats <physis_ros.serving.server.Server.stats>`) and the lifecycle state,
gathered on the executor thread and judged by the serving core's pure verdicts (:mod:`physis_ros.serving.health`,
the same concept one layer down), then published as ``diagnostic_msgs`` messages."""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from physis_ros import heap
from physis_ros.serving import health

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, float):
        text = "nan" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.3f}")
    else:
        text = str(value)
    return KeyValue(key=key, value=text)


def to_msg(status: health.Status) -> DiagnosticStatus:
    return DiagnosticStatus(level=bytes([status.level]), name=status.name, message=status.message,
                            hardware_id=status.hardware_id, values=[_kv(k, v) for k, v in status.values.items()])


def diagnostic_array(stamp, statuses: list[health.Status]) -> DiagnosticArray:
    msg = DiagnosticArray()
    msg.header.stamp = stamp
    msg.status = [to_msg(s) for s in statuses]
    return msg


def statuses(node: PhysisServer) -> list[health.Status]:
    """The engine's, every stream's (the node's and other front ends') and every worker's status, from the
    server's figures (:meth:`Server.stats <physis_ros.serving.server.Server.stats>`) and the node's own."""
    ecfg = node.config.engine
    figures = node.server.stats() if node.server is not None else {
        "engine": {"failure": None, "rss_mb": heap.rss_mb(os.getpid())}, "workers": {}, "streams": {}}
    mono = time.monotonic()
    worker_hw, down, out = {}, [], []
    for wname, w in figures["workers"].items():
        stats = dict(w["stats"])
        if w["admission_load_factor"] is not None:    # admission's load calibration (the server feeds it)
            stats["admission_load_factor"] = w["admission_load_factor"]
        worker_hw[wname] = health.hardware_id(w["host"] or node.hostname, str(w["device"]))
        stale = w["state"] == "up" and w["last_seen"] and mono - w["last_seen"] > ecfg.heartbeat_timeout_s
        if not w["alive"] or stale:
            down.append(wname)
        out.append(health.worker_status(wname, w["pid"], w["last_seen"], stats, ecfg.heartbeat_timeout_s,
                                        w["alive"], hardware_id=worker_hw[wname], state=w["state"],
                                        prefix=node.diag_prefix))
    engine = health.engine_status(node.state, node.model.name, "admission", ecfg.workers,
                                  figures["engine"]["failure"],
                                  telemetry_subscribers=node.pub_telemetry.get_subscription_count(),
                                  armed=node.armed, lifecycle=node.lifecycle, workers_down=sorted(down),
                                  hardware_id=node.hostname, prefix=node.diag_prefix,
                                  rss_mb=figures["engine"]["rss_mb"])
    since = None if node.serving_since is None else mono - node.serving_since
    streams = [_stream_status(node, name, stats, worker_hw, since) for name, stats in figures["streams"].items()]
    for name in node.hub.departed:   # once each, then gone
        streams.append(health.removed_stream_status(name, prefix=node.diag_prefix, hardware_id=node.hostname))
    node.hub.departed.clear()
    for name in node.hub.configured:
        verdict = node.startup.get(name)
        if name not in node.streams and verdict != "admitted":    # admitted and then removed: gone
            streams.append(health.pending_stream_status(name, verdict, node.state, prefix=node.diag_prefix,
                                                        hardware_id=node.hostname))
    return [engine, *streams, *out]


def _stream_status(node: PhysisServer, name: str, stats: dict, worker_hw: dict[str, str], since: float | None
                   ) -> health.Status:
    """One stream's status: a stream on the node's topics with the node's own figures (handover and publish
    times, late rows, subscribers, rejects since the last status; a warning when its inputs stop), another
    front end's (an openpi client's connection) from the server's alone."""
    cfg = node.config
    inputs = {**stats.pop("inputs"), **_health_counts(stats)}
    st = node.streams.get(name)
    new_rejects, idle = 0, None
    if st is not None:
        stats.update(st.node_figures())
        total_rejects = sum(inputs["rejected"].values())
        new_rejects, st.rejects_reported = total_rejects - st.rejects_reported, total_rejects
        waiting = inputs["waiting_since"]
        idle = None if waiting is None else time.monotonic() - waiting
        if node.state == "serving" and idle is not None and idle > cfg.diagnostics_starved_s:
            st.warn("idle", f"stream {name}: no fresh observation for {idle:.1f} s ({health.inputs_summary(inputs)} "
                            f"so far)")
        d = st.delivery
        inputs.update(late_points=d.late_points, late_chunks=d.late_chunks, blended_chunks=d.blended_chunks,
                      **st.subscriber_counts())
    hardware = health.stream_hardware_id(node.hostname, [worker_hw[w] for w in stats["workers"] if w in worker_hw])
    return health.stream_status(
        name, stats, inputs, slo_interval_ms=stats["slo_interval_ms"], new_rejects=new_rejects,
        engine_state=node.state, idle_s=idle, armed=node.armed if st is not None else True, hardware_id=hardware,
        miss_rate_warn=cfg.diagnostics_miss_rate_warn, starved_s=cfg.diagnostics_starved_s,
        stale_intervals=cfg.diagnostics_stale_intervals,
        since_s=None if since is None else min(since, stats["serving_s"]), prefix=node.diag_prefix,
        requests=st is None and stats["cadence"] == "request")


def _health_counts(stats: dict) -> dict:
    """A stream's health figures (Session.figures) as stream_status reads them among its inputs."""
    return {"failed": stats["failed"], "recovering": stats["recovering"], "failures": stats["failures"],
            "lost_chunks": stats["lost_chunks"], "unpublished": stats["undelivered"], "resets": stats["resets"]}
