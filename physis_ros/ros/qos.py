"""QoS profiles of the node's topics, from :class:`~physis_ros.serving.config.QoSConfig`."""

from __future__ import annotations

from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSPolicyKind, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from rclpy.qos_overriding_options import QoSOverridingOptions

from physis_ros.serving.config import QoSConfig

_RELIABILITY = {"reliable": ReliabilityPolicy.RELIABLE, "best_effort": ReliabilityPolicy.BEST_EFFORT}
_DURABILITY = {"volatile": DurabilityPolicy.VOLATILE, "transient_local": DurabilityPolicy.TRANSIENT_LOCAL}

# Inputs in deterministic mode: best effort (matches any publisher) but deep, so a replay burst
# waits in the subscription queue instead of being overwritten.
DETERMINISTIC_INPUT = QoSConfig("best_effort", 1000)
# Telemetry keeps its last 100 messages for subscribers that join late (transient local): a plot or a
# monitor started with the server still sees the first chunks, whatever discovery takes.
TELEMETRY = QoSConfig("reliable", 100, "transient_local")
DIAGNOSTICS = QoSConfig("reliable", 10)
# The output publishers declare the standard qos_overrides.<topic>.publisher.<policy> parameters (read-only),
# so a parameters file or -p can change these policies of each output without touching the serve config.
OVERRIDES = QoSOverridingOptions(policy_kinds=(QoSPolicyKind.HISTORY, QoSPolicyKind.DEPTH,
                                               QoSPolicyKind.RELIABILITY, QoSPolicyKind.DURABILITY))


def action_services(depth: int) -> QoSProfile:
    """The serve_stream action's goal, cancel and result services: reliable, volatile, keep-last ``depth``
    (rclpy's default of 10 lost all but about 20 goals of a burst of 100, unanswered)."""
    return profile(QoSConfig("reliable", depth))


def profile(cfg: QoSConfig) -> QoSProfile:
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cfg.depth,
                      reliability=_RELIABILITY[cfg.reliability], durability=_DURABILITY[cfg.durability])


def input_profile(cfg: QoSConfig | None, deterministic: bool) -> QoSProfile:
    """Camera/joint subscriptions: sensor-data QoS unless configured (best effort accepts both kinds
    of publisher)."""
    if cfg is not None:
        return profile(cfg)
    return profile(DETERMINISTIC_INPUT) if deterministic else qos_profile_sensor_data


def describe(p: QoSProfile) -> str:
    rel = "reliable" if p.reliability == ReliabilityPolicy.RELIABLE else "best_effort"
    return f"{rel}/keep_last {p.depth}"
