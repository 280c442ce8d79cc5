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

With ``tracking`` the arms follow the scripted expert in closed loop instead: the joint state at each
tick is :class:`~physis_ros.observations.TrackingScene`'s (where the expert's chunk for the previous
tick's observation took the arm), what a robot executing a good policy reports.

A robot served by an action-conditioned world model (ACWM) also needs the actions to
imagine: with an :class:`ActionsSpec` for its namespace, each tick also carries a
``physis_ros/ActionChunk`` (or a ``trajectory_msgs/JointTrajectory``) on its actions
topic with the same header stamp: the scene's planned joint trajectory from that
instant (what :class:`~physis_ros.observations.SyntheticScene` renders as ``actions``),
logged between the joint state and the image.

Faults (:class:`Fault`, ``physis-bag generate --fault KIND@TICK[:NS]``) replace one
tick's message with one the server must reject (:data:`FAULTS`: which message, and
the server's rejection counter it lands in): ``nonfinite`` (a NaN joint position),
``missing_joints`` (the joint state lacks the last configured joint), ``size`` (image
data one row short of step x height), ``encoding`` (a yuv422 image, which the server
does not take); on an actions topic ``actions_nonfinite`` (a NaN action, counted
``nonfinite``), ``actions_malformed`` (an ActionChunk whose values disagree with its
horizon x dof, or a trajectory point short of a position: ``malformed``),
``actions_missing_joints`` (the last joint left out: ``missing_joints``) and
``actions_short`` (fewer steps than the world model imagines: ``size``).
``physis-bag check`` on such a bag proves that the checker and the server agree
on what is rejected and that every accepted observation still gets its chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.bags.bagio import BagWriter, new_message, typestore
from physis_ros.bags.serveconf import DEFAULT_NAMESPACES, default_joint_names
from physis_ros.model.interface import derived_seed
from physis_ros.observations import SyntheticScene, TrackingScene

START_NS = 1_700_000_000_000_000_000   # a fixed epoch, so regeneration is byte-for-byte stable
JOINT_LOG_DELAY_NS = 2_000_000          # joint states reach the recorder 2 ms after their stamp
IMAGE_LOG_DELAY_NS = 6_000_000          # camera frames 6 ms after theirs
ACTIONS_LOG_DELAY_NS = 4_000_000        # actions 4 ms after theirs (a policy's output)
ENCODINGS = {"rgb8": 3, "bgr8": 3, "mono8": 1}
ACTION_CHUNK = "physis_ros/msg/ActionChunk"
JOINT_TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
# fault kind -> which message of the tick it spoils
FAULTS = {"nonfinite": "joint_states", "missing_joints": "joint_states", "size": "image", "encoding": "image",
          "actions_nonfinite": "actions", "actions_malformed": "actions", "actions_missing_joints": "actions",
          "actions_short": "actions"}
# fault kind -> the server's rejection counter (conversions.InputRejected reason) that counts it
FAULT_REASONS = {"nonfinite": "nonfinite", "missing_joints": "missing_joints", "size": "size", "encoding": "encoding",
                 "actions_nonfinite": "nonfinite", "actions_malformed": "malformed",
                 "actions_missing_joints": "missing_joints", "actions_short": "size"}


@dataclass(frozen=True)
class Fault:
    """At ``tick``, in ``namespace`` (None: every robot), a message the server must reject (see FAULTS)."""
    kind: str
    tick: int
    namespace: str | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@TICK`` or ``KIND@TICK:NAMESPACE`` (e.g. ``nonfinite@3:robot0``, ``actions_nonfinite@2``)."""
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

    @property
    def reason(self) -> str:
        """The server's rejection counter for the spoiled message."""
        return FAULT_REASONS[self.kind]


@dataclass(frozen=True)
class ActionsSpec:
    """A robot whose stream imagines actions (an ACWM): per tick one message on ``topic`` (default
    ``/<namespace>/actions``), ``msgtype`` ActionChunk or JointTrajectory, ``horizon`` steps."""
    namespace: str
    topic: str = ""
    msgtype: str = ACTION_CHUNK
    horizon: int = 8

    @property
    def full_topic(self) -> str:
        return self.topic or f"/{self.namespace}/actions"


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
    actions: tuple[ActionsSpec, ...] = ()      # robots that also get actions to imagine
    tracking: bool = False                     # joint states follow the scripted expert (TrackingScene)

    def actions_of(self, namespace: str) -> ActionsSpec | None:
        return next((a for a in self.actions if a.namespace == namespace), None)

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
            if FAULTS[f.kind] == "actions" and not any(
                    f.namespace in (None, a.namespace) for a in self.actions):
                who = f"{f.namespace} has no actions topic" if f.namespace else "no robot has an actions topic"
                raise ValueError(f"fault {f.kind}@{f.tick}{':' + f.namespace if f.namespace else ''}: {who} "
                                 f"(only a world model's stream takes actions)")
        for a in self.actions:
            if a.namespace not in self.namespaces:
                raise ValueError(f"actions for '{a.namespace}': no such namespace ({', '.join(self.namespaces)})")
            if a.msgtype not in (ACTION_CHUNK, JOINT_TRAJECTORY):
                raise ValueError(f"actions for '{a.namespace}': type {a.msgtype} is neither {ACTION_CHUNK} nor "
                                 f"{JOINT_TRAJECTORY}")
            if a.horizon < 1:
                raise ValueError(f"actions for '{a.namespace}': horizon must be >= 1, got {a.horizon}")
        if len({a.namespace for a in self.actions}) != len(self.actions):
            raise ValueError("one actions topic per namespace")

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


def planned_actions(dof: int, horizon: int, t: float, phase: float, rate_hz: float) -> np.ndarray:
    """[horizon, dof] float32: the scene's planned joint trajectory from time ``t`` (step k at
    ``t + k / (horizon * rate_hz)``), as :class:`SyntheticScene` renders ``actions``."""
    steps = np.arange(horizon, dtype=np.float32) / (horizon * rate_hz)
    return np.stack([SyntheticScene.joints(dof, t + s, phase) for s in steps]).astype(np.float32)


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
        acts = spec.actions_of(ns)
        phase = scene_phase(ns)
        offset_ns = (period_ns * 37 * r // 100) % period_ns    # robots tick out of step
        dof = len(spec.joint_names)
        arm = TrackingScene({"state": (dof,)}, spec.rate_hz) if spec.tracking else None
        for tick in range(spec.ticks):
            stamp = spec.start_ns + offset_ns + tick * period_ns
            t = (stamp - spec.start_ns) / 1e9
            faults = {f.kind for f in spec.faults if f.applies(ns, tick)}
            names = list(spec.joint_names)
            if arm is not None:
                position = arm.observation_state(ns, tick, dof).astype(np.float64)
                velocity = (arm.observation_state(ns, tick + 1, dof) - position) * spec.rate_hz
            else:
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
            if acts is not None:
                msg = actions_message(spec, acts, ns, tick, stamp, t, phase, faults)
                out.append((acts.full_topic, acts.msgtype, stamp + ACTIONS_LOG_DELAY_NS,
                            bytes(store.serialize_cdr(msg, acts.msgtype))))
    out.sort(key=lambda m: m[2])
    return out


def actions_message(spec: SceneSpec, acts: ActionsSpec, namespace: str, tick: int, stamp_ns: int, t: float,
                    phase: float, faults: set[str]):
    """One tick's actions to imagine (a rosbags message of ``acts.msgtype``), spoiled by ``faults``."""
    names = list(spec.joint_names)
    period = 1.0 / (acts.horizon * spec.rate_hz)
    values = planned_actions(len(names), acts.horizon, t, phase, spec.rate_hz)
    if "actions_nonfinite" in faults:
        values[min(1, len(values) - 1), min(2, len(names) - 1)] = np.nan
    if "actions_missing_joints" in faults:
        names, values = names[:-1], values[:, :-1]
    if "actions_short" in faults:
        values = values[: max(0, acts.horizon // 2)]
    header = new_message("std_msgs/msg/Header", stamp=_stamp(stamp_ns), frame_id=f"{namespace}/base_link")
    if acts.msgtype == JOINT_TRAJECTORY:
        points = []
        for k, row in enumerate(values.astype(np.float64)):
            if "actions_malformed" in faults and k == 0:
                row = row[:-1]                       # a point short of a position
            sec, nsec = divmod(int(round((k + 1) * period * 1e9)), 1_000_000_000)
            points.append(new_message("trajectory_msgs/msg/JointTrajectoryPoint", positions=np.ascontiguousarray(row),
                                      time_from_start=new_message("builtin_interfaces/msg/Duration", sec=sec,
                                                                  nanosec=nsec)))
        return new_message(JOINT_TRAJECTORY, header=header, joint_names=names, points=points)
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if "actions_malformed" in faults:
        flat = flat[:-1]                              # one value short of horizon x dof
    # Only the fields a policy's chunk must carry: the rest (timeline bookkeeping of this server's own
    # chunks) stays at its default, whatever this package's ActionChunk.msg adds.
    return new_message(ACTION_CHUNK, header=header, stream=namespace, chunk_index=tick, control_period=period,
                       joint_names=names, horizon=len(values), dof=len(names), actions=flat)


def scene_actions(serve, namespaces) -> tuple[ActionsSpec, ...]:
    """The actions topics a scene bag needs for a serve config (:class:`~physis_ros.bags.serveconf.ServeInfo`):
    one per world-model stream among ``namespaces``, with the stream's actions topic, type and the horizon its
    model imagines; none where the actions come from the server itself (another stream's output)."""
    fed = serve.fed_by_outputs()
    return tuple(ActionsSpec(s.namespace, s.topics["actions"], s.types["actions"],
                             s.model_config.observation_shapes["actions"][0])
                 for s in serve.streams
                 if "actions" in s.topics and s.namespace in namespaces and s.topics["actions"] not in fed)


def write_scene_bag(out: str | Path, spec: SceneSpec | None = None, storage: str = "mcap") -> dict[str, int]:
    """Write the scene bag to ``out`` (a new rosbag2 directory); returns message counts per topic."""
    spec = spec or SceneSpec()
    with BagWriter(out, storage) as writer:
        for topic, msgtype, log_ns, raw in scene_messages(spec):
            writer.add_topic(topic, msgtype)
            writer.write(topic, log_ns, raw)
        return dict(writer.counts)
