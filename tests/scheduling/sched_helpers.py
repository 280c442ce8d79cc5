"""Factories for the joint-scheduling tests: synthetic profiles and devices with round numbers.

(A uniquely named module, imported by the tests directly; the fixtures live in conftest.py.)
"""

from __future__ import annotations

from physis_ros.runtime.plans import pipeline_order
from physis_ros.runtime.costs import CostProfile
from physis_ros.scheduling.settings import GB, DeviceSpec, LDSConfig, SchedulingConfig


def make_profile(model: str = "m", *, steps: int = 1, blocks: int = 4, stage_ms=1.0, weight_gb: float = 1.0,
                 kv_gb: float = 0.0, hop_ms: float = 0.0, hidden_bytes: int = 0) -> CostProfile:
    """A synthetic profile; ``stage_ms`` is one number or a list in pipeline order."""
    order = pipeline_order(steps, blocks)
    times = stage_ms if isinstance(stage_ms, (list, tuple)) else [stage_ms] * len(order)
    assert len(times) == len(order)
    return CostProfile(model=model, device="test", source="roofline-model:test", steps=steps, blocks=blocks,
                       stage_ms={s: {1: t, 2: 2 * t} for s, t in zip(order, times)}, hop_ms=hop_ms,
                       block_weight_bytes=int(weight_gb * GB), kv_bytes=int(kv_gb * GB), hidden_bytes=hidden_bytes)


def make_device(name: str = "dev", memory_gb: float = 100.0) -> DeviceSpec:
    return DeviceSpec(name=name, peak_tflops=1.0, memory_gb=memory_gb, reserved_gb=0.0)


def make_config(headroom: float = 0.0, **lds) -> SchedulingConfig:
    return SchedulingConfig(headroom=headroom, lds=LDSConfig(**lds))
