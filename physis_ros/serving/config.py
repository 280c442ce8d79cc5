"""The serve config (``config/serve.yaml``) in config.py's typed dataclasses, validated once at the edge.

The same file serves two front ends:

- ``physis-serve --config config/serve.yaml``: read here, as a plain mapping;
- ``ros2 launch physis_ros serve.launch.py``: handed to the node as a ROS 2
  parameters file (``/**: ros__parameters: ...``); the node rebuilds the mapping
  from its parameters (``engine.workers`` -> ``{"engine": {"workers": ...}}``).

A ROS 2 parameters file cannot hold a list of mappings, so ``streams`` is a
mapping from stream name to its settings. Precedence, lowest first: the file,
ROS parameters (``--ros-args -p``/``--params-file``), command-line flags.
Errors name the dotted key (``streams.robot0.joint_names``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from physis_ros.config import ConfigError, bounded, described, from_mapping, load_yaml, repo_config_dir
from physis_ros.runtime.settings import EngineConfig
from physis_ros.serving.openpi_config import OpenpiConfig
from physis_ros.serving.policies import resolve_policy

PREPROCESS_MODES = ("resize", "center_crop", "pad")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_TOPIC = re.compile(r"^/?[A-Za-z~][A-Za-z0-9_/{}~]*$")
MAX_STREAM_NAME = 64        # characters of a stream's name (it names its parameters, diagnostics, namespace)
ROS_TOPIC_MAX = 247         # characters of a full topic name (rmw's RMW_TOPIC_MAX_NAME_LENGTH, 255 - 8)


def check_stream_name(name: str, key: str) -> None:
    """ConfigError naming ``key`` unless ``name`` can name a stream."""
    if not _NAME.match(name or ""):
        raise ConfigError(key, f"{name[:80]!r}{'...' if len(name) > 80 else ''}: letters, digits and '_', "
                               f"starting with a letter")
    if len(name) > MAX_STREAM_NAME:
        raise ConfigError(key, f"{len(name)} characters; a stream name has at most {MAX_STREAM_NAME}")


@dataclass(frozen=True)
class QoSConfig:
    """One topic's QoS (history is always KEEP_LAST ``depth``)."""

    reliability: str = field(default="reliable", metadata=bounded(
        choices=("reliable", "best_effort"), doc="QoS reliability (reliable matches every subscriber)"))
    depth: int = field(default=10, metadata=bounded(ge=1, le=100000, doc="QoS history depth (keep last N)"))
    durability: str = field(default="volatile", metadata=bounded(
        choices=("volatile", "transient_local"), doc="QoS durability"))


@dataclass(frozen=True)
class StreamQoS:
    """Per-stream QoS overrides. ``input`` unset: sensor-data QoS (best effort, depth 5), or in
    deterministic mode best effort with depth 1000 (so a replay burst is not dropped)."""

    input: QoSConfig | None = field(default=None, metadata=described(
        "camera and joint_states subscriptions; unset: sensor-data QoS (deterministic: best effort, depth 1000)"))
    action_chunk: QoSConfig = field(default_factory=lambda: QoSConfig("reliable", 10),
                                    metadata=described("action_chunk publisher"))
    # Reliable matches both kinds of subscriber. ros2_control's joint_trajectory_controller subscribes with
    # SystemDefaultsQoS, which the RMW resolves (best effort under rmw_fastrtps; docs/ros2_control.md).
    joint_trajectory: QoSConfig = field(default_factory=lambda: QoSConfig("reliable", 10),
                                        metadata=described("joint_trajectory publisher"))


@dataclass(frozen=True)
class TopicsConfig:
    """Topic names relative to the stream's namespace (a leading '/' makes one absolute)."""

    image: str = field(default="camera/image_raw", metadata=described("sensor_msgs/Image input topic"))
    compressed_image: str = field(default="camera/image_raw/compressed", metadata=described(
        "sensor_msgs/CompressedImage input topic (with compressed: true)"))
    joint_states: str = field(default="joint_states", metadata=described("sensor_msgs/JointState input topic"))
    action_chunk: str = field(default="action_chunk", metadata=described("physis_ros/ActionChunk output topic"))
    joint_trajectory: str = field(default="joint_trajectory", metadata=described(
        "trajectory_msgs/JointTrajectory output topic; e.g. /arm_controller/joint_trajectory to feed a "
        "ros2_control joint_trajectory_controller directly"))
    telemetry: str = field(default="telemetry", metadata=described(
        "this stream's own physis_ros/ChunkTelemetry topic (published only with telemetry: true)"))
    actions: str = field(default="actions", metadata=described(
        "world models (ACWM): the actions to imagine, a physis_ros/ActionChunk or trajectory_msgs/JointTrajectory "
        "topic (actions_type); e.g. /robot0/action_chunk to imagine what a WAM stream of this server commands"))
    predicted_frames: str = field(default="predicted_frames", metadata=described(
        "models that predict frames (an ACWM, a Wan WAM): physis_ros/PredictedFrames output topic"))
    predicted_image: str = field(default="predicted_image", metadata=described(
        "models whose frames can be decoded (a Wan world model's VAE): sensor_msgs/Image (rgb8) of the last "
        "predicted frame, at most preview_hz times a second"))
    expert: str = field(default="expert_actions", metadata=described(
        "world-action models: an expert's physis_ros/ActionChunk for the same observation (header stamp = the "
        "camera image's), if one is known; telemetry then carries the tracking error against it"))

    def check(self, prefix: str) -> None:
        for name in TOPIC_KEYS:
            value = getattr(self, name)
            if not _TOPIC.match(value) or "//" in value or value.endswith("/"):
                raise ConfigError(f"{prefix}.{name}", f"{value[:80]!r} is not a valid ROS topic name")


TOPIC_KEYS = tuple(f.name for f in dataclasses.fields(TopicsConfig))
OUTPUT_KEYS = ("action_chunk", "joint_trajectory", "predicted_frames", "predicted_image", "telemetry")   # a stream publishes these


@dataclass(frozen=True)
class ImageConfig:
    """How camera images of any size become the model's square input."""

    # resize: stretch to SxS; center_crop: central square, then resize; pad: pad to a square, then resize
    preprocess: str = field(default="center_crop", metadata=bounded(
        choices=PREPROCESS_MODES, doc="camera image to the model's square input: resize (stretch), center_crop "
                                      "(central square, then resize) or pad (pad to a square, then resize)"))
    pad_value: float = field(default=0.0, metadata=bounded(ge=0.0, le=1.0, doc="fill value of pad (0 black, 1 white)"))
    # 32 MiB: 4K (3840x2160) rgba8 fits, 8K rgb8 (~100 MB) does not; checked before any work on the pixels
    max_bytes: int = field(default=32 * 1024 * 1024, metadata=bounded(
        ge=1, doc="reject images with more bytes than this (raw data, or a CompressedImage's decoded size): too_large"))


@dataclass(frozen=True)
class StreamConfig:
    """One robot: its model, namespace, joints, SLO, input handling and topics."""

    joint_names: list[str] = field(metadata=described(
        "the model's action/state columns in order, matched by name in joint_states"))
    model: str = field(default="", metadata=described(
        "model preset, model YAML or checkpoint (.safetensors) of this stream (empty: the server's model)"))
    actions_type: str = field(default="action_chunk", metadata=bounded(
        choices=("action_chunk", "joint_trajectory"), doc="world models (ACWM): message type of topics.actions"))
    inputs: dict[str, str] = field(default_factory=dict, metadata=described(
        "model inputs no topic feeds, each read from a file when the stream joins and given to every chunk: "
        "input name -> a safetensors file holding a tensor of that name (a Wan trunk's prompt_embeds "
        "[L, text_dim]); a stream whose every input is a file is released once per SLO interval (one control step "
        "by default) less admission.pace_margin. Serve config and "
        "Server.join only: a ServeStream goal or an openpi client never names a file on the server"))
    namespace: str = field(default="", metadata=described("namespace of the stream's topics (empty: its name)"))
    slo_interval_ms: float | None = field(default=None, metadata=bounded(
        gt=0.0, le=600_000.0, doc="output interval target (ms, at most 10 minutes): telemetry deadline_miss, "
                                  "/diagnostics verdicts, task deadlines (unset: none)"))
    control_rate_hz: float = field(default=50.0, metadata=bounded(
        ge=0.1, le=10_000.0, doc="action steps per second (0.1 to 10000): ActionChunk.control_period and "
                                 "trajectory point timing"))
    execution_horizon: int = field(default=0, metadata=bounded(
        ge=0, doc="control steps each chunk is executed for (s; 0: half the model's horizon): the stream's "
                  "interval is s / control_rate_hz; with cadence timeline chunk c covers steps [c*s', c*s' + H), "
                  "s' the whole steps within that interval less admission.pace_margin (s with no margin)"))
    compressed: bool = field(default=False, metadata=described(
        "subscribe sensor_msgs/CompressedImage (jpeg/png, decoded with OpenCV) instead of Image"))
    image: ImageConfig = field(default_factory=ImageConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    qos: StreamQoS = field(default_factory=StreamQoS)
    frame_id: str = field(default="", metadata=described("header.frame_id of the outputs"))
    preview_hz: float = field(default=1.0, metadata=bounded(
        ge=0.0, le=100.0, doc="pictures per second of the predicted frames on topics.predicted_image, for a model "
                              "whose family decodes them (a Wan world model's VAE), decoded off the chunks' path "
                              "(0: none)"))
    telemetry: bool = field(default=False, metadata=described(
        "also publish this stream's ChunkTelemetry on <namespace>/telemetry (topics.telemetry), to plot one robot"))
    cadence: str = field(default="timeline", metadata=bounded(
        choices=("timeline", "free", "request"),
        doc="timeline: one chunk per execution horizon, released on the control timeline with the freshest "
            "observation; free: as fast as the pipeline allows (benchmarks); request: one chunk per observation a "
            "client sends, at once (openpi clients), its SLO a bound on each chunk's latency: admission books a "
            "chunk per SLO interval and lets its latency vary by the SLO less the chunk's own work"))
    handoff: str = field(default="soft", metadata=bounded(
        choices=("none", "hard", "soft"), doc="world-action models: how a chunk continues the one the robot executes "
                                              "while it is computed: hard keeps its first d actions exactly, soft also "
                                              "pulls the rest of the overlap toward it (real-time chunking)"))
    extra_delay_steps: int = field(default=0, metadata=bounded(
        ge=0, doc="control steps added to the measured inference delay d (benchmarks: a slower robot link)"))
    capture_margin_steps: float | None = field(default=0.3, metadata=bounded(
        ge=0.0, le=0.9, doc="with a hand-off, each observation is taken ahead of its chunk's slot (by under a step) "
                            "so that the chunk's estimated arrival lands this many control steps before a step "
                            "boundary: the robot then runs one of its frozen rows, not up to two (null: at the slot)"))
    seam_blend_steps: int = field(default=4, metadata=bounded(
        ge=0, le=64, doc="world-action models: a chunk the robot takes over where it differs from the chunk it was "
                         "executing (a latency spike past the hand-off's frozen rows, the first chunk after a reset, "
                         "every chunk with handoff none) starts from the previous chunk's position and eases onto its "
                         "own rows over this many rows (cosine; not past the next chunk's first step; "
                         "ChunkTelemetry.seam_blended_rows counts them); 0: sent as computed"))
    # Row i of a chunk is due at row0 + i / control_rate_hz; rows already due when it is published are
    # dropped from the JointTrajectory (counted as late points), whose header stamp is its first row's time.
    trajectory_start: str = field(default="timeline", metadata=bounded(
        choices=("timeline", "observation", "emit"),
        doc="when a chunk's row 0 is due: its step on the control timeline, the observation's stamp, or one "
            "control period after publication (then nothing is late but the chunk runs behind the timeline)"))
    trajectory_start_offset_s: float = field(default=0.0, metadata=bounded(
        ge=-10.0, le=10.0, doc="added to the time row 0 is due (s, -10 to 10)"))
    trajectory_min_lead_s: float = field(default=0.002, metadata=bounded(
        ge=0.0, le=1.0, doc="rows due less than this after the node reads the clock are dropped too, so that point 0 "
                            "is still ahead when the JointTrajectory is published and received (both messages' "
                            "publish and DDS delivery take 0.3-0.7 ms on a 2-core host; s)"))
    max_future_s: float = field(default=0.5, metadata=bounded(
        ge=0.0, le=60.0, doc="reject input stamps further ahead of the node clock (s, at most 60)"))
    max_age_s: float = field(default=1.0, metadata=bounded(
        ge=0.0, le=3600.0, doc="reject input stamps older than this, and start no chunk on an older image (s, at "
                               "most 3600; 0: off)"))
    max_joints: int = field(default=1024, metadata=bounded(
        ge=1, doc="reject joint states listing more joints than this (too_large); >= len(joint_names)"))
    max_abs_position: float = field(default=1e9, metadata=bounded(
        gt=0.0, doc="reject joint positions with |x| above this (nonfinite): float32 models overflow on huge inputs"))

    def check(self, prefix: str) -> None:
        """Cross-field checks; called by ServeConfig.validate so that errors carry the full key."""
        if not self.joint_names:
            raise ConfigError(f"{prefix}.joint_names", "needs at least one joint name")
        seen = set()
        for i, name in enumerate(self.joint_names):
            if not name:
                raise ConfigError(f"{prefix}.joint_names[{i}]", "joint names must not be empty")
            if name in seen:
                raise ConfigError(f"{prefix}.joint_names[{i}]", f"joint '{name}' is listed twice")
            seen.add(name)
        if self.max_joints < len(self.joint_names):
            raise ConfigError(f"{prefix}.max_joints", f"{self.max_joints} is below the {len(self.joint_names)} "
                                                      f"joint names the stream needs")
        if self.namespace and not all(_NAME.match(p) for p in self.namespace.strip("/").split("/")):
            raise ConfigError(f"{prefix}.namespace", f"{self.namespace[:80]!r} is not a valid ROS namespace")
        self.topics.check(f"{prefix}.topics")

    def check_topics(self, name: str, prefix: str) -> None:
        """Every topic of stream ``name`` (namespace and overrides resolved) fits ROS's topic-name length, so
        that no publisher or subscription fails after admission."""
        for which in TOPIC_KEYS:
            full = resolve_topic(stream_topic(name, self, which))
            if len(full) > ROS_TOPIC_MAX:
                raise ConfigError(f"{prefix}.topics.{which}", f"{full[:60]}... is {len(full)} characters; ROS "
                                                              f"takes at most {ROS_TOPIC_MAX} (shorten the "
                                                              f"namespace or the topic)")

    @property
    def control_period(self) -> float:
        return 1.0 / self.control_rate_hz


@dataclass(frozen=True)
class AdmissionConfig:
    """How streams are admitted: the joint scheduler over this server's workers (one device each)."""

    headroom: float = field(default=0.1, metadata=bounded(
        ge=0.0, le=0.9, doc="every worker keeps this fraction of its time free (utilisation <= 1 - headroom)"))
    enforce: bool = field(default=True, metadata=described(
        "false: admission off, for measuring it (physis-bench admission-accuracy): every valid stream is placed "
        "on the least booked workers whatever its SLO and their time (memory, names and engine.max_streams still "
        "checked), so streams may miss their SLO"))
    device: str = field(default="", metadata=described(
        "device spec of the workers (config/devices/<name>.yaml; empty: cpu for CPU workers, h200 for cuda)"))
    profiles: str = field(default="", metadata=described(
        "directory of physis-profile JSON files (<model>.<device>.json) to admit with; empty or missing "
        "file: measure the model here at first use"))
    profile_repeats: int = field(default=8, metadata=bounded(ge=1, le=1000, doc="timing rounds when measuring"))
    policy: str = field(default="auto", metadata=described(
        "admission policy (physis_ros.serving.policies): base (the cost model's capacity and the SLO, plus "
        "admission.checks), cpu-host (base plus what CPU workers sharing one host need: host-cpu, "
        "measured-spread, a host share per worker, co-run contention, engine.cpu_host; CPU workers only) or "
        "auto (cpu-host for CPU workers, base for GPU workers)"))
    checks: list[str] = field(default_factory=lambda: ["jitter-bound", "load-calibration"], metadata=described(
        "checks by name on top of the policy's (physis_ros.serving.policies.CHECKS): jitter-bound (refuse "
        "placements that could delay a stream's chunk past what its SLO leaves over its release interval; "
        "leave it out to book time only, e.g. for robots that buffer chunks), load-calibration (book each "
        "worker at its measured busy / booked factor; never in deterministic serving), measured-spread "
        "(charge each stream its measured interval spread beyond its bound; needs the two before it), "
        "host-cpu (the CPU host's cores); the policy adds its own after these"))
    corun_slowdown: float = field(default=1.15, metadata=bounded(
        ge=1.0, le=10.0, doc="policy cpu-host: CPU workers sharing the host run this much slower than the "
                             "one-process measurement of a profile measured here (physis-profile --corun "
                             "measures it)"))
    pace_margin: float = field(default=0.2, metadata=bounded(
        ge=0.0, le=0.5, doc="streams are released (and admitted) every SLO x (1 - pace_margin): the margin absorbs "
                            "release and compute jitter, so intervals stay within the SLO (fraction of the SLO)"))
    host_reserve_cores: float = field(default=0.75, metadata=bounded(
        ge=0.0, le=1024.0, doc="policy cpu-host: cores left to the node and the host's other work: the workers' load "
                               "plus this plus host_cores_per_stream per stream must fit the host's cores (host-cpu), "
                               "and workers busy at once share the cores less this (the jitter bound) (cores)"))
    host_cores_per_stream: float = field(default=0.08, metadata=bounded(
        ge=0.0, le=64.0, doc="policy cpu-host: host cores each stream costs outside the workers (the node's callbacks, "
                             "image conversion and publishing) (cores per stream)"))
    goal_outputs_outside_namespace: bool = field(default=False, metadata=described(
        "a ServeStream goal may publish on absolute topics outside its own namespace (e.g. a controller's "
        "/arm_controller/joint_trajectory); streams of the serve config always may"))
    strict: bool = field(default=False, metadata=described(
        "a config stream that is not admitted at start-up stops the server (exit 2) instead of being "
        "reported"))
    profile_memory_gb: float = field(default=4.0, metadata=bounded(
        gt=0.0, le=4096.0, doc="address space of the child process that measures a model's first profile (GB, "
                               "CPU devices; its interpreter and torch take about 2 of it)"))
    profile_timeout_s: float = field(default=120.0, metadata=bounded(
        gt=0.0, le=86400.0, doc="a model's first profile is given up after this long (s); its goal is refused as "
                                "profile-failed"))
    max_pending_goals: int = field(default=32, metadata=bounded(
        ge=1, le=10000, doc="ServeStream goals admitted at once (each resolving its model and placement); a goal "
                            "beyond them is refused at once as busy (the robot asks again)"))
    goal_queue_depth: int = field(default=1000, metadata=bounded(
        ge=10, le=100000, doc="requests the serve_stream action keeps per service (goal, cancel, result; QoS "
                              "keep-last depth): a burst beyond it from one instant is lost in DDS unanswered"))


@dataclass(frozen=True)
class ServeConfig:
    """The whole server: model, engine, streams (robots) and node-wide settings."""

    streams: dict[str, StreamConfig] = field(default_factory=dict, metadata=described(
        "the robots served from start-up, by stream name (more join through the serve_stream action)"))
    model: str = field(default="tiny-wam", metadata=described(
        "the default model: preset (config/models/), model YAML or checkpoint (.safetensors)"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    openpi: OpenpiConfig = field(default_factory=OpenpiConfig)
    # Each chunk consumes the next complete observation in arrival order instead of the latest one.
    deterministic: bool = field(default=False, metadata=described(
        "chunk c consumes the c-th complete observation (bag replay checks) instead of the latest one"))
    deterministic_queue: int = field(default=10000, metadata=bounded(
        ge=1, doc="images queued per stream in deterministic mode before dropping"))
    pair_timeout_s: float = field(default=0.5, metadata=bounded(
        gt=0.0, doc="deterministic mode: wait this long for a joint state with the image's stamp (s)"))
    use_sim_time: bool = field(default=False, metadata=described("stamp from /clock (bag replay)"))
    telemetry_topic: str = field(default="telemetry", metadata=described(
        "server-wide physis_ros/ChunkTelemetry topic, one message per chunk"))
    diagnostics_period_s: float = field(default=1.0, metadata=bounded(gt=0.0, doc="/diagnostics period (s)"))
    diagnostics_window_s: float = field(default=5.0, metadata=bounded(
        gt=0.0, le=3600.0, doc="/diagnostics rates, percentiles and miss rate are over this many seconds (they "
                               "decay; at most 3600)"))
    diagnostics_miss_rate_warn: float = field(default=0.05, metadata=bounded(
        ge=0.0, le=1.0, doc="a stream is WARN when more than this fraction of its chunks in the window missed "
                            "the SLO"))
    diagnostics_starved_s: float = field(default=2.0, metadata=bounded(
        gt=0.0, le=3600.0, doc="a stream is ERROR (starved) after waiting this long for a fresh observation (s, "
                               "at most 3600)"))
    diagnostics_stale_intervals: float = field(default=1.0, metadata=bounded(
        gt=0.0, le=1000.0, doc="a stream is WARN (stale inputs) when the observations its chunks used were older "
                               "than this many of its SLO intervals when the chunk started (median over the "
                               "window)"))
    stats_window: int = field(default=200, metadata=bounded(
        ge=2, doc="chunks kept per stream for /diagnostics and the exit summary"))
    warn_throttle_s: float = field(default=5.0, metadata=bounded(
        ge=0.0, le=3600.0, doc="least time between two warnings of one kind per stream (s, at most 3600)"))

    def validate(self) -> None:
        namespaces: dict[str, str] = {}
        for name, stream in self.streams.items():
            check_stream_name(name, f"streams.{name[:80]}")
            stream.check(f"streams.{name}")
            stream.check_topics(name, f"streams.{name}")
            ns = self.namespace_of(name)
            if ns in namespaces:
                raise ConfigError(f"streams.{name}.namespace",
                                  f"namespace '{ns}' is already used by stream '{namespaces[ns]}'")
            namespaces[ns] = name
        if len(self.streams) > self.engine.max_streams:
            raise ConfigError("streams", f"{len(self.streams)} streams but engine.max_streams is "
                                         f"{self.engine.max_streams}")
        if not _TOPIC.match(self.telemetry_topic):
            raise ConfigError("telemetry_topic", f"{self.telemetry_topic!r} is not a valid ROS topic name")
        policy = resolve_policy(self)   # admission.policy and .checks name registered ones that fit the workers
        if self.engine.cpu_host != "auto" and (self.engine.cpu_host == "on") != policy.cpu_host:
            raise ConfigError("engine.cpu_host", f"admission.policy {policy.name} sets it "
                                                 f"{'on' if policy.cpu_host else 'off'}: drop engine.cpu_host, or "
                                                 f"choose the admission.policy that has it")

    def namespace_of(self, stream: str) -> str:
        return stream_namespace(stream, self.streams[stream])

    def topic(self, stream: str, name: str) -> str:
        """Full topic name of one of a stream's topics (relative to the node namespace unless absolute)."""
        return stream_topic(stream, self.streams[stream], name)


def resolve_topic(topic: str, node_namespace: str = "/") -> str:
    """The full name of a topic: an absolute one as it is, a relative one under ``node_namespace``."""
    return topic if topic.startswith("/") else node_namespace.rstrip("/") + "/" + topic


def stream_topics(name: str, stream: StreamConfig, node_namespace: str = "/") -> tuple[dict[str, str], dict[str, str]]:
    """The full names of what a stream publishes and what it reads: ({key: topic}, {key: topic}), relative
    names resolved under ``node_namespace``. Every output key counts (a model's kind decides which it uses)."""
    def full(which: str) -> str:
        return resolve_topic(stream_topic(name, stream, which), node_namespace)
    outputs = {k: full(k) for k in OUTPUT_KEYS if k != "telemetry" or stream.telemetry}
    inputs = {k: full(k) for k in TOPIC_KEYS if k not in OUTPUT_KEYS}
    return outputs, inputs


def stream_namespace(name: str, stream: StreamConfig) -> str:
    return (stream.namespace or name).strip("/")


def stream_topic(name: str, stream: StreamConfig, which: str) -> str:
    """Full name of one of a stream's topics (``which``: a TopicsConfig field), relative to the node's
    namespace unless absolute."""
    rel = getattr(stream.topics, which)
    if rel.startswith("/"):
        return rel
    ns = stream.namespace or name
    return f"{ns.rstrip('/')}/{rel}" if ns.startswith("/") else f"{ns}/{rel}"


# ---- loading ------------------------------------------------------------------------------------
def unwrap_ros_parameters(data: dict[str, Any]) -> dict[str, Any]:
    """``{node: {ros__parameters: {...}}}`` (a ROS 2 parameters file) -> ``{...}``; plain mappings pass."""
    wrapped = [v["ros__parameters"] for v in data.values()
               if isinstance(v, dict) and "ros__parameters" in v]
    if not wrapped:
        return data
    if len(data) != 1:
        raise ConfigError("<root>", "a ROS 2 parameters file for physis_server must hold exactly one node "
                                    "section ('/**' or 'physis_server')")
    inner = wrapped[0]
    if not isinstance(inner, dict):
        raise ConfigError("ros__parameters", "must be a mapping")
    return inner


def load_serve_mapping(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a serve YAML (plain or ROS 2 parameters format); errors name the file."""
    try:
        return unwrap_ros_parameters(load_yaml(path))
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path)) from None


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, recursively for mappings; neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted ROS parameter names -> nested mapping (``engine.workers`` -> ``{engine: {workers}}``)."""
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(dotted, f"'{part}' is both a value and a section")
            node = child
        node[parts[-1]] = value
    return out


def serve_config(mapping: dict[str, Any], source: str | None = None) -> ServeConfig:
    try:
        return from_mapping(ServeConfig, mapping)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=source) from None


def default_serve_path() -> Path:
    """The shipped ``config/serve.yaml``."""
    return repo_config_dir() / "serve.yaml"


def load_serve_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """A serve config file (the shipped one if ``path`` is None), validated."""
    path = path or default_serve_path()
    return serve_config(deep_merge(load_serve_mapping(path), overrides or {}), source=str(path))
