"""``physis-serve --no-ros --openpi PORT``: the server with only its openpi front end, no ROS in the process.

The config (``--config``, else the shipped ``config/serve.yaml``) gives the model, workers and admission;
its ``streams`` read ROS topics and are left out (said on stderr). Runs until Ctrl-C / SIGTERM or
``--duration``; prints each client's totals on exit. Exit codes as physis-serve's: 0 after a clean stop, 1
if the engine failed, 2 for a usage or configuration error (the API key missing off loopback, a port in
use)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from physis_ros.config import ConfigError
from physis_ros.console import StopSignals, check_yaml_file, preflight_serve, set_threads


def serve_without_ros(args: argparse.Namespace, overrides: dict) -> int:
    from physis_ros.openpi import OpenpiFrontEnd
    from physis_ros.serving.config import deep_merge, default_serve_path, load_serve_mapping, serve_config
    from physis_ros.serving.server import Server

    path = args.config or str(default_serve_path())
    try:
        check_yaml_file(path, "--config")
        mapping = load_serve_mapping(path)
        streams = mapping.pop("streams", None) or {}
        cfg = serve_config(deep_merge(mapping, overrides), source=path)
        if cfg.openpi.port is None:
            raise ConfigError("openpi.port", "--no-ros serves openpi clients only: give --openpi PORT")
        preflight_serve(cfg)
    except ConfigError as exc:
        print(f"physis-serve: error: {exc}", file=sys.stderr)
        return 2
    if streams:
        print(f"physis-serve: note: --no-ros leaves out the config's streams ({', '.join(streams)}): they read "
              f"ROS topics", file=sys.stderr)
    set_threads(1)
    signals = StopSignals()
    server = Server(cfg)
    try:
        front = OpenpiFrontEnd(server)   # the API key checked before any worker starts
    except ConfigError as exc:
        print(f"physis-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        server.start(args.start_timeout)
    except RuntimeError as exc:
        print(f"physis-serve: error: {exc}", file=sys.stderr)
        return 1
    code = 0
    try:
        try:
            port = front.start()
        except OSError as exc:
            print(f"physis-serve: error: the openpi front end cannot listen on {cfg.openpi.host}:"
                  f"{cfg.openpi.port}: {exc}", file=sys.stderr)
            return 2
        print(f"physis-serve: serving openpi clients on ws://{cfg.openpi.host}:{port} (model {server.model.name}, "
              f"{cfg.engine.workers} workers; Ctrl-C stops)", file=sys.stderr, flush=True)
        started = time.monotonic()
        while not signals.stop.wait(0.1):
            if server.state == "failed":
                print(f"physis-serve: error: engine failed: {server.failure}", file=sys.stderr)
                code = 1
                break
            if args.duration and time.monotonic() - started >= args.duration:
                signals.why = f"--duration {args.duration:g} s"
                break
        print(f"physis-serve: stopping ({signals.why})", file=sys.stderr)
    finally:
        front.close()
        if not server.close():
            print("physis-serve: warning: engine thread did not stop in time", file=sys.stderr)
            code = code or 1
    report = server.report()
    print_totals(report)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"exit": code, "streams": report, "openpi": front.stats()}, f, indent=2, default=str)
    return code


def print_totals(report: dict[str, dict]) -> None:
    """Each stream's totals (:meth:`Server.report <physis_ros.serving.server.Server.report>`) on stderr."""
    for name, r in report.items():
        if "not_admitted" in r:
            print(f"physis-serve: {name}: not admitted ({r['not_admitted']})", file=sys.stderr)
            continue
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "none"
        ms = {k: "n/a" if r[k] is None else f"{r[k]:.1f} ms" for k in ("interval_ms_p50", "latency_ms_p50")}
        print(f"physis-serve: {name}: {r['chunks']} chunks, interval p50 {ms['interval_ms_p50']}, latency p50 "
              f"{ms['latency_ms_p50']}, rejected inputs: {rejected}, ended {r['ended'] or 'serving'}", file=sys.stderr)
