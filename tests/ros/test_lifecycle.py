"""physis_server as a managed (lifecycle) node, driven through its standard lifecycle services by a
client in this process; the server (``--no-autostart``) and the synthetic robot are real processes.

One server serves the whole module, in order: unconfigured -> configure (engine computing, outputs
disarmed) -> activate (trajectories on a controller's remapped topic) -> deactivate (they stop within
one chunk interval; telemetry and /diagnostics go on) -> activate (they resume) -> robot goes silent
(/diagnostics turns ERROR, the rate decays to 0) -> cleanup (workers gone) -> shutdown (clean exit).
"""

from __future__ import annotations

import time
import uuid

import pytest
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from physis_ros.launcher import Child, serve_command, synthetic_command

from rosprobe import JOINTS, NODE, NODE_ARGS, TAG, Probe, child_env, diag_values, processes_with_marker, write_config

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

RELIABLE = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
ROSOUT = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
NS = f"{TAG}_l0"
CONTROLLER_TOPIC = f"/{TAG}_arm_controller/joint_trajectory"
START_TIMEOUT = 90.0


class Live:
    def __init__(self, tmp):
        from diagnostic_msgs.msg import DiagnosticArray
        from lifecycle_msgs.srv import ChangeState, GetState
        from rcl_interfaces.msg import Log
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry

        self.marker = uuid.uuid4().hex
        self.config = write_config(tmp / "serve.yaml", {
            "l0": {"namespace": NS, "joint_names": JOINTS, "max_age_s": 1.0,
                   "telemetry": True, "topics": {"joint_trajectory": CONTROLLER_TOPIC}}},
            telemetry_topic=f"/{TAG}_ltelemetry", diagnostics_period_s=0.25, diagnostics_window_s=2.0,
            diagnostics_starved_s=1.0, engine={"workers": 1, "plan": "sequential"})
        self.probe = Probe("physis_lifecycle_probe")
        self.probe.subscribe("traj", JointTrajectory, CONTROLLER_TOPIC, RELIABLE)   # what a controller does
        self.probe.subscribe("traj_default", JointTrajectory, f"/{NS}/joint_trajectory", RELIABLE)
        self.probe.subscribe("chunk", ActionChunk, f"/{NS}/action_chunk", RELIABLE)
        self.probe.subscribe("telemetry", ChunkTelemetry, f"/{TAG}_ltelemetry", RELIABLE)
        self.probe.subscribe("robot_telemetry", ChunkTelemetry, f"/{NS}/telemetry", RELIABLE)
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=100))
        self.probe.subscribe("rosout", Log, "/rosout", ROSOUT)   # before the server starts: nothing missed
        self.change = self.probe.node.create_client(ChangeState, f"/{NODE}/change_state")
        self.get_state = self.probe.node.create_client(GetState, f"/{NODE}/get_state")
        env = child_env(self.marker)
        self.synthetic = Child("synthetic", synthetic_command(self.config, "--rate", "20", "--width", "40",
                                                              "--height", "30"), env=env, log=tmp / "synthetic.log")
        self.server = Child("server", serve_command(self.config, "--no-autostart", *NODE_ARGS), env=env,
                            log=tmp / "serve.log")

    def call(self, client, request, timeout=30.0):
        future = client.call_async(request)
        self.probe.wait(future.done, timeout, f"a reply from {client.srv_name}")
        return future.result()

    def transition(self, transition_id: int) -> bool:
        from lifecycle_msgs.srv import ChangeState
        req = ChangeState.Request()
        req.transition.id = transition_id
        return self.call(self.change, req).success

    def state(self) -> str:
        from lifecycle_msgs.srv import GetState
        return self.call(self.get_state, GetState.Request()).current_state.label

    def statuses_since(self, n: int, what: str) -> list[dict]:
        out = []
        for msg, _ in self.probe.get("diagnostics")[n:]:
            v = diag_values(msg, what)
            if v is not None:
                out.append(v)
        return out

    def others(self) -> list[int]:
        """Processes of this test other than the server and the synthetic robot: the workers."""
        return sorted(set(processes_with_marker(self.marker)) - {self.server.pid, self.synthetic.pid})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("lifecycle"))
    try:
        ok = live.change.wait_for_service(30.0) and live.get_state.wait_for_service(10.0)
        assert ok and live.server.poll() is None, f"no lifecycle services:\n{live.server.tail(40)}"
        yield live
    finally:
        live.server.stop(30.0)
        live.synthetic.stop(10.0)
        live.probe.close()


def test_starts_unconfigured_without_workers_or_outputs(live):
    assert live.state() == "unconfigured"
    live.probe.wait(lambda: live.probe.status("engine").get("state") == "unconfigured", 10, "an 'unconfigured' status")
    engine = live.probe.status("engine")
    assert engine["_level"] == 1 and engine["armed"] == "False" and engine["lifecycle"] == "unconfigured"
    stream = live.probe.status("l0")
    assert stream["_level"] == 1 and "unconfigured" in stream["_message"]   # WARN, never STALE
    assert live.probe.status("worker w0") == {}
    time.sleep(0.5)
    assert live.others() == [] and live.probe.count("telemetry") == 0


def test_configure_computes_but_publishes_no_outputs(live):
    from lifecycle_msgs.msg import Transition
    assert live.transition(Transition.TRANSITION_CONFIGURE)
    assert live.state() == "inactive"
    try:
        live.probe.wait(lambda: live.probe.count("telemetry") >= 5, START_TIMEOUT, "telemetry while inactive")
    except AssertionError:
        raise AssertionError(live.server.tail(40)) from None
    assert live.probe.count("traj") == 0 and live.probe.count("chunk") == 0
    live.probe.wait(lambda: live.probe.status("engine").get("state") == "serving", 10, "engine serving")
    engine = live.probe.status("engine")
    assert engine["armed"] == "False" and engine["_level"] == 1 and "disarmed" in engine["_message"]
    assert engine["lifecycle"] == "inactive" and live.others() != []
    assert live.probe.status("worker w0").get("_level") == 0


def test_engine_and_worker_log_lines_reach_rosout(live):
    """Requirement: engine and worker lines go through the node's logger to /rosout, INFO included, and a
    worker's lines carry its name (the workers themselves run with --no-log-stderr)."""
    def lines(child: str) -> list:
        return [m for m, _ in live.probe.get("rosout") if m.name.endswith(f"{NODE}.{child}")]

    def level(m) -> int:
        return int.from_bytes(m.level, "little") if isinstance(m.level, bytes) else m.level

    live.probe.wait(lambda: any(m.msg.startswith("engine started") for m in lines("engine")), 10,
                    "the engine's 'engine started' line on /rosout")
    started = next(m for m in lines("engine") if m.msg.startswith("engine started"))
    assert level(started) == 20 and "w0 pid" in started.msg   # INFO (rcl_interfaces/Log.INFO)
    live.probe.wait(lambda: any(m.msg.startswith("[w0] up on ") for m in lines("worker")), 10,
                    "worker w0's 'up on' line on /rosout")
    up = next(m for m in lines("worker") if m.msg.startswith("[w0] up on "))
    assert level(up) == 20 and " (pid " in up.msg


def test_activate_publishes_trajectories_on_the_controllers_topic(live):
    from lifecycle_msgs.msg import Transition
    assert live.transition(Transition.TRANSITION_ACTIVATE)
    assert live.state() == "active"
    live.probe.wait(lambda: live.probe.count("traj") >= 5 and live.probe.count("chunk") >= 5, 30,
                    f"trajectories on {CONTROLLER_TOPIC}")
    traj, _ = live.probe.get("traj")[-1]
    assert list(traj.joint_names) == JOINTS and 1 <= len(traj.points) <= 16
    assert live.probe.count("traj_default") == 0
    assert live.probe.node.get_publishers_info_by_topic(f"/{NS}/joint_trajectory") == []
    # per-robot telemetry beside the global topic
    assert live.probe.count("robot_telemetry") >= 5
    live.probe.wait(lambda: live.probe.status("engine").get("armed") == "True", 5, "armed on /diagnostics")
    assert live.probe.status("engine")["_level"] == 0 and live.probe.status("engine")["_message"] == "serving"


def one_interval_s(live) -> float:
    intervals = sorted(m.output_interval_ms for m, _ in live.probe.get("telemetry")[-20:] if m.output_interval_ms > 0)
    return intervals[len(intervals) // 2] / 1e3


def test_deactivate_stops_trajectories_within_one_chunk_interval(live):
    from lifecycle_msgs.msg import Transition
    interval = one_interval_s(live)
    n_diag = len(live.probe.get("diagnostics"))
    assert live.transition(Transition.TRANSITION_DEACTIVATE)
    replied = time.time()
    assert live.state() == "inactive"
    at_reply = live.probe.count("traj")
    tel = live.probe.count("telemetry")
    live.probe.wait(lambda: live.probe.count("telemetry") >= tel + 8, 30, "telemetry while deactivated")
    trajs = live.probe.get("traj")
    late = [info["source_timestamp"] * 1e-9 - replied for _, info in trajs if info["source_timestamp"] * 1e-9 > replied]
    assert late == [] or max(late) < interval, f"published {late} s after deactivate (interval {interval:.3f} s)"
    assert len(trajs) <= at_reply + 1
    assert live.probe.count("chunk") <= live.probe.count("traj") + 1
    assert live.probe.count("robot_telemetry") >= tel  # per-robot telemetry also keeps flowing
    # /diagnostics says so (published from the deactivate callback; a periodic status sent just before the
    # transition may still arrive first), and never armed again while inactive
    engine = live.statuses_since(n_diag, "engine")
    first = next((i for i, e in enumerate(engine) if e["armed"] == "False"), None)
    assert first is not None and "disarmed" in engine[first]["_message"], engine
    assert first <= 1 and all(e["armed"] == "False" for e in engine[first:]), engine
    assert live.probe.status("l0")["armed"] == "False"


def test_activate_resumes(live):
    from lifecycle_msgs.msg import Transition
    before = live.probe.count("traj")
    assert live.transition(Transition.TRANSITION_ACTIVATE)
    live.probe.wait(lambda: live.probe.count("traj") >= before + 5, 30, "trajectories again")
    live.probe.wait(lambda: live.probe.status("l0").get("_level") == 0, 10, "stream OK")


def test_silent_robot_turns_error_and_the_rate_decays(live):
    assert float(live.probe.status("l0").get("chunks_per_s", -1)) > 0, live.probe.status("l0")
    live.synthetic.stop(10.0)
    stopped = time.monotonic()
    live.probe.wait(lambda: live.probe.status("l0").get("_level") == 2, 10, "ERROR for a silent robot")
    took = time.monotonic() - stopped
    msg = live.probe.status("l0")["_message"]
    assert "no chunk for" in msg or "starved" in msg, msg
    # within two SLO intervals (+ max_age_s, which still lets the last image through, + reporting periods)
    assert took < 1.0 + 2 * 0.4 + 3.0, took
    live.probe.wait(lambda: live.probe.status("l0").get("chunks_per_s") == "0.000", 10, "the rate to decay to 0")
    live.probe.wait(lambda: "starved" in live.probe.status("l0").get("_message", ""), 10, "a starved verdict")


def test_cleanup_stops_the_workers_and_shutdown_exits_cleanly(live):
    from lifecycle_msgs.msg import Transition
    assert live.transition(Transition.TRANSITION_DEACTIVATE)
    assert live.transition(Transition.TRANSITION_CLEANUP)
    assert live.state() == "unconfigured"
    live.probe.wait(lambda: live.others() == [], 10, "the workers to exit")
    live.probe.wait(lambda: live.probe.status("engine").get("state") == "unconfigured", 10, "unconfigured status")
    assert live.transition(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
    deadline = time.monotonic() + 15
    while live.server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live.server.poll() == 0, live.server.tail(20)
    assert "stopping (lifecycle shutdown)" in live.server.log_path.read_text()
