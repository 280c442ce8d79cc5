"""Simulated time and deterministic mode, end to end (real rclpy, server in its own process).

This test plays a bag player: it publishes /clock (simulated time from 1000 s)
and N observations stamped on it. With ``use_sim_time`` every stamp the server
makes comes from /clock; with ``deterministic`` chunk c consumes the c-th
observation, so its output must equal, bit for bit, the sequential reference
fed the same messages through the same preprocessing (observation_from_msgs).
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from rclpy.qos import QoSProfile, ReliabilityPolicy

from physis_ros.launcher import Child, serve_command

from rosprobe import (JOINTS, NODE_ARGS, TAG, Probe, child_env, diag_values, processes_with_marker,
                      write_config)

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

STREAM = "d0"
NS = f"{TAG}_d0"
CLOCK = f"/{TAG}/clock"          # the server's /clock is remapped here: no other test can drive it
TELEMETRY = f"/{TAG}_sim_telemetry"
SIM_T0 = 1000.0
N = 10
RELIABLE = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)


def sec(t) -> float:
    return t.sec + t.nanosec * 1e-9


class SimRun:
    def __init__(self, tmp):
        from diagnostic_msgs.msg import DiagnosticArray
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import Image, JointState
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry

        self.marker = uuid.uuid4().hex
        self.config = write_config(tmp / "serve.yaml", {STREAM: {
            "namespace": NS, "joint_names": JOINTS, "control_rate_hz": 25.0,
            "image": {"preprocess": "pad", "pad_value": 0.25},
            "qos": {"input": {"reliability": "reliable", "depth": 100}}}},
            telemetry_topic=TELEMETRY, deterministic=True, use_sim_time=True, diagnostics_period_s=0.25,
            engine={"workers": 1, "plan": "sequential"})
        self.probe = p = Probe("physis_sim_probe")
        p.subscribe("chunk", ActionChunk, f"/{NS}/action_chunk", RELIABLE)
        p.subscribe("traj", JointTrajectory, f"/{NS}/joint_trajectory", RELIABLE)
        p.subscribe("telemetry", ChunkTelemetry, TELEMETRY, RELIABLE)
        p.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        self.Clock, self.Image, self.JointState = Clock, Image, JointState
        self.pub_clock = p.node.create_publisher(Clock, CLOCK, QoSProfile(depth=10))
        self.pub_img = p.node.create_publisher(Image, f"/{NS}/camera/image_raw", RELIABLE)
        self.pub_js = p.node.create_publisher(JointState, f"/{NS}/joint_states", RELIABLE)
        self.t_wall0 = time.monotonic()
        self.clock_lock = threading.Lock()  # the timer's thread and the observations' share /clock: one order
        self.clock_timer = p.node.create_timer(0.02, self.tick)  # sim time runs with wall time, from 1000 s
        self.server = Child("server", serve_command(self.config, "--duration", "120", *NODE_ARGS, "-r",
                                                    f"/clock:={CLOCK}"),
                            env=child_env(self.marker), log=tmp / "serve.log")

    def sim_now(self) -> float:
        return SIM_T0 + (time.monotonic() - self.t_wall0)

    def tick(self):
        """Publish /clock at the simulated now and return that stamp."""
        from physis_ros.ros.conversions import time_msg
        with self.clock_lock:
            stamp = time_msg(self.sim_now())
            self.pub_clock.publish(self.Clock(clock=stamp))
        return stamp

    def serving_on_sim_time(self) -> bool:
        """Serving, on simulated time, and (as the server sees it) our subscriptions and publishers match."""
        if not (self.pub_img.get_subscription_count() and self.pub_js.get_subscription_count()):
            return False
        for a, _ in reversed(self.probe.get("diagnostics")[-5:]):
            engine, stream = diag_values(a, "engine"), diag_values(a, STREAM)
            if (engine is not None and engine["state"] == "serving" and SIM_T0 <= sec(a.header.stamp) < SIM_T0 + 1e5
                    and int(engine["telemetry_subscribers"]) >= 1 and stream is not None
                    and int(stream["action_chunk_subscribers"]) >= 1
                    and int(stream["joint_trajectory_subscribers"]) >= 1):
                return True
        return False


def observation_msgs(run: SimRun, i: int, stamp):
    """Observation i: a bgr8 camera of odd size and joints in another order with an extra joint."""
    rng = np.random.default_rng(i)
    h, w = 24 + 2 * i, 40
    img = run.Image(height=h, width=w, encoding="bgr8", step=w * 3,
                    data=rng.integers(0, 256, (h, w, 3), dtype=np.uint8).tobytes())
    img.header.stamp = stamp
    positions = rng.uniform(-1, 1, 7).tolist()
    js = run.JointState(name=["gripper"] + JOINTS[::-1], position=[0.0] + positions[::-1])
    js.header.stamp = stamp
    return img, js


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    run = SimRun(tmp_path_factory.mktemp("sim"))
    try:
        try:
            run.probe.wait(lambda: run.serving_on_sim_time() or run.server.poll() is not None, 90,
                           "the server to serve on simulated time")
        except AssertionError:
            raise AssertionError(f"server log:\n{run.server.tail(40)}") from None
        assert run.server.poll() is None, run.server.tail(40)
        run.sent = []
        for i in range(N):
            # As a bag player does, the clock reaches an observation's stamp before the observation is sent:
            # stamped on the test's own clock alone, an observation ran 300 ms ahead of the server's /clock on
            # a slow CI host (the probe's clock timer starved) and its latency read -298 ms.
            stamp = run.tick()
            img, js = observation_msgs(run, i, stamp)
            run.pub_img.publish(img)
            run.pub_js.publish(js)
            run.sent.append((img, js))
            time.sleep(0.03)
        run.probe.wait(lambda: run.probe.count("chunk") >= N, 60, f"{N} chunks")
        time.sleep(0.5)  # a chunk more than observations would show up here
        yield run
    finally:
        run.server.stop(30.0)
        run.probe.close()


def test_chunk_c_uses_observation_c_and_stamps_come_from_clock(sim):
    chunks = [m for m, _ in sim.probe.get("chunk")]
    assert [m.chunk_index for m in chunks] == list(range(N))  # one chunk per observation, none skipped
    for m, (img, _) in zip(chunks, sim.sent):
        assert m.header.stamp == img.header.stamp
        assert m.control_period == pytest.approx(0.04)
    sim_end = sim.sim_now()
    tel = [m for m, _ in sim.probe.get("telemetry")]
    assert len(tel) == N
    for t in tel:
        # Emit stamps on simulated time (about 1000 s), not on the wall clock (about 1.7e9 s).
        assert SIM_T0 <= sec(t.emit_stamp) <= sim_end and t.header.stamp == t.emit_stamp
        assert 0.0 <= t.response_latency_ms < 60_000
    # Trajectories are on the control timeline of simulated time: point 0 is the first row still ahead.
    trajs = [m for m, _ in sim.probe.get("traj")]
    sent = [m for m in chunks if not m.late]
    assert len(trajs) == len(sent)
    for traj, m in zip(trajs, sent):
        assert SIM_T0 <= sec(m.step0_stamp) <= sim_end
        assert sec(traj.header.stamp) == pytest.approx(sec(m.step0_stamp) + m.late_points * 0.04, abs=1e-6)
        assert len(traj.points) == 16 - m.late_points


def test_deterministic_outputs_equal_the_sequential_reference(sim, tiny_wam):
    from physis_ros.model.spec import load_model_config
    from physis_ros.reference import ReferenceRollout
    from physis_ros.serving.config import load_serve_config
    from physis_ros.ros.conversions import observation_from_msgs

    cfg = load_serve_config(sim.config)
    model_cfg = load_model_config(cfg.model)
    ref = ReferenceRollout(tiny_wam, seed=cfg.engine.seed)
    chunks = [m for m, _ in sim.probe.get("chunk")]
    for m, (img, js) in zip(chunks, sim.sent):
        obs = observation_from_msgs(img, js, cfg.streams[STREAM], model_cfg)
        expected = ref.step(STREAM, obs).output.numpy()
        got = np.frombuffer(m.actions, np.float32).reshape(expected.shape)
        assert np.array_equal(got, expected), f"chunk {m.chunk_index} differs from the reference"


def test_lost_worker_is_reported_restarted_and_the_stream_carries_on(sim):
    import os
    import signal

    worker = sim.probe.status("worker w0")
    assert worker and worker["_level"] == 0, "no healthy worker status on /diagnostics"
    old_pid = int(worker["pid"])
    os.kill(old_pid, signal.SIGKILL)
    sim.probe.wait(lambda: int(sim.probe.status(STREAM).get("failures_total", 0)) >= 1, 15,
                   "/diagnostics to report the stream's failure")

    def restarted():
        w = sim.probe.status("worker w0")
        return w.get("_level") == 0 and int(w.get("pid", old_pid)) != old_pid
    sim.probe.wait(restarted, 90, "the worker to be restarted")
    # Re-admitted: no longer "failed", but ERROR until it publishes again (no input arrives until below).
    sim.probe.wait(lambda: not sim.probe.status(STREAM).get("_message", "stream failed").startswith(
        "stream failed"), 15, "the stream to be re-admitted")
    readmitted = sim.probe.status(STREAM)
    assert readmitted["_level"] == 2 and readmitted["_message"].startswith("recovering"), readmitted
    assert int(readmitted["resets.worker_lost"]) >= 1, readmitted
    more = []
    for i in range(N, N + 3):
        img, js = observation_msgs(sim, i, sim.tick())
        sim.pub_img.publish(img)
        sim.pub_js.publish(js)
        more.append(img)
        time.sleep(0.03)
    sim.probe.wait(lambda: sim.probe.count("chunk") >= N + 3, 60, "chunks after the restart")
    after = [m for m, _ in sim.probe.get("chunk")][N:]
    assert [m.header.stamp for m in after] == [img.header.stamp for img in more]
    assert [m.chunk_index for m in after] == list(range(N, N + 3))  # nothing was in flight: no gap
    sim.probe.wait(lambda: not sim.probe.status(STREAM).get("_message", "recovering").startswith(
        "recovering"), 15, "/diagnostics to see the stream publishing again")
    assert sim.server.poll() is None
    assert "stream d0 reset (worker_lost)" in sim.server.log_path.read_text()


def test_sim_server_stops_cleanly_with_no_orphans(sim):
    assert sim.server.stop(30.0) == 0, sim.server.tail(30)
    deadline = time.monotonic() + 5
    while processes_with_marker(sim.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(sim.marker) == []
