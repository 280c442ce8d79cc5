"""Typed settings of the joint scheduler (as runtime/settings.py has the engine's): the device a cluster is made
of and the search knobs.

``config/devices/<name>.yaml`` describes one device kind (roofline numbers, memory,
link); ``config/scheduling.yaml`` holds the scheduler settings (headroom, LDS
budget) and the SLOs of the named simulator scenarios. Both load through
:func:`physis_ros.config.load`, so a wrong key or value names itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError, bounded, load, repo_config_dir

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU worker) kind: what the roofline model and the placer need."""

    name: str
    peak_tflops: float = field(metadata=bounded(gt=0))          # dense peak in the model dtype
    efficiency: float = field(default=0.6, metadata=bounded(gt=0, le=1))  # achieved / peak (MFU-like)
    mem_bw_gbps: float = field(default=4800.0, metadata=bounded(gt=0))    # HBM bandwidth, GB/s
    bw_efficiency: float = field(default=0.8, metadata=bounded(gt=0, le=1))
    memory_gb: float = field(default=141.0, metadata=bounded(gt=0))
    reserved_gb: float = field(default=6.0, metadata=bounded(ge=0))       # runtime context, allocator slack
    link_gbps: float = field(default=450.0, metadata=bounded(gt=0))       # per direction, device to device
    link_latency_us: float = field(default=10.0, metadata=bounded(ge=0))
    launch_overhead_us: float = field(default=30.0, metadata=bounded(ge=0))  # fixed cost per block forward

    def validate(self) -> None:
        if self.reserved_gb >= self.memory_gb:
            raise ConfigError("reserved_gb", f"{self.reserved_gb} must be below memory_gb {self.memory_gb}")

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * GB


@dataclass(frozen=True)
class LDSConfig:
    """Limited Discrepancy Search over the Best-Fit order of candidate devices."""

    discrepancies: int = field(default=3, metadata=bounded(ge=0, le=16))  # budget per placement
    branch: int = field(default=4, metadata=bounded(ge=1, le=64))         # candidates kept per rank
    max_nodes: int = field(default=4000, metadata=bounded(ge=1))          # search nodes per placement
    min_new_devices: bool = True  # keep searching (within budget) for a placement opening fewer empty devices
    split: bool = True            # a rank may be cut shorter to fill a gap left on a busy device
    min_piece: float = field(default=0.1, metadata=bounded(ge=0, le=1))   # smallest gap piece, x rank budget
    max_extra_ranks: int = field(default=2, metadata=bounded(ge=0, le=64))  # ranks beyond the fewest


@dataclass(frozen=True)
class SchedulingConfig:
    """Scheduler settings: headroom on every device, the LDS budget and the equal-split fallback."""

    headroom: float = field(default=0.1, metadata=bounded(ge=0, le=0.9))
    device: str = "h200"
    lds: LDSConfig = field(default_factory=LDSConfig)
    equal_fallback: bool = True  # try the equal split's placement when packing fails
    scenarios: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario -> model -> SLO ms

    def validate(self) -> None:
        for scen, table in self.scenarios.items():
            for model, slo in table.items():
                if slo <= 0:
                    raise ConfigError(f"scenarios.{scen}.{model}", f"SLO {slo} ms must be > 0")


def devices_dir() -> Path:
    return repo_config_dir() / "devices"


def load_device(name_or_path: str | Path) -> DeviceSpec:
    """A device by name (``h200``, ``cpu``) or a path to a device YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = devices_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in devices_dir().glob("*.yaml")))
            raise ConfigError("device", f"unknown device '{name_or_path}'; known devices: {known}")
    return load(DeviceSpec, path)


def load_scheduling(path: str | Path | None = None) -> SchedulingConfig:
    """``config/scheduling.yaml`` (or another file); defaults when the file is absent and none was named."""
    if path is None:
        default = repo_config_dir() / "scheduling.yaml"
        return load(SchedulingConfig, default) if default.is_file() else SchedulingConfig()
    return load(SchedulingConfig, path)
