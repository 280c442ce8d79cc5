"""What the bag tools need to know about a server configuration (``config/serve.yaml``).

Streams (engine stream name, ROS namespace, joint names, model, full topic names and their
message types), the default model and the seed, from the node's own
:class:`~physis_ros.serving.config.ServeConfig` and the node's own rules (a stream's model:
``streams.<name>.model``, empty: the server's ``model``; what it takes and what it publishes: its
kind) so that the tools and the node agree. Without a config file, the default server: streams
``robot0`` and ``robot1`` with joints ``joint1..joint7``.

Per stream, by the kind of its model:

- a world-action model (WAM): ``image`` + ``joint_states`` in, ``action_chunk`` +
  ``joint_trajectory`` out;
- an action-conditioned world model (ACWM): ``image`` (+ ``joint_states`` if it takes a state) +
  ``actions`` (``physis_ros/ActionChunk`` or ``trajectory_msgs/JointTrajectory``, its
  ``actions_type``) in, ``predicted_frames`` out;
- both: ``telemetry`` (the stream's own ChunkTelemetry topic) with ``telemetry: true``; the
  server-wide ``/telemetry`` and ``/diagnostics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from physis_ros.config import ConfigError
from physis_ros.serving.config import ServeConfig, default_serve_path, load_serve_config, serve_config

if TYPE_CHECKING:
    from physis_ros.model.spec import ModelConfig

DEFAULT_NAMESPACES = ("robot0", "robot1")
DEFAULT_DOF = 7

IMAGE_TYPE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE_TYPE = "sensor_msgs/msg/CompressedImage"
JOINT_STATE_TYPE = "sensor_msgs/msg/JointState"
ACTION_CHUNK_TYPE = "physis_ros/msg/ActionChunk"
TRAJECTORY_TYPE = "trajectory_msgs/msg/JointTrajectory"
FRAMES_TYPE = "physis_ros/msg/PredictedFrames"
TELEMETRY_TYPE = "physis_ros/msg/ChunkTelemetry"
DIAGNOSTICS_TYPE = "diagnostic_msgs/msg/DiagnosticArray"

# The model's observation -> the stream topic (TopicsConfig field) that feeds it (as the node subscribes).
OBSERVATION_TOPIC = {"image": "image", "state": "joint_states", "actions": "actions"}


def default_joint_names(dof: int = DEFAULT_DOF) -> list[str]:
    return [f"joint{i}" for i in range(1, dof + 1)]


def _absolute(topic: str) -> str:
    return topic if topic.startswith("/") else "/" + topic


def _unique(items) -> list:
    return list(dict.fromkeys(items))


@dataclass
class StreamInfo:
    name: str                 # the engine's stream name (noise seed, reference)
    namespace: str            # ROS namespace, without slashes
    joint_names: list[str] = field(default_factory=default_joint_names)
    # role -> full topic name: image, joint_states and actions (inputs the model takes); action_chunk and
    # joint_trajectory (a WAM's outputs) or predicted_frames (an ACWM's); telemetry (with telemetry: true)
    topics: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)    # role -> message type
    produces: str = "actions"                              # what the model's chunks are: actions | frames
    model: str = ""                                        # model reference as served (preset, YAML, checkpoint)
    model_config: ModelConfig | None = None
    checkpoint: str | None = None                          # weights the server loads (None: init_seed)
    paired: list[str] = field(default_factory=lambda: ["state"])   # observations paired to the image, in order

    @property
    def input_roles(self) -> list[str]:
        return [OBSERVATION_TOPIC[o] for o in ("image", *self.paired)]

    @property
    def output_roles(self) -> list[str]:
        chunk = ["action_chunk", "joint_trajectory"] if self.produces == "actions" else []
        chunk += ["predicted_frames"] if "predicted_frames" in self.topics else []
        return chunk + (["telemetry"] if "telemetry" in self.topics else [])

    @property
    def chunk_role(self) -> str:
        """The topic that carries one message per chunk: action_chunk (WAM) or predicted_frames (ACWM)."""
        return "action_chunk" if self.produces == "actions" else "predicted_frames"

    @property
    def chunk_topic(self) -> str:
        return self.topics[self.chunk_role]

    def topic_of(self, observation: str) -> str:
        """The topic that feeds one of the model's observations (image, state, actions)."""
        return self.topics[OBSERVATION_TOPIC[observation]]


@dataclass
class ServeInfo:
    path: Path | None
    config: ServeConfig
    streams: list[StreamInfo]

    @property
    def model(self) -> str:
        """The server's default model (``model``); a stream's own is :attr:`StreamInfo.model`."""
        return self.config.model

    @property
    def seed(self) -> int:
        return self.config.engine.seed

    @property
    def bit_exact(self) -> bool:
        """Whether outputs must equal the sequential reference bit for bit (no batching)."""
        return getattr(self.config.engine, "batching", "off") == "off"

    @property
    def telemetry_topic(self) -> str:
        return _absolute(self.config.telemetry_topic)

    def stream(self, name: str) -> StreamInfo:
        return next(s for s in self.streams if s.name == name)

    @property
    def input_topics(self) -> list[str]:
        return _unique(s.topics[r] for s in self.streams for r in s.input_roles)

    @property
    def output_topics(self) -> list[str]:
        return _unique([s.topics[r] for s in self.streams for r in s.output_roles]
                       + [self.telemetry_topic, "/diagnostics"])

    @property
    def topic_types(self) -> dict[str, str]:
        """Every input and output topic of the server with its message type."""
        out = {s.topics[r]: s.types[r] for s in self.streams for r in (*s.input_roles, *s.output_roles)}
        out[self.telemetry_topic] = TELEMETRY_TYPE
        out["/diagnostics"] = DIAGNOSTICS_TYPE
        return out

    @property
    def expert_types(self) -> dict[str, str]:
        """The expert action topics of WAM streams (the tracking error's reference, where a robot publishes
        one): recorded with the inputs, never replayed into a check."""
        return {s.topics["expert"]: s.types["expert"] for s in self.streams if "expert" in s.topics}

    @property
    def output_types(self) -> dict[str, str]:
        types = self.topic_types
        return {t: types[t] for t in self.output_topics}

    @property
    def input_types(self) -> dict[str, str]:
        types = self.topic_types
        return {t: types[t] for t in self.input_topics}

    def fed_by_outputs(self) -> dict[str, str]:
        """Input topics that are also outputs of this server (a world model imagining what a policy stream
        commands, ``topics.actions: /robot0/action_chunk``): topic -> the stream whose input it is."""
        outputs = set(self.output_topics)
        return {s.topics[r]: s.name for s in self.streams for r in s.input_roles if s.topics[r] in outputs}


def default_serve_config() -> Path | None:
    try:
        path = default_serve_path()
    except ConfigError:  # no config/ directory at all
        return None
    return path if path.exists() else None


def stream_model(config: ServeConfig, name: str) -> tuple[str, ModelConfig, str | None]:
    """(reference, model config, checkpoint or None) of a stream's model, resolved as the server resolves it
    (:class:`physis_ros.serving.catalog.ModelCatalog`: empty is the server's ``model``, whose weights are
    ``engine.checkpoint`` if set); ConfigError naming ``streams.<name>.model`` (or ``model``) if unusable."""
    from physis_ros.serving.capacity import Rejected
    from physis_ros.serving.catalog import model_config_of

    own = config.streams[name].model
    ref = own or config.model
    try:
        model, checkpoint = model_config_of(ref)
    except Rejected as exc:
        raise ConfigError(f"streams.{name}.model" if own else "model", exc.detail) from None
    if ref == config.model and checkpoint is None:
        checkpoint = config.engine.checkpoint or None
    return ref, model, checkpoint


def stream_info(config: ServeConfig, name: str) -> StreamInfo:
    """One stream of a config: its model and kind, its topics and their types (ConfigError if its model
    cannot be loaded or does not fit the stream, as the server refuses it at start)."""
    from physis_ros.serving.fit import check_stream_model

    s = config.streams[name]
    ref, model, checkpoint = stream_model(config, name)
    check_stream_model(f"streams.{name}", s, model)
    shapes = {k: v for k, v in model.observation_shapes.items() if k not in s.inputs}   # files feed the rest
    paired = [o for o in shapes if o != "image"]
    topics: dict[str, str] = {}
    types: dict[str, str] = {}

    def add(role: str, field_name: str, msgtype: str) -> None:
        topics[role] = _absolute(config.topic(name, field_name))
        types[role] = msgtype

    if s.compressed:
        add("image", "compressed_image", COMPRESSED_IMAGE_TYPE)
    else:
        add("image", "image", IMAGE_TYPE)
    if "state" in shapes:
        add("joint_states", "joint_states", JOINT_STATE_TYPE)
    if "actions" in shapes:
        add("actions", "actions", TRAJECTORY_TYPE if s.actions_type == "joint_trajectory" else ACTION_CHUNK_TYPE)
    if model.produces == "actions":
        add("action_chunk", "action_chunk", ACTION_CHUNK_TYPE)
        add("joint_trajectory", "joint_trajectory", TRAJECTORY_TYPE)
        add("expert", "expert", ACTION_CHUNK_TYPE)   # optional input: what an expert does (tracking error)
    if model.spec.has_frames:                        # a world model's chunk, or what a WAM predicts beside it
        add("predicted_frames", "predicted_frames", FRAMES_TYPE)
    if s.telemetry:
        add("telemetry", "telemetry", TELEMETRY_TYPE)
    return StreamInfo(name, config.namespace_of(name), list(s.joint_names), topics, types, model.produces, ref, model,
                      checkpoint, paired)


def load_serve_info(path: str | Path | None = None) -> ServeInfo:
    """Streams (each with its model), default model and seed of a server config (ConfigError names a bad
    key); defaults without one."""
    path = Path(path) if path else default_serve_config()
    if path is not None:
        config = load_serve_config(path)
    else:
        config = serve_config({"streams": {ns: {"joint_names": default_joint_names()} for ns in DEFAULT_NAMESPACES}})
    try:
        streams = [stream_info(config, name) for name in config.streams]
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path) if path else None) from None
    return ServeInfo(path, config, streams)
