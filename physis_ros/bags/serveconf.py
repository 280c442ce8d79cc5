"""What the bag tools need to know about a server configuration (``config/serve.yaml``).

Streams (engine stream name, ROS namespace, joint names, full topic names),
the model and the seed, from the node's own :class:`~physis_ros.ros.config.ServeConfig`
so that the tools and the node agree. Without a config file, the default
server: streams ``robot0`` and ``robot1`` with joints ``joint1..joint7``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError
from physis_ros.ros.config import ServeConfig, default_serve_path, load_serve_config, serve_config

DEFAULT_NAMESPACES = ("robot0", "robot1")
DEFAULT_DOF = 7


def default_joint_names(dof: int = DEFAULT_DOF) -> list[str]:
    return [f"joint{i}" for i in range(1, dof + 1)]


def _absolute(topic: str) -> str:
    return topic if topic.startswith("/") else "/" + topic


@dataclass
class StreamInfo:
    name: str                 # the engine's stream name (noise seed, reference)
    namespace: str            # ROS namespace, without slashes
    joint_names: list[str] = field(default_factory=default_joint_names)
    topics: dict[str, str] = field(default_factory=dict)   # image, joint_states, action_chunk, joint_trajectory


@dataclass
class ServeInfo:
    path: Path | None
    config: ServeConfig
    streams: list[StreamInfo]

    @property
    def model(self) -> str:
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

    @property
    def input_topics(self) -> list[str]:
        return [s.topics[t] for s in self.streams for t in ("image", "joint_states")]

    @property
    def output_topics(self) -> list[str]:
        per_stream = [s.topics[t] for s in self.streams for t in ("action_chunk", "joint_trajectory")]
        return per_stream + [self.telemetry_topic, "/diagnostics"]


def default_serve_config() -> Path | None:
    try:
        path = default_serve_path()
    except ConfigError:  # no config/ directory at all
        return None
    return path if path.exists() else None


def load_serve_info(path: str | Path | None = None) -> ServeInfo:
    """Streams, model and seed of a server config (ConfigError names a bad key); defaults without one."""
    path = Path(path) if path else default_serve_config()
    if path is not None:
        config = load_serve_config(path)
    else:
        config = serve_config({"streams": {ns: {"joint_names": default_joint_names()} for ns in DEFAULT_NAMESPACES}})
    streams = []
    for name, s in config.streams.items():
        topics = {t: _absolute(config.topic(name, "compressed_image" if (t == "image" and s.compressed) else t))
                  for t in ("image", "joint_states", "action_chunk", "joint_trajectory")}
        streams.append(StreamInfo(name, config.namespace_of(name), list(s.joint_names), topics))
    return ServeInfo(path, config, streams)
