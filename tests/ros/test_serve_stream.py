"""Robots joining and leaving a running server through the ServeStream action, end to end: a real
physis-serve process (2 workers) started with no streams, real rclpy goals, services and topics from this
test process, which also plays the robots (camera + joint states, recorded so that outputs can be checked
against the sequential reference).

One server serves the whole module, in order: refused goals -> admission until a named rejection and
capacity freed by a cancel -> a running robot's chunks stay contiguous while another joins and another
leaves -> duplicates refused, nothing changes -> a world model (tiny-acwm) co-served with the policy,
imagining exactly what the policy commands (bit-for-bit against the reference) -> clean stop. The server
runs ``--deterministic`` (chunk c consumes the c-th observation), which the world-model check needs.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from physis_ros.launcher import Child, serve_command

from rosprobe import (JOINTS, NODE, NODE_ARGS, SHIPPED_PROFILES, TAG, Probe, child_env, diag_values,
                      processes_with_marker)

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

RELIABLE = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
LATCHED = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
TELEMETRY = f"/{TAG}_ss_telemetry"
START_TIMEOUT = 90.0
RATE_HZ = 6.0                # what the robots publish; every stream with inputs runs at this rate
SLO_MS = 80.0                # of the streams with inputs: paced every 60 ms (3 control steps within 76 ms)
CAPACITY_SLO_MS = 60.0       # of the streams that fill the workers (no inputs: admitted, never computing)
MAX_STREAMS = 32             # engine.max_streams: well above what fits in time, even on a fast machine
NS = {k: f"{TAG}_{k}" for k in ("a", "b", "c", "m", "dup")}


def ns_of(t) -> int:
    return t.sec * 1_000_000_000 + t.nanosec


class Robots:
    """Camera (40x30 rgb8) + joint states for some namespaces at RATE_HZ, published from a thread of this
    process with one stamp per tick; what went to recorded namespaces is kept by stamp."""

    def __init__(self, node):
        from sensor_msgs.msg import Image, JointState

        self.node, self.Image, self.JointState = node, Image, JointState
        self.lock = threading.Lock()
        self.pubs: dict[str, tuple] = {}
        self.sent: dict[str, dict[int, tuple]] = defaultdict(dict)   # ns -> stamp ns -> (Image, JointState)
        self.recorded: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def add(self, ns: str, record: bool = False) -> None:
        from physis_ros.model.interface import derived_seed

        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        pubs = (self.node.create_publisher(self.Image, f"/{ns}/camera/image_raw", qos),
                self.node.create_publisher(self.JointState, f"/{ns}/joint_states", qos),
                (derived_seed("scene", ns) % 1000) / 1000.0 * 2 * math.pi)
        with self.lock:
            self.pubs[ns] = pubs
            if record:
                self.recorded.add(ns)

    def _run(self) -> None:
        from physis_ros.observations import SyntheticScene
        from physis_ros.cli.synthetic import image_bytes

        period, next_tick = 1.0 / RATE_HZ, time.monotonic()
        while not self.stop.wait(max(0.0, next_tick - time.monotonic())):
            next_tick = max(next_tick + period, time.monotonic())
            stamp = self.node.get_clock().now()
            t = stamp.nanoseconds * 1e-9
            with self.lock:
                pubs = dict(self.pubs)
                recorded = set(self.recorded)
            for ns, (pub_img, pub_js, phase) in pubs.items():
                img = self.Image()
                img.header.stamp = stamp.to_msg()
                img.height, img.width, img.encoding, img.step = 30, 40, "rgb8", 120
                img.data = image_bytes(40, 30, t, phase)
                js = self.JointState()
                js.header.stamp = img.header.stamp
                js.name, js.position = list(JOINTS), SyntheticScene.joints(len(JOINTS), t, phase).astype(float).tolist()
                pub_img.publish(img)
                pub_js.publish(js)
                if ns in recorded:
                    self.sent[ns][stamp.nanoseconds] = (img, js)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)


class Goal:
    """One ServeStream goal from this process: sent, then decided (first feedback: admitted; result:
    rejected)."""

    def __init__(self, live, stream: str, **fields):
        from physis_ros.action import ServeStream

        self.live, self.stream = live, stream
        self.fields = {"joint_names": JOINTS, **fields}
        self.msg = ServeStream.Goal(stream=stream, **self.fields)
        self.feedback: list = []
        sent = live.client.send_goal_async(self.msg, feedback_callback=lambda m: self.feedback.append(m.feedback))
        live.probe.wait(sent.done, 15.0, f"the server to take goal {stream}")
        self.handle = sent.result()
        assert self.handle.accepted, "every goal is taken as a goal; admission answers in the result"
        self.result_future = self.handle.get_result_async()
        live.probe.wait(lambda: self.feedback or self.result_future.done(), 60.0, f"admission of {stream}")

    @property
    def admitted(self) -> bool:
        return bool(self.feedback)

    def result(self, timeout: float = 15.0):
        self.live.probe.wait(self.result_future.done, timeout, f"the result of goal {self.stream}")
        return self.result_future.result().result

    def cancel(self):
        done = self.handle.cancel_goal_async()
        self.live.probe.wait(done.done, 10.0, f"the server to take the cancel of {self.stream}")
        return self.result()


class Live:
    def __init__(self, tmp):
        from diagnostic_msgs.msg import DiagnosticArray

        from physis_ros.action import ServeStream
        from physis_ros.msg import ActionChunk, ChunkTelemetry, PredictedFrames
        from physis_ros.srv import ListStreams, RemoveStream

        self.marker = uuid.uuid4().hex
        self.config = tmp / "serve.yaml"
        # No streams: every robot joins through the action. (The liveness bound is not what this module
        # checks: a 3 s floor keeps a busy shared CI host from resetting a stream in the middle of a check.)
        self.config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
            "model": "tiny-wam", "deterministic": True, "pair_timeout_s": 5.0, "telemetry_topic": TELEMETRY,
            "diagnostics_period_s": 0.5,
            "engine": {"workers": 2, "max_streams": MAX_STREAMS, "chunk_timeout_floor_s": 3.0},
            # The workers' time is what this module fills up: the base policy (no host budget) and no
            # latency-jitter bound (both tested in test_admission_unit, test_policies and tests/scheduling), so
            # the capacity checks do not depend on how many cores the CI host has, and several robots share a
            # worker at these short SLOs. Admission
            # books the shipped CPU profiles, not a measurement taken now: deterministic serving decides from
            # profiles alone, so what fits is the same on a quiet and on a busy machine.
            "admission": {"profiles": SHIPPED_PROFILES, "policy": "base", "checks": []}}}}))
        self.probe = Probe("physis_serve_stream_probe")
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        self.probe.subscribe("telemetry", ChunkTelemetry, TELEMETRY, LATCHED)
        for k in ("a", "b", "c"):
            self.probe.subscribe(f"chunk/{k}", ActionChunk, f"/{NS[k]}/action_chunk", RELIABLE)
        self.probe.subscribe("frames/m", PredictedFrames, f"/{NS['m']}/predicted_frames", RELIABLE)
        self.client = self.probe.action_client(ServeStream, f"/{NODE}/serve_stream")
        self.list_client = self.probe.node.create_client(ListStreams, f"/{NODE}/list_streams")
        self.remove_client = self.probe.node.create_client(RemoveStream, f"/{NODE}/remove_stream")
        self.robots = Robots(self.probe.node)
        from rclpy.parameter_client import AsyncParameterClient
        self.params = AsyncParameterClient(self.probe.node, NODE)
        self.goals: dict[str, Goal] = {}
        # physis-bag record from before the server starts, its topics from the config (no streams): the robots
        # that join later must be in the bag too (issue 48 item 6)
        self.recording = tmp / "recorded"
        self.recorder = Child("recorder", [sys.executable, "-m", "physis_ros.cli.bag", "record", str(self.recording),
                                           "--config", str(self.config), "--server-node", f"/{NODE}"],
                              env=child_env(self.marker), log=tmp / "record.log")
        self.server = Child("server", serve_command(self.config, *NODE_ARGS), env=child_env(self.marker),
                            log=tmp / "serve.log")

    # ---- what the server says ----------------------------------------------------------------------------
    def engine_state(self) -> str | None:
        return self.probe.status("engine").get("state")

    def call(self, client, request):
        future = client.call_async(request)
        self.probe.wait(future.done, 15.0, f"a reply from {client.srv_name}")
        return future.result()

    def done(self, future, what: str):
        self.probe.wait(future.done, 15.0, what)
        return future.result()

    def parameter_names(self, stream: str) -> set[str]:
        return set(self.done(self.params.list_parameters([f"streams.{stream}"]), "list_parameters").result.names)

    def set_parameter(self, name: str, value):
        from rclpy.parameter import Parameter

        (r,) = self.done(self.params.set_parameters([Parameter(name, value=value)]), "set_parameters").results
        return r

    def listed(self) -> dict[str, dict]:
        from physis_ros.srv import ListStreams

        r = self.call(self.list_client, ListStreams.Request())
        return {s: {"model": m, "namespace": n, "origin": o, "slo_interval_ms": slo, "workers": w}
                for s, m, n, o, slo, w in zip(r.streams, r.models, r.namespaces, r.origins, r.slo_interval_ms,
                                              r.workers)}

    def chunks(self, key: str) -> list:
        return [m for m, _ in self.probe.get(f"chunk/{key}")]

    def telemetry(self, stream: str) -> list:
        return [m for m, _ in self.probe.get("telemetry") if m.stream == stream]

    def goal(self, stream: str, **fields) -> Goal:
        g = Goal(self, stream, **fields)
        if g.admitted:
            self.goals[stream] = g
        return g

    def stop(self) -> int:
        return self.server.stop(30.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("serve_stream"))
    try:
        try:
            live.probe.wait(lambda: live.engine_state() == "serving" or live.server.poll() is not None,
                            START_TIMEOUT, "the engine to serve")
            assert live.client.wait_for_server(timeout_sec=10.0)
        except AssertionError:
            raise AssertionError(f"server log:\n{live.server.tail(40)}") from None
        assert live.server.poll() is None, f"server exited:\n{live.server.tail(40)}"
        yield live
    finally:
        live.robots.close()
        live.recorder.stop(30.0)
        live.stop()
        live.probe.close()


def refused(live, stream: str, reason: str, **fields):
    g = Goal(live, stream, **fields)
    assert not g.admitted, f"goal {stream} was admitted; expected {reason}"
    r = g.result()
    assert (r.accepted, r.outcome) == (False, "rejected"), r
    assert r.reason.startswith(reason + ": "), r.reason
    assert (r.chunks_emitted, r.chunks_lost, list(r.workers)) == (0, 0, [])
    return r


def server_rss_mb(live) -> float:
    for line in open(f"/proc/{live.server.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def contiguous(indices: list[int]) -> bool:
    return indices == list(range(indices[0], indices[0] + len(indices))) if indices else True


# ---- refused goals -------------------------------------------------------------------------------------------
def diag_stamps(live) -> list[float]:
    return sorted(msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9 for msg, _ in live.probe.get("diagnostics"))


def test_diagnostics_keep_their_rate_through_start_up(live):
    """Issue 48 item 3: physis-serve published /diagnostics on every spin until it served (1,243 messages in one
    start-up). At most one message a period (0.5 s here), start-up included."""
    live.probe.wait(lambda: len(diag_stamps(live)) >= 3, 10.0, "three /diagnostics messages")
    stamps = diag_stamps(live)
    span = stamps[-1] - stamps[0]
    assert len(stamps) <= span / 0.5 + 2, f"{len(stamps)} /diagnostics messages in {span:.2f} s (period 0.5 s)"


def test_goals_that_cannot_be_served_are_refused_with_the_reason(live):
    assert live.listed() == {}
    refused(live, "ghost", "unknown-model", model="no-such-model")
    refused(live, "ghost", "unknown-model", model="/nonexistent/model.safetensors")
    refused(live, "ghost", "model-mismatch", joint_names=["j1", "j2", "j3"])          # tiny-wam acts on 7 joints
    refused(live, "ghost", "timeline", slo_interval_ms=500.0)                          # beyond its control timeline
    refused(live, "9ghost", "invalid-request")
    refused(live, "ghost", "invalid-request", joint_names=[])
    refused(live, "ghost", "invalid-request", slo_interval_ms=-1.0)
    refused(live, "ghost", "invalid-request", image_topic="not a topic")
    assert "lease_s" in refused(live, "ghost", "invalid-request", lease_s=-1.0).reason
    # One stream of the LTX 22B shape needs 69 GB, the 2 CPU workers hold 14: refused from its shape, at once,
    # before anything builds or profiles it (the 14B preset once took the server from 0.34 to 20.7 GB in-process)
    rss = server_rss_mb(live)
    start = time.monotonic()
    r = refused(live, "ghost", "memory", model="ltx-22b")
    assert "69.4 GB for one stream" in r.reason and time.monotonic() - start < 10.0, r.reason
    # A Wan preset reads its prompt embeddings from a file, which a goal never names: refused as such
    r = refused(live, "ghost", "model-mismatch", model="wan2.1-14b")
    assert "inputs: {prompt_embeds: FILE.safetensors}" in r.reason, r.reason
    assert server_rss_mb(live) < rss + 100.0
    assert live.listed() == {}
    assert live.server.poll() is None


# ---- admission: one by one until rejected; cancelling frees capacity -------------------------------------------
def test_admits_robots_one_by_one_until_one_is_rejected_and_a_cancel_frees_its_capacity(live):
    goals, rejected = [], None
    for i in range(MAX_STREAMS):
        g = live.goal(f"cap{i}", topic_namespace=f"{TAG}_cap{i}", slo_interval_ms=CAPACITY_SLO_MS)
        if not g.admitted:
            rejected = g
            break
        fb = g.feedback[0]
        assert fb.state == "serving" and list(fb.workers) and set(fb.workers) <= {"w0", "w1"}
        goals.append(g)
    assert rejected is not None, f"{MAX_STREAMS} streams admitted on 2 workers at a {CAPACITY_SLO_MS:g} ms SLO"
    r = rejected.result()
    assert (r.accepted, r.outcome) == (False, "rejected") and r.reason.startswith("capacity: ") and r.reason.endswith("[time-capacity]"), r.reason
    assert len(goals) >= 2, f"only {len(goals)} stream(s) of tiny-wam fit 2 workers at {CAPACITY_SLO_MS} ms: {r.reason}"
    listed = live.listed()
    assert sorted(listed) == sorted(g.stream for g in goals)
    for g in goals:
        row = listed[g.stream]
        assert (row["model"], row["namespace"], row["origin"]) == ("tiny-wam", f"{TAG}_{g.stream}", "action")
        assert row["slo_interval_ms"] == pytest.approx(CAPACITY_SLO_MS)
        assert row["workers"] == ",".join(g.feedback[0].workers)
    # Nothing changed, so the same request is refused again ...
    refused(live, rejected.stream, "capacity", **rejected.fields)
    # ... until a robot leaves: cancelling frees exactly its capacity, and the request fits where it was.
    last = goals.pop()
    r = last.cancel()
    assert (r.accepted, r.outcome, list(r.workers)) == (True, "cancelled", list(last.feedback[0].workers)), r
    assert last.stream not in live.listed()
    again = live.goal(rejected.stream, **rejected.fields)
    assert again.admitted, again.result().reason
    assert list(again.feedback[0].workers) == list(last.feedback[0].workers)
    for g in [*goals, again]:
        assert g.cancel().outcome == "cancelled"
    assert live.listed() == {}


# ---- a joined stream's parameters -------------------------------------------------------------------------
def test_a_joined_robot_has_the_parameters_of_a_configured_one_and_they_leave_with_it(live):
    """Was: a robot joined through ServeStream declared no parameter (nothing to tune, no range shown), and
    a removed robot's parameters stayed listed and settable (issue 45 item 2)."""
    ns = f"{TAG}_prm"
    assert live.parameter_names("prm") == set()
    g = live.goal("prm", topic_namespace=ns, slo_interval_ms=CAPACITY_SLO_MS)
    assert g.admitted, g.result().reason
    names = live.parameter_names("prm")
    for key in ("slo_interval_ms", "trajectory_start_offset_s", "max_age_s", "image.preprocess", "joint_names",
                "control_rate_hz", "namespace", "topics.joint_trajectory", "qos.action_chunk.depth"):
        assert f"streams.prm.{key}" in names, key
    (offset, rate) = live.done(live.params.describe_parameters(["streams.prm.trajectory_start_offset_s",
                                                                "streams.prm.control_rate_hz"]), "describe").descriptors
    r = offset.floating_point_range[0]
    assert not offset.read_only and (r.from_value, r.to_value) == (-10.0, 10.0) and offset.description
    assert "fixed while the stream is served" in rate.additional_constraints
    got = live.done(live.params.get_parameters(["streams.prm.namespace", "streams.prm.joint_names",
                                                "streams.prm.slo_interval_ms"]), "get_parameters").values
    assert (got[0].string_value, list(got[1].string_array_value)) == (ns, JOINTS)   # the goal's values
    assert got[2].double_value == CAPACITY_SLO_MS
    r = live.set_parameter("streams.prm.trajectory_start_offset_s", 1e308)   # what silenced a stream before
    assert not r.successful and "streams.prm.trajectory_start_offset_s" in r.reason, r.reason
    r = live.set_parameter("streams.prm.control_rate_hz", 25.0)
    assert not r.successful and "cannot change while the stream is served" in r.reason, r.reason
    r = live.set_parameter("streams.prm.trajectory_start_offset_s", 0.25)
    assert r.successful, r.reason
    got = live.done(live.params.get_parameters(["streams.prm.trajectory_start_offset_s"]), "get").values
    assert got[0].double_value == 0.25
    assert g.cancel().outcome == "cancelled"
    assert live.parameter_names("prm") == set()                # they left with it
    r = live.set_parameter("streams.prm.trajectory_start_offset_s", 0.5)
    assert not r.successful
    again = live.goal("prm", topic_namespace=ns)                 # the name serves again, with the new goal's values
    assert again.admitted, again.result().reason
    got = live.done(live.params.get_parameters(["streams.prm.trajectory_start_offset_s"]), "get").values
    assert got[0].double_value == 0.0
    assert again.cancel().outcome == "cancelled"
    assert live.server.poll() is None


def test_a_goal_whose_client_stops_renewing_its_lease_ends_client_gone(live):
    """Issue 46 item 3: a dead client cannot cancel. A goal with a lease that its client does not renew (this
    one never does) ends ``client-gone`` once the lease lapses, its stream removed and its capacity freed."""
    g = live.goal("lapsed", topic_namespace=f"{TAG}_lapsed", lease_s=1.0)
    assert g.admitted, g.result().reason
    r = g.result(timeout=20.0)
    assert (r.accepted, r.outcome) == (True, "client-gone") and "1 s" in r.reason, r
    assert "lapsed" not in live.listed()


# ---- joining and leaving while a robot runs -----------------------------------------------------------------
def test_a_running_robots_chunks_stay_contiguous_while_another_joins_and_another_leaves(live):
    for k in ("a", "b", "c"):
        live.robots.add(NS[k], record=(k == "a"))
    stream = dict(slo_interval_ms=SLO_MS, control_rate_hz=50.0)
    a = live.goal("a", topic_namespace=NS["a"], **stream)
    c = live.goal("c", topic_namespace=NS["c"], **stream)
    assert a.admitted and c.admitted
    live.probe.wait(lambda: len(live.chunks("a")) >= 5 and len(live.chunks("c")) >= 3, 30.0, "chunks of a and c")
    a_workers = list(a.feedback[-1].workers)

    joined_at = len(live.chunks("a"))
    b = live.goal("b", topic_namespace=NS["b"], **stream)                  # another robot joins ...
    assert b.admitted
    live.probe.wait(lambda: len(live.chunks("b")) >= 3, 30.0, "chunks of b")
    left_at = len(live.chunks("a"))
    r = c.cancel()                                                         # ... and another leaves
    assert (r.accepted, r.outcome) == (True, "cancelled") and r.chunks_emitted >= 3 and r.chunks_lost == 0, r
    live.probe.wait(lambda: len(live.chunks("a")) >= left_at + 5, 30.0, "chunks of a after c left")

    idx = [m.chunk_index for m in live.chunks("a")]
    assert joined_at < left_at < len(idx)
    assert contiguous(idx), f"a's chunk indices have a gap: {idx}"
    # Telemetry (kept for late subscribers) shows every chunk of a from its first.
    live.probe.wait(lambda: len(live.telemetry("a")) > idx[-1], 10.0, "a's telemetry")
    tel = [m.chunk_index for m in live.telemetry("a")]
    assert tel == list(range(len(tel))), tel
    for m in live.chunks("a"):
        assert (m.stream, list(m.joint_names), m.horizon, m.dof) == ("a", JOINTS, 16, 7)
        assert np.isfinite(np.frombuffer(m.actions, np.float32)).all()
    # The robot that left: every chunk it emitted was published and counted, then its topics stopped.
    live.probe.wait(lambda: live.probe.node.count_publishers(f"/{NS['c']}/action_chunk") == 0, 10.0,
                    "c's action_chunk publisher to go")
    live.probe.wait(lambda: len(live.telemetry("c")) >= r.chunks_emitted, 10.0, "c's telemetry")
    assert [m.chunk_index for m in live.telemetry("c")] == list(range(r.chunks_emitted))
    n = len(live.chunks("c"))
    assert [m.chunk_index for m in live.chunks("c")] == list(range(r.chunks_emitted))[r.chunks_emitted - n:]
    live.probe.wait(lambda: len(live.chunks("a")) >= left_at + 8, 30.0, "more chunks of a")
    assert len(live.chunks("c")) == n and len(live.telemetry("c")) == r.chunks_emitted
    # Nobody moved, and the others run on.
    assert list(a.feedback[-1].workers) == a_workers
    assert sorted(live.listed()) == ["a", "b"]
    assert not a.result_future.done() and not b.result_future.done()
    fb = a.feedback[-1]
    assert fb.state == "serving" and fb.chunks_lost == 0 and fb.chunks >= 5


def test_a_duplicate_name_or_namespace_is_refused_and_nothing_changes(live):
    before = live.listed()
    count = len(live.chunks("a"))
    refused(live, "a", "name-in-use", topic_namespace=NS["dup"])
    refused(live, "dup", "namespace-in-use", topic_namespace=NS["a"])
    refused(live, "dup", "namespace-in-use", topic_namespace="/" + NS["b"])
    # publishing onto a's topics from another namespace (it was admitted, and a's robot saw two interleaved
    # index sequences on its action_chunk)
    r = refused(live, "evil", "topic-collision", topic_namespace=NS["dup"],
                action_chunk_topic=f"/{NS['a']}/action_chunk")
    assert f"/{NS['a']}/action_chunk" in r.reason and "'a'" in r.reason
    refused(live, "evil", "topic-collision", topic_namespace=NS["dup"],
            joint_trajectory_topic=f"/{NS['b']}/joint_trajectory")
    assert live.listed() == before
    live.probe.wait(lambda: len(live.chunks("a")) >= count + 3, 30.0, "chunks of a")
    idx = [m.chunk_index for m in live.chunks("a")]
    assert contiguous(idx), f"a's chunk indices have a gap: {idx}"
    assert not live.goals["a"].result_future.done() and not live.goals["b"].result_future.done()


# ---- a world model co-served with the policy ----------------------------------------------------------------
def test_a_world_model_imagines_exactly_what_the_policy_commands(live):
    """tiny-acwm on robot a's camera and joint states, imagining a's own action chunks (the policy of the
    same server). In deterministic mode each predicted chunk equals the sequential reference fed the image,
    joint state and actions the server paired (exact stamp, else the latest at or before the image: its
    acceptance and pairing rules), bit for bit."""
    from physis_ros.model import build_model
    from physis_ros.model.spec import load_model_config
    from physis_ros.reference import ReferenceRollout
    from physis_ros.ros.acceptance import accept_actions, accept_image, accept_joints
    from physis_ros.serving.intake import pick_joint
    from physis_ros.ros.serve_action import stream_config_of

    a = f"/{NS['a']}"
    m = live.goal("m", topic_namespace=NS["m"], model="tiny-acwm", image_topic=f"{a}/camera/image_raw",
                  joint_states_topic=f"{a}/joint_states", actions_topic=f"{a}/action_chunk")
    assert m.admitted, m.result().reason
    assert live.listed()["m"]["model"] == "tiny-acwm"
    chunks = 6
    live.probe.wait(lambda: len(live.telemetry("m")) >= chunks and len(live.probe.get("frames/m")) >= chunks - 1,
                    40.0, f"{chunks} predicted chunks")

    cfg = load_model_config("tiny-acwm")
    stream = stream_config_of(m.msg)               # the stream config the server made of the goal
    tel = live.telemetry("m")[:chunks]
    assert [t.chunk_index for t in tel] == list(range(chunks))
    frames = {f.chunk_index: f for f, _ in live.probe.get("frames/m")}
    assert len(frames) >= chunks - 1              # (the very first may beat discovery)
    policy = [(ns_of(c.header.stamp), c) for c in live.chunks("a")]   # in arrival order, as the server got them
    sent = live.robots.sent[NS["a"]]
    ref = ReferenceRollout(build_model(cfg), seed=0)
    compared = exact = 0
    for t in tel:
        stamp = ns_of(t.observation_stamp)
        image, joints = sent[stamp]               # the camera frame this chunk was computed from
        verdict, i = pick_joint(stamp, [s for s, _ in policy], complete=True)
        assert verdict == "pair", f"chunk {t.chunk_index}: no policy chunk at or before its image"
        actions_msg = policy[i][1]
        exact += policy[i][0] == stamp
        obs = {"image": accept_image(image, stream, cfg), "state": accept_joints(joints, stream),
               "actions": accept_actions(actions_msg, stream, cfg)}
        expected = ref.step("m", obs).output.numpy()
        if t.chunk_index == 0:
            # The actions matter: the same image and state with other actions give other frames.
            moved = {**obs, "actions": obs["actions"] + 0.5}
            assert not np.array_equal(ReferenceRollout(build_model(cfg), seed=0).step("m", moved).output.numpy(),
                                      expected)
        f = frames.get(t.chunk_index)
        if f is None:
            continue
        assert f.stream == "m" and ns_of(f.header.stamp) == stamp
        assert (f.frames, f.channels, f.height, f.width) == expected.shape == (2, 4, 8, 8)
        got = np.frombuffer(f.latents, np.float32).reshape(expected.shape)
        assert np.array_equal(got, expected), (f"chunk {t.chunk_index}: max |diff| "
                                               f"{np.abs(got - expected).max():.3g} from the reference")
        compared += 1
    assert compared >= chunks - 1
    # It imagined the very chunk the policy computed from the same image (the pairing is by stamp; one
    # image the policy did not get, over best-effort transport, would pair with its previous chunk).
    assert exact >= chunks - 1, f"{exact} of {chunks} chunks paired with the policy's chunk of their image"
    # The policy ran on: its chunks are still contiguous with the world model beside it.
    idx = [c.chunk_index for c in live.chunks("a")]
    assert contiguous(idx), f"a's chunk indices have a gap: {idx}"
    fb = m.feedback[-1]
    assert fb.state == "serving" and fb.chunks_lost == 0


def wan_wam_directory(root):
    """A Wan world-action model as a checkpoint directory holds it: diffusers' transformer/, the adapter's
    safetensors and JSON, physis_model.yaml (tests/tiny_wan.py's trunk; the robot side of tiny-wam's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_wan import save_tiny_wan

    from physis_ros.model import build_model, load_model_config
    from physis_ros.model.wan_adapter import save_adapter

    save_tiny_wan(root / "transformer", num_layers=2)
    (root / "physis_model.yaml").write_text(yaml.safe_dump({
        "kind": "wan_wam", "steps": 2, "window": 2, "init_seed": 3,
        "wan": {"frames": 2, "height": 4, "width": 4, "text_tokens": 0,
                "actions": {"horizon": 16, "dof": 7, "state_dim": 7, "image_size": 32, "image_patch": 8}}}))
    save_adapter(build_model(load_model_config(root)), root)
    return root


def test_a_goal_serves_a_wan_wam_directory_bit_for_bit_and_leaves(live, tmp_path):
    """A ServeStream goal names a Wan world-action model's directory (model: DIR) and robot a's camera and
    joints: its action chunks and predicted frames come with one chunk index each, equal to the sequential
    reference fed the observations the server took (deterministic), bit for bit; cancelled, it leaves."""
    from physis_ros.msg import ActionChunk, PredictedFrames
    from physis_ros.model import build_model
    from physis_ros.model.spec import load_model_config
    from physis_ros.reference import ReferenceRollout
    from physis_ros.ros.acceptance import accept_image, accept_joints
    from physis_ros.ros.serve_action import stream_config_of

    root = wan_wam_directory(tmp_path / "tiny-wan-wam")
    ns, a = f"{TAG}_wanw", f"/{NS['a']}"
    live.probe.subscribe("chunk/wanw", ActionChunk, f"/{ns}/action_chunk", RELIABLE)
    live.probe.subscribe("frames/wanw", PredictedFrames, f"/{ns}/predicted_frames", RELIABLE)
    w = live.goal("wanw", topic_namespace=ns, model=str(root), image_topic=f"{a}/camera/image_raw",
                  joint_states_topic=f"{a}/joint_states", slo_interval_ms=160.0, control_rate_hz=50.0)
    assert w.admitted, w.result().reason
    assert live.listed()["wanw"]["model"] == "tiny-wan-wam"
    chunks = 4
    live.probe.wait(lambda: len(live.telemetry("wanw")) >= chunks and len(live.probe.get("frames/wanw")) >= chunks - 1
                    and len(live.chunks("wanw")) >= chunks - 1, 40.0, f"{chunks} chunks of the Wan WAM")
    cfg = load_model_config(root)
    stream = stream_config_of(w.msg)
    ref = ReferenceRollout(build_model(cfg), seed=0)
    actions = {c.chunk_index: c for c in live.chunks("wanw")}
    frames = {f.chunk_index: f for f, _ in live.probe.get("frames/wanw")}
    sent = live.robots.sent[NS["a"]]
    compared = 0
    for t in live.telemetry("wanw")[:chunks]:
        image, joints = sent[ns_of(t.observation_stamp)]
        expected = ref.step("wanw", {"image": accept_image(image, stream, cfg),
                                     "state": accept_joints(joints, stream)}).output.numpy()
        if t.chunk_index not in actions or t.chunk_index not in frames:
            continue
        got_actions = np.asarray(actions[t.chunk_index].actions, np.float32).reshape(16, 7)
        f = frames[t.chunk_index]
        got_frames = np.frombuffer(f.latents, np.float32).reshape(f.frames, f.channels, f.height, f.width)
        assert np.array_equal(got_actions, cfg.spec.actions_of(expected)), t.chunk_index
        assert np.array_equal(got_frames, cfg.spec.frames_of(expected)), t.chunk_index
        compared += 1
    assert compared >= chunks - 1
    r = w.cancel()
    assert r.accepted and r.outcome == "cancelled", r
    live.probe.wait(lambda: "wanw" not in live.listed(), 10.0, "the Wan stream to leave")


def test_a_stream_that_joins_late_is_judged_from_its_admission(live):
    """Issue 47 item 2: the first /diagnostics of a stream that joined a server serving for minutes said
    ERROR "no chunk in 143 s of serving", counted from the server's start. It waits for its first chunk."""
    g = live.goal("late", topic_namespace=f"{TAG}_late")    # no robot publishes: no chunk will come
    assert g.admitted, g.result().reason
    def first():
        return next((st for msg, _ in live.probe.get("diagnostics") for st in msg.status
                     if st.name.endswith(": late")), None)

    live.probe.wait(lambda: first() is not None, 10.0, "a /diagnostics status of the new stream")
    first = first()
    assert not first.message.startswith("no chunk in"), first.message
    assert g.cancel().outcome == "cancelled"


def test_a_recording_started_before_the_robots_joined_holds_their_topics(live):
    """Issue 48 item 6: physis-bag record took its default topics from the config only, so robots that joined
    the running server later were not recorded. It follows the server node: what it publishes and subscribes to
    as streams join (here: started before the server, whose config has no stream)."""
    from physis_ros.bags.bagio import bag_info

    assert live.recorder.stop(30.0) == 0, live.recorder.tail(20)
    counts = {t.topic: t.count for t in bag_info(live.recording).topics}
    types = {t.topic: t.msgtype for t in bag_info(live.recording).topics}
    a = NS["a"]
    for topic, msgtype in ((f"/{a}/action_chunk", "physis_ros/msg/ActionChunk"),
                           (f"/{a}/joint_trajectory", "trajectory_msgs/msg/JointTrajectory"),
                           (f"/{a}/camera/image_raw", "sensor_msgs/msg/Image"),
                           (f"/{a}/joint_states", "sensor_msgs/msg/JointState"),
                           (f"/{NS['m']}/predicted_frames", "physis_ros/msg/PredictedFrames")):
        assert types.get(topic) == msgtype and counts[topic] > 0, (topic, counts)
    assert counts[TELEMETRY] > 0 and counts["/diagnostics"] > 0
    assert not any(t.startswith(f"/{NODE}/") for t in counts), sorted(counts)   # not its actions, lease, ...
    log = live.recorder.log_path.read_text()
    assert f"/{a}/action_chunk" in log


# ---- removal and stop ----------------------------------------------------------------------------------------
def test_remove_stream_ends_the_goal_as_removed(live):
    from physis_ros.srv import RemoveStream

    r = live.call(live.remove_client, RemoveStream.Request(stream="b"))
    assert r.ok, r.message
    result = live.goals["b"].result()
    assert (result.accepted, result.outcome) == (True, "removed") and result.chunks_emitted > 0, result
    r = live.call(live.remove_client, RemoveStream.Request(stream="b"))
    assert not r.ok and "b" in r.message
    assert sorted(live.listed()) == ["a", "m"]
    # Issue 48 item 3: a removed robot stayed on /diagnostics for good. It is said once as removed, then gone.
    removed_at = time.monotonic()
    def statuses_of_b() -> list[tuple[float, dict]]:
        return [(msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, v) for msg, _ in live.probe.get("diagnostics")
                if (v := diag_values(msg, "b")) is not None]

    live.probe.wait(lambda: any(v.get("removed") == "True" for _, v in statuses_of_b()), 10.0,
                    "b said once as removed on /diagnostics")
    said_at = max(t for t, v in statuses_of_b() if v.get("removed") == "True")
    live.probe.wait(lambda: diag_stamps(live)[-1] > said_at + 1.2, 10.0, "three more /diagnostics periods")
    after = [v for t, v in statuses_of_b() if t > said_at]
    assert [v["_message"] for _, v in statuses_of_b()].count("removed: no longer served") == 1
    assert after == [], f"b still on /diagnostics {time.monotonic() - removed_at:.1f} s after its removal: {after}"


def test_clean_stop_leaves_no_process(live):
    live.running = [live.goals[s] for s in ("a", "m")]
    rc = live.stop()
    assert rc == 0, live.server.tail(40)
    assert "stopping (SIGINT)" in live.server.log_path.read_text()
    deadline = time.monotonic() + 5
    while processes_with_marker(live.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(live.marker) == []


def test_goals_running_at_a_stop_end_with_outcome_shutdown(live):
    for g in live.running:
        assert g.result_future.done(), f"goal {g.stream} got no result when the server stopped"
        r = g.result_future.result().result
        assert (r.accepted, r.outcome) == (True, "shutdown"), r
