"""The openpi front end's section of the serve config (``openpi:``): where it listens, who may connect, how
an openpi observation dict maps onto a model's inputs, and what a connection that names nothing joins as.
The front end itself is :mod:`physis_ros.openpi`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from physis_ros.config import ConfigError, bounded, described

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """``host`` reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class OpenpiConfig:
    """openpi clients (``openpi_client.WebsocketClientPolicy``) served over websockets, each connection a
    stream of the server (``physis-serve --openpi PORT``)."""

    port: int | None = field(default=None, metadata=bounded(
        ge=0, le=65535, doc="TCP port of the openpi websocket front end (unset: no front end; 0: any free port)"))
    host: str = field(default="127.0.0.1", metadata=described(
        "address it binds: loopback by default; any other address requires an API key (api_key_env)"))
    api_key_env: str = field(default="PHYSIS_OPENPI_API_KEY", metadata=described(
        "environment variable holding the API key clients must send (header 'Authorization: Api-Key <key>', "
        "what WebsocketClientPolicy(api_key=...) sends); required when host is not loopback, checked when set"))
    image_keys: list[str] = field(default_factory=lambda: ["observation/image", "observation/wrist_image"],
                                  metadata=described(
        "observation keys of camera frames (HxWx3 uint8, any size), in the model's camera order: a model with "
        "one camera takes the first and ignores the rest ('a/b' also finds obs['a']['b'])"))
    state_key: str = field(default="observation/state", metadata=described(
        "observation key of the joint state vector (joint_names order)"))
    actions_key: str = field(default="actions", metadata=described(
        "world models: observation key of the actions to imagine ([horizon, dof])"))
    prompt_key: str = field(default="prompt", metadata=described(
        "observation key of the language prompt (ignored by models that take none)"))
    model: str = field(default="", metadata=described(
        "model of a connection that names none in its URI (empty: the server's model)"))
    slo_ms: float | None = field(default=None, metadata=bounded(
        gt=0.0, le=600_000.0, doc="SLO interval of a connection that names none (ms; unset: its control timeline's)"))
    control_rate_hz: float = field(default=50.0, metadata=bounded(
        ge=0.1, le=10_000.0, doc="control rate of a connection that names none (action steps per second)"))
    max_message_bytes: int = field(default=8 * 1024 * 1024, metadata=bounded(
        ge=1024, le=1 << 30, doc="largest message a client may send (bytes); a larger one closes its connection "
                                 "(1009, message too big)"))
    max_connections: int = field(default=64, metadata=bounded(
        ge=1, le=10_000, doc="connections at once; one beyond is answered HTTP 503"))
    infer_timeout_s: float = field(default=10.0, metadata=bounded(
        gt=0.0, le=3600.0, doc="an infer call gets an error frame if its chunk has not come by then (s)"))
    idle_timeout_s: float = field(default=300.0, metadata=bounded(
        gt=0.0, le=86_400.0, doc="a connection that sends nothing for this long is closed and its stream leaves "
                                 "(s)"))

    def validate(self) -> None:
        if not self.host:
            raise ConfigError("openpi.host", "empty; give an address to bind, e.g. 127.0.0.1")
        if not self.image_keys and not self.state_key:
            raise ConfigError("openpi.image_keys", "no observation key at all; give image_keys and state_key")
        for i, key in enumerate(self.image_keys):
            if not key:
                raise ConfigError(f"openpi.image_keys[{i}]", "empty key")
