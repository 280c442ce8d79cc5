"""``physis-serve``: run the ``physis_server`` ROS 2 node (the action server) until Ctrl-C.

    physis-serve --config config/serve.yaml [--duration S] [--deterministic] [--ros-args ...]

Without ``--config`` the configuration comes from ROS parameters (what
``ros2 launch physis_ros serve.launch.py`` passes). Exit codes: 0 after a clean
stop, 1 if the engine failed (did not start, or lost a worker it could not restart), 2 for a
configuration error (the message names the key).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from physis_ros.cli.common import set_threads
from physis_ros.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="serve YAML (plain or ROS 2 parameters format), e.g. config/serve.yaml")
    p.add_argument("--model", default="", help="model preset or YAML (overrides the config; empty: keep)")
    p.add_argument("--workers", type=int, default=0, help="local worker processes (overrides; 0: keep)")
    p.add_argument("--plan", default="", help="placement plan (overrides; empty: keep)")
    p.add_argument("--deterministic", action="store_true",
                   help="each chunk consumes the next complete observation in arrival order")
    p.add_argument("--use-sim-time", action="store_true", help="stamp from /clock (same as -p use_sim_time:=true)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop after this many seconds of serving (0: until Ctrl-C / SIGTERM)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="give up if the engine is not up by then")
    p.add_argument("--summary-json", help="write per-stream totals here on exit")
    return p


def overrides_from_args(args: argparse.Namespace) -> dict:
    out: dict = {}
    if args.model:
        out["model"] = args.model
    engine = {}
    if args.workers:
        engine["workers"] = args.workers
    if args.plan:
        engine["plan"] = args.plan
    if engine:
        out["engine"] = engine
    if args.deterministic:
        out["deterministic"] = True
    if args.use_sim_time:
        out["use_sim_time"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions
    from rclpy.utilities import remove_ros_args

    from physis_ros.ros.config import deep_merge, load_serve_mapping, serve_config

    args = build_parser().parse_args(remove_ros_args(["physis-serve", *argv])[1:])
    overrides = overrides_from_args(args)
    file_mapping = {}
    try:
        if args.config:
            file_mapping = load_serve_mapping(args.config)
            if "streams" in file_mapping:  # fail fast, before ROS (else streams come from ROS parameters)
                serve_config(deep_merge(file_mapping, overrides), source=args.config)
    except ConfigError as exc:
        print(f"physis-serve: error: {exc}", file=sys.stderr)
        return 2
    set_threads(1)

    stop = threading.Event()
    reason = {"why": "stopped"}

    def on_signal(signum, _frame):
        reason["why"] = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    rclpy.init(args=["physis-serve", *argv], signal_handler_options=SignalHandlerOptions.NO)
    from physis_ros.ros.node import PhysisServer

    node = None
    executor = None
    code = 0
    try:
        try:
            node = PhysisServer(file_mapping, overrides)
        except ConfigError as exc:
            print(f"physis-serve: error: {exc}", file=sys.stderr)
            return 2
        log = node.get_logger()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        node.start_engine()
        started = time.monotonic()
        serving_since = None
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
            failure = node.engine.failure
            if failure is not None:
                log.error(f"engine failed: {failure}")
                node.publish_diagnostics()
                code = 1
                break
            if serving_since is None:
                if node.engine.ready.is_set():
                    serving_since = time.monotonic()
                    node.publish_diagnostics()  # flips the state to serving at once
                elif time.monotonic() - started > args.start_timeout:
                    log.error(f"engine did not start within {args.start_timeout:.0f} s")
                    code = 1
                    break
            elif args.duration and time.monotonic() - serving_since >= args.duration:
                reason["why"] = f"--duration {args.duration:g} s"
                break
        log.info(f"stopping ({reason['why']})")
    finally:
        if node is not None:
            if not node.close():
                print("physis-serve: warning: engine thread did not stop in time", file=sys.stderr)
                code = code or 1
            report = node.report()
            for name, r in report.items():
                rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "none"
                print(f"physis-serve: {name}: {r['chunks']} chunks, interval p50 {r['interval_ms_p50']:.1f} ms, "
                      f"latency p50 {r['latency_ms_p50']:.1f} ms, rejected inputs: {rejected}", file=sys.stderr)
            if args.summary_json:
                with open(args.summary_json, "w") as f:
                    json.dump({"exit": code, "streams": report}, f, indent=2, default=str)
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
