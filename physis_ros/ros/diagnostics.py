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
    from physis_ros.ros.stream_topics import RosStream


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
    """The engine's, every stream's (the node's and other front ends') and every worker's status
    (:func:`physis_ros.serving.health.statuses`) from the server's figures and the node's own outputs."""
    figures = node.server.stats() if node.server is not None else {
        "engine": {"failure": None, "model": node.model.name, "rss_mb": heap.rss_mb(os.getpid())},
        "workers": {}, "streams": {}}
    own = {name: _outputs(node, st, figures["streams"][name]["inputs"])
           for name, st in node.streams.items() if name in figures["streams"]}
    mono = time.monotonic()
    reporter = health.Reporter(node.diag_prefix, node.hostname, node.state, node.armed, node.lifecycle,
                               node.pub_telemetry.get_subscription_count(),
                               None if node.serving_since is None else mono - node.serving_since)
    pending = {name: node.startup.get(name) for name in node.hub.configured     # (admitted and then removed: gone)
               if name not in node.streams and node.startup.get(name) != "admitted"}
    departed, node.hub.departed = node.hub.departed, []   # said once each, then gone
    return health.statuses(figures, node.config, reporter, own, pending, departed)


def _outputs(node: PhysisServer, st: RosStream, inputs: dict) -> health.Outputs:
    """What the node adds to a stream on its topics: handover and publish times, late rows, subscribers, inputs
    rejected since the last status, and how long it has waited for one (warned about when its inputs stop)."""
    total_rejects = sum(inputs["rejected"].values())
    new_rejects, st.rejects_reported = total_rejects - st.rejects_reported, total_rejects
    waiting = inputs["waiting_since"]
    idle = None if waiting is None else time.monotonic() - waiting
    if node.state == "serving" and idle is not None and idle > node.config.diagnostics_starved_s:
        st.warn("idle", f"stream {st.name}: no fresh observation for {idle:.1f} s ({health.inputs_summary(inputs)} "
                        f"so far)")
    d = st.delivery
    counters = dict(late_points=d.late_points, late_chunks=d.late_chunks, blended_chunks=d.blended_chunks,
                    **st.subscriber_counts())
    return health.Outputs(st.node_figures(), counters, new_rejects, idle)
