"""ROS layer: what publishing chunks over ROS 2 adds on top of the engine.

Runs the real server (``physis-serve``) fed by the synthetic robots, each in a
process of its own, on a private ROS domain, and subscribes from this (third)
process, as a robot's controller would: RELIABLE ``action_chunk`` and
``joint_trajectory`` per stream and ``telemetry``. For every chunk the delay
from the engine's emit (``ChunkTelemetry.emit_stamp``: the node clock when the
finished chunk came off the last worker) to the moment the subscriber's
callback ran is split into: emit -> DDS write (the node: conversion +
``publish``, from ``MessageInfo.source_timestamp``), DDS write -> DDS receipt,
and DDS receipt -> callback (the subscriber's executor). All processes share
one host clock. Lost chunks: chunks the telemetry reports as emitted that the
subscriber never received. Target: <= 0.5 ms p50 and no lost chunk.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

TARGET_P50_MS = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="serve YAML (default: the bundled config/serve.yaml)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured (after --warmup)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of serving left out at the start")
    p.add_argument("--rate", type=float, default=30.0, help="synthetic camera/joint-state rate (Hz)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--domain", type=int, default=0, help="ROS_DOMAIN_ID (0: a private one from the pid)")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--json", help="write results here")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _stats(values_ns: list[int]) -> dict:
    ms = [v * 1e-6 for v in values_ns]
    return {"n": len(ms), "p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "max_ms": max(ms) if ms else None}


class Recorder:
    """Subscriptions of the out-of-process consumer; callbacks note receipt time first."""

    def __init__(self, node, cfg):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry

        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.chunks: dict[str, dict[int, tuple[int, int, int]]] = defaultdict(dict)  # chunk -> (cb, rx, src)
        self.trajs: dict[str, dict[int, tuple[int, int, int]]] = defaultdict(dict)   # seq-1 -> same
        self.emits: dict[str, dict[int, tuple[int, float]]] = defaultdict(dict)      # chunk -> (emit ns, interval)
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
            emit = msg.emit_stamp.sec * 1_000_000_000 + msg.emit_stamp.nanosec
            self.emits[msg.stream][int(msg.chunk_index)] = (emit, msg.output_interval_ms)

        self.subs.append(node.create_subscription(ChunkTelemetry, _abs(cfg.telemetry_topic), on_tel,
                                                  QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)))

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
        emits = {c: e for c, (e, _) in rec.emits[name].items() if lo <= e < hi}
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
            parts["emit_to_callback"].append(cb - emit)
            parts["emit_to_dds_write"].append(src - emit)
            parts["dds_transport"].append(rx - src)
            parts["dds_to_callback"].append(cb - rx)
            traj = rec.trajs[name].get(c)
            if traj is not None:
                parts["trajectory_emit_to_callback"].append(traj[0] - emit)
            else:
                parts["trajectory_missing"].append(c)
        received = sorted(c for c in rec.chunks[name] if c in emits)
        span_s = (max(emits.values()) - min(emits.values())) * 1e-9
        intervals = [iv for c, (e, iv) in rec.emits[name].items() if lo <= e < hi and iv > 0]
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


def run(args: argparse.Namespace) -> int:
    from physis_ros.cli.common import write_json
    from physis_ros.config import ConfigError, repo_config_dir
    from physis_ros.ros.config import load_serve_config
    from physis_ros.ros.launcher import Child, serve_command, synthetic_command

    config = Path(args.config) if args.config else repo_config_dir() / "serve.yaml"
    try:
        cfg = load_serve_config(config)
    except ConfigError as exc:
        print(f"physis-bench ros: error: {exc}", file=sys.stderr)
        return 2
    domain = args.domain or 1 + os.getpid() % 100
    os.environ["ROS_DOMAIN_ID"] = str(domain)  # the children inherit it

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rclpy.init(domain_id=domain, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("physis_bench_ros")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    rec = Recorder(node, cfg)
    logs = tempfile.TemporaryDirectory(prefix="physis-bench-ros-")
    children = []
    code = 0
    window = (0, 0)
    print(f"physis-bench ros: {cfg.model}, {cfg.engine.workers} workers, plan {cfg.engine.plan}, streams "
          f"{', '.join(cfg.streams)}; ROS_DOMAIN_ID {domain}; {args.warmup:g} s warm-up + {args.duration:g} s",
          file=sys.stderr)
    try:
        children.append(Child("synthetic", synthetic_command(config, "--rate", str(args.rate), "--width",
                                                             str(args.width), "--height", str(args.height)),
                              log=Path(logs.name) / "synthetic.log"))
        server = Child("physis-serve", serve_command(config), log=Path(logs.name) / "serve.log")
        children.append(server)
        started = time.monotonic()
        first = None
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
            if server.poll() is not None:
                print(f"physis-bench ros: server exited ({server.poll()}):\n{server.tail()}", file=sys.stderr)
                code = 1
                break
            if first is None:
                if rec.total:
                    first = time.monotonic()
                    lo = time.time_ns() + int(args.warmup * 1e9)
                    window = (lo, lo + int(args.duration * 1e9))
                elif time.monotonic() - started > args.start_timeout:
                    print(f"physis-bench ros: no chunk within {args.start_timeout:.0f} s:\n{server.tail()}",
                          file=sys.stderr)
                    code = 1
                    break
            elif time.time_ns() > window[1] + 500_000_000:  # let the window's last chunks arrive
                break
    finally:
        for child in reversed(children):
            child.stop()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        logs.cleanup()
    if code:
        return code
    result = analyse(rec, window)
    overall = result["overall"]
    p50 = (overall.get("emit_to_callback") or {}).get("p50_ms")
    result.update(
        benchmark="ros", model=cfg.model, workers=cfg.engine.workers, plan=cfg.engine.plan,
        stream_names=list(cfg.streams), camera={"rate_hz": args.rate, "width": args.width, "height": args.height},
        warmup_s=args.warmup, duration_s=args.duration, cpus=os.cpu_count(),
        load_avg_1m=os.getloadavg()[0], joint_order_ok=rec.joint_order_ok,
        target={"emit_to_callback_p50_ms_max": TARGET_P50_MS, "lost": 0},
        passed=bool(p50 is not None and p50 <= TARGET_P50_MS and overall["lost"] == 0
                    and overall["chunks_received"] > 0),
    )
    _print(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _print(r: dict) -> None:
    def f(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    print(f"{'stream':<10} {'emitted':>8} {'received':>8} {'lost':>5} {'chunks/s':>9} "
          f"{'emit->cb p50/p99 ms':>20} {'node p50':>9} {'dds p50':>8} {'exec p50':>9} {'traj p50':>9}")
    rows = list(r["streams"].items()) + [("all", r["overall"])]
    for name, s in rows:
        g = lambda k, q="p50_ms": (s.get(k) or {}).get(q)
        print(f"{name:<10} {s['chunks_emitted']:>8} {s['chunks_received']:>8} {s['lost']:>5} "
              f"{f(s['chunks_per_s']):>9} {f(g('emit_to_callback')):>9} / {f(g('emit_to_callback', 'p99_ms')):>8} "
              f"{f(g('emit_to_dds_write')):>9} {f(g('dds_transport')):>8} {f(g('dds_to_callback')):>9} "
              f"{f(g('trajectory_emit_to_callback')):>9}")
    verdict = "PASS" if r["passed"] else "FAIL"
    print(f"target: emit->callback p50 <= {TARGET_P50_MS} ms and no lost chunk: {verdict} "
          f"(load average {r['load_avg_1m']:.2f} on {r['cpus']} CPUs)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="physis-bench ros", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
