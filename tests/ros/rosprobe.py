"""Test helpers: an out-of-process ROS observer/publisher, the server/synthetic child processes, and the
server node in this process with one stream's ROS side and no engine (:func:`served_stream`).

Each test process uses a ROS domain and topic namespaces of its own (from its
pid), so that concurrent runs on one machine do not hear each other.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import yaml

from physis_ros.config import repo_config_dir
from domains import domain

TAG = f"t{os.getpid()}"
DOMAIN = domain("servers")
NODE = f"physis_server_{TAG}"                       # servers run under this name: /diagnostics are ours
NODE_ARGS = ("--ros-args", "-r", f"__node:={NODE}")
JOINTS = [f"joint{i}" for i in range(1, 8)]


def child_env(marker: str) -> dict[str, str]:
    # PHYSIS_TEST_MARKER is inherited by the server's workers: it finds orphans.
    return {**os.environ, "ROS_DOMAIN_ID": str(DOMAIN), "PHYSIS_TEST_MARKER": marker, "PYTHONUNBUFFERED": "1"}


def processes_with_marker(marker: str) -> list[int]:
    found = []
    needle = f"PHYSIS_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


SHIPPED_PROFILES = str(repo_config_dir() / "profiles")


def write_config(path: Path, streams: dict, **top) -> Path:
    """A server config. Admission decides on the CPU profiles shipped in config/profiles unless ``admission``
    says otherwise: a profile measured at start-up, at the lowest priority beside the workers' own start-up,
    read 70 ms a chunk on a slow CI host and refused the second robot of a test that is not about admission."""
    admission = {"profiles": SHIPPED_PROFILES, **top.pop("admission", {})}
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": {**top, "admission": admission, "streams": streams}}}))
    return path


class Probe:
    """A node in this (test) process, spun on a background thread; records what it hears."""

    def __init__(self, name: str = "physis_test_probe"):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=DOMAIN)
        self.node = rclpy.create_node(f"{name}_{TAG}", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.lock = threading.Lock()
        self.msgs: dict[str, list] = defaultdict(list)   # key -> [(msg, info)]
        self._spinning = threading.Lock()   # held around each spin_once (see action_client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            try:
                with self._spinning:
                    self.executor.spin_once(timeout_sec=0.02)
            except Exception:  # shutting down
                if self._stop.is_set():
                    return
                raise

    def action_client(self, action_type, name: str):
        """An ActionClient on this node, made while the executor is between spins: rclpy's ActionClient adds
        itself to the node before it makes its lock, and an executor that looks at it in between dies with
        AttributeError '_lock' (seen on a slow CI host: the probe then heard nothing more)."""
        from rclpy.action import ActionClient

        with self._spinning:
            return ActionClient(self.node, action_type, name)

    def subscribe(self, key: str, msg_type, topic: str, qos) -> None:
        def callback(msg, info):
            with self.lock:
                self.msgs[key].append((msg, info))
        self.node.create_subscription(msg_type, topic, callback, qos)

    def get(self, key: str) -> list:
        with self.lock:
            return list(self.msgs[key])

    def status(self, what: str, key: str = "diagnostics") -> dict[str, str]:
        """The newest /diagnostics values (:func:`diag_values`) of our server's status ``what`` heard on
        ``key``; {} if none yet."""
        for msg, _ in reversed(self.get(key)):
            v = diag_values(msg, what)
            if v is not None:
                return v
        return {}

    def count(self, key: str) -> int:
        with self.lock:
            return len(self.msgs[key])

    def wait(self, predicate, timeout: float, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        if not predicate():
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")

    def close(self) -> None:
        import rclpy
        self._stop.set()
        self._thread.join(5.0)
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def diag_values(array_msg, what: str) -> dict[str, str] | None:
    """Values of our server's status ``what`` (``engine``, ``worker w0``, a stream name), or None."""
    for status in array_msg.status:
        if status.name == f"{NODE}: {what}":
            out = {kv.key: kv.value for kv in status.values}
            out["_level"] = int.from_bytes(status.level, "little") if isinstance(status.level, bytes) else status.level
            out["_message"] = status.message
            out["_hardware_id"] = status.hardware_id
            return out
    return None


def admitted_stream(node, name: str, cfg):
    """Stream ``name``'s ROS side as the node makes it once the server admitted it on w0, with no engine: its
    session registered with a server that is not started."""
    from physis_ros.ros.stream_topics import RosStream

    session = registered_session(node, name, cfg, "config")
    st = RosStream(node, session)
    session.on_chunk = st.on_chunk
    return st


def registered_session(node, name: str, cfg, origin: str):
    """A session of stream ``name`` as the node's server holds one it admitted on w0 (``origin``: config, action,
    or another front end's, openpi), with no engine and no ROS side."""
    from physis_ros.runtime.streams import ServedModel
    from physis_ros.serving.fit import slo_interval_ms, stream_timeline
    from physis_ros.serving.intake import StreamInput
    from physis_ros.serving.server import Server
    from physis_ros.serving.session import Session

    if node.server is None:
        node.server = Server(node.config, clock=node.now)
    c = node.config
    paired = [k for k in node.model.observation_shapes if k != "image"]
    slo = slo_interval_ms(cfg, node.model)
    session = Session(name, cfg, ServedModel(node.model), origin, ["w0"], slo,
                      StreamInput(c.deterministic, c.deterministic_queue, c.pair_timeout_s, cfg.max_age_s, node.now,
                                  paired), node.now,
                      timeline=stream_timeline(cfg, node.model, c.deterministic, slo, c.admission.pace_margin))
    node.server._sessions[name] = session   # (what Server.admit does once the engine runs the stream)
    return session


@contextlib.contextmanager
def served_stream(*ros_args: str, armed: bool = False):
    """The real node (config/serve.yaml, then ``ros_args``) and the ROS side of its first config stream, no
    engine: the tests play its events and outputs. ``armed``: the stream joins an active node (its outputs
    publish)."""
    import rclpy

    from physis_ros.ros.node import PhysisServer

    context = rclpy.Context()
    rclpy.init(args=["physis-serve", "--ros-args", "--params-file", str(repo_config_dir() / "serve.yaml"), *ros_args],
               context=context, domain_id=DOMAIN)
    try:
        node = PhysisServer(context=context)
        try:
            node.armed = armed
            name, cfg = next(iter(node.config.streams.items()))
            st = node.streams[name] = admitted_stream(node, name, cfg)
            node.state = "serving"
            yield node, name, st
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)
