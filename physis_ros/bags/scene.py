"""The scene bag: 7-DoF arms with a camera watching a moving target, one per robot namespace.

Per namespace and tick ``t`` (``rate`` Hz): ``/<ns>/joint_states`` (positions and
velocities of :meth:`SyntheticScene.joints`) and ``/<ns>/camera/image_raw`` (an
rgb8 view of :meth:`SyntheticScene.image`, a bright disc on a Lissajous path),
both with the same header stamp so that they pair into one observation. The
camera is deliberately not the model's 32x32 so that replay exercises the
node's resize. Robots are offset in time (they are not synchronised), and each
message is logged a few milliseconds after its stamp, as a recorder would.

Output is deterministic: the same arguments give the same messages, stamps and
log times, so the bundled bag can be regenerated and compared.

Faults (:class:`Fault`, ``physis-bag generate --fault KIND@TICK[:NS]``) replace one
tick's message with one the server must reject, named after the server's
rejection counter: ``nonfinite`` (a NaN joint position), ``missing_joints`` (the
joint state lacks the last configured joint), ``size`` (image data one row short
of step x height), ``encoding`` (a yuv422 image, which the server does not take).
``physis-bag check`` on such a bag proves that the checker and the server agree
on what is rejected and that every accepted observation still gets its chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.bags.bagio import BagWriter, typestore
from physis_ros.bags.serveconf import DEFAULT_NAMESPACES, default_joint_names
from physis_ros.model.interface import derived_seed
from physis_ros.observations import SyntheticScene

START_NS = 1_700_000_000_000_000_000   # a fixed epoch, so regeneration is byte-for-byte stable
JOINT_LOG_DELAY_NS = 2_000_000          # joint states reach the recorder 2 ms after their stamp
IMAGE_LOG_DELAY_NS = 6_000_000          # camera frames 6 ms after theirs
ENCODINGS = {"rgb8": 3, "bgr8": 3, "mono8": 1}
# fault kind (the server's rejection counter) -> which message of the tick it spoils
FAULTS = {"nonfinite": "joint_states", "missing_joints": "joint_states", "size": "image", "encoding": "image"}


@dataclass(frozen=True)
class Fault:
    """At ``tick``, in ``namespace`` (None: every robot), a message the server must reject (see FAULTS)."""
    kind: str
    tick: int
    namespace: str | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@TICK`` or ``KIND@TICK:NAMESPACE`` (e.g. ``nonfinite@3:robot0``)."""
        kind, at, rest = text.partition("@")
        tick, _, namespace = rest.partition(":")
        try:
            number = int(tick)
        except ValueError:
            number = -1
        if not at or kind not in FAULTS or number < 0:
            raise ValueError(f"a fault is KIND@TICK[:NAMESPACE] with KIND one of {', '.join(FAULTS)} and TICK >= 0, "
                             f"got '{text}'")
        return cls(kind, number, namespace.strip("/") or None)

    def applies(self, namespace: str, tick: int) -> bool:
        return tick == self.tick and self.namespace in (None, namespace)


@dataclass
class SceneSpec:
    namespaces: tuple[str, ...] = DEFAULT_NAMESPACES
    duration_s: float = 4.0
    rate_hz: float = 10.0
    width: int = 64
    height: int = 48
    encoding: str = "rgb8"
    joint_names: list[str] = field(default_factory=default_joint_names)
    start_ns: int = START_NS
    faults: tuple[Fault, ...] = ()

    def validate(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding '{self.encoding}' not supported; use one of {', '.join(ENCODINGS)}")
        if self.rate_hz <= 0 or self.duration_s <= 0 or self.width < 1 or self.height < 1:
            raise ValueError("rate, duration and image size must be positive")
        if not self.namespaces:
            raise ValueError("give at least one namespace")
        if self.ticks < 1:
            raise ValueError(f"duration {self.duration_s:g} s at {self.rate_hz:g} Hz is less than one observation")
        for f in self.faults:
            if f.kind not in FAULTS:
                raise ValueError(f"unknown fault '{f.kind}'; use one of {', '.join(FAULTS)}")
            if not 0 <= f.tick < self.ticks:
                raise ValueError(f"fault {f.kind}@{f.tick}: the bag has ticks 0..{self.ticks - 1}")
            if f.namespace is not None and f.namespace not in self.namespaces:
                raise ValueError(f"fault {f.kind}@{f.tick}:{f.namespace}: no such namespace "
                                 f"({', '.join(self.namespaces)})")

    @property
    def ticks(self) -> int:
        return int(round(self.duration_s * self.rate_hz))


def scene_phase(namespace: str) -> float:
    return (derived_seed("scene", namespace) % 1000) / 1000.0 * 2 * math.pi


def render_image(spec: SceneSpec, t: float, phase: float) -> np.ndarray:
    """[height, width, channels] uint8 in the spec's encoding."""
    rgb = SyntheticScene.image((3, spec.height, spec.width), t, phase)            # [3, H, W] in [0, 1]
    img = np.round(np.clip(rgb, 0.0, 1.0) * 255.0).astype(np.uint8).transpose(1, 2, 0)
    if spec.encoding == "bgr8":
        img = img[:, :, ::-1]
    elif spec.encoding == "mono8":
        img = np.round(img.astype(np.float32).mean(axis=2, keepdims=True)).astype(np.uint8)
    return np.ascontiguousarray(img)


def joint_velocities(dof: int, t: float, phase: float) -> np.ndarray:
    j = np.arange(dof, dtype=np.float64)
    w = 0.5 * (1 + 0.15 * j)
    return 0.6 * w * np.cos(w * t + phase + j)


def _stamp(ns: int):
    from rosbags.typesys.stores.ros2_kilted import builtin_interfaces__msg__Time as Time
    sec, nsec = divmod(ns, 1_000_000_000)
    return Time(sec=sec, nanosec=nsec)


def scene_messages(spec: SceneSpec):
    """(topic, msgtype, log time ns, raw CDR) in log-time order."""
    spec.validate()
    store = typestore()
    Header = store.types["std_msgs/msg/Header"]
    Image = store.types["sensor_msgs/msg/Image"]
    JointState = store.types["sensor_msgs/msg/JointState"]
    period_ns = int(round(1e9 / spec.rate_hz))
    channels = ENCODINGS[spec.encoding]
    out = []
    for r, ns in enumerate(spec.namespaces):
        phase = scene_phase(ns)
        offset_ns = (period_ns * 37 * r // 100) % period_ns    # robots tick out of step
        for tick in range(spec.ticks):
            stamp = spec.start_ns + offset_ns + tick * period_ns
            t = (stamp - spec.start_ns) / 1e9
            dof = len(spec.joint_names)
            faults = {f.kind for f in spec.faults if f.applies(ns, tick)}
            names = list(spec.joint_names)
            position = SyntheticScene.joints(dof, t, phase).astype(np.float64)
            velocity = joint_velocities(dof, t, phase)
            if "nonfinite" in faults:
                position[min(2, dof - 1)] = np.nan
            if "missing_joints" in faults:
                names, position, velocity = names[:-1], position[:-1], velocity[:-1]
            joints = JointState(
                header=Header(stamp=_stamp(stamp), frame_id=f"{ns}/base_link"),
                name=names, position=position, velocity=velocity, effort=np.zeros(0, dtype=np.float64))
            img = render_image(spec, t, phase)
            encoding, step, data = spec.encoding, spec.width * channels, img.reshape(-1)
            if "encoding" in faults:       # a camera left in YUV mode: 2 bytes per pixel
                encoding, step = "yuv422", spec.width * 2
                data = np.resize(data, step * spec.height)
            if "size" in faults:           # one row short of step x height
                data = data[: step * (spec.height - 1)]
            image = Image(
                header=Header(stamp=_stamp(stamp), frame_id=f"{ns}/camera_optical_frame"),
                height=spec.height, width=spec.width, encoding=encoding, is_bigendian=0,
                step=step, data=np.ascontiguousarray(data))
            out.append((f"/{ns}/joint_states", "sensor_msgs/msg/JointState", stamp + JOINT_LOG_DELAY_NS,
                        bytes(store.serialize_cdr(joints, "sensor_msgs/msg/JointState"))))
            out.append((f"/{ns}/camera/image_raw", "sensor_msgs/msg/Image", stamp + IMAGE_LOG_DELAY_NS,
                        bytes(store.serialize_cdr(image, "sensor_msgs/msg/Image"))))
    out.sort(key=lambda m: m[2])
    return out


def write_scene_bag(out: str | Path, spec: SceneSpec | None = None, storage: str = "mcap") -> dict[str, int]:
    """Write the scene bag to ``out`` (a new rosbag2 directory); returns message counts per topic."""
    spec = spec or SceneSpec()
    with BagWriter(out, storage) as writer:
        for topic, msgtype, log_ns, raw in scene_messages(spec):
            writer.add_topic(topic, msgtype)
            writer.write(topic, log_ns, raw)
        return dict(writer.counts)
