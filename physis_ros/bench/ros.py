"""ROS layer: what publishing chunks over ROS 2 adds on top of the engine.

Runs the real server (``physis-serve``) fed by the synthetic robots, each in a
process of its own, on a private ROS domain, and subscribes from this (third)
process, as a robot's controller would: RELIABLE ``action_chunk`` and
``joint_trajectory`` per stream, ``telemetry`` and ``/diagnostics``.

Per chunk, the delay from the engine's emit (``ChunkTelemetry.emit_stamp``:
the node clock when the finished chunk came off the last worker) to the
moment this subscriber's callback ran, and its parts: the engine's handover
(emit -> ``handover_stamp``, when the node's output callback began: decoding
the last worker's message, not ROS), the node's conversion + ``publish`` up to
the DDS write (``MessageInfo.source_timestamp``), DDS write -> DDS receipt
here (``received_timestamp``), receipt -> callback (this process's rclpy
executor). All processes share one host clock. The ROS layer, per chunk =
DDS receipt (or callback) - handover stamp. Lost chunks: chunks the telemetry
reports as emitted that never arrived here. Target: ROS layer to receipt
<= 0.5 ms p50, no lost chunk. ``floor`` measures a bare rclpy publisher -> this subscriber at the
same rate, the least any rclpy hop costs here. Two scenarios: ``full``
(the pipeline at full rate, workers saturating the CPUs) and ``paced`` (one
chunk per camera frame, deterministic mode, workers idle between frames).
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
from pathlib import Path

from physis_ros.bench.rosmeasure import Recorder, analyse, run_floor  # noqa: F401 (analyse: tests)

TARGET_P50_MS = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="serve YAML (default: the bundled config/serve.yaml)")
    p.add_argument("--scenario", choices=("full", "paced", "all"), default="all")
    p.add_argument("--floor-rate", type=float, default=50.0,
                   help="rate of the bare-publisher floor measurement (0: skip it)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured per scenario (after --warmup)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of serving left out at the start")
    p.add_argument("--rate", type=float, default=30.0, help="synthetic camera/joint-state rate (Hz), full scenario")
    p.add_argument("--paced-rate", type=float, default=10.0,
                   help="camera rate of the paced scenario (below the pipeline's rate, so workers idle)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--domain", type=int, default=0, help="ROS_DOMAIN_ID (0: a private one from the pid)")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--json", help="write results here")


SCENARIOS = {
    # The pipeline as fast as it goes (latest-observation mode): the CPUs are saturated by the workers,
    # so this is the ROS layer under full load, and the loss check at the pipeline's rate.
    "full": [],
    # One chunk per camera frame (deterministic mode): the workers idle between frames, so this is
    # what the ROS layer itself costs when it gets a CPU at once.
    "paced": ["--deterministic"],
}


def run_scenario(name: str, args: argparse.Namespace, cfg, config: Path, node, executor, stop) -> dict | None:
    from physis_ros.launcher import Child, serve_command, synthetic_command

    rec = Recorder(node, cfg)
    logs = tempfile.TemporaryDirectory(prefix="physis-bench-ros-")
    children = []
    window = (0, 0)
    ok = False
    print(f"physis-bench ros [{name}]: {args.warmup:g} s warm-up + {args.duration:g} s", file=sys.stderr)
    try:
        rate = args.paced_rate if name == "paced" else args.rate
        children.append(Child("synthetic", synthetic_command(config, "--rate", str(rate), "--width",
                                                             str(args.width), "--height", str(args.height)),
                              log=Path(logs.name) / "synthetic.log"))
        server = Child("physis-serve", serve_command(config, *SCENARIOS[name]), log=Path(logs.name) / "serve.log")
        children.append(server)
        started = time.monotonic()
        first = None
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
            if server.poll() is not None:
                print(f"physis-bench ros: server exited ({server.poll()}):\n{server.tail()}", file=sys.stderr)
                break
            if first is None:
                if rec.total:
                    first = time.monotonic()
                    lo = time.time_ns() + int(args.warmup * 1e9)
                    window = (lo, lo + int(args.duration * 1e9))
                elif time.monotonic() - started > args.start_timeout:
                    print(f"physis-bench ros: no chunk within {args.start_timeout:.0f} s:\n{server.tail()}",
                          file=sys.stderr)
                    break
            elif time.time_ns() > window[1] + 500_000_000:  # let the window's last chunks arrive
                ok = True
                break
    finally:
        for child in reversed(children):
            child.stop()
        for sub in rec.subs:
            node.destroy_subscription(sub)
        logs.cleanup()
    if not ok:
        return None
    result = analyse(rec, window)
    for stream, timings in rec.node_timings.items():
        if stream in result["streams"]:
            result["streams"][stream]["node"] = timings
    result["joint_order_ok"] = rec.joint_order_ok
    result["load_avg_1m"] = os.getloadavg()[0]
    return result


def run(args: argparse.Namespace) -> int:
    from physis_ros.console import serve_config_or_exit, write_json

    config, cfg = serve_config_or_exit(args.config, "physis-bench ros")
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
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
    print(f"physis-bench ros: {cfg.model}, {cfg.engine.workers} workers, plan {cfg.engine.plan}, streams "
          f"{', '.join(cfg.streams)}; ROS_DOMAIN_ID {domain}; camera {args.width}x{args.height} at {args.rate:g} Hz",
          file=sys.stderr)
    results = {}
    try:
        for name in scenarios:
            if stop.is_set():
                break
            r = run_scenario(name, args, cfg, config, node, executor, stop)
            if r is None:
                return 1
            results[name] = r
        floor = run_floor(args, node, executor, stop) if args.floor_rate > 0 and not stop.is_set() else None
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    p50 = {n: (r["overall"].get("ros_layer_to_receipt") or {}).get("p50_ms") for n, r in results.items()}
    lost = {n: r["overall"]["lost"] for n, r in results.items()}
    out = {
        "benchmark": "ros", "model": cfg.model, "workers": cfg.engine.workers, "plan": cfg.engine.plan,
        "stream_names": list(cfg.streams), "camera": {"rate_hz": args.rate, "paced_rate_hz": args.paced_rate,
                                                      "width": args.width, "height": args.height},
        "warmup_s": args.warmup, "duration_s": args.duration, "cpus": os.cpu_count(),
        "scenarios": results,
        "floor": floor,
        # Judged to the subscriber's DDS receipt; its own executor (rclpy here, C++ in ros2_control)
        # is reported beside it, with the floor of a bare rclpy hop on this machine.
        "target": {"ros_layer_to_receipt_p50_ms_max": TARGET_P50_MS, "lost": 0},
        "passed": {n: bool(p50[n] is not None and p50[n] <= TARGET_P50_MS and lost[n] == 0
                           and results[n]["overall"]["chunks_received"] > 0) for n in results},
    }
    for name, r in results.items():
        print(f"\n[{name}] {SCENARIO_TEXT[name]} (load average {r['load_avg_1m']:.2f} on {out['cpus']} CPUs)")
        _print(r)
        verdict = "PASS" if out["passed"][name] else "FAIL"
        print(f"target: ROS layer to receipt p50 <= {TARGET_P50_MS} ms and no lost chunk: {verdict}")
    if floor is not None:
        fs = floor["publish_to_callback"]
        print(f"\n[floor] bare rclpy publisher -> this subscriber, ActionChunk at {floor['rate_hz']:g} Hz: "
              f"publish -> callback p50 {fs['p50_ms']:.3f} / p99 {fs['p99_ms']:.3f} ms (publish call "
              f"{floor['publish_call']['p50_ms']:.3f}, dds {floor['dds_transport']['p50_ms']:.3f}, "
              f"exec {floor['dds_to_callback']['p50_ms']:.3f})")
    if args.json:
        write_json(args.json, out)
    return 0


SCENARIO_TEXT = {"full": "pipeline at full rate, CPUs saturated by the workers",
                 "paced": "one chunk per camera frame (deterministic mode), workers idle between frames"}


def _print(r: dict) -> None:
    def f(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    def q(s: dict, key: str, which: str = "p50_ms"):
        return (s.get(key) or {}).get(which)

    print(f"{'stream':<8} {'emitted':>7} {'recv':>6} {'lost':>4} {'chunks/s':>8} {'emit->cb p50/p99':>17} "
          f"{'handover':>8} {'publish':>8} {'dds':>6} {'exec':>6} {'ROS rx p50/p99':>15} {'traj rx/cb':>12}"
          "   (ms, p50 unless noted)")
    for name, s in list(r["streams"].items()) + [("all", r["overall"])]:
        print(f"{name:<8} {s['chunks_emitted']:>7} {s['chunks_received']:>6} {s['lost']:>4} "
              f"{f(s['chunks_per_s']):>8} {f(q(s, 'emit_to_callback')):>8} /{f(q(s, 'emit_to_callback', 'p99_ms')):>7} "
              f"{f(q(s, 'engine_handover')):>8} {f(q(s, 'node_publish')):>8} {f(q(s, 'dds_transport')):>6} "
              f"{f(q(s, 'dds_to_callback')):>6} {f(q(s, 'ros_layer_to_receipt')):>7}/"
              f"{f(q(s, 'ros_layer_to_receipt', 'p99_ms')):>7} "
              f"{f(q(s, 'trajectory_emit_to_receipt')):>5}/{f(q(s, 'trajectory_emit_to_callback')):>6}")
    o = r["overall"]
    print(f"emit -> DDS receipt p50/p99: {f(q(o, 'emit_to_receipt'))} / {f(q(o, 'emit_to_receipt', 'p99_ms'))} ms; "
          f"ROS layer p50 (per chunk, from the node's handover): to DDS receipt {f(q(o, 'ros_layer_to_receipt'))} "
          f"ms, to callback {f(q(o, 'ros_layer_to_callback'))} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="physis-bench ros", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
