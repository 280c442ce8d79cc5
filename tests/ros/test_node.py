"""The action server end to end: real rclpy, the server, the synthetic robots and this test in
separate processes (tests/ros/rosprobe.py keeps runs on one machine apart).

One server with two namespaced streams serves the first group of tests; the
last of them stops it and checks that nothing is left behind.
"""

from __future__ import annotations

import math
import socket
import time
import uuid

import numpy as np
import pytest
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from physis_ros.launcher import Child, serve_command, synthetic_command

import rosprobe
from rosprobe import (JOINTS, NODE, NODE_ARGS, TAG, Probe, child_env, diag_values, processes_with_marker,
                      write_config)

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

STREAMS = {"r0": f"{TAG}_r0", "r1": f"{TAG}_r1"}
TELEMETRY = f"/{TAG}_telemetry"
RELIABLE = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
LATCHED = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
START_TIMEOUT = 90.0


def sec(t) -> float:
    return t.sec + t.nanosec * 1e-9


def ns(t) -> int:
    return t.sec * 1_000_000_000 + t.nanosec


class Live:
    def __init__(self, tmp):
        from diagnostic_msgs.msg import DiagnosticArray
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry

        self.marker = uuid.uuid4().hex
        self.config = write_config(tmp / "serve.yaml", {
            name: {"namespace": ns_, "joint_names": JOINTS, "control_rate_hz": 50.0, "execution_horizon": 4,
                   "max_age_s": 5.0, "image": {"preprocess": "center_crop"}}
            for name, ns_ in STREAMS.items()},
            telemetry_topic=TELEMETRY, diagnostics_period_s=0.5, warn_throttle_s=0.2,
            engine={"workers": 2, "plan": "stage"})   # admitted on the shipped CPU profiles (write_config)
        self.probe = Probe()
        for name, ns_ in STREAMS.items():
            self.probe.subscribe(f"chunk/{name}", ActionChunk, f"/{ns_}/action_chunk", RELIABLE)
            # A reliable reader: the strictest a controller can be. joint_trajectory_controller subscribes with
            # SystemDefaultsQoS (best effort under rmw_fastrtps; docs/ros2_control.md section 1), which our
            # RELIABLE publisher matches too.
            self.probe.subscribe(f"traj/{name}", JointTrajectory, f"/{ns_}/joint_trajectory", RELIABLE)
        self.probe.subscribe("telemetry", ChunkTelemetry, TELEMETRY, LATCHED)  # from the first chunk on
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        env = child_env(self.marker)
        self.synthetic = Child("synthetic", synthetic_command(self.config, "--rate", "20", "--width", "40",
                                                              "--height", "30"), env=env, log=tmp / "synthetic.log")
        self.server = Child("server", serve_command(self.config, "--duration", "120", *NODE_ARGS), env=env,
                            log=tmp / "serve.log")

    def chunks(self, name):
        return [m for m, _ in self.probe.get(f"chunk/{name}")]

    def stop(self) -> tuple[int, int]:
        rc = self.server.stop(30.0), self.synthetic.stop(10.0)
        return rc


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("live"))
    try:
        try:
            live.probe.wait(lambda: all(len(live.chunks(n)) >= 12 for n in STREAMS) or live.server.poll() is not None,
                            START_TIMEOUT, "12 chunks on both streams")
        except AssertionError:
            raise AssertionError(f"server log:\n{live.server.tail(40)}") from None
        assert live.server.poll() is None, f"server exited:\n{live.server.tail(40)}"
        yield live
    finally:
        live.stop()
        live.probe.close()


def test_both_streams_get_contiguous_chunks_in_joint_order(live):
    for name in STREAMS:
        msgs = live.chunks(name)
        idx = [m.chunk_index for m in msgs]
        # Contiguous; the very first chunks can beat discovery on a loaded machine (volatile QoS) ...
        assert idx == list(range(idx[0], idx[0] + len(idx))), f"{name}: chunk indices not contiguous: {idx[:20]}"
        # ... but telemetry, kept for late subscribers, shows every chunk from the first.
        tel = [m.chunk_index for m, _ in live.probe.get("telemetry") if m.stream == name]
        assert tel == list(range(len(tel))) and idx[0] < len(tel), (name, tel[:10], idx[:5])
        for m in msgs:
            assert m.stream == name and list(m.joint_names) == JOINTS
            assert (m.horizon, m.dof) == (16, 7) and m.control_period == pytest.approx(0.02)
            a = np.frombuffer(m.actions, np.float32)
            assert a.shape == (16 * 7,) and np.isfinite(a).all()
            assert 1e9 < sec(m.header.stamp) <= time.time()  # an observation stamp, wall clock here
        # The two robots see different scenes, so their chunks differ.
    a0 = np.frombuffer(live.chunks("r0")[5].actions, np.float32)
    a1 = np.frombuffer(live.chunks("r1")[5].actions, np.float32)
    assert not np.array_equal(a0, a1)


def test_reliable_trajectory_subscriber_matches_and_trajectories_are_controller_ready(live):
    for name, ns_ in STREAMS.items():
        infos = live.probe.node.get_publishers_info_by_topic(f"/{ns_}/joint_trajectory")
        assert len(infos) == 1
        q = infos[0].qos_profile
        assert q.reliability == ReliabilityPolicy.RELIABLE  # (discovery does not carry the history kind)
        # a RELIABLE subscription only matches a RELIABLE publisher (the module waited for chunks, not for these)
        live.probe.wait(lambda: live.probe.count(f"traj/{name}") >= 10, 30.0, f"10 trajectories of {name}")
        trajs = live.probe.get(f"traj/{name}")
        chunks = {m.chunk_index: m for m in live.chunks(name)}
        tel = {m.chunk_index: m for m, _ in live.probe.get("telemetry") if m.stream == name}
        sent = [c for _, c in sorted(chunks.items()) if not c.late]   # one trajectory per chunk not late, in order
        # header.stamp: when the first point sent is due on the control timeline (step0 + the rows dropped as
        # already due), still ahead at publication. Each trajectory is paired with its chunk by that stamp, not
        # by arrival order: the trajectory subscription may match a chunk or two after the chunk one does.
        due = np.array([sec(c.step0_stamp) + c.late_points * 0.02 for c in sent])
        trajs = [t for t in trajs if sec(t[0].header.stamp) > due[0] - 1e-6]   # (chunks heard from the first on)
        nearest = [int(np.argmin(np.abs(due - sec(traj.header.stamp)))) for traj, _ in trajs[:20]]
        matched = [i if abs(due[i] - sec(traj.header.stamp)) <= 1e-6 else None
                   for i, (traj, _) in zip(nearest, trajs[:20])]
        assert None not in matched, (matched, [sec(t.header.stamp) for t, _ in trajs[:3]])
        assert matched == list(range(matched[0], matched[0] + len(matched))), matched   # none missing, in order
        for (traj, info), chunk in zip(trajs[:20], sent[matched[0]:]):
            assert list(traj.joint_names) == JOINTS
            k = chunk.late_points   # rows already due when it was published: dropped
            assert 0 <= k < 16
            assert sec(traj.header.stamp) == pytest.approx(sec(chunk.step0_stamp) + k * 0.02, abs=1e-6)
            if chunk.chunk_index in tel:
                assert sec(traj.header.stamp) > sec(tel[chunk.chunk_index].handover_stamp)
            pos = np.array([p.positions for p in traj.points])
            vel = np.array([p.velocities for p in traj.points])
            acc = np.array([p.accelerations for p in traj.points])
            np.testing.assert_array_equal(pos, np.frombuffer(chunk.actions, np.float32).reshape(16, 7)[k:])
            np.testing.assert_array_equal(vel[-1], 0.0)
            np.testing.assert_array_equal(acc[-1], 0.0)
            assert np.isfinite(vel).all() and np.isfinite(acc).all()
            t = [sec(p.time_from_start) for p in traj.points]
            np.testing.assert_allclose(t, 0.02 * np.arange(16 - k), atol=1e-9)


def test_telemetry_agrees_with_what_the_subscriber_saw(live):
    tel = {}
    for m, _ in live.probe.get("telemetry"):
        tel[(m.stream, m.chunk_index)] = m
    for name in STREAMS:
        chunks = {m.chunk_index: m for m in live.chunks(name)}
        first = min(chunks)
        settled = first + min(len(chunks), live.probe.count(f"traj/{name}")) - 5  # surely arrived up to here
        assert settled - first > 5
        for c in range(first, settled):
            t = tel.get((name, c))
            assert t is not None, f"no telemetry for {name} chunk {c}"
            assert t.observation_stamp == chunks[c].header.stamp
            assert t.header.stamp == t.emit_stamp
            assert ns(t.observation_stamp) <= ns(t.enqueue_stamp) <= ns(t.emit_stamp)
            # the node took the chunk over after the engine emitted it (well under a second on any machine)
            assert 0 <= ns(t.handover_stamp) - ns(t.emit_stamp) < 1_000_000_000
            assert t.response_latency_ms == pytest.approx((sec(t.emit_stamp) - sec(t.observation_stamp)) * 1e3,
                                                          abs=1e-3)
            assert t.stage_compute_ms_sum >= t.stage_compute_ms_max >= t.stage_compute_ms_min > 0
            assert len(t.batch_sizes) > 0
            if c > first:
                prev = tel[(name, c - 1)]
                assert t.output_interval_ms == pytest.approx((sec(t.emit_stamp) - sec(prev.emit_stamp)) * 1e3,
                                                             abs=1e-3)
                assert t.deadline_miss == (t.output_interval_ms > 80.0)   # the SLO: its control timeline


def test_bad_inputs_are_rejected_counted_and_reported(live):
    from sensor_msgs.msg import Image, JointState

    node = live.probe.node
    ns1 = STREAMS["r1"]
    pub_img = node.create_publisher(Image, f"/{ns1}/camera/image_raw", QoSProfile(depth=10))
    pub_js = node.create_publisher(JointState, f"/{ns1}/joint_states", QoSProfile(depth=10))
    live.probe.wait(lambda: pub_img.get_subscription_count() > 0 and pub_js.get_subscription_count() > 0, 20,
                    "the server to subscribe")
    before = {n: len(live.chunks(n)) for n in STREAMS}

    def stamp(offset=0.0):
        from physis_ros.ros.conversions import time_msg
        return time_msg(time.time() + offset)

    def image(encoding="rgb8", size=None, offset=0.0):
        data = bytes(size if size is not None else 40 * 30 * 3)
        msg = Image(height=30, width=40, encoding=encoding, step=120, data=data)
        msg.header.stamp = stamp(offset)
        return msg

    def joints(positions=None, names=JOINTS, offset=0.0):
        msg = JointState(name=list(names), position=[0.1] * len(names) if positions is None else positions)
        msg.header.stamp = stamp(offset)
        return msg

    bad = [
        (pub_img, lambda: image(encoding="yuv422"), "encoding"),
        (pub_img, lambda: image(size=100), "size"),
        (pub_js, lambda: joints([0.1, 0.1, math.nan, 0.1, 0.1, 0.1, 0.1]), "nonfinite"),
        (pub_js, lambda: joints(names=JOINTS[:6]), "missing_joints"),
        (pub_img, lambda: image(offset=30.0), "future_stamp"),
        (pub_js, lambda: joints(offset=-30.0), "stale_stamp"),
    ]
    for _ in range(3):
        for pub, make, _reason in bad:
            pub.publish(make())
            time.sleep(0.01)

    def reported():
        arrays = [m for m, _ in live.probe.get("diagnostics")[-6:]]
        for a in reversed(arrays):
            v = diag_values(a, "r1")
            if v is not None:
                return v
        return {}

    reasons = [r for _, _, r in bad]
    live.probe.wait(lambda: all(int(reported().get(f"rejected.{r}", 0)) >= 1 for r in reasons), 20,
                    f"/diagnostics to report rejected {reasons}")
    v = reported()
    for r in reasons:
        assert 1 <= int(v[f"rejected.{r}"]) <= 3, (r, v)
    assert int(v["rejected_total"]) >= len(reasons)
    r0 = None
    for a, _ in reversed(live.probe.get("diagnostics")):
        r0 = diag_values(a, "r0")
        if r0 is not None:
            break
    assert r0 is not None and r0["rejected_total"] == "0"
    # The server and both streams carry on.
    live.probe.wait(lambda: all(len(live.chunks(n)) >= before[n] + 5 for n in STREAMS), 30,
                    "both streams to keep producing chunks")
    assert live.server.poll() is None
    log = live.server.log_path.read_text()
    assert "rejected image [encoding]" in log and "yuv422" in log


def test_diagnostics_report_streams_workers_and_engine(live):
    arrays = [m for m, _ in live.probe.get("diagnostics")]
    assert arrays
    last = arrays[-1]
    names = {s.name for s in last.status}
    assert {f"{NODE}: {what}" for what in ("engine", "r0", "r1", "worker w0", "worker w1")} <= names
    engine = diag_values(last, "engine")
    assert engine["state"] == "serving" and engine["_level"] == 0
    assert engine["armed"] == "True" and engine["lifecycle"] == "active"   # --autostart (the default)
    r0 = diag_values(last, "r0")
    assert float(r0["chunks_per_s"]) > 0 and r0["slo_interval_ms"] == "80.000"   # its control timeline: 4 steps at 50 Hz
    assert int(r0["chunks_total"]) >= 12
    # hardware ids name host and device: the workers', and for a stream the devices of its workers
    host = socket.gethostname()
    assert engine["_hardware_id"] == host
    assert diag_values(last, "worker w0")["_hardware_id"] == f"{host}:cpu"
    # admission's measured load factor per worker (busy / booked, never below the profiles' 1.0)
    assert all(float(diag_values(last, f"worker {w}")["admission_load_factor"]) >= 1.0 for w in ("w0", "w1"))
    assert set(r0["_hardware_id"].split(",")) <= {f"{host}:cpu"} and r0["_hardware_id"]
    # admission's measured spread: "none" until a whole window of r0's published intervals is in (2 s after
    # the last join, 6 s long), then what r0's interval p99 exceeds its release interval by beyond its bound
    def spread():
        for array, _ in reversed(live.probe.get("diagnostics")):
            values = diag_values(array, "r0")
            if values is not None:
                return values["admission_spread_ms"]
    live.probe.wait(lambda: spread() != "none", 30, "admission to measure r0's spread")
    assert 0.0 <= float(spread()) < 1e3


def test_clean_stop_leaves_no_process(live):
    server_rc, synthetic_rc = live.stop()
    assert server_rc == 0, live.server.tail(40)
    assert synthetic_rc == 0
    assert "stopping (SIGINT)" in live.server.log_path.read_text()
    deadline = time.monotonic() + 5
    while processes_with_marker(live.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(live.marker) == []
    assert rosprobe.DOMAIN >= 1
