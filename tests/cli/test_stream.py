"""``physis-stream`` against a running server: real subprocesses of the installed command and a real
physis-serve (1 worker, no streams), as an operator on a host without ros2 tooling uses them.

``add`` prints one JSON line with the decision (and writes ``--json``), stays attached while the stream is
served, and cancels on ``--duration`` or Ctrl-C; a refused ``add`` exits 1 with the reason; ``list`` and
``remove`` call the server's services; a server that goes away ends an attached ``add`` with one error
line. (Usage errors, and no server answering: exit 2 with one line, are rows of
tests/cli/test_cli_errors.py.)
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ros"))
from rosprobe import JOINTS, NODE, NODE_ARGS, TAG, Probe, child_env, diag_values, processes_with_marker  # noqa: E402

from physis_ros.launcher import Child, serve_command  # noqa: E402

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

BIN = Path(sys.executable).parent / "physis-stream"
SERVER = f"/{NODE}"
START_TIMEOUT = 90.0


class Cli:
    """One physis-stream process; its stdout lines arrive on a queue as they are printed."""

    def __init__(self, env: dict, *args: str, server: str = SERVER):
        self.args = args
        self.proc = subprocess.Popen([str(BIN), "--server", server, *args], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout: float = 60.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"physis-stream {' '.join(self.args)} printed nothing in {timeout:.0f} s") from None

    def wait(self, timeout: float = 60.0) -> tuple[int, list[str], list[str]]:
        """(exit code, stdout lines, stderr lines but blank ones and the 'wrote FILE' notes of --json)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"physis-stream {' '.join(self.args)} did not end in {timeout:.0f} s") from None
        self._reader.join(5.0)
        err = [line for line in self.proc.stderr.read().splitlines() if line.strip() and not line.startswith("wrote ")]
        return self.proc.returncode, self.stdout, err


class Live:
    def __init__(self, tmp: Path):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile

        self.tmp = tmp
        self.marker = uuid.uuid4().hex
        self.env = child_env(self.marker)
        config = tmp / "serve.yaml"
        config.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
            "model": "tiny-wam", "telemetry_topic": f"/{TAG}_cli_telemetry", "diagnostics_period_s": 0.5,
            "engine": {"workers": 1},
            # a robot here feeds its controller's topic, outside its namespace: the operator allows it
            "admission": {"goal_outputs_outside_namespace": True}}}}))
        self.probe = Probe("physis_stream_cli_probe")
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        self.server = Child("server", serve_command(config, *NODE_ARGS), env=self.env, log=tmp / "serve.log")
        self.clis: list[Cli] = []

    def serving(self) -> bool:
        for msg, _ in reversed(self.probe.get("diagnostics")):
            v = diag_values(msg, "engine")
            if v is not None:
                return v["state"] == "serving"
        return False

    def cli(self, *args: str, server: str = SERVER) -> Cli:
        c = Cli(self.env, *args, server=server)
        self.clis.append(c)
        return c

    def run(self, *args: str, timeout: float = 60.0):
        return self.cli(*args).wait(timeout)

    def add(self, name: str, *extra: str) -> Cli:
        return self.cli("add", "--name", name, "--namespace", f"{TAG}_{name}", "--joints", ",".join(JOINTS), *extra)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("physis_stream"))
    try:
        try:
            live.probe.wait(lambda: live.serving() or live.server.poll() is not None, START_TIMEOUT,
                            "the engine to serve")
        except AssertionError:
            raise AssertionError(f"server log:\n{live.server.tail(40)}") from None
        assert live.server.poll() is None, f"server exited:\n{live.server.tail(40)}"
        yield live
    finally:
        for c in live.clis:              # a failed test may leave an add attached
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait(5.0)
        live.server.stop(30.0)
        live.probe.close()


def decision(line: str) -> dict:
    d = json.loads(line)
    assert set(d) == {"accepted", "reason", "workers"}, d
    return d


def test_add_prints_its_admission_and_duration_cancels_and_a_refused_add_exits_1(live):
    out = live.tmp / "add.json"
    add = live.add("r0", "--duration", "1", "--json", str(out))
    refused = live.add("r9", "--model", "no-such-model", "--json", str(live.tmp / "refused.json"))
    d = decision(add.next_line())
    assert d == {"accepted": True, "reason": "", "workers": ["w0"]}
    assert json.loads(out.read_text()) == d
    # --duration: the goal is cancelled, the capacity freed, exit 0.
    code, stdout, stderr = add.wait()
    assert code == 0, (stdout, stderr)
    assert stderr == []
    end = json.loads(stdout[-1])
    assert (end["outcome"], end["chunks_lost"]) == ("cancelled", 0), end
    assert any(line.startswith("r0: serving,") for line in stdout[1:-1]), stdout
    # A refused add: one JSON line with the reason, the --json file, exit 1.
    code, stdout, stderr = refused.wait()
    assert code == 1 and stderr == [], (stdout, stderr)
    d = decision(stdout[0])
    assert d["accepted"] is False and d["reason"].startswith("unknown-model: ") and d["workers"] == []
    assert json.loads((live.tmp / "refused.json").read_text()) == d and len(stdout) == 1


def test_a_goal_for_a_third_party_family_is_served_by_physis_serve(live, example_family):
    """Issue 53: the example package's family (examples/physis_gmlp, installed as a user installs it) behind a
    running physis-serve through a ServeStream goal naming its model YAML: profiled, its blocks built on the
    worker, served until cancelled, listed under its model's name."""
    add = live.add("g0", "--model", str(example_family), "--duration", "4")
    d = decision(add.next_line(timeout=120.0))
    assert d == {"accepted": True, "reason": "", "workers": ["w0"]}, d
    code, stdout, _ = live.run("list")
    assert code == 0 and any(line.split()[:2] == ["g0", "gmlp-policy"] for line in stdout), stdout
    code, stdout, stderr = add.wait()
    assert code == 0 and stderr == [], (stdout, stderr)
    assert (json.loads(stdout[-1])["outcome"], json.loads(stdout[-1])["chunks_lost"]) == ("cancelled", 0)


def test_list_shows_attached_robots_remove_ends_one_and_ctrl_c_cancels_one(live):
    controller = f"/{TAG}_arm_controller/joint_trajectory"
    removed, interrupted = live.add("r1", "--joint-trajectory-topic", controller), live.add("r2")
    assert decision(removed.next_line())["accepted"] and decision(interrupted.next_line())["accepted"]
    # r1's trajectories go straight to its controller's topic.
    live.probe.wait(lambda: live.probe.node.count_publishers(controller) == 1, 10.0, "r1's trajectory publisher")
    assert live.probe.node.count_publishers(f"/{TAG}_r1/joint_trajectory") == 0
    # While they run, list shows them (and writes --json).
    listed = live.tmp / "list.json"
    code, stdout, stderr = live.run("list", "--json", str(listed))
    assert code == 0 and stderr == [], stderr
    for name in ("r1", "r2"):
        assert any(line.split()[:2] == [name, "tiny-wam"] and f"/{TAG}_{name}" in line and "action" in line
                   for line in stdout), stdout
    rows = json.loads(listed.read_text())["streams"]
    assert sorted((r["stream"], r["model"], r["namespace"], r["origin"], tuple(r["workers"])) for r in rows) == \
        [(n, "tiny-wam", f"{TAG}_{n}", "action", ("w0",)) for n in ("r1", "r2")]
    assert [r["slo_interval_ms"] for r in rows] == [pytest.approx(160.0)] * 2   # 8 steps at 50 Hz: the timeline
    code, stdout, stderr = live.run("remove", "r1")
    assert (code, stdout, stderr) == (0, ["stream 'r1' removed"], [])
    code, stdout, stderr = removed.wait()
    assert code == 1 and stderr == [], (stdout, stderr)            # the server ended it
    assert json.loads(stdout[-1])["outcome"] == "removed"
    # Nothing to remove: exit 1, one error line.
    code, stdout, stderr = live.run("remove", "r1")
    assert code == 1 and stdout == [] and len(stderr) == 1 and stderr[0].startswith("physis-stream: error: "), stderr
    assert "r1" in stderr[0]
    # Ctrl-C: cancelled, capacity freed, exit 0.
    interrupted.proc.send_signal(signal.SIGINT)
    code, stdout, stderr = interrupted.wait()
    assert code == 0 and stderr == [], (stdout, stderr)
    assert json.loads(stdout[-1])["outcome"] == "cancelled"
    code, stdout, _ = live.run("list")
    assert code == 0 and stdout == ["(no stream is served)"]


def listed_names(live) -> list[str]:
    code, stdout, _ = live.run("list")
    assert code == 0, stdout
    return [] if stdout == ["(no stream is served)"] else [line.split()[0] for line in stdout]


def test_a_killed_clients_stream_is_removed_when_its_lease_lapses(live):
    """Issue 46 item 3: kill -9 of physis-stream add left its stream served, holding capacity, for as long as
    anyone watched (206 s+). The add renews a lease (here 2 s) every second; while it lives the stream stays
    (well past the lease), and once it is killed the server removes the stream within the lease."""
    code, _, stderr = live.run("add", "--name", "rx", "--joints", "a", "--lease-s", "0.5")
    assert code == 2 and "--lease-s" in stderr[0], stderr
    add = live.add("r4", "--lease-s", "2")
    assert decision(add.next_line())["accepted"]
    time.sleep(5.0)                                       # 2.5 leases: renewed, still served
    assert "r4" in listed_names(live)
    add.proc.kill()                                       # SIGKILL: no cancel, no goodbye
    add.proc.wait(5.0)
    killed = time.monotonic()
    while "r4" in listed_names(live) and time.monotonic() - killed < 15.0:
        time.sleep(0.2)
    gone_s = time.monotonic() - killed
    print(f"\nr4 removed {gone_s:.1f} s after its client was killed (lease 2 s)")
    assert "r4" not in listed_names(live), "the stream outlived its dead client"
    assert "its client renewed no lease for 2 s" in live.server.log_path.read_text()


def test_an_add_ends_when_the_server_goes_away(live):
    """Bug found: a stopped server sends no result, and physis-stream add waited for it for ever."""
    add = live.add("r3")
    assert decision(add.next_line())["accepted"]
    assert live.server.stop(30.0) == 0
    start = time.monotonic()
    code, stdout, stderr = add.wait(timeout=30.0)
    assert code == 1 and len(stderr) <= 1, (stdout, stderr)
    if stderr:                      # the server went away without ending the goal
        assert stderr[0].startswith("physis-stream: error: ") and "went away" in stderr[0]
    else:                           # or it ended the goal as it stopped
        assert json.loads(stdout[-1])["outcome"] == "shutdown"
    assert time.monotonic() - start < 15.0
    deadline = time.monotonic() + 5
    while processes_with_marker(live.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(live.marker) == []


def test_an_add_to_a_server_that_never_decides_ends_with_a_clear_error(live):
    """Bug found: in a burst of goals the server lost most of them, and physis-stream add waited for a reply
    for ever. A server that takes the goal and never decides (here an action server in this process that
    never answers) ends the add after its --timeout with one line saying so (exit 2), the goal withdrawn."""
    import rclpy.task
    from rclpy.action import ActionServer, CancelResponse

    from physis_ros.action import ServeStream

    cancels = []

    async def never(handle):
        await rclpy.task.Future()          # no feedback, no result

    def cancel(handle):
        cancels.append(handle)
        return CancelResponse.ACCEPT

    with live.probe._spinning:
        mute = ActionServer(live.probe.node, ServeStream, f"/{NODE}_mute/serve_stream", never,
                            cancel_callback=cancel)
    try:
        # 8 s: under the full suite's load the probe's executor has taken over 3 s to accept the goal
        add = live.cli("--timeout", "8", "add", "--name", "mute", "--namespace", f"{TAG}_mute", "--joints",
                       ",".join(JOINTS), server=f"/{NODE}_mute")
        code, stdout, stderr = add.wait(timeout=60.0)
        assert code == 2 and stdout == [], (stdout, stderr)
        assert len(stderr) == 1 and stderr[0].startswith("physis-stream: error: "), stderr
        assert "did not decide within 8 s" in stderr[0], stderr
        live.probe.wait(lambda: len(cancels) == 1, 10.0, "the goal to be withdrawn")
    finally:
        with live.probe._spinning:
            mute.destroy()
