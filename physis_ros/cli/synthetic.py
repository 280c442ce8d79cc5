"""``physis-synthetic``: a stand-in robot. Publishes a camera and joint states per stream.

For every stream of a serve config (or ``--streams``) it publishes, at
``--rate`` Hz, ``<ns>/camera/image_raw`` (``sensor_msgs/Image``, ``--width`` x
``--height``, rgb8 by default: the bundled scene's moving target, seen at a
camera resolution that is not the model's, so the server's preprocessing
works) and ``<ns>/joint_states`` (the scene's arm, plus an extra ``gripper``
joint, in reversed order, so the server's mapping by name works). Image and
joint state of one tick share one header stamp from the node clock. Beside them
it publishes ``<ns>/expert_actions`` (``physis_ros/ActionChunk``, same stamp):
what the scene's scripted expert does for that observation
(:class:`~physis_ros.observations.ScriptedExpert`: the arm towards a pose for
the target it sees), so the server reports its tracking error.

    physis-synthetic [--config config/serve.yaml | --streams ns1,ns2] [--rate 30] [--duration S]
                     [--ros-args ...]

Exit status: 0 stopped (--duration, Ctrl-C, SIGTERM); 2 usage or input error (bad
flag or value, e.g. --rate 0; a physis-synthetic flag placed after --ros-args; serve
config missing, empty, binary or invalid); 70 internal error (a bug; PHYSIS_DEBUG=1
shows the traceback). Errors are one line on stderr:
'physis-synthetic: error: <what and the fix>'.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from physis_ros import heap
from physis_ros.observations import ScriptedExpert, SyntheticScene

JOINTS = [f"joint{i}" for i in range(1, 8)]


@dataclass(frozen=True)
class SyntheticStream:
    """One robot to stand in for: its namespace, joints, and the chunks its expert plans."""

    namespace: str
    joints: list[str] = field(default_factory=lambda: list(JOINTS))
    control_rate_hz: float = 50.0
    horizon: int = 16


def image_bytes(width: int, height: int, t: float, phase: float, encoding: str = "rgb8") -> bytes:
    chw = SyntheticScene.image((3, height, width), t, phase)
    hwc = np.ascontiguousarray((np.transpose(chw, (1, 2, 0)) * 255.0 + 0.5).astype(np.uint8))
    if encoding == "bgr8":
        hwc = np.ascontiguousarray(hwc[:, :, ::-1])
    elif encoding == "mono8":
        hwc = np.ascontiguousarray(hwc.mean(axis=2, keepdims=True).astype(np.uint8))
    return hwc.tobytes()


class SyntheticRobots:
    """Publishers for several streams on one node; call :meth:`tick` with the stamp to publish."""

    def __init__(self, node, streams: dict[str, SyntheticStream], width: int, height: int,
                 encoding: str = "rgb8", extra_joints: bool = True, reliable: bool = True):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image, JointState

        from physis_ros.msg import ActionChunk

        self.node = node
        self.width, self.height, self.encoding = width, height, encoding
        self.extra_joints = extra_joints
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE if reliable
                         else ReliabilityPolicy.BEST_EFFORT)
        expert_qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)   # the server's actions QoS
        self.Image, self.JointState, self.ActionChunk = Image, JointState, ActionChunk
        self.streams = streams
        self.pubs = {}
        for name, s in streams.items():
            prefix = s.namespace.strip("/")
            self.pubs[name] = (node.create_publisher(Image, f"/{prefix}/camera/image_raw", qos),
                               node.create_publisher(JointState, f"/{prefix}/joint_states", qos),
                               node.create_publisher(ActionChunk, f"/{prefix}/expert_actions", expert_qos),
                               SyntheticScene.phase(name), ScriptedExpert(s.horizon, s.control_rate_hz))
        self.ticks = 0

    def expert_msg(self, name: str, stamp_msg, q: np.ndarray, t: float, phase: float, expert: ScriptedExpert):
        s = self.streams[name]
        actions = expert.chunk(q, expert.target(SyntheticScene.disc_center(t, phase), len(q)))
        msg = self.ActionChunk()
        msg.header.stamp = stamp_msg
        msg.stream = name
        msg.chunk_index = self.ticks
        msg.control_period = 1.0 / s.control_rate_hz
        msg.joint_names = list(s.joints)
        msg.horizon, msg.dof = actions.shape
        msg.actions = actions.ravel().tolist()
        return msg

    def tick(self, stamp_msg, t: float) -> None:
        channels = 1 if self.encoding == "mono8" else 3
        for name, (pub_img, pub_js, pub_expert, phase, expert) in self.pubs.items():
            joints = self.streams[name].joints
            img = self.Image()
            img.header.stamp = stamp_msg
            img.header.frame_id = f"{name}_camera"
            img.height, img.width, img.encoding = self.height, self.width, self.encoding
            img.step = self.width * channels
            img.data = image_bytes(self.width, self.height, t, phase, self.encoding)
            js = self.JointState()
            js.header.stamp = stamp_msg
            q = SyntheticScene.joints(len(joints), t, phase)
            positions = q.astype(float).tolist()
            names = list(joints)
            if self.extra_joints:
                names, positions = names + ["gripper"], positions + [0.04]
                names, positions = names[::-1], positions[::-1]
            js.name, js.position = names, positions
            pub_expert.publish(self.expert_msg(name, stamp_msg, q, t, phase, expert))   # first: the server keeps it
            pub_img.publish(img)
            pub_js.publish(js)
        self.ticks += 1


def streams_from_config(path: str) -> dict[str, SyntheticStream]:
    from physis_ros.serving.config import load_serve_config
    from physis_ros.serving.catalog import model_config_of
    cfg = load_serve_config(path)
    out = {}
    for name, s in cfg.streams.items():
        model, _ = model_config_of(s.model or cfg.engine.checkpoint or cfg.model)
        out[name] = SyntheticStream(cfg.namespace_of(name), list(s.joint_names), s.control_rate_hz,
                                    model.control_horizon)
    return out


def main(argv: list[str] | None = None) -> int:
    from physis_ros.console import run_main

    return run_main("physis-synthetic", _main, argv)


def _main(argv: list[str] | None = None) -> int:
    from physis_ros.console import (ArgumentParser, check_yaml_file, nonneg_float, positive_float, positive_int,
                                       split_ros_args)

    p = ArgumentParser(prog="physis-synthetic", description=__doc__)
    p.add_argument("--config", default=None, help="serve YAML whose streams to feed (default config/serve.yaml)")
    p.add_argument("--streams", default="", help="comma-separated namespaces instead of --config (joints joint1..7)")
    p.add_argument("--rate", type=positive_float, default=30.0, help="camera + joint state rate (Hz)")
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--height", type=positive_int, default=64)
    p.add_argument("--encoding", choices=("rgb8", "bgr8", "mono8"), default="rgb8")
    p.add_argument("--best-effort", action="store_true", help="publish best effort (default reliable)")
    p.add_argument("--duration", type=nonneg_float, default=0.0, help="stop after this many seconds (0: until Ctrl-C)")
    args = p.parse_args(split_ros_args("physis-synthetic", sys.argv[1:] if argv is None else argv))
    if args.streams:
        streams = {ns: SyntheticStream(ns) for ns in args.streams.split(",") if ns}
        if not streams:
            p.error("argument --streams: give comma-separated namespaces, e.g. robot0,robot1")
    else:
        from physis_ros.serving.config import default_serve_path
        config = args.config or str(default_serve_path())
        check_yaml_file(config, "--config")
        streams = streams_from_config(config)

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rclpy.init(args=["physis-synthetic", *(sys.argv[1:] if argv is None else argv)],
               signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("physis_synthetic")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    robots = SyntheticRobots(node, streams, args.width, args.height, args.encoding,
                             reliable=not args.best_effort)
    heap.settle(collect=True)   # a full collection over rclpy's objects would stall the cameras
    start = time.monotonic()
    period = 1.0 / args.rate
    next_tick = start
    try:
        while not stop.is_set():
            now = time.monotonic()
            if args.duration and now - start >= args.duration:
                break
            if now >= next_tick:
                stamp = node.get_clock().now()
                robots.tick(stamp.to_msg(), stamp.nanoseconds * 1e-9)
                next_tick += period
                if next_tick < now:  # fell behind (loaded machine): do not burst
                    next_tick = now + period
            executor.spin_once(timeout_sec=max(0.0, min(0.05, next_tick - time.monotonic())))
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    print(f"physis-synthetic: published {robots.ticks} ticks to {len(streams)} stream(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
