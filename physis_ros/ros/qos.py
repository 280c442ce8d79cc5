"""QoS profiles of the node's topics, from :class:`~physis_ros.ros.config.QoSConfig`."""

from __future__ import annotations

from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)

from physis_ros.ros.config import QoSConfig

_RELIABILITY = {"reliable": ReliabilityPolicy.RELIABLE, "best_effort": ReliabilityPolicy.BEST_EFFORT}
_DURABILITY = {"volatile": DurabilityPolicy.VOLATILE, "transient_local": DurabilityPolicy.TRANSIENT_LOCAL}

# Inputs in deterministic mode: best effort (matches any publisher) but deep, so a replay burst
# waits in the subscription queue instead of being overwritten.
DETERMINISTIC_INPUT = QoSConfig("best_effort", 1000)
TELEMETRY = QoSConfig("reliable", 100)
DIAGNOSTICS = QoSConfig("reliable", 10)


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
