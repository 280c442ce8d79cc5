"""``physis-demo``: the main job, end to end on this machine.

Starts the synthetic robots (camera + joint states per stream, ``physis-synthetic``)
and the action server (``physis-serve``: tiny-wam on 2 local CPU workers) as
processes of their own, then shows a live table from the server's telemetry:
chunks/s, output interval p50/p99 and response latency p50/p99 per stream,
until Ctrl-C or ``--duration`` seconds of serving. Stops everything it started.

Exit status: 0 success (also after Ctrl-C); 1 the server or the synthetic robots
failed (exited, or no chunk within --start-timeout; their log is printed);
2 usage or input error (bad flag or value; serve config missing, empty, binary or
invalid, or a file it names unreadable: checkpoint, profile, keys); 70 internal
error (a bug; PHYSIS_DEBUG=1 shows the traceback). Errors are one line on stderr:
'physis-demo: error: <what and the fix>'.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from physis_ros.console import (ArgumentParser, check_writable, cli_main, nonneg_float, positive_float,
                                   positive_int, serve_config_or_exit, write_json)


@cli_main("physis-demo")
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="physis-demo", description=__doc__)
    p.add_argument("--config", default=None, help="serve YAML (default: the bundled config/serve.yaml)")
    p.add_argument("--duration", type=nonneg_float, default=0.0, help="seconds of serving, then stop (0: until Ctrl-C)")
    p.add_argument("--rate", type=positive_float, default=30.0, help="synthetic camera/joint-state rate (Hz)")
    p.add_argument("--width", type=positive_int, default=64, help="synthetic camera width (the model sees 32x32)")
    p.add_argument("--height", type=positive_int, default=64)
    p.add_argument("--deterministic", action="store_true", help="serve in deterministic mode")
    p.add_argument("--start-timeout", type=positive_float, default=120.0)
    p.add_argument("--json", help="write the final per-stream summary here")
    p.add_argument("--logs", help="directory for the children's logs (default: a temporary one)")
    args = p.parse_args(argv)
    check_writable(args.json)

    from physis_ros.launcher import Child, serve_command, synthetic_command

    config, cfg = serve_config_or_exit(args.config, "physis-demo")
    telemetry_topic = cfg.telemetry_topic if cfg.telemetry_topic.startswith("/") else "/" + cfg.telemetry_topic

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    tmp = None
    if args.logs:
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="physis-demo-")
        logs = Path(tmp.name)

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from physis_ros.cli.monitor import TelemetryMonitor

    domain = os.environ.get("ROS_DOMAIN_ID", "0")
    print(f"physis-demo: {cfg.model} on {cfg.engine.workers} {cfg.engine.devices[0]} worker(s), plan "
          f"{cfg.engine.plan}; streams {', '.join(cfg.streams)}; ROS_DOMAIN_ID {domain}; logs in {logs}")
    print(f"physis-demo: synthetic camera {args.width}x{args.height} rgb8 + joint states at {args.rate:g} Hz "
          f"per stream; Ctrl-C to stop")
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("physis_demo_monitor")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    monitor = TelemetryMonitor(node, telemetry_topic)
    serve_extra = ["--deterministic"] if args.deterministic else []
    children: list[Child] = []
    code = 0
    try:
        children.append(Child("synthetic robots", synthetic_command(
            config, "--rate", str(args.rate), "--width", str(args.width), "--height", str(args.height)),
            log=logs / "synthetic.log"))
        server = Child("physis-serve", serve_command(config, *serve_extra), log=logs / "serve.log")
        children.append(server)
        started = time.monotonic()
        serving_since = None
        next_print = 0.0
        printed = 0
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
            now = time.monotonic()
            if server.poll() is not None:
                print(f"physis-demo: the server exited with code {server.poll()}; its log:\n{server.tail()}",
                      file=sys.stderr)
                code = 1
                break
            if serving_since is None:
                if monitor.total > 0:
                    serving_since = now
                    print(f"physis-demo: first chunk after {now - started:.1f} s (worker start-up, model load)")
                elif now - started > args.start_timeout:
                    print(f"physis-demo: no chunk within {args.start_timeout:.0f} s; server log:\n{server.tail()}",
                          file=sys.stderr)
                    code = 1
                    break
                continue
            elapsed = now - serving_since
            if now >= next_print:
                if printed % 10 == 0:
                    print(TelemetryMonitor.HEADER)
                for line in monitor.table(elapsed):
                    print(line, flush=True)
                printed += 1
                next_print = now + 1.0
            if args.duration and elapsed >= args.duration:
                break
    finally:
        for child in reversed(children):  # the server first: it drains and stops its workers
            rc = child.stop()
            if rc not in (0, None, -signal.SIGINT):
                print(f"physis-demo: {child.name} exited with code {rc}; log:\n{child.tail()}", file=sys.stderr)
                code = code or 1
        executor.spin_once(timeout_sec=0.0)
        summaries = monitor.summaries()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        if tmp is not None:
            tmp.cleanup()
    print("physis-demo: summary over the whole run")
    for name, s in sorted(summaries.items()):
        fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"
        print(f"  {name}: {s['chunks']} chunks (indices {s['first_chunk']}..{s['last_chunk']}, gaps {s['gaps']}), "
              f"{fmt(s['chunks_per_s'])} chunks/s, interval p50/p99 {fmt(s['interval_p50'])}/"
              f"{fmt(s['interval_p99'])} ms, latency p50/p99 {fmt(s['latency_p50'])}/{fmt(s['latency_p99'])} ms, "
              f"deadline misses {s['misses']}, late chunks {s['late_chunks']}, seam jumps over 0.01 rad "
              f"{s['seam_events']} ({s['seam_blended_chunks']} sent eased onto the chunk, "
              f"{s['past_frozen_chunks']} taken over at or past row d), tracking error vs the expert "
              f"{'n/a' if s['tracking_error'] is None else format(s['tracking_error'], '.4f')}")
        for e in s["seam_event_chunks"][:5]:   # with a hand-off, row >= d: it came later than its frozen rows
            print(f"    chunk {e['chunk']}: seam {e['seam_jump']:.3f} rad, the robot switched at row {e['late_points']}"
                  f" (d = {e['delay_steps']}), latency {e['latency_ms']:.1f} ms"
                  + (f", eased over {e['blended_rows']} rows" if e["blended_rows"] else ""))
    if args.json:
        write_json(args.json, {"config": str(config), "exit": code, "streams": summaries})
    return code


if __name__ == "__main__":
    sys.exit(main())
