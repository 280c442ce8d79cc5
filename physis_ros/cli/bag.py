"""``physis-bag``: replay, record, check, generate and inspect rosbag2 files (no rosbag2 needed).

  physis-bag replay BAG [--rate R] [--loop] [--start-offset S] [--remap FROM:=TO] [--clock [HZ]]
  physis-bag record OUT [--config serve.yaml] [--topics T ...] [--all] [--storage mcap|sqlite3] [--duration S]
  physis-bag check BAG [--config serve.yaml] [--out DIR] [--report] [--server-cmd CMD]
  physis-bag generate OUT [--config serve.yaml] [--duration S] [--rate HZ] [--size WxH] [--encoding rgb8] [--tracking]
                          [--fault KIND@TICK[:NS]]
  physis-bag info BAG

Exit status (every subcommand): 0 success; 1 a check failed (check: a failing
item, e.g. a missing or unequal chunk, a NaN/inf output, rejected-input counts
that disagree with the server's); 2 usage or input error (bad flag or value,
missing argument; bag missing, empty, binary, truncated or corrupt; serve config
or a file it names unreadable; check: the server failed to start or exited
early); 3 replay finished but topics with unknown message types were skipped
(``--skip-unknown`` makes that 0); 70 internal error (a bug; PHYSIS_DEBUG=1 shows
the traceback); 130 interrupted. Errors are one line on stderr:
'physis-bag: error: <what and the fix>' ('physis-bag SUB: error: ...' for flags).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from physis_ros.bags.bagio import UnknownTypeError, bag_info, rclpy_class
from physis_ros.console import (EXIT_FAILED, EXIT_SKIPPED, EXIT_USAGE, ArgumentParser, CliError, check_writable,
                                   cli_main, nonneg_float, one_line, positive_float, positive_int, print_error,
                                   yaml_file)

EXIT_ERROR = EXIT_USAGE
PROG = "physis-bag"


def _error(message: str) -> int:
    print_error(PROG, message)
    return EXIT_ERROR


def _fault(text: str):
    from physis_ros.bags.scene import Fault

    return Fault.parse(text)


_fault.__name__ = "fault (KIND@TICK[:NAMESPACE])"


def _write_json(path: str | Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ----------------------------------------------------------------------------- replay

def cmd_replay(args) -> int:
    from physis_ros.bags.replay import ReplayOptions, Replayer, parse_remaps
    from physis_ros.bags.rosnode import RosSession

    check_writable(args.json)

    options = ReplayOptions(rate=args.rate, loop=args.loop, start_offset_s=args.start_offset,
                            remaps=parse_remaps(args.remap), clock_hz=args.clock, topics=args.topics,
                            restamp=args.restamp, wait_for=args.wait_for or [], wait_timeout_s=args.wait_timeout,
                            delay_s=args.delay, max_loops=args.max_loops, progress=not args.quiet,
                            reliable=args.reliable)
    options.validate()
    info = bag_info(args.bag)     # fail fast on a missing or broken bag, before ROS starts
    with RosSession("physis_bag_replay", spin=False) as ros:
        replayer = Replayer(args.bag, ros.node, options)
        for s in replayer.skipped:
            print(f"physis-bag: warning: skipping {s.topic} ({s.msgtype}, {s.count} messages): {s.reason}",
                  file=sys.stderr)
        print(f"replaying {args.bag}: {info.count} messages, {len(info.topics)} topics, "
              f"{info.duration_s:.2f} s at rate {args.rate}", file=sys.stderr)
        result = replayer.run()
    print(result.summary())
    if args.json:
        _write_json(args.json, {"bag": str(args.bag), "counts": result.counts, "timing": result.timing(),
                                "wall_s": result.wall_s, "passes": result.passes,
                                "skipped": [s.__dict__ for s in result.skipped]})
    if result.skipped and not args.skip_unknown:
        print(f"physis-bag: {len(result.skipped)} topic(s) skipped (unknown message type); "
              f"pass --skip-unknown to accept", file=sys.stderr)
        return EXIT_SKIPPED
    return 130 if result.interrupted else 0


# ----------------------------------------------------------------------------- record

def cmd_record(args) -> int:
    from physis_ros.bags.record import Recorder, parse_topic_specs, server_topics
    from physis_ros.bags.rosnode import RosSession

    follow = None
    if args.topics:
        topics = parse_topic_specs(args.topics)
        for topic, msgtype in topics.items():
            if msgtype:
                try:
                    rclpy_class(msgtype)
                except UnknownTypeError as exc:
                    raise CliError(f"--topics {topic}:{msgtype}: {exc}; give TOPIC:pkg/msg/Name with an installed "
                                   f"type, or TOPIC alone to take the type from the publisher") from None
    elif args.all:
        topics = {}
    else:
        from physis_ros.bags.serveconf import load_serve_info   # imports torch (model config): only when needed
        topics = server_topics(load_serve_info(args.config), inputs=not args.outputs_only)
        follow = args.server_node or None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with RosSession("physis_bag_record") as ros:
        recorder = Recorder(ros.node, args.out, topics, storage=args.storage, discover_all=args.all,
                            follow=follow, follow_inputs=not args.outputs_only)
        print(f"recording {len(topics) if topics else 'all'} topics to {recorder.path} ({args.storage}); "
              f"Ctrl-C to stop", file=sys.stderr)
        deadline = time.monotonic() + args.duration if args.duration else None
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            stop.wait(0.1)
        counts = recorder.close()
    for topic, n in sorted(counts.items()):
        print(f"{n:8d}  {topic}")
    missing = [t for t in topics if t not in counts]
    for topic in missing:
        print(f"      --  {topic} (never seen: type unknown, not published)")
    print(f"wrote {args.out}: {sum(counts.values())} messages on {len(counts)} topics")
    return 0


# ----------------------------------------------------------------------------- check

def cmd_check(args) -> int:
    from physis_ros.bags.check import CheckOptions, run_check

    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise CliError(f"--out {args.out} is a file; give a directory for the outputs")
    if args.server_cmd is not None:
        import shlex

        try:
            if not shlex.split(args.server_cmd):
                raise ValueError("empty command")
        except ValueError as exc:
            raise CliError(f"--server-cmd: not a command line ({exc}): {args.server_cmd!r}") from None
    options = CheckOptions(bag=Path(args.bag), config=args.config, out=args.out, timeout_s=args.timeout,
                           rate=args.rate, reference=not args.no_reference, server_cmd=args.server_cmd,
                           sim_time=args.sim_time,
                           report=args.report, verbose=args.verbose)
    result = run_check(options)
    print(result.summary(), flush=True)
    if args.out:
        _write_json(Path(args.out) / "check.json", result.as_dict())
    if result.error is not None:
        # the whole story (server log tail) is in the summary above; stderr gets the one line
        return _error(one_line(result.error.split("; its log")[0].splitlines()[0]))
    if not result.ok:
        failed = [i.name for i in result.analysis.items if not i.ok]
        print(f"{PROG}: check failed: {len(failed)} item(s): {', '.join(failed[:6])}"
              f"{' ...' if len(failed) > 6 else ''}", file=sys.stderr)
        return EXIT_FAILED
    return 0


# ----------------------------------------------------------------------------- generate / info

def cmd_generate(args) -> int:
    from physis_ros.bags.scene import SceneSpec, scene_actions, write_scene_bag
    from physis_ros.bags.serveconf import load_serve_info

    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        return _error(f"--size must look like 64x48, got '{args.size}'")
    serve = load_serve_info(args.config)
    namespaces = tuple(args.namespaces) if args.namespaces else tuple(s.namespace for s in serve.streams)
    joints = serve.streams[0].joint_names if serve.streams else None
    spec = SceneSpec(namespaces=namespaces, duration_s=args.duration, rate_hz=args.rate, width=width,
                     height=height, encoding=args.encoding, faults=tuple(args.fault or ()),
                     actions=scene_actions(serve, namespaces), tracking=args.tracking,
                     **({"joint_names": joints} if joints else {}))
    try:
        spec.validate()
    except ValueError as exc:
        return _error(str(exc))
    out = Path(args.out)
    if out.exists():
        if not args.force:
            return _error(f"{out} exists (use --force to replace it)")
        shutil.rmtree(out)
    counts = write_scene_bag(out, spec, storage=args.storage)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {sum(counts.values())} messages, {len(counts)} topics, {size / 1e6:.2f} MB "
          f"({len(namespaces)} robots x {spec.ticks} observations at {spec.rate_hz:g} Hz, "
          f"{width}x{height} {spec.encoding}"
          + "".join(f"; actions on {a.full_topic}" for a in spec.actions) + ")"
          + (f"; faults {', '.join(f'{f.kind}@{f.tick}' + (':' + f.namespace if f.namespace else '') for f in spec.faults)}"
             if spec.faults else ""))
    return 0


def cmd_info(args) -> int:
    info = bag_info(args.bag)
    print(f"bag:      {info.path} ({info.storage})\nduration: {info.duration_s:.3f} s\nmessages: {info.count}")
    for t in info.topics:
        try:
            rclpy_class(t.msgtype)
            note = ""
        except UnknownTypeError:
            note = "  (type not installed: replay skips it)"
        print(f"  {t.count:7d}  {t.topic}  [{t.msgtype}]{note}")
    return 0


# ----------------------------------------------------------------------------- main

EXIT_EPILOG = "Exit status" + __doc__.split("Exit status", 1)[1]


def build_parser() -> ArgumentParser:
    """(replay's --rate, --start-offset and --clock are range-checked by ReplayOptions.validate.)"""
    parser = ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{replay,record,check,generate,info}")

    p = sub.add_parser("replay", epilog=EXIT_EPILOG, help="publish a bag's topics with their original timing")
    p.add_argument("bag")
    p.add_argument("--rate", type=float, default=1.0, help="time scale (2 = twice as fast)")
    p.add_argument("--loop", action="store_true", help="start again at the end (Ctrl-C to stop)")
    p.add_argument("--max-loops", type=positive_int, help="with --loop: stop after this many passes")
    p.add_argument("--start-offset", type=float, default=0.0, metavar="S", help="skip the bag's first S seconds")
    p.add_argument("--remap", action="append", metavar="FROM:=TO", help="topic or namespace remap (repeatable)")
    p.add_argument("--clock", type=float, nargs="?", const=100.0, metavar="HZ",
                   help="publish /clock with bag time (default 100 Hz) for use_sim_time")
    p.add_argument("--topics", nargs="+", metavar="TOPIC", help="replay only these bag topics")
    p.add_argument("--restamp", action="store_true",
                   help="rewrite header stamps to the wall time of publication (same shift for all topics)")
    p.add_argument("--wait-for", action="append", metavar="TOPIC",
                   help="wait until this (output) topic has a subscriber before starting (repeatable)")
    p.add_argument("--wait-timeout", type=nonneg_float, default=10.0, metavar="S")
    p.add_argument("--delay", type=nonneg_float, default=0.5, metavar="S",
                   help="pause after creating publishers, for discovery (default 0.5 s)")
    p.add_argument("--reliable", action="store_true",
                   help="publish sensor topics reliable too (lossless, for a subscriber that asks for reliable)")
    p.add_argument("--skip-unknown", action="store_true",
                   help="exit 0 even if topics with unknown message types were skipped")
    p.add_argument("--json", help="write counts and timing error here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("record", epilog=EXIT_EPILOG, help="record topics to a rosbag2 file")
    p.add_argument("out", help="new bag directory")
    p.add_argument("--topics", nargs="+", metavar="TOPIC[:TYPE]",
                   help="topics to record (default: the server's inputs and outputs from --config)")
    p.add_argument("--all", action="store_true", help="record every topic that appears")
    p.add_argument("--outputs-only", action="store_true", help="default topics: only the server's outputs")
    p.add_argument("--config", type=yaml_file, help="server config for the default topics (default config/serve.yaml)")
    p.add_argument("--server-node", default="/physis_server", metavar="NODE",
                   help="default topics: also those of streams that join this running server later (what it "
                        "publishes, and with inputs what it subscribes to); empty: the config's streams only")
    p.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    p.add_argument("--duration", type=positive_float, metavar="S", help="stop after S seconds (default: Ctrl-C)")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("check", epilog=EXIT_EPILOG, help="replay a bag through a deterministic server and check its outputs")
    p.add_argument("bag")
    p.add_argument("--config", type=yaml_file, help="server config (default config/serve.yaml)")
    p.add_argument("--out", help="keep the recorded outputs, check.json (and the report) here")
    p.add_argument("--report", action="store_true", help="also write the latency report into --out")
    p.add_argument("--timeout", type=positive_float, default=120.0, metavar="S", help="overall limit")
    p.add_argument("--rate", type=positive_float, default=1.0, help="replay time scale")
    p.add_argument("--no-reference", action="store_true", help="skip the bit-for-bit reference comparison")
    p.add_argument("--sim-time", action="store_true",
                   help="drive the server with the bag's /clock (use_sim_time) instead of restamping to now")
    p.add_argument("--server-cmd", help="server command line instead of 'physis-serve --config C --deterministic'")
    p.add_argument("--verbose", action="store_true", help="print the server's log")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("generate", epilog=EXIT_EPILOG, help="write the synthetic scene bag (the bundled tests/data bag)")
    p.add_argument("out")
    p.add_argument("--duration", type=positive_float, default=4.0, metavar="S")
    p.add_argument("--rate", type=positive_float, default=10.0, metavar="HZ")
    p.add_argument("--size", default="64x48", metavar="WxH", help="camera resolution")
    p.add_argument("--encoding", default="rgb8", choices=("rgb8", "bgr8", "mono8"))
    p.add_argument("--namespaces", nargs="+", help="robot namespaces (default: the server config's streams)")
    p.add_argument("--config", type=yaml_file,
                   help="server config for namespaces, joint names and, for a world model's (ACWM) stream, its "
                        "actions topic and type (default config/serve.yaml)")
    p.add_argument("--fault", type=_fault, action="append", metavar="KIND@TICK[:NS]",
                   help="replace a message with one the server must reject (repeatable): nonfinite, "
                        "missing_joints (joint state), size, encoding (image), actions_nonfinite, "
                        "actions_malformed, actions_missing_joints, actions_short (a world model's actions); "
                        "NS: one robot (default all)")
    p.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    p.add_argument("--tracking", action="store_true",
                   help="the arms follow the scripted expert in closed loop (default: they move on their own)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", epilog=EXIT_EPILOG, help="topics, types and counts of a bag")
    p.add_argument("bag")
    p.set_defaults(func=cmd_info)
    return parser


@cli_main(PROG)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
