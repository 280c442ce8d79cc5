"""``physis-serve --openpi PORT``: openpi clients served by the real program, alone without ROS
(``--no-ros``) and beside the ROS node's robots, sharing its workers and admission."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from domains import domain
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosedError

from physis_ros.launcher import Child, serve_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROFILES = str(ROOT / "config" / "profiles")
OBS = {"observation/image": np.zeros((96, 128, 3), np.uint8), "observation/state": np.zeros(7, np.float32)}


def start(tmp: Path, config: dict, *flags: str, domain_id: int | None = None) -> tuple[Child, int]:
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "ROS_DOMAIN_ID": str(domain("spare") if domain_id is None else domain_id),
           "PYTHONUNBUFFERED": "1"}
    child = Child("physis-serve", serve_command(path, "--openpi", "0", *flags), env=env, log=tmp / "serve.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"ws://127\.0\.0\.1:(\d+)", child.tail(200))
        if found:
            return child, int(found.group(1))
        if child.poll() is not None:
            break
        time.sleep(0.1)
    child.stop()
    raise AssertionError(f"physis-serve did not listen for openpi clients:\n{child.tail()}")


def infer_until_served(url: str, timeout_s: float = 60.0) -> tuple[WebsocketClientPolicy, dict]:
    """Connect and infer, asking again while the server answers 'not serving yet' (1013)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            policy = WebsocketClientPolicy(url)
            return policy, policy.infer(OBS)
        except ConnectionClosedError as exc:
            if "not-serving" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_no_ros_serves_openpi_clients_alone_and_reports_them(tmp_path):
    summary = tmp_path / "summary.json"
    config = {"model": "tiny-wam", "engine": {"workers": 2}, "admission": {"profiles": PROFILES},
              "streams": {"robot0": {"joint_names": [f"j{i}" for i in range(7)]}}}
    child, port = start(tmp_path, config, "--no-ros", "--summary-json", str(summary))
    try:
        policy, reply = infer_until_served(f"ws://127.0.0.1:{port}/?name=arm")
        assert reply["actions"].shape == (16, 7) and np.isfinite(reply["actions"]).all()
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        assert "rclpy" not in maps and "librcl" not in maps   # no ROS in the process
        for k in range(1, 3):
            assert policy.infer(OBS)["server_timing"]["chunk"] == k
        policy._ws.close()
    finally:
        code = child.stop()
    log = child.tail(50)
    assert code == 0, log
    assert "leaves out the config's streams (robot0)" in log and "Traceback" not in log
    assert "arm: 3 chunks" in log
    out = json.loads(summary.read_text())
    assert out["exit"] == 0 and out["streams"]["arm"]["chunks"] == 3 and out["openpi"]["counts"]["infers"] == 3


def test_beside_the_ros_node_openpi_clients_share_its_admission_and_its_diagnostics(tmp_path):
    """One config robot (ROS topics) and engine.max_streams 2: one openpi client is served, a second is
    refused for capacity, and the client is a stream on /diagnostics (OK while it is idle between requests:
    a request stream computes only when asked)."""
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile

    sys.path.insert(0, str(ROOT / "tests" / "ros"))
    from rosprobe import DOMAIN, NODE_ARGS, Probe

    config = {"/**": {"ros__parameters": {
        "model": "tiny-wam", "engine": {"workers": 1, "max_streams": 2}, "admission": {"profiles": PROFILES},
        "telemetry_topic": "/openpi_test_telemetry", "diagnostics_period_s": 0.5, "diagnostics_starved_s": 1.0,
        "streams": {"robot0": {"namespace": "openpi_test_robot0", "joint_names": [f"j{i}" for i in range(7)]}}}}}
    probe = Probe("physis_openpi_probe")
    probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
    child, port = start(tmp_path, config, "--duration", "60", *NODE_ARGS, domain_id=DOMAIN)
    try:
        policy, reply = infer_until_served(f"ws://127.0.0.1:{port}/?name=arm")
        assert reply["actions"].shape == (16, 7)
        with pytest.raises(ConnectionClosedError, match="capacity.*engine.max_streams=2"):
            WebsocketClientPolicy(f"ws://127.0.0.1:{port}/?name=second")
        time.sleep(2.0)    # idle past diagnostics_starved_s
        probe.wait(lambda: probe.status("arm").get("chunks_total") == "1", 20, "the openpi stream on /diagnostics")
        arm = probe.status("arm")
        assert arm["_level"] == 0 and "on request" in arm["_message"], arm
        policy._ws.close()
    finally:
        code = child.stop()
        probe.close()
    assert code == 0, child.tail()
    assert "Traceback" not in child.tail(400)
