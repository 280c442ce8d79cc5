"""Heavy inputs end to end (issue 12): a real server process with two robots, large images on one.

Robot ``a`` gets its joint states and small camera frames from this test (so that the test can pause
them), plus bursts of 1080p and 4K frames (``pad``, the costliest preprocessing) and one 8K frame;
robot ``b`` is fed by the synthetic robot. What must hold:

- ``b``'s chunk rate while ``a`` gets large frames stays within a generous ratio of its rate before
  (decoding and preprocessing never block the executor for long: before, a 4K frame in ``pad`` mode
  held it for about a second); b's observation age meanwhile is printed, not asserted (a CPU hog beside
  the test moves it more than the old defect did);
- the server's RSS returns to within :data:`RSS_MARGIN_MB` of its baseline after the bursts (and the
  8K frame): nothing image-sized is retained;
- the 8K frame is rejected before any work and counted as ``too_large`` on /diagnostics;
- joint states of 1e30 are rejected as ``nonfinite``: no published chunk holds a non-finite value, and
  the engine never has to catch a NaN chunk and reset the stream (1e30 is a finite float32, but the
  model's float32 arithmetic overflows on it).

Large samples and DDS: ``a``'s inputs are RELIABLE (a best-effort reader loses multi-megabyte samples,
which travel as many UDP fragments), and small frames pause during a burst (a KEEP_LAST 5 reader drops
a large sample still in reassembly when five newer small ones overtake it).

Memory: physis-serve makes two process settings (physis_ros/cli/serve.py, config/fastdds.xml) and the
node itself calls ``malloc_trim(0)`` once after a burst of large frames
(:class:`physis_ros.heap.HeapTrimmer`). Measured after 50 1080p + 4 4K frames (baseline
~287 MB; server RSS once settled, above baseline):

- rmw_fastrtps defaults: +72 MB (+160 MB after one 8K frame). Each reader keeps its sample buffers
  at the largest size ever received (~ depth x the largest frame); they are live, no trim returns
  them. Hence Fast DDS readers in the DYNAMIC history memory mode (an XML profile, honoured only
  with RMW_FASTRTPS_USE_QOS_FROM_XML=1).
- DYNAMIC alone: +7, +48 MB (glibc keeps the freed buffers); with a periodic ``malloc_trim(0)``:
  +25, +1 MB (it does not shrink the top of a thread's arena, where the DDS threads' buffers were).
- DYNAMIC and one malloc arena (MALLOC_ARENA_MAX=1): +1 MB in four runs, +18 MB in two.
- DYNAMIC, one arena and the trim after a burst: +0..2 MB in every run (10+).
- (A fixed M_MMAP_THRESHOLD of 1 MB also gives +1 MB, but every large allocation then page-faults
  afresh: rclpy's deserialization of a 1080p frame on the executor thread goes from 1.4 to 6.5 ms,
  4K from 6 to 37 ms.)
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from rclpy.qos import QoSProfile, ReliabilityPolicy

from physis_ros.launcher import Child, serve_command, synthetic_command

from rosprobe import JOINTS, NODE_ARGS, TAG, Probe, child_env, diag_values, processes_with_marker, write_config

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

NS = {"a": f"{TAG}_ha", "b": f"{TAG}_hb"}
RELIABLE = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
START_TIMEOUT = 90.0
RATE_RATIO = 0.5          # b's chunk rate while a gets large frames / before (noisy 2-core VM: generous)
RSS_MARGIN_MB = 16.0      # after the bursts the server's RSS is back within this of its baseline
BURST_1080P, BURST_HZ = 50, 15.0
BURST_4K = 4

def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def frame(width: int, height: int):
    from sensor_msgs.msg import Image
    px = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image(height=height, width=width, encoding="rgb8", step=width * 3, data=px.tobytes())


def stamp_now():
    from physis_ros.ros.conversions import time_msg
    return time_msg(time.time())


class Heavy:
    def __init__(self, tmp: Path):
        from diagnostic_msgs.msg import DiagnosticArray
        from sensor_msgs.msg import Image, JointState

        from physis_ros.msg import ActionChunk

        self.tmp = tmp
        self.marker = uuid.uuid4().hex
        # a's 4K frames (25 MB, reliable, in fragments) can take more than a second to arrive beside a CPU hog,
        # and a frame older than max_age_s is refused as stale before it counts as received: their age is not
        # what this test checks (the bound on it has tests of its own), so a allows 30 s
        a_only = {"image": {"preprocess": "pad", "pad_value": 0.5}, "max_age_s": 30.0,
                  "qos": {"input": {"reliability": "reliable", "depth": 5}}}
        self.config = write_config(tmp / "serve.yaml", {
            name: {"namespace": ns, "joint_names": JOINTS, "max_age_s": 1.0, **(a_only if name == "a" else {})}
            for name, ns in NS.items()},
            diagnostics_period_s=0.5, warn_throttle_s=1.0, engine={"workers": 2, "plan": "stage"})
        self.probe = Probe("physis_heavy_probe")
        for name, ns in NS.items():
            self.probe.subscribe(f"chunk/{name}", ActionChunk, f"/{ns}/action_chunk", RELIABLE)
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        node = self.probe.node
        # depth 200: a large frame stays in the writer's history until the reader has all its fragments
        self.pub_img = node.create_publisher(Image, f"/{NS['a']}/camera/image_raw", QoSProfile(depth=200))
        self.pub_js = node.create_publisher(JointState, f"/{NS['a']}/joint_states", QoSProfile(depth=50))
        self.JointState = JointState
        self.small_images = threading.Event()
        self.good_joints = threading.Event()
        self.small_images.set()
        self.good_joints.set()
        self.stop_threads = threading.Event()
        env = child_env(self.marker)  # physis-serve makes its own memory settings (physis_ros/cli/serve.py)
        self.synthetic = Child("synthetic", synthetic_command(self.config, "--rate", "20", "--width", "40",
                                                              "--height", "30", "--streams", NS["b"]),
                               env=env, log=tmp / "synthetic.log")
        self.server = Child("server", serve_command(self.config, "--duration", "300", *NODE_ARGS), env=env,
                            log=tmp / "serve.log")
        self.rss: list[tuple[float, float]] = []   # (time.monotonic(), MB)
        self.baseline: float | None = None
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._feed_a, self._sample_rss)]
        for t in self.threads:
            t.start()

    def _feed_a(self) -> None:
        small = frame(40, 30)
        while not self.stop_threads.is_set():
            stamp = stamp_now()
            if self.small_images.is_set():
                small.header.stamp = stamp
                self.pub_img.publish(small)
            if self.good_joints.is_set():
                js = self.JointState(name=list(JOINTS), position=[0.1 * i for i in range(7)])
                js.header.stamp = stamp
                self.pub_js.publish(js)
            time.sleep(0.05)

    def _sample_rss(self) -> None:
        while not self.stop_threads.is_set() and self.server.poll() is None:
            try:
                self.rss.append((time.monotonic(), rss_mb(self.server.pid)))
            except (OSError, RuntimeError):
                return
            time.sleep(0.05)

    # ---- reading what happened ----
    def chunks(self, name: str) -> list:
        return [m for m, _ in self.probe.get(f"chunk/{name}")]

    def rate(self, name: str, t0: float, t1: float) -> float:
        """Chunks per second of ``name`` received between wall-clock times t0 and t1."""
        got = [info["received_timestamp"] * 1e-9 for _, info in self.probe.get(f"chunk/{name}")]
        return sum(t0 <= t < t1 for t in got) / (t1 - t0)

    def ages(self, name: str, t0: float, t1: float) -> list[float]:
        """Per chunk of ``name`` received between wall-clock t0 and t1: reception time minus the stamp of
        the observation it was computed from (s). A starved robot acts on old observations."""
        return [info["received_timestamp"] * 1e-9 - (m.header.stamp.sec + m.header.stamp.nanosec * 1e-9)
                for m, info in self.probe.get(f"chunk/{name}")
                if t0 <= info["received_timestamp"] * 1e-9 < t1]

    def baseline_rss(self) -> float:
        """The server's RSS at rest (median over 4 s, measured once, before any large frame)."""
        if self.baseline is None:
            m0 = time.monotonic()
            time.sleep(4.0)
            self.baseline = statistics.median(self.rss_between(m0, time.monotonic()))
        return self.baseline

    def rss_between(self, t0: float, t1: float) -> list[float]:
        return [mb for t, mb in list(self.rss) if t0 <= t <= t1]

    def diag(self, name: str) -> dict[str, str]:
        for array, _ in reversed(self.probe.get("diagnostics")):
            v = diag_values(array, name)
            if v is not None:
                return v
        return {}

    def fresh_diag(self, name: str) -> dict[str, str]:
        """A /diagnostics report published after this call."""
        n = self.probe.count("diagnostics")
        self.probe.wait(lambda: self.probe.count("diagnostics") >= n + 3, 10, "fresh /diagnostics")
        return self.diag(name)

    def publish_frames(self, msg, count: int, hz: float) -> tuple[float, float]:
        """``count`` copies of a large frame at ``hz`` on robot a (small frames paused); wall-clock span."""
        self.small_images.clear()
        time.sleep(0.2)
        t0 = time.time()
        for _ in range(count):
            msg.header.stamp = stamp_now()
            self.pub_img.publish(msg)
            time.sleep(1.0 / hz)
        return t0, time.time()

    def settle_rss(self, baseline: float, timeout: float) -> float:
        """The median RSS over the last second, once it is back within the margin (or at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            median = statistics.median(self.rss_between(now - 1.0, now))
            if median <= baseline + RSS_MARGIN_MB or now > deadline:
                return median

    def close(self) -> tuple[int, int]:
        self.stop_threads.set()
        return self.server.stop(30.0), self.synthetic.stop(10.0)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    h = Heavy(tmp_path_factory.mktemp("heavy"))
    try:
        try:
            h.probe.wait(lambda: all(len(h.chunks(n)) >= 20 for n in NS) or h.server.poll() is not None,
                         START_TIMEOUT, "20 chunks on both streams")
        except AssertionError:
            raise AssertionError(f"server log:\n{h.server.tail(40)}") from None
        assert h.server.poll() is None, f"server exited:\n{h.server.tail(40)}"
        time.sleep(3.0)   # past start-up: steady rates and RSS
        yield h
    finally:
        h.close()
        h.probe.close()


def test_burst_of_large_frames_on_one_robot(heavy):
    h = heavy
    t0 = time.time()
    m0 = time.monotonic()
    baseline = h.baseline_rss()
    before_b = h.rate("b", t0, time.time())
    received0 = int(h.fresh_diag("a").get("images_received", 0))
    assert before_b > 0.0, "b produced no chunks before the burst"

    b0, _ = h.publish_frames(frame(1920, 1080), BURST_1080P, BURST_HZ)
    time.sleep(1.0)    # what was queued gets processed
    received1 = int(h.fresh_diag("a").get("images_received", 0))
    h.publish_frames(frame(3840, 2160), BURST_4K, 2.0)
    # (a bound, not a speed: the whole suite pinned to one core once took more than 10 s, and a burst
    # beside a CPU hog more than 30)
    h.probe.wait(lambda: int(h.diag("a").get("images_received", 0)) > received1, 120, "a 4K frame to get through")
    time.sleep(0.5)
    b1 = time.time()
    during_b, during_a = h.rate("b", b0, b1), h.rate("a", b0, b1)
    received2 = int(h.fresh_diag("a").get("images_received", 0))
    h.small_images.set()
    got_b = sorted(info["received_timestamp"] * 1e-9 for _, info in h.probe.get("chunk/b"))
    gap_b = max(np.diff([t for t in got_b if b0 <= t <= b1] or [b0, b0]), default=0.0)
    age_before = float(np.percentile(h.ages("b", t0, b0), 95))
    age_during = float(np.percentile(h.ages("b", b0, b1), 95))
    peak = max(h.rss_between(m0, time.monotonic()))
    after = h.settle_rss(baseline, 15.0)
    print(f"\nb: {before_b:.1f} chunks/s before, {during_b:.1f} while a got large frames ({during_b / before_b:.2f}), "
          f"longest gap {gap_b * 1e3:.0f} ms, observation age p95 {age_before * 1e3:.0f} -> {age_during * 1e3:.0f} ms; "
          f"a meanwhile: {during_a:.1f}; large frames processed: {received1 - received0} 1080p, "
          f"{received2 - received1} 4K; server RSS {baseline:.0f} MB -> peak {peak:.0f} -> {after:.0f} MB")
    # the large frames got through the transport and were used (else nothing was tested)
    assert received1 - received0 >= BURST_1080P // 5 and received2 > received1
    assert during_b >= RATE_RATIO * before_b, (before_b, during_b)
    # b's observation age while a gets 4K frames is printed above, not asserted: the old code's p95 was ~0.9 s
    # (the executor blocked behind each frame), today's under 0.6 s on a quiet host (the bound it had) and
    # 0.7 s beside a CPU hog, so no bound tells them apart on a loaded machine; the chunk rate above does
    assert during_a > 0.0
    assert after <= baseline + RSS_MARGIN_MB, f"RSS {after:.0f} MB, baseline {baseline:.0f} MB"
    assert h.server.poll() is None


def test_8k_frame_rejected_as_too_large(heavy):
    h = heavy
    baseline = h.baseline_rss()
    before = int(h.diag("a").get("rejected.too_large", 0))
    b_before = len(h.chunks("b"))
    h.publish_frames(frame(7680, 4320), 1, 1.0)   # ~100 MB: the transport alone takes a while
    h.probe.wait(lambda: int(h.diag("a").get("rejected.too_large", 0)) > before, 60,
                 "/diagnostics to count the 8K frame as too_large")
    h.small_images.set()
    log = h.server.log_path.read_text()
    assert "rejected image [too_large]" in log and "7680x4320" in log
    after = h.settle_rss(baseline, 15.0)
    print(f"\nserver RSS {baseline:.0f} MB before the 8K frame, {after:.0f} MB after")
    assert after <= baseline + RSS_MARGIN_MB
    h.probe.wait(lambda: len(h.chunks("b")) >= b_before + 20, 30, "b to keep producing chunks")
    assert h.server.poll() is None


def test_huge_joint_state_rejected_and_no_chunk_is_nonfinite(heavy):
    h = heavy
    before = int(h.diag("a").get("rejected.nonfinite", 0))
    failures = int(h.diag("a").get("resets.nonfinite_output", 0))
    h.good_joints.clear()                     # for a second or more, robot a reports only 1e30 for joint4
    time.sleep(0.1)
    # At least 20 of them, and on until /diagnostics has counted one: a server stalled by the load of the
    # suite can let its KEEP_LAST 5 reader drop a burst of 20 whole (the test then waited in vain)
    deadline, sent = time.monotonic() + 15.0, 0
    while sent < 20 or (int(h.diag("a").get("rejected.nonfinite", 0)) <= before and time.monotonic() < deadline):
        js = h.JointState(name=list(JOINTS), position=[0.1, 0.1, 0.1, 1e30, 0.1, 0.1, 0.1])
        js.header.stamp = stamp_now()
        h.pub_js.publish(js)
        sent += 1
        time.sleep(0.05)
    h.good_joints.set()
    n = len(h.chunks("a"))
    h.probe.wait(lambda: len(h.chunks("a")) >= n + 20, 30, "a to keep producing chunks")
    for name in NS:
        bad = [m.chunk_index for m in h.chunks(name) if not np.isfinite(np.frombuffer(m.actions, np.float32)).all()]
        assert not bad, f"{name}: chunks {bad[:10]} hold non-finite actions"
    # nor did the engine have to catch a NaN chunk and reset the stream (losing chunks in flight)
    caught = [line for line in h.server.log_path.read_text().splitlines() if "non-finite values" in line]
    assert not caught, caught[:2]
    # (a reset for another cause, a chunk late past its bound beside a CPU hog, is not what this checks)
    assert int(h.fresh_diag("a").get("resets.nonfinite_output", 0)) == failures
    # (not all need to arrive: a KEEP_LAST 5 reader may drop some when the machine stalls)
    h.probe.wait(lambda: int(h.diag("a").get("rejected.nonfinite", 0)) > before, 15,
                 "/diagnostics to count the 1e30 joint states as nonfinite")
    assert "rejected joint_states [nonfinite]" in h.server.log_path.read_text()


def test_malformed_cdr_is_counted_per_topic_and_logged_at_most_once_per_period(heavy):
    """Issue 47 item 4: malformed CDR on a camera topic printed 346 lines of Fast CDR exceptions on the server's
    stderr and counted nothing. Now each one is counted on /diagnostics (rejected.undecodable_image) and
    warned about once per warn_throttle_s (1 s in this module's config) at most; robot a keeps being served."""
    h = heavy
    before = int(h.diag("a").get("rejected.undecodable_image", 0))
    garbage = [b"\x00\x01\x00\x00" + bytes([i % 256]) * 40 for i in range(200)]   # CDR header, then nonsense
    start = time.monotonic()
    for raw in garbage:
        h.pub_img.publish(raw)       # bytes: published as serialized CDR as is
        time.sleep(0.005)
    h.probe.wait(lambda: int(h.diag("a").get("rejected.undecodable_image", 0)) >= before + 150, 30,
                 "/diagnostics to count the malformed images")
    log = h.server.log_path.read_text()
    took = time.monotonic() - start
    raw = [line for line in log.splitlines() if "Fast CDR" in line and "could not be decoded" not in line]
    assert raw == [], raw[:3]                          # rmw's own print, one per message, is gone
    warned = log.count("could not be decoded as Image")
    assert 1 <= warned <= 1 + took / 1.0, (warned, took)   # at most one per 1 s throttle period
    n = len(h.chunks("a"))
    h.probe.wait(lambda: len(h.chunks("a")) >= n + 10, 30, "a to keep producing chunks")


def test_clean_stop(heavy):
    server_rc, synthetic_rc = heavy.close()
    assert server_rc == 0, heavy.server.tail(40)
    assert synthetic_rc == 0
    deadline = time.monotonic() + 5
    while processes_with_marker(heavy.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_marker(heavy.marker) == []
