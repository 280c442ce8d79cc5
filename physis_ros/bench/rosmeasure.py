"""Measurements behind ``physis-bench ros``: the out-of-process recorder, the per-chunk analysis and
the bare-rclpy floor (see :mod:`physis_ros.bench.ros`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _stats(values_ns: list[int]) -> dict:
    ms = [v * 1e-6 for v in values_ns]
    return {"n": len(ms), "p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "max_ms": max(ms) if ms else None}


class Recorder:
    """Subscriptions of the out-of-process consumer; callbacks note receipt time first."""

    def __init__(self, node, cfg):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from diagnostic_msgs.msg import DiagnosticArray
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry
        from physis_ros.ros.conversions import stamp_ns

        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.chunks: dict[str, dict[int, tuple[int, int, int]]] = defaultdict(dict)  # chunk -> (cb, rx, src)
        self.trajs: dict[str, dict[int, tuple[int, int, int]]] = defaultdict(dict)   # seq-1 -> same
        # chunk -> (emit ns, output interval ms, handover ns: the node began publishing it)
        self.emits: dict[str, dict[int, tuple[int, float, int]]] = defaultdict(dict)
        self.joint_order_ok = True
        self.subs = []
        for name in cfg.streams:
            joints = list(cfg.streams[name].joint_names)

            def on_chunk(msg, info, name=name, joints=joints):
                now = time.time_ns()
                self.chunks[name][int(msg.chunk_index)] = (now, info["received_timestamp"], info["source_timestamp"])
                if list(msg.joint_names) != joints:
                    self.joint_order_ok = False

            def on_traj(msg, info, name=name):
                now = time.time_ns()
                seq = info.get("publication_sequence_number") or 0
                self.trajs[name][seq - 1] = (now, info["received_timestamp"], info["source_timestamp"])

            topic = cfg.topic(name, "action_chunk")
            self.subs.append(node.create_subscription(ActionChunk, _abs(topic), on_chunk, reliable))
            self.subs.append(node.create_subscription(JointTrajectory, _abs(cfg.topic(name, "joint_trajectory")),
                                                      on_traj, reliable))

        def on_tel(msg):
            self.emits[msg.stream][int(msg.chunk_index)] = (stamp_ns(msg.emit_stamp), msg.output_interval_ms,
                                                            stamp_ns(msg.handover_stamp))

        self.subs.append(node.create_subscription(ChunkTelemetry, _abs(cfg.telemetry_topic), on_tel,
                                                  QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)))

        # The node's own timings (engine emit -> output callback -> ActionChunk published), last report.
        self.node_timings: dict[str, dict[str, float]] = {}
        names = {f"physis_server: {n}": n for n in cfg.streams}

        def on_diag(msg):
            for status in msg.status:
                if status.name in names:
                    values = {kv.key: kv.value for kv in status.values}
                    self.node_timings[names[status.name]] = {
                        k: float(values[k]) for k in ("handover_ms_p50", "handover_ms_p99", "publish_ms_p50",
                                                      "publish_ms_p99") if k in values}

        self.subs.append(node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 10))

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.emits.values())


def _abs(topic: str) -> str:
    return topic if topic.startswith("/") else "/" + topic


def analyse(rec: Recorder, window: tuple[int, int]) -> dict:
    """Per stream and overall, over chunks emitted within ``window`` (ns on the host clock)."""
    lo, hi = window
    out = {"streams": {}}
    parts_all = defaultdict(list)
    lost_all = 0
    for name in sorted(rec.emits):
        emits = {c: e for c, (e, _, _) in rec.emits[name].items() if lo <= e < hi}
        if not emits:
            continue
        parts = defaultdict(list)
        lost = []
        for c, emit in emits.items():
            got = rec.chunks[name].get(c)
            if got is None:
                lost.append(c)
                continue
            cb, rx, src = got
            handover = rec.emits[name][c][2]
            # The ROS layer per chunk: from the node taking the chunk over (its output callback) to
            # this subscriber's DDS receipt / callback. The engine's handover before it is not ROS.
            parts["ros_layer_to_receipt"].append(rx - handover)
            parts["ros_layer_to_callback"].append(cb - handover)
            parts["engine_handover"].append(handover - emit)
            parts["node_publish"].append(src - handover)
            parts["emit_to_callback"].append(cb - emit)
            parts["emit_to_receipt"].append(rx - emit)
            parts["emit_to_dds_write"].append(src - emit)
            parts["dds_transport"].append(rx - src)
            parts["dds_to_callback"].append(cb - rx)
            traj = rec.trajs[name].get(c)
            if traj is not None:
                parts["trajectory_emit_to_callback"].append(traj[0] - emit)
                parts["trajectory_emit_to_receipt"].append(traj[1] - emit)
            else:
                parts["trajectory_missing"].append(c)
        received = sorted(c for c in rec.chunks[name] if c in emits)
        span_s = (max(emits.values()) - min(emits.values())) * 1e-9
        intervals = [iv for e, iv, _ in rec.emits[name].values() if lo <= e < hi and iv > 0]
        indices = sorted(rec.chunks[name])
        contiguous = indices == list(range(indices[0], indices[-1] + 1)) if indices else False
        out["streams"][name] = {
            "chunks_emitted": len(emits),
            "chunks_received": len(received),
            "lost": len(lost),
            "trajectories_missing": len(parts.pop("trajectory_missing", [])),
            "contiguous_indices": contiguous,
            "chunks_per_s": (len(emits) - 1) / span_s if span_s > 0 else None,
            "pipeline_interval_ms_p50": _pct(intervals, 50),
            **{k: _stats(v) for k, v in parts.items()},
        }
        lost_all += len(lost)
        for k, v in parts.items():
            parts_all[k].extend(v)
    streams = out["streams"].values()
    out["overall"] = {
        "chunks_emitted": sum(s["chunks_emitted"] for s in streams),
        "chunks_received": sum(s["chunks_received"] for s in streams),
        "lost": lost_all,
        "chunks_per_s": sum(s["chunks_per_s"] or 0.0 for s in streams),
        **{k: _stats(v) for k, v in parts_all.items()},
    }
    return out


def floor_publisher(topic: str, rate_hz: float, duration_s: float) -> None:
    """The platform's floor: a bare rclpy publisher of ActionChunks (header stamp = publish time) at the
    pipeline's rate, nothing else. Runs as a child process of the benchmark."""
    import array

    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from physis_ros.msg import ActionChunk
    from physis_ros.ros.conversions import time_msg

    rclpy.init()
    node = rclpy.create_node("physis_bench_floor")
    pub = node.create_publisher(ActionChunk, topic, QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    msg = ActionChunk(horizon=16, dof=7)
    msg.actions = array.array("f", bytes(16 * 7 * 4))
    period, end = 1.0 / rate_hz, time.monotonic() + duration_s
    n = 0
    while time.monotonic() < end:
        msg.header.stamp = time_msg(time.time())
        msg.chunk_index = n
        pub.publish(msg)
        n += 1
        time.sleep(period)
    node.destroy_node()
    rclpy.try_shutdown()


def run_floor(args: argparse.Namespace, node, executor, stop) -> dict:
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from physis_ros.msg import ActionChunk
    from physis_ros.launcher import Child

    topic = f"/physis_bench_floor_{os.getpid()}"
    samples: list[tuple[int, int, int, int]] = []  # (stamp, src, rx, cb)

    def on_msg(msg, info):
        now = time.time_ns()
        samples.append((msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec,
                        info["source_timestamp"], info["received_timestamp"], now))

    sub = node.create_subscription(ActionChunk, topic, on_msg,
                                   QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    total = args.warmup + args.duration + 1.0
    print(f"physis-bench ros [floor]: bare publisher at {args.floor_rate:g} Hz for {total:g} s", file=sys.stderr)
    child = Child("floor", [sys.executable, "-c", "from physis_ros.bench.rosmeasure import floor_publisher; "
                            f"floor_publisher({topic!r}, {args.floor_rate}, {total})"])
    try:
        while child.poll() is None and not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
    finally:
        child.stop()
        node.destroy_subscription(sub)
    rows = samples[int(args.warmup * args.floor_rate):]
    return {"rate_hz": args.floor_rate, "messages": len(rows),
            "publish_to_callback": _stats([cb - st for st, _, _, cb in rows]),
            "publish_call": _stats([src - st for st, src, _, _ in rows]),
            "dds_transport": _stats([rx - src for _, src, rx, _ in rows]),
            "dds_to_callback": _stats([cb - rx for _, _, rx, cb in rows]),
            "load_avg_1m": os.getloadavg()[0]}
