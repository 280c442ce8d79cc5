"""``physis-serve``: run the ``physis_server`` ROS 2 node (the action server) until Ctrl-C.

    physis-serve --config config/serve.yaml [--duration S] [--deterministic] [--openpi PORT] [--ros-args ...]
    physis-serve --no-ros --openpi PORT [--config config/serve.yaml]     (openpi clients only, no ROS)

Without ``--config`` the configuration comes from ROS parameters (what
``ros2 launch physis_ros serve.launch.py`` passes). The node is a lifecycle node: with
``--autostart`` (the default) it configures (engine + workers) and activates (outputs armed) at
once; ``--no-autostart`` leaves it unconfigured for a lifecycle manager. A lifecycle shutdown
ends the process (exit 0). The config's streams are admitted at start-up (one not admitted is
reported, or with ``--strict`` ends the server with exit 2); more robots join through the
``~/serve_stream`` action (``physis-stream add``). Exit codes: 0 after a clean
stop, 1 if the engine failed (did not start, or lost a worker it could not restart) or none of the
config's streams started (each one's reason on stderr), 2 for a
config stream refused under --strict, or a usage or configuration error (bad flag or value, a physis-serve flag placed after --ros-args,
config missing/empty/binary/invalid: the message names the key; unreadable checkpoint, profile
or keys directory), 70 internal error (a bug; PHYSIS_DEBUG=1 shows the traceback). Errors are
one line on stderr: 'physis-serve: error: <what and the fix>'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from physis_ros.console import (ArgumentParser, StopSignals, check_yaml_file, model_arg, nonneg_float, nonneg_int,
                                   positive_float, preflight_serve, run_main, set_threads, split_ros_args)
from physis_ros import heap
from physis_ros.cli.serve_openpi import print_totals, serve_without_ros
from physis_ros.config import ConfigError, repo_config_dir


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="physis-serve", description=__doc__)
    p.add_argument("--config", help="serve YAML (plain or ROS 2 parameters format), e.g. config/serve.yaml")
    p.add_argument("--model", type=model_arg, default="", help="model preset or YAML (overrides the config; empty: keep)")
    p.add_argument("--workers", type=nonneg_int, default=0, help="local worker processes (overrides; 0: keep)")
    p.add_argument("--plan", default="", help="engine.plan (overrides; empty: keep); the server places each "
                                              "stream by admission, offline runs and benchmarks use the plan")
    p.add_argument("--deterministic", action="store_true",
                   help="each chunk consumes the next complete observation in arrival order")
    p.add_argument("--use-sim-time", action="store_true", help="stamp from /clock (same as -p use_sim_time:=true)")
    p.add_argument("--duration", type=nonneg_float, default=0.0,
                   help="stop after this many seconds of serving (0: until Ctrl-C / SIGTERM)")
    p.add_argument("--start-timeout", type=positive_float, default=120.0, help="give up if the engine is not up by then")
    p.add_argument("--summary-json", help="write per-stream totals here on exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 if a stream of the config is not admitted at start-up (default: report it, serve the "
                        "others)")
    p.add_argument("--autostart", nargs="?", const=True, default=True, type=_boolean,
                   metavar="BOOL", help="configure and activate the lifecycle node at start (default: true)")
    p.add_argument("--no-autostart", dest="autostart", action="store_false",
                   help="start unconfigured and wait for lifecycle transitions (configure, activate, ...)")
    p.add_argument("--openpi", type=port_arg, default=None, metavar="PORT",
                   help="also serve openpi clients (openpi_client.WebsocketClientPolicy) on this port, sharing the "
                        "workers and admission (0: any free port; sets openpi.port; docs/openpi.md)")
    p.add_argument("--no-ros", action="store_true",
                   help="serve only openpi clients, without ROS in the process (needs --openpi or openpi.port; the "
                        "config's streams, which read ROS topics, are left out)")
    p.add_argument("--trajectory-topic", default="",
                   help="joint_trajectory topic of a single-stream config, e.g. /arm_controller/joint_trajectory "
                        "(empty: keep; several streams: set streams.<name>.topics.joint_trajectory)")
    return p


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


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
    if args.openpi is not None:
        out["openpi"] = {"port": args.openpi}
    return out


def port_arg(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535; 0: any free one)")
    return port


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself (not a call from Python): DDS and heap settings
        reexec_with_process_env()
    return run_main("physis-serve", _serve, argv)


def process_env() -> dict[str, str]:
    """The environment the server process should run with for large inputs (what is already set is kept).

    Measured (tests/ros/test_heavy_inputs.py): after a burst of 1080p and 4K frames the server's memory stayed
    70-160 MB above its baseline with the defaults, because rmw_fastrtps keeps each reader's sample buffers at
    the largest size ever received and glibc keeps what is freed in per-thread arenas. With readers in Fast
    DDS's DYNAMIC history mode (``config/fastdds.xml``, which rmw_fastrtps honours only with
    ``RMW_FASTRTPS_USE_QOS_FROM_XML=1``), one malloc arena, and the node's ``malloc_trim`` after a burst
    (:class:`~physis_ros.heap.HeapTrimmer`), it returns to within 2 MB."""
    env = {}
    if "FASTDDS_DEFAULT_PROFILES_FILE" not in os.environ:
        profile = repo_config_dir() / "fastdds.xml"
        if profile.is_file():
            env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
            if "RMW_FASTRTPS_USE_QOS_FROM_XML" not in os.environ:
                env["RMW_FASTRTPS_USE_QOS_FROM_XML"] = "1"
    if "MALLOC_ARENA_MAX" not in os.environ:
        env["MALLOC_ARENA_MAX"] = "1"  # read by glibc when the process starts, hence the re-exec below
    return env


def reexec_with_process_env() -> None:
    """Run this command again with :func:`process_env` set, once (it replaces the process). glibc reads
    MALLOC_ARENA_MAX at start-up, and a mallopt() made later leaves the arenas already created (measured: +24 MB
    after the burst instead of +0..2)."""
    env = process_env()
    if env and "PHYSIS_PROCESS_ENV" not in os.environ:
        os.environ.update(env, PHYSIS_PROCESS_ENV="1")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _serve(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--no-ros" in argv:   # no ROS in the process: not even rclpy's argument parsing
        if "--ros-args" in argv:
            print("physis-serve: error: --no-ros takes no --ros-args; drop one of them", file=sys.stderr)
            return 2
        own = argv
    else:
        own = split_ros_args("physis-serve", argv)
    args = build_parser().parse_args(own)   # bad flags: before the heavy imports
    if args.no_ros:
        return serve_without_ros(args, overrides_from_args(args))
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from physis_ros.serving.config import deep_merge, load_serve_mapping, serve_config
    from physis_ros.serving.config_keys import apply_trajectory_topic

    overrides = overrides_from_args(args)
    file_mapping = {}
    try:
        if args.config:
            check_yaml_file(args.config, "--config")
            file_mapping = load_serve_mapping(args.config)
            if "streams" in file_mapping:  # fail fast, before ROS (else streams come from ROS parameters)
                checked = deep_merge(file_mapping, overrides)
                if args.trajectory_topic:
                    checked = apply_trajectory_topic(checked, args.trajectory_topic)
                preflight_serve(serve_config(checked, source=args.config))
    except ConfigError as exc:
        print(f"physis-serve: error: {exc}", file=sys.stderr)
        return 2
    set_threads(1)

    signals = StopSignals()
    stop = signals.stop

    rclpy.init(args=["physis-serve", *argv], signal_handler_options=SignalHandlerOptions.NO)
    from rclpy.lifecycle import TransitionCallbackReturn

    from physis_ros.ros.node import PhysisServer

    SUCCESS = TransitionCallbackReturn.SUCCESS

    node = None
    executor = None
    code = 0
    try:
        try:
            node = PhysisServer(file_mapping, overrides, trajectory_topic=args.trajectory_topic)
        except ConfigError as exc:
            print(f"physis-serve: error: {exc}", file=sys.stderr)
            return 2
        log = node.get_logger()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        if args.autostart:
            if node.trigger_configure() != SUCCESS or node.trigger_activate() != SUCCESS:
                log.error("autostart: the lifecycle configure/activate transitions failed")
                code = 1
                stop.set()
        else:
            log.info("waiting for lifecycle transitions (unconfigured; autostart off)")
        heap.settle(collect=True)   # before any chunk: what start-up made is never scanned again
        serving_since = None
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)
            if node.finalized:
                signals.why = "lifecycle shutdown"
                break
            engine = node.engine
            if engine is None:   # unconfigured (cleaned up): nothing to watch
                serving_since = None
                continue
            failure = engine.failure
            if failure is not None:
                log.error(f"engine failed: {failure}")
                node.publish_diagnostics()
                code = 1
                break
            if serving_since is None:
                node.update_state()  # serving once the config's streams are in (/diagnostics keeps its own rate)
                if node.state == "serving":
                    serving_since = time.monotonic()
                    refused = {n: v for n, v in node.startup.items() if v != "admitted"}
                    if refused and (args.strict or node.config.admission.strict):
                        for n, v in refused.items():
                            print(f"physis-serve: error: config stream {n} not admitted ({v}) and --strict",
                                  file=sys.stderr)
                        code = 2
                        break
                    if refused and len(refused) == len(node.startup):   # configured robots, none of them served
                        for n, v in refused.items():
                            print(f"physis-serve: error: config stream {n} did not start ({v})", file=sys.stderr)
                        print("physis-serve: error: none of the config's streams started; fix them (or start with "
                              "no streams: robots join through ~/serve_stream)", file=sys.stderr)
                        signals.why = "no config stream started"
                        code = 1
                        break
                elif time.monotonic() - node.engine_started > args.start_timeout:
                    log.error(f"engine did not start within {args.start_timeout:.0f} s")
                    code = 1
                    break
            elif args.duration and time.monotonic() - serving_since >= args.duration:
                signals.why = f"--duration {args.duration:g} s"
                break
        log.info(f"stopping ({signals.why})")
    finally:
        if node is not None:
            if not node.close():
                print("physis-serve: warning: engine thread did not stop in time", file=sys.stderr)
                code = code or 1
            if executor is not None:
                _send_goal_results(executor, node)
            report = node.report()
            print_totals(report)
            if args.summary_json:
                with open(args.summary_json, "w") as f:
                    json.dump({"exit": code, "streams": report}, f, indent=2, default=str)
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return code


def _send_goal_results(executor, node, timeout_s: float = 2.0) -> None:
    """Goals still running were ended 'shutdown' by close(); spin until their results are out (bounded),
    so that clients learn the outcome instead of waiting on a server that is gone."""
    deadline = time.monotonic() + timeout_s
    while node.actions.goals and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    linger = time.monotonic() + 0.2   # the result messages themselves
    while time.monotonic() < linger:
        executor.spin_once(timeout_sec=0.05)


if __name__ == "__main__":
    sys.exit(main())
