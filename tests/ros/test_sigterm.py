"""SIGTERM ends physis-serve cleanly and soon whatever it is doing (issue 46 item 2): measuring a model's first
profile for a goal, or bringing back a worker that was killed. A real server process, a real goal from this
process, real signals; every process of the server (workers, the profile child) gone afterwards."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import yaml

from physis_ros.launcher import Child, serve_command

from rosprobe import JOINTS, NODE, NODE_ARGS, TAG, Probe, child_env, processes_with_marker

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

START_TIMEOUT = 90.0
STOP_S = 5.0        # what the issue asks of a SIGTERM
SLACK_S = 5.0       # a loaded CI host's scheduling on top (the time taken is printed)


def processes_running(marker: str, what: str) -> list[int]:
    found = []
    for pid in processes_with_marker(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if what.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


class Server:
    def __init__(self, tmp, streams: dict | None = None, **admission):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile

        self.marker = uuid.uuid4().hex
        config = tmp / "serve.yaml"
        config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
            "model": "tiny-wam", "diagnostics_period_s": 0.5, "telemetry_topic": f"/{TAG}_sigterm_telemetry",
            "engine": {"workers": 1, "heartbeat_timeout_s": 2.0}, "streams": streams or {},
            "admission": {"profiles": "", **admission}}}}))
        self.probe = Probe("physis_sigterm_probe")
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        self.server = Child("server", serve_command(config, *NODE_ARGS), env=child_env(self.marker),
                            log=tmp / "serve.log")

    def engine_state(self) -> str | None:
        return self.probe.status("engine").get("state")

    def wait_serving(self) -> None:
        try:
            self.probe.wait(lambda: self.engine_state() == "serving" or self.server.poll() is not None,
                            START_TIMEOUT, "the engine to serve")
        except AssertionError:
            raise AssertionError(f"server log:\n{self.server.tail(40)}") from None
        assert self.server.poll() is None, self.server.tail(40)

    def sigterm(self) -> tuple[int | None, float]:
        """SIGTERM; (exit code, seconds until it exited), or (None, ...) if it did not within the bound."""
        start = time.monotonic()
        self.server.proc.send_signal(signal.SIGTERM)
        deadline = start + STOP_S + SLACK_S
        while self.server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.server.poll(), time.monotonic() - start

    def close(self) -> None:
        self.server.stop(10.0)
        self.probe.close()


def no_process_left(marker: str) -> None:
    deadline = time.monotonic() + 5.0
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(marker) == []


def test_sigterm_while_a_model_is_profiled_for_a_goal(tmp_path):
    """Was: a goal for a big model made the server profile it in-process for minutes, and SIGTERM was not
    enough (the catalog's thread was joined at exit): SIGKILL was needed."""
    from physis_ros.action import ServeStream

    s = Server(tmp_path, profile_repeats=1000, profile_timeout_s=3600.0)   # minutes of measurement
    try:
        s.wait_serving()
        client = s.probe.action_client(ServeStream, f"/{NODE}/serve_stream")
        assert client.wait_for_server(timeout_sec=10.0)
        client.send_goal_async(ServeStream.Goal(stream="r", topic_namespace=f"{TAG}_r", joint_names=JOINTS))
        s.probe.wait(lambda: processes_running(s.marker, "physis_ros.cli.profile"), 30.0, "a profile child")
        time.sleep(1.0)                                       # well into it
        code, took = s.sigterm()
        print(f"\nSIGTERM while profiling: exit {code} after {took:.2f} s")
        assert code == 0, (code, took, s.server.tail(30))
        assert took <= STOP_S + SLACK_S
        no_process_left(s.marker)
    finally:
        s.close()


def test_sigterm_while_a_killed_worker_is_brought_back(tmp_path):
    s = Server(tmp_path, streams={"r0": {"namespace": f"{TAG}_r0", "joint_names": JOINTS}})
    try:
        s.wait_serving()
        (worker,) = processes_running(s.marker, "physis_ros.cli.worker")
        import os
        os.kill(worker, signal.SIGKILL)
        s.probe.wait(lambda: s.engine_state() != "serving" or "w0" in s.server.log_path.read_text(), 10.0,
                     "the server to see its worker gone")
        code, took = s.sigterm()
        print(f"\nSIGTERM while a worker is brought back: exit {code} after {took:.2f} s")
        assert code is not None and code in (0, 1), (code, took, s.server.tail(30))
        assert took <= STOP_S + SLACK_S
        no_process_left(s.marker)
    finally:
        s.close()
