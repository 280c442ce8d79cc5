"""``physis-bench goals``: a burst of ServeStream goals sent at once to a running server; every goal must
be answered.

One physis-serve process (``--workers`` workers, tiny-wam, no robots publishing: admitted streams are
served but never compute) gets ``--burst`` goals, each for a stream of its own name and namespace, sent
from one action client as fast as rclpy sends them. Each goal is answered twice: the goal response (the
server takes every goal as a goal) and the result of admission (admitted: the first feedback; refused:
the result with its reason, e.g. ``time-capacity``, ``stream-limit`` or ``busy`` when the bounded
admission queue is full). The admitted goals are then cancelled, and each must end with a result.

Then the cancel storm: ``--cancels`` cancel requests for every goal at once, admitted or refused (a
refused goal's cancel must be harmless, a repeated one idempotent). Every cancel request must be answered,
every admitted goal must end with one result (``cancelled``), and ``list_streams`` must list none of
the burst's streams afterwards.

The JSON summary (``--json``): goals sent, goal responses and decisions received, admitted, refused by
reason, cancel requests and responses, the admitted goals' results, streams still listed, the time from
the first send to the last decision, and the goals that got no answer within ``--reply-timeout`` (exit
status 1 when anything went unanswered or a stream stayed served).

``--relaxed`` turns off admission's host-CPU budget and jitter bound and books the shipped CPU profiles,
so that many streams are admitted (they never compute: no robot publishes).

The client's service QoS (goal, result and cancel) keeps ``--burst`` requests: with rclpy's default depth
of 10 a client that sends a burst loses its own requests before they leave the process; the server's
side is its own (README, Reliability).
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from physis_ros.console import write_json

JOINTS = [f"joint{i}" for i in range(1, 8)]


def add_arguments(p) -> None:
    p.add_argument("--burst", type=int, default=500, help="goals sent at once (default 500)")
    p.add_argument("--workers", type=int, default=1, help="the server's workers (default 1)")
    p.add_argument("--max-streams", type=int, default=64, help="the server's engine.max_streams (default 64)")
    p.add_argument("--max-pending-goals", type=int, default=None,
                   help="the server's admission.max_pending_goals (default: the server's own)")
    p.add_argument("--cancels", type=int, default=1, help="cancel requests sent at once per goal (default 1)")
    p.add_argument("--relaxed", action="store_true",
                   help="admission without host-CPU budget or jitter bound, on the shipped profiles (more admitted)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="wait this long for the server (s)")
    p.add_argument("--reply-timeout", type=float, default=120.0,
                   help="wait this long after the last send for every goal's answer (s)")
    p.add_argument("--json", default="bench/out/goals.json", help="summary JSON (default bench/out/goals.json)")
    p.add_argument("--logs", default="", help="directory for the server's log (default: a temporary one)")


def _say(text: str) -> None:
    print(f"physis-bench goals: {text}", file=sys.stderr, flush=True)


def _config(args) -> dict:
    from physis_ros.config import repo_config_dir

    admission = {} if args.max_pending_goals is None else {"max_pending_goals": args.max_pending_goals}
    if args.relaxed:
        admission.update(policy="base", checks=["load-calibration"], profiles=str(repo_config_dir() / "profiles"))
    return {"model": "tiny-wam", "diagnostics_period_s": 0.5, "admission": admission,
            "engine": {"workers": args.workers, "max_streams": args.max_streams}}


class Burst:
    """The client side: one node, one executor, one action client with room for the burst."""

    def __init__(self, context, requests: int):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        from physis_ros.action import ServeStream

        self.ServeStream = ServeStream
        self.node = rclpy.create_node("physis_bench_goals", context=context)
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        from physis_ros.srv import ListStreams

        room = QoSProfile(depth=max(10, requests), reliability=ReliabilityPolicy.RELIABLE)
        self.client = ActionClient(self.node, ServeStream, "/physis_server/serve_stream",
                                   goal_service_qos_profile=room, result_service_qos_profile=room,
                                   cancel_service_qos_profile=room)
        self.lister = self.node.create_client(ListStreams, "/physis_server/list_streams")
        self.ListStreams = ListStreams
        self.engine_state: str | None = None
        self.statuses: dict[str, dict[str, str]] = {}   # the latest /diagnostics values by status
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)

    def _on_diag(self, msg) -> None:
        for st in msg.status:
            values = {kv.key: kv.value for kv in st.values}
            self.statuses[st.name.rsplit(": ", 1)[-1]] = values     # "engine", "worker w0", a stream's name
            if st.name.endswith(": engine"):
                self.engine_state = values.get("state")

    def spin_until(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            self.executor.spin_once(timeout_sec=0.02)
        return True

    def close(self) -> None:
        self.client.destroy()
        self.executor.shutdown()
        self.node.destroy_node()


class Goal:
    def __init__(self, burst: Burst, name: str, t0: float):
        self.name, self.t0 = name, t0
        self.feedback_at: float | None = None
        self.result_at: float | None = None
        self.handle = None
        self.result_future = None
        goal = burst.ServeStream.Goal(stream=name, topic_namespace=name, joint_names=JOINTS)
        self.sent = burst.client.send_goal_async(goal, feedback_callback=self._feedback)
        self.sent.add_done_callback(self._taken)

    def _feedback(self, _msg) -> None:
        if self.feedback_at is None:
            self.feedback_at = time.monotonic()

    def _taken(self, future) -> None:
        self.handle = future.result()
        if self.handle is not None and self.handle.accepted:
            self.result_future = self.handle.get_result_async()
            self.result_future.add_done_callback(self._ended)

    def _ended(self, _future) -> None:
        self.result_at = time.monotonic()

    @property
    def decided(self) -> bool:
        return self.feedback_at is not None or self.result_at is not None

    @property
    def result(self):
        return self.result_future.result().result if self.result_at is not None else None


@contextmanager
def serving(config: dict, requests: int, logs: str, start_timeout: float, say: Callable[[str], None]):
    """A physis-serve on ``config`` (a serve-config mapping; its log in ``logs``, default a temporary
    directory) and a :class:`Burst` client with room for ``requests`` requests, once its engine serves:
    yields (burst, server), or None when it did not serve within ``start_timeout`` (said why); both are
    stopped afterwards."""
    import rclpy
    import yaml

    from physis_ros.launcher import Child, serve_command

    with tempfile.TemporaryDirectory(prefix="physis_bench_") as tmp:
        log_dir = Path(logs or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        context = rclpy.Context()
        rclpy.init(context=context)
        burst = Burst(context, requests)
        server = Child("physis-serve", serve_command(path), log=log_dir / "serve.log")
        try:
            say(f"starting physis-serve ({config['engine']['workers']} worker(s)); log {log_dir / 'serve.log'}")
            if burst.spin_until(lambda: burst.client.server_is_ready() and burst.engine_state == "serving",
                                start_timeout):
                yield burst, server
            else:
                say(f"the server did not serve within {start_timeout:g} s:\n{server.tail()}")
                yield None
        finally:
            server.stop(30.0)
            burst.close()
            rclpy.try_shutdown(context=context)


def run(args) -> int:
    with serving(_config(args), args.burst * (1 + args.cancels), args.logs, args.start_timeout, _say) as up:
        return 1 if up is None else _run(args, *up)


def _run(args, burst: Burst, server) -> int:
    _say(f"sending {args.burst} goals at once")
    t0 = time.monotonic()
    goals = [Goal(burst, f"g{i}", t0) for i in range(args.burst)]
    sent_s = time.monotonic() - t0
    burst.spin_until(lambda: all(g.decided for g in goals), sent_s + args.reply_timeout)
    decided = [g for g in goals if g.decided]
    last_s = max((min(x for x in (g.feedback_at, g.result_at) if x is not None) - t0 for g in decided),
                 default=None)
    admitted = [g for g in goals if g.feedback_at is not None]
    refused = collections.Counter(g.result.reason.partition(":")[0] for g in goals
                                  if g.feedback_at is None and g.result is not None)
    _say(f"{len(decided)} of {args.burst} goals decided ({len(admitted)} admitted, refused {dict(refused)}); "
         f"{args.cancels} cancel(s) of every goal at once")
    cancels = [g.handle.cancel_goal_async() for _ in range(args.cancels) for g in goals if g.handle is not None]
    burst.spin_until(lambda: all(c.done() for c in cancels) and all(g.result_at is not None for g in admitted),
                     args.reply_timeout)
    cancelled = collections.Counter(g.result.outcome if g.result is not None else "no result" for g in admitted)
    listing = burst.lister.call_async(burst.ListStreams.Request())
    burst.spin_until(listing.done, 15.0)
    ours = {g.name for g in goals}
    listed = sorted(set(listing.result().streams) & ours) if listing.done() else None
    summary = {
        "burst": args.burst, "workers": args.workers, "max_streams": args.max_streams,
        "max_pending_goals": args.max_pending_goals,
        "goal_responses": sum(g.sent.done() for g in goals), "decisions": len(decided),
        "admitted": len(admitted), "refused": dict(sorted(refused.items())),
        "unanswered": [g.name for g in goals if not g.decided][:50],
        "unanswered_total": args.burst - len(decided),
        "cancels_sent": len(cancels), "cancel_responses": sum(c.done() for c in cancels),
        "cancelled_results": dict(cancelled), "still_listed": listed, "send_s": round(sent_s, 3),
        "last_decision_s": None if last_s is None else round(last_s, 3),
        "server_alive": server.poll() is None,
    }
    write_json(args.json, summary)
    ok = (summary["unanswered_total"] == 0 and cancelled.get("no result", 0) == 0 and summary["server_alive"]
          and summary["cancel_responses"] == len(cancels) and listed == [])
    _say(f"{summary['decisions']}/{args.burst} answered, the last after {summary['last_decision_s']} s; "
         f"{'OK' if ok else 'FAILED'}; JSON {args.json}")
    return 0 if ok else 1
