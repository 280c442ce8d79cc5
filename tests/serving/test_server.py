"""The Server API with real workers: without ROS in the process, bit for bit against the sequential
reference; refusals with their labels; leaving frees room; a killed worker resets the stream, which
carries on in a new epoch; the config's streams admitted at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from physis_ros.serving import REASONS, Rejected, Server, health
from waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROFILES = str(ROOT / "config" / "profiles")
JOINTS = [f"j{i}" for i in range(7)]


def config(**extra) -> dict:
    return {"model": "tiny-wam", "engine": {"workers": 1}, "admission": {"profiles": PROFILES}, **extra}


class Robot:
    """Sends an observation every ``period_s`` from a thread of its own, as a camera would."""

    def __init__(self, session, period_s: float = 0.02):
        self.session, self.period_s = session, period_s
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        frame = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        while not self.stop.wait(self.period_s):
            try:
                self.session.observe(images={"camera": frame}, state=np.zeros(7), stamp_s=time.time())
            except RuntimeError:   # the stream ended
                return
            except Exception as exc:   # noqa: BLE001 (a test reports what went wrong)
                self.errors.append(repr(exc))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)


def test_the_server_api_serves_without_ros_bit_for_bit_as_the_reference():
    """In a process where importing rclpy or any ROS message package raises (tests/serving/no_ros_client.py)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("no_ros_client.py")), PROFILES],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ros_imported"] == []
    assert out["chunk_without_observation"] is False
    assert out["indices"] == [0, 1, 2, 3, 4] and out["equal"] == [True] * 5, out
    assert out["stamps"] == [0.0, 0.01, 0.02, 0.03, 0.04]
    rejected = out["rejected"]
    expect = {"bad-field": ("invalid-request", "streams.r1.control_rate_hz"),
              "unknown-key": ("invalid-request", "streams.r1.speed"), "in-use": ("name-in-use", "r0"),
              "bad-name": ("invalid-request", "9 lives"), "no-model": ("unknown-model", "no-such-model"),
              "timeline": ("timeline", "slo_interval_ms"), "joints": ("model-mismatch", "joint_names")}
    for case, (label, named) in expect.items():
        assert rejected[case] is not None, f"{case} was admitted"
        assert rejected[case][0] == label and named in rejected[case][1], (case, rejected[case])
        assert label in REASONS
    assert out["events"][0] == ["r0", "joined", "api"] and out["events"][-1] == ["r0", "ended", "left"]
    assert [e[1] for e in out["events"][1:-1]] == ["rejected"] * len(expect)
    assert out["streams"]["r0"]["workers"] == ["w0"] and out["streams_after"] == {}
    assert out["stats"]["total"] == 5 and out["stats"]["received"] == {"images": 5, "joints": 5}
    assert out["stats"]["rss_bytes"] > 0
    assert "ended (left)" in out["after_leave"]


def test_capacity_is_refused_with_its_label_and_leaving_frees_it():
    with Server.from_config(config(engine={"workers": 1, "max_streams": 1})) as server:
        server.join("r0", joint_names=JOINTS)
        with pytest.raises(Rejected) as exc:
            server.join("r1", joint_names=JOINTS)
        assert exc.value.label == "capacity" and "engine.max_streams" in exc.value.detail
        assert exc.value.cause == "stream-limit"
        with pytest.raises(KeyError, match="r1"):
            server.leave("r1")
        server.leave("r0")
        assert server.streams() == {}
        robot = Robot(server.join("r1", joint_names=JOINTS))
        try:
            assert server.session("r1").next_chunk(timeout_s=30.0).actions.shape == (16, 7)
        finally:
            robot.close()
        assert robot.errors == []
        assert server.rejections[-1][:2] == ("r1", "capacity")
    assert server.state == "stopped"
    with pytest.raises(Rejected) as exc:
        server.join("r2", joint_names=JOINTS)
    assert exc.value.label == "not-serving"


def test_a_killed_worker_resets_the_stream_which_carries_on_in_a_new_epoch():
    events = []
    with Server.from_config(config()) as server:
        server.subscribe(events.append)
        session = server.join("r0", joint_names=JOINTS)
        robot = Robot(session)
        try:
            first = session.next_chunk(timeout_s=30.0)
            assert first.epoch == 0
            pid = server.stats()["workers"]["w0"]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: any(e.kind == "readmitted" for e in events), 60.0, "the stream re-admitted")
            while True:
                chunk = session.next_chunk(timeout_s=30.0)
                if chunk.epoch == 1:
                    break
            stats = server.stats()
        finally:
            robot.close()
    kinds = [e.kind for e in events if e.stream == "r0"]
    assert kinds[:2] == ["joined", "reset"] and "readmitted" in kinds and kinds[-1] == "ended", kinds
    reset = next(e for e in events if e.kind == "reset")
    assert reset.reason and "w0" in reset.detail, reset
    s = stats["streams"]["r0"]
    assert s["failures"] == 1 and s["epoch"] == 1 and sum(s["resets"].values()) == 1, s
    assert stats["workers"]["w0"]["pid"] != pid and stats["workers"]["w0"]["stats"]["restarts"] == 1
    assert robot.errors == []


def test_the_configs_streams_are_admitted_at_start_and_a_refused_one_is_recorded():
    streams = {"r0": {"joint_names": JOINTS}, "r1": {"joint_names": JOINTS, "slo_interval_ms": 1.0}}
    events = []
    server = Server.from_config(config(streams=streams))
    server.subscribe(events.append)
    with server:
        assert server.startup["r0"] == "admitted" and server.startup["r1"].startswith(("capacity", "slo-too-tight"))
        assert list(server.streams()) == ["r0"] and server.streams()["r0"]["origin"] == "config"
        robot = Robot(server.session("r0"))
        try:
            assert server.session("r0").next_chunk(timeout_s=30.0).index == 0
            # the health verdicts /diagnostics publishes, without ROS: from the server's figures alone
            verdicts = {s.name: s for s in health.statuses(server.stats(), server.config, health.Reporter(), {},
                                                           pending={"r1": server.startup["r1"]})}
        finally:
            robot.close()
    assert verdicts["physis_server: engine"].level == health.OK, verdicts
    assert verdicts["physis_server: r0"].values["chunks_total"] >= 1, verdicts["physis_server: r0"]
    assert verdicts["physis_server: r1"].level == health.ERROR and "not admitted" in verdicts["physis_server: r1"].message
    assert any(name.startswith("physis_server: worker") for name in verdicts), verdicts
    assert [(e.stream, e.kind) for e in events] == [("r0", "joined"), ("r1", "rejected"), ("r0", "ended")]
    assert events[-1].reason == "shutdown"
    report = server.report()   # the exit summary: the stream served, and the config stream refused
    assert report["r0"]["ended"] == "shutdown" and report["r0"]["chunks"] >= 1, report
    assert report["r0"]["latency_ms_p50"] > 0 and report["r0"]["origin"] == "config", report
    json.loads(json.dumps(report), parse_constant=lambda c: pytest.fail(f"{c} in the exit totals: not JSON"))
    assert report["r1"]["not_admitted"] == server.startup["r1"] and report["r1"]["chunks"] == 0, report


def test_a_run_time_update_may_change_only_the_keys_that_change_at_run_time():
    """The rule the ROS parameters enforce holds for the Python API too: check_update refuses a change of a
    key that needs a restart (or, for a stream, serving it again), naming the key; a run-time key passes."""
    import dataclasses

    from physis_ros.config import ConfigError
    with Server.from_config(config(streams={"r0": {"joint_names": JOINTS}})) as server:
        cfg = server.config
        r0 = cfg.streams["r0"]
        server.check_update(dataclasses.replace(cfg, warn_throttle_s=cfg.warn_throttle_s + 1.0))
        server.check_update(dataclasses.replace(cfg, streams={"r0": dataclasses.replace(r0, max_age_s=2.0)}))
        with pytest.raises(ConfigError) as exc:
            server.check_update(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_streams=3)))
        assert exc.value.key == "engine.max_streams" and "restart" in str(exc.value)
        with pytest.raises(ConfigError) as exc:
            server.check_update(dataclasses.replace(cfg, streams={"r0": dataclasses.replace(r0, namespace="x")}))
        assert exc.value.key == "streams.r0.namespace" and "serve it again" in str(exc.value)
