"""What the admission benchmark observes: the server's admission replayed on the same profiles
(:class:`Mirror`), the robots' chunks, telemetry, /diagnostics and the server's log (:class:`Recorder`),
per-window statistics, and the CPU each process used."""

from __future__ import annotations

import math
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

RAW_COLUMNS = ["emit_s", "chunk", "interval_ms", "latency_ms", "compute_ms", "deadline_miss", "mean_batch",
               "queue_ms", "transport_ms", "observation_age_ms"]
_LOG = re.compile(r"stream (\w+) (admitted|removed).*worker utilisation \[([^\]]*)\]")


# ---------------------------------------------------------------------------------------------- replay
class Mirror:
    """The server's admission (:class:`~physis_ros.ros.hub.StreamHub`'s set-up), replayed here."""

    def __init__(self, cfg, profiles: dict):
        from physis_ros.model.spec import load_model_config
        from physis_ros.runtime.streams import ServedModel
        from physis_ros.serving.policies import server_admission

        self.admission, _, _ = server_admission(cfg)
        self.max_batch = self.admission.cluster.max_batch
        self.served = {name: ServedModel(load_model_config(name), None, p["profile"]) for name, p in profiles.items()}

    def model(self, ref: str):
        """The served model of a reference (preset name or model YAML), as the server resolves it."""
        from physis_ros.model.spec import load_model_config

        return self.served[load_model_config(ref).name]

    def admit(self, name: str, model: str, pace_ms: float, slo_ms: float) -> tuple[bool, str, dict | None]:
        from physis_ros.serving.capacity import Rejected

        try:
            a = self.admission.admit(name, self.model(model), pace_ms, slo_ms)
        except Rejected as exc:
            return False, exc.reason, None
        compute, hop = defaultdict(float), defaultdict(float)
        for r, d in zip(a.placed.ranks, a.placed.devices):
            compute[f"w{d}"] += r.compute_ms
            hop[f"w{d}"] += r.hop_ms
        return True, "", {"ranks": [r.describe() for r in a.placed.ranks], "devices": list(a.placed.devices),
                          "workers": a.workers, "compute_ms": _round(dict(compute)), "hop_ms": _round(dict(hop)),
                          "method": a.placed.method}

    def remove(self, name: str) -> None:
        self.admission.remove(name)

    def follow(self, factors: dict[int, float], spreads: dict[str, float]) -> None:
        """The server's measured load factors and streams' spreads (its /diagnostics), so the replay checks
        what the server did."""
        self.admission.follow(factors, spreads)

    def spreads(self) -> dict[str, float]:
        return dict(self.admission.spreads)

    def load_factors(self) -> list[float]:
        return self.admission.load_factors()

    def utilisation(self) -> list[float]:
        return self.admission.utilisation()


# ---------------------------------------------------------------------------------------------- recording
class Recorder:
    """This process's subscriptions: telemetry, diagnostics, the server's log, each robot's action_chunk."""

    def __init__(self, node):
        from diagnostic_msgs.msg import DiagnosticArray
        from rcl_interfaces.msg import Log
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        from physis_ros.msg import ChunkTelemetry

        self.node = node
        self.reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self.rows: dict[str, list] = defaultdict(list)            # stream -> RAW_COLUMNS rows
        self.received: dict[str, set] = defaultdict(set)          # stream -> chunk indices on action_chunk
        self.diag: dict[str, list] = defaultdict(list)            # worker -> (t, values)
        self.spread: dict[str, float] = {}                        # stream -> admission's spread, last published
        self.log_util: list[tuple[str, str, list[float]]] = []    # (stream, admitted|removed, utilisation)
        self.subs = [
            node.create_subscription(ChunkTelemetry, "/telemetry", self._on_tel, self.reliable),
            node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50),
            node.create_subscription(Log, "/rosout", self._on_log, QoSProfile(
                depth=1000, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)),
        ]
        self.watched: set[str] = set()
        self.engine_state: str | None = None

    def close(self) -> None:
        for sub in self.subs:
            self.node.destroy_subscription(sub)

    def watch(self, stream: str, produces: str) -> None:
        """Subscribe to the robot's output as its controller would (RELIABLE): a world-action model's
        action_chunk, a world model's predicted_frames."""
        from physis_ros.msg import ActionChunk, PredictedFrames

        if stream not in self.watched:
            self.watched.add(stream)
            msg_type, topic = (ActionChunk, "action_chunk") if produces == "actions" else (PredictedFrames, "predicted_frames")
            self.subs.append(self.node.create_subscription(
                msg_type, f"/{stream}/{topic}",
                lambda msg, s=stream: self.received[s].add(int(msg.chunk_index)), self.reliable))

    def _on_tel(self, m) -> None:
        emit = m.emit_stamp.sec + m.emit_stamp.nanosec * 1e-9
        batches = list(m.batch_sizes)
        self.rows[m.stream].append([emit, int(m.chunk_index), m.output_interval_ms, m.response_latency_ms,
                                    m.stage_compute_ms_sum, bool(m.deadline_miss),
                                    float(np.mean(batches)) if batches else 1.0, m.queue_ms, m.transport_ms,
                                    m.observation_age_ms])

    def _on_diag(self, msg) -> None:
        t = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        for st in msg.status:
            if st.name.endswith(": engine"):
                self.engine_state = {kv.key: kv.value for kv in st.values}.get("state")
            if ": worker " in st.name:
                values = {kv.key: kv.value for kv in st.values}
                self.diag[st.name.rsplit(" ", 1)[-1]].append((t, values))
            for kv in st.values:   # a stream's status: what admission charges it beyond its bound
                if kv.key == "admission_spread_ms" and kv.value != "none":
                    self.spread[st.name.rsplit(": ", 1)[-1]] = float(kv.value)

    def _on_log(self, msg) -> None:
        found = _LOG.search(msg.msg)
        if found:
            util = [float(x) for x in found.group(3).split(",") if x.strip()]
            self.log_util.append((found.group(1), found.group(2), util))

    def server_util(self, stream: str, kind: str) -> list[float] | None:
        for s, k, u in reversed(self.log_util):
            if s == stream and k == kind:
                return u
        return None

    def worker_pids(self) -> dict[str, int]:
        out = {}
        for w, samples in self.diag.items():
            try:
                out[w] = int(samples[-1][1].get("pid", 0))
            except ValueError:
                pass
        return out

    def load_factors(self) -> dict[int, float]:
        """Per worker index: the load factor the server's admission last published on /diagnostics."""
        out = {}
        for w, samples in self.diag.items():
            try:
                out[int(w[1:])] = float(samples[-1][1]["admission_load_factor"])
            except (KeyError, ValueError):
                pass
        return out

    def spreads(self) -> dict[str, float]:
        """Per stream: the spread the server's admission last published on /diagnostics (measured ones only)."""
        return dict(self.spread)

    def worker_window(self, worker: str, lo: float, hi: float) -> dict:
        """From the worker's cumulative counters: compute time / wall time, stages, batches in [lo, hi]."""
        inside = [(t, v) for t, v in self.diag.get(worker, []) if lo - 0.6 <= t <= hi + 0.6]
        if len(inside) < 2:
            return {"measured_busy": None}
        (t0, a), (t1, b) = inside[0], inside[-1]

        def delta(key):
            try:
                return float(b[key]) - float(a[key])
            except (KeyError, ValueError):
                return math.nan
        stages, batches = delta("stages"), delta("batches")
        return {"measured_busy": _r(delta("compute_ms") / 1e3 / (t1 - t0)) if t1 > t0 else None,
                "counter_span_s": round(t1 - t0, 3), "stages": stages, "batches": batches,
                "mean_batch": _r(stages / batches) if batches > 0 else None}


def _pct(values, q):
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return round(float(np.percentile(vals, q)), 3) if vals else None


def _r(x, nd: int = 4):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), nd)


def _round(d: dict, nd: int = 3) -> dict:
    return {k: _r(v, nd) for k, v in d.items()}


def _gaps(indices) -> int:
    idx = sorted(set(indices))
    return int(sum(b - a - 1 for a, b in zip(idx, idx[1:])))


def stream_window(rows: list, received: set, lo: float, hi: float, slo: float) -> dict:
    rs = [r for r in rows if lo <= r[0] < hi]
    iv = [r[2] for r in rs if r[2] > 0]
    span = rs[-1][0] - rs[0][0] if len(rs) > 1 else 0.0
    p99 = _pct(iv, 99)
    return {"chunks": len(rs), "chunks_per_s": _r((len(rs) - 1) / span, 3) if span > 0 else None,
            "interval_ms": {"p50": _pct(iv, 50), "p99": p99, "max": _r(max(iv), 3) if iv else None},
            "latency_ms": {"p50": _pct([r[3] for r in rs], 50), "p99": _pct([r[3] for r in rs], 99),
                           "max": _r(max(r[3] for r in rs), 3) if rs else None},
            "deadline_misses": int(sum(r[5] for r in rs)), "over_slo": int(sum(v > slo for v in iv)),
            "gaps": _gaps([r[1] for r in rs]), "lost_to_robot": int(sum(r[1] not in received for r in rs)),
            "compute_ms_p50": _pct([r[4] for r in rs], 50),
            "mean_batch": _r(np.mean([r[6] for r in rs]), 3) if rs else None,
            "queue_ms_p50": _pct([r[7] for r in rs], 50), "observation_age_ms_p50": _pct([r[9] for r in rs], 50),
            "meets_slo": bool(p99 is not None and p99 <= slo)}


# ---------------------------------------------------------------------------------------------- CPU accounting
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _machine_cpu() -> tuple[float, float, float]:
    """(busy, steal, total) jiffies of all cores since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(v[:8])
    return total - v[3] - v[4], v[7], total


def _cpu_snapshot(pids: dict[str, int]) -> dict:
    return {"t": time.monotonic(), "machine": _machine_cpu(), "procs": {k: _proc_cpu(p) for k, p in pids.items()}}


def _cpu_delta(a: dict, b: dict) -> dict:
    dt = b["t"] - a["t"]
    busy, steal, total = (y - x for x, y in zip(a["machine"], b["machine"]))
    out = {"machine_busy": _r(busy / total) if total else None, "machine_steal": _r(steal / total) if total else None,
           "cores_used": {}}
    for k, x in a["procs"].items():
        y = b["procs"].get(k)
        if x is not None and y is not None and dt > 0:
            out["cores_used"][k] = _r((y - x) / dt)
    ours = sum(out["cores_used"].values())
    out["ours_cores"] = _r(ours)
    # what the rest of the machine (other users' work) took meanwhile
    out["others_cores"] = _r(max(0.0, busy / total * (os.cpu_count() or 1) - ours)) if total else None
    return out
