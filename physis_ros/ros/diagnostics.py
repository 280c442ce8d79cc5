"""``/diagnostics`` for ``physis_server``: the node's streams, the engine's workers (through
:func:`engine_snapshot`, the one place that reads the engine: its own health snapshot) and the lifecycle state,
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
from physis_ros.serving.capacity import worker_index

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


def engine_snapshot(node: PhysisServer) -> dict[str, Any]:
    """The engine's workers and each stream's workers and resets (:meth:`EngineThread.snapshot`)."""
    return node.engine.snapshot() if node.engine is not None else {"workers": {}, "streams": {}, "resets": {}}


def statuses(node: PhysisServer) -> list[health.Status]:
    cfg, ecfg = node.config, node.config.engine
    snap = engine_snapshot(node)
    mono = time.monotonic()
    admission = node.server.admission if node.server is not None else None
    worker_hw, down, out = {}, [], []
    for wname, w in snap["workers"].items():
        index = worker_index(wname)
        if index >= 0 and admission is not None:   # admission's load calibration (the server feeds it)
            w["stats"]["admission_load_factor"] = round(admission.load_factor(index), 3)
        worker_hw[wname] = health.hardware_id(w["host"] or node.hostname, str(w["device"]))
        stale = w["state"] == "up" and w["last_seen"] and mono - w["last_seen"] > ecfg.heartbeat_timeout_s
        if not w["alive"] or stale:
            down.append(wname)
        out.append(health.worker_status(wname, w["pid"], w["last_seen"], w["stats"], ecfg.heartbeat_timeout_s,
                                      w["alive"], hardware_id=worker_hw[wname], state=w["state"],
                                      prefix=node.diag_prefix))
    failure = node.engine.failure if node.engine is not None else None
    engine = health.engine_status(node.state, node.model.name, "admission", ecfg.workers,
                                str(failure) if failure else None,
                                telemetry_subscribers=node.pub_telemetry.get_subscription_count(),
                                armed=node.armed, lifecycle=node.lifecycle, workers_down=sorted(down),
                                hardware_id=node.hostname, prefix=node.diag_prefix, rss_mb=heap.rss_mb(os.getpid()))
    since = None if node.serving_since is None else mono - node.serving_since
    streams = []
    for name, st in list(node.streams.items()):
        stats = st.figures(snap["resets"].get(name, {}))
        inputs = stats.pop("inputs")
        total_rejects = sum(inputs["rejected"].values())
        new = total_rejects - st.rejects_reported
        st.rejects_reported = total_rejects
        waiting = inputs["waiting_since"]
        idle = None if waiting is None else mono - waiting
        if node.state == "serving" and idle is not None and idle > cfg.diagnostics_starved_s:
            st.warn("idle", f"stream {name}: no fresh observation for {idle:.1f} s ({health.inputs_summary(inputs)} "
                            f"so far)")
        d = st.delivery
        inputs.update(**_health_counts(stats), late_points=d.late_points, late_chunks=d.late_chunks,
                      blended_chunks=d.blended_chunks, **st.subscriber_counts())
        hw = _hardware_id(node, snap, worker_hw, name)
        # admission's spread calibration (the server feeds it): what it charges the stream
        stats["admission_spread_ms"] = admission.spread_ms(name) if admission is not None else None
        streams.append(health.stream_status(
            name, stats, inputs, slo_interval_ms=st.slo_interval_ms,
            new_rejects=new, engine_state=node.state, idle_s=idle, armed=node.armed, hardware_id=hw,
            miss_rate_warn=cfg.diagnostics_miss_rate_warn, starved_s=cfg.diagnostics_starved_s,
            stale_intervals=cfg.diagnostics_stale_intervals,
            since_s=None if since is None else min(since, mono - st.admitted_mono), prefix=node.diag_prefix))
    streams += _other_front_ends(node, snap, worker_hw, since)
    for name in node.departed:   # once each, then gone
        streams.append(health.removed_stream_status(name, prefix=node.diag_prefix, hardware_id=node.hostname))
    node.departed.clear()
    for name in node.configured:
        verdict = node.startup.get(name)
        if name not in node.streams and verdict != "admitted":    # admitted and then removed: gone
            streams.append(health.pending_stream_status(name, verdict,
                                                      node.state, prefix=node.diag_prefix,
                                                      hardware_id=node.hostname))
    return [engine, *streams, *out]


def _other_front_ends(node: PhysisServer, snap: dict, worker_hw: dict[str, str], since: float | None
                      ) -> list[health.Status]:
    """The server's streams that are not the node's (an openpi client's connection), from their sessions."""
    server, cfg = node.server, node.config
    if server is None:
        return []
    out = []
    for name in server.streams():
        if name in node.streams:
            continue
        try:
            session = server.session(name)
        except KeyError:
            continue   # it left meanwhile
        stats = session.figures(node.now(), cfg.diagnostics_window_s, snap["resets"].get(name, {}))
        inputs = {**stats.pop("inputs"), **_health_counts(stats)}
        out.append(health.stream_status(
            name, stats, inputs, slo_interval_ms=session.slo_interval_ms, new_rejects=0, engine_state=node.state,
            idle_s=None, armed=True, hardware_id=_hardware_id(node, snap, worker_hw, name),
            miss_rate_warn=cfg.diagnostics_miss_rate_warn,
            starved_s=cfg.diagnostics_starved_s, stale_intervals=cfg.diagnostics_stale_intervals,
            since_s=None if since is None else min(since, time.monotonic() - session.admitted_mono),
            prefix=node.diag_prefix, requests=session.config.cadence == "request"))
    return out


def _health_counts(stats: dict) -> dict:
    """A stream's health figures (Session.figures) as stream_status reads them among its inputs."""
    return {"failed": stats["failed"], "recovering": stats["recovering"], "failures": stats["failures"],
            "lost_chunks": stats["lost_chunks"], "unpublished": stats["undelivered"], "resets": stats["resets"]}


def _hardware_id(node: PhysisServer, snap: dict, worker_hw: dict[str, str], name: str) -> str:
    """The hardware id of a stream: its host and the devices of the workers it runs on."""
    return health.stream_hardware_id(node.hostname, [worker_hw[w] for w in snap["streams"].get(name, [])
                                                     if w in worker_hw])
