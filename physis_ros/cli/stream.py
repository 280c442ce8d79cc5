"""``physis-stream``: robots join and leave a running physis_server, for hosts without ``ros2`` tooling.

    physis-stream add --name NAME --namespace NS --joints j1,j2,... [--model PRESET] [--slo-ms X]
                      [--control-rate-hz R] [--json OUT] [--duration S] [--*-topic T]
    physis-stream list [--wait NAME,...] [--json OUT]
    physis-stream remove NAME

``add`` sends a ServeStream goal to ``<server>/serve_stream`` and prints one JSON line once the
server has decided, ``{"accepted": bool, "reason": str, "workers": [...]}`` (also written to
``--json``). An admitted stream stays served while the command runs: it prints the server's
feedback about once per second, and cancels the goal (freeing the capacity) on Ctrl-C or after
``--duration`` seconds (counted from the admission); a server that goes away ends it (exit 1).
``list`` and ``remove`` call ``<server>/list_streams`` and ``<server>/remove_stream``; ``list --wait
robot0,robot1`` first waits (up to ``--timeout``) until the server serves those streams, e.g. in a script
that starts the server. ``--server``
is the node's name (default /physis_server); ROS arguments go after ``--ros-args``.

Exit status: 0 success (admitted, then cancelled; listed; removed); 1 not admitted, the stream
ended by the server (removed, failed, shutdown) or the server went away, or nothing to remove; 2
usage error or no server answering within ``--timeout`` (or, with ``list --wait``, the streams not
served by then); 70 internal error (a bug; PHYSIS_DEBUG=1
shows the traceback); 130 interrupted before the server answered. Errors are one line on stderr: 'physis-stream: error: <what and the fix>'.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from physis_ros.console import (ArgumentParser, CliError, nonneg_float, nonneg_int, positive_float, run_main,
                                   split_ros_args, write_json)

PROG = "physis-stream"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--server", default="/physis_server", help="the server node's full name")
    p.add_argument("--timeout", type=positive_float, default=30.0, help="wait this long for the server to answer")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", description=__doc__, help="join a robot (stays attached; Ctrl-C or --duration cancels)")
    add.add_argument("--name", required=True, help="stream name (letters, digits, _)")
    add.add_argument("--namespace", default="", help="topics under /<namespace>/ (default: the name)")
    add.add_argument("--joints", required=True, help="comma-separated joint names, in the model's column order")
    add.add_argument("--model", default="", help="preset, model YAML or checkpoint (default: the server's)")
    add.add_argument("--slo-ms", type=nonneg_float, default=0.0, help="output interval SLO (0: the control timeline)")
    add.add_argument("--control-rate-hz", type=nonneg_float, default=0.0, help="action steps per second (0: default)")
    add.add_argument("--execution-horizon", type=nonneg_int, default=0,
                     help="control steps each chunk is executed for (0: half the model's horizon)")
    add.add_argument("--handoff", choices=("", "none", "hard", "soft"), default="",
                     help="how a chunk continues the previous one (default: soft)")
    add.add_argument("--actions-type", choices=("", "action_chunk", "joint_trajectory"), default="",
                     help="world models: the message type of --actions-topic (default action_chunk)")
    add.add_argument("--actions-topic", default="", help="world models: the actions to imagine")
    add.add_argument("--image-topic", default="", help="camera topic (relative to the namespace, or absolute)")
    add.add_argument("--joint-states-topic", default="")
    add.add_argument("--action-chunk-topic", default="", help="ActionChunk output topic")
    add.add_argument("--joint-trajectory-topic", default="",
                     help="JointTrajectory output topic, e.g. /arm_controller/joint_trajectory to feed a controller")
    add.add_argument("--duration", type=nonneg_float, default=0.0, help="cancel after this many seconds (0: never)")
    add.add_argument("--lease-s", type=nonneg_float, default=15.0,
                     help="the server removes the stream when this command has not renewed its lease for this long "
                          "(it died: kill -9, a lost host); renewed every second; 0: no lease (default 15)")
    add.add_argument("--json", help="write the admission decision here")
    lst = sub.add_parser("list", description=__doc__, help="the streams served")
    lst.add_argument("--json", help="write the list here")
    lst.add_argument("--wait", default="", metavar="NAME,...",
                     help="first wait (up to --timeout) until the server serves these streams")
    rm = sub.add_parser("remove", description=__doc__, help="remove a stream (any: config or joined)")
    rm.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(split_ros_args(PROG, argv))
    import rclpy
    from rclpy.node import Node

    context = rclpy.Context()
    rclpy.init(args=[PROG, *argv], context=context)
    node = Node(f"physis_stream_{int(time.time() * 1000) % 10**9}", context=context)
    try:
        if args.command == "add":
            return _add(node, args)
        if args.command == "list":
            return _list(node, args)
        return _remove(node, args)
    finally:
        # An executor left to the garbage collector after the context is shut down printed a traceback
        # ("Exception ignored in Executor.__del__ ... InvalidHandle") at exit.
        if node.executor is not None:
            node.executor.shutdown(timeout_sec=0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def _spin_until(node, future, timeout: float) -> bool:
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    deadline = time.monotonic() + timeout
    while not future.done() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    executor.shutdown(timeout_sec=0)   # (its guard conditions go now, not when collected after the context)
    return future.done()


def _service(node, kind, name: str, request, timeout: float):
    client = node.create_client(kind, name)
    if not client.wait_for_service(timeout_sec=timeout):
        raise CliError(f"no server answers on {name} within {timeout:g} s (is physis-serve running? --server?)")
    future = client.call_async(request)
    if not _spin_until(node, future, timeout):
        raise CliError(f"{name} did not answer within {timeout:g} s")
    return future.result()


def _list(node, args) -> int:
    from physis_ros.srv import ListStreams

    wanted = {n.strip() for n in args.wait.split(",") if n.strip()}
    deadline = time.monotonic() + args.timeout
    while True:
        r = _service(node, ListStreams, f"{args.server}/list_streams", ListStreams.Request(),
                     max(0.1, deadline - time.monotonic()))
        missing = sorted(wanted - set(r.streams))
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise CliError(f"--wait: {', '.join(missing)} not served within --timeout {args.timeout:g} s (not yet "
                           f"admitted, or refused: see the server's log)")
        time.sleep(0.2)
    rows = [{"stream": s, "model": m, "namespace": n, "origin": o, "slo_interval_ms": slo, "workers": w.split(",")}
            for s, m, n, o, slo, w in zip(r.streams, r.models, r.namespaces, r.origins, r.slo_interval_ms, r.workers)]
    for row in rows:   # (a stream of another front end, an openpi client, has no topics: no namespace)
        ns = f"/{row['namespace']}" if row["namespace"] else "-"
        print(f"{row['stream']:<16} {row['model']:<12} {ns:<17} {row['origin']:<7} "
              f"SLO {row['slo_interval_ms']:.1f} ms  on {','.join(row['workers'])}")
    if not rows:
        print("(no stream is served)")
    if args.json:
        write_json(args.json, {"streams": rows})
    return 0


def _remove(node, args) -> int:
    from physis_ros.srv import RemoveStream

    r = _service(node, RemoveStream, f"{args.server}/remove_stream", RemoveStream.Request(stream=args.name),
                 args.timeout)
    if not r.ok:
        print(f"{PROG}: error: {r.message}", file=sys.stderr)
        return 1
    print(r.message)
    return 0


def _add(node, args) -> int:
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor

    from physis_ros.action import ServeStream

    joints = [j.strip() for j in args.joints.split(",") if j.strip()]
    if not joints:
        raise CliError("--joints: give the joint names, comma-separated")
    client = ActionClient(node, ServeStream, f"{args.server}/serve_stream")
    if not client.wait_for_server(timeout_sec=args.timeout):
        raise CliError(f"no server answers on {args.server}/serve_stream within {args.timeout:g} s (is physis-serve "
                       f"running? --server?)")
    if args.lease_s and not 1.0 <= args.lease_s <= 3600.0:
        raise CliError(f"--lease-s: give 0 (no lease) or 1-3600 s, got {args.lease_s:g}")
    goal = ServeStream.Goal(stream=args.name, topic_namespace=args.namespace, model=args.model, joint_names=joints,
                            lease_s=args.lease_s,
                            slo_interval_ms=args.slo_ms, control_rate_hz=args.control_rate_hz,
                            execution_horizon=args.execution_horizon, handoff=args.handoff,
                            actions_type=args.actions_type, actions_topic=args.actions_topic, image_topic=args.image_topic,
                            joint_states_topic=args.joint_states_topic, action_chunk_topic=args.action_chunk_topic,
                            joint_trajectory_topic=args.joint_trajectory_topic)
    state = {"decided": None, "decided_at": None, "last_print": 0.0}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def decided(accepted: bool, reason: str, workers) -> None:
        if state["decided"] is None:
            state["decided"] = {"accepted": accepted, "reason": reason, "workers": list(workers)}
            if args.json:   # first: once the line is out, the file is there
                write_json(args.json, state["decided"])
            print(json.dumps(state["decided"]), flush=True)

    def on_feedback(msg) -> None:
        fb = msg.feedback
        decided(True, "", fb.workers)
        now = time.monotonic()
        if now - state["last_print"] >= 1.0:
            state["last_print"] = now
            print(f"{args.name}: {fb.state}, {fb.chunks} chunks, interval p50/p99 {fb.interval_ms_p50:.1f}/"
                  f"{fb.interval_ms_p99:.1f} ms, latency p50/p99 {fb.latency_ms_p50:.1f}/{fb.latency_ms_p99:.1f} ms, "
                  f"misses {fb.deadline_misses}, lost {fb.chunks_lost}", flush=True)

    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    gone = ServerWatch(client, min(args.timeout, SERVER_GONE_S))
    sent = client.send_goal_async(goal, feedback_callback=on_feedback)
    deadline = time.monotonic() + args.timeout
    while not sent.done():
        if stop.is_set():
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        executor.spin_once(timeout_sec=0.05)
        if gone():
            raise CliError(f"{args.server}/serve_stream went away before it answered (the server stopped?)")
        if time.monotonic() > deadline:
            raise CliError(f"{args.server}/serve_stream did not take the goal within {args.timeout:g} s (the "
                           f"server is overloaded or its goal queue dropped it: try again, or a longer --timeout)")
    handle = sent.result()
    result_future = handle.get_result_async()
    cancelled = False
    renew = Renewal(node, args.server, bytes(handle.goal_id.uuid).hex(), args.lease_s)
    while not result_future.done():
        executor.spin_once(timeout_sec=0.05)
        renew()
        if state["decided"] is not None and state["decided_at"] is None:
            state["decided_at"] = time.monotonic()
        if state["decided"] is None and time.monotonic() > deadline + args.timeout and not cancelled:
            withdrawn = handle.cancel_goal_async()   # the server may still admit it: withdraw it
            until = time.monotonic() + 2.0
            while not withdrawn.done() and time.monotonic() < until:
                executor.spin_once(timeout_sec=0.05)
            raise CliError(f"{args.server}/serve_stream took the goal but did not decide within {args.timeout:g} s "
                           f"(admission resolving a model? try a longer --timeout)")
        overtime = args.duration and state["decided_at"] is not None and \
            time.monotonic() - state["decided_at"] >= args.duration
        if (stop.is_set() or overtime) and not cancelled:
            cancelled = True
            handle.cancel_goal_async()
        if gone():
            # Without this the command waited for ever: a stopped server sends no result.
            print(f"{PROG}: error: {args.server}/serve_stream went away while stream '{args.name}' was served (the "
                  f"server stopped, or is unreachable)", file=sys.stderr)
            return 1
    result = result_future.result().result
    if not result.accepted:
        decided(False, result.reason, result.workers)
        return 1
    decided(True, "", result.workers)
    print(json.dumps({"outcome": result.outcome, "reason": result.reason, "chunks_emitted": result.chunks_emitted,
                      "chunks_lost": result.chunks_lost}), flush=True)
    return 0 if result.outcome == "cancelled" else 1


class Renewal:
    """Renews a goal's lease on ``<server>/lease`` about every second (a third of the lease, if shorter)."""

    def __init__(self, node, server: str, goal_id: str, lease_s: float):
        from std_msgs.msg import String

        self.msg = String(data=goal_id)
        self.period = min(1.0, lease_s / 3.0)
        self.pub = node.create_publisher(String, f"{server}/lease", 100) if lease_s else None
        self.last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self.pub is not None and now - self.last >= self.period:
            self.last = now
            self.pub.publish(self.msg)


SERVER_GONE_S = 3.0   # the action server undiscovered this long: it stopped (a clean exit is seen at once)


class ServerWatch:
    """``watch()`` is True once the action server has been out of the ROS graph for ``grace_s``."""

    def __init__(self, client, grace_s: float):
        self.client, self.grace_s = client, grace_s
        self.missing_since: float | None = None
        self.checked = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.checked < 0.25:
            return False
        self.checked = now
        if self.client.server_is_ready():
            self.missing_since = None
            return False
        if self.missing_since is None:
            self.missing_since = now
        return now - self.missing_since >= self.grace_s
