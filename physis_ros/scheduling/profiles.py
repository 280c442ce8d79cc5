"""Cost profiles as the scheduler chooses them (the profile itself, :class:`CostProfile`, is the runtime's:
:mod:`physis_ros.runtime.costs`, the same concept one layer down). A profile is either

* **measured** (``source: "measured:<host>"``): the JSON that ``physis-profile``
  writes, or :func:`measure_profile` run in-process for the tiny CPU presets, or
* **modelled** (``source: "roofline-model:<device>"``): :func:`roofline_profile`,
  a roofline estimate for the paper-size presets on a named device (H200). The
  formula is in ``docs/scheduling.md``; no such device was used.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from physis_ros.config import repo_config_dir
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.costs import ITEMSIZE, CostProfile, load_profile, memory_fields
from physis_ros.runtime.plans import pipeline_order
from physis_ros.scheduling.settings import DeviceSpec

DEFAULT_BATCHES = (1, 2, 4, 8)

# ----------------------------------------------------------------------------- roofline model

def block_bytes(cfg: ModelConfig, batch: int) -> float:
    """HBM traffic of one block forward: weights once per batch; KV and activations per sample."""
    s = ITEMSIZE[cfg.dtype]
    t, d, f = cfg.tokens_per_chunk, cfg.hidden, cfg.ffn_dim
    kv_read = 2 * cfg.spec.kv_slot_tokens * cfg.spec.kv_width * s
    kv_write = 2 * (cfg.spec.kv_slot_tokens // (cfg.window + int(cfg.sink))) * cfg.spec.kv_width * s
    activations = t * (20 * d + 2 * f) * s
    return cfg.block_params() * s + batch * (kv_read + kv_write + activations)


def roofline_ms(cfg: ModelConfig, dev: DeviceSpec, batch: int) -> float:
    compute_s = batch * cfg.spec.block_flops / (dev.peak_tflops * 1e12 * dev.efficiency)
    memory_s = block_bytes(cfg, batch) / (dev.mem_bw_gbps * 1e9 * dev.bw_efficiency)
    return max(compute_s, memory_s) * 1e3 + dev.launch_overhead_us * 1e-3


def hop_ms(cfg: ModelConfig, dev: DeviceSpec) -> float:
    hidden = cfg.tokens_per_chunk * cfg.hidden * ITEMSIZE[cfg.dtype]
    return hidden / (dev.link_gbps * 1e9) * 1e3 + dev.link_latency_us * 1e-3


def roofline_profile(cfg: ModelConfig, dev: DeviceSpec,
                     batches: Iterable[int] = DEFAULT_BATCHES) -> CostProfile:
    """Modelled per-stage times of ``cfg`` on ``dev`` (every stage is one block forward)."""
    table = {n: roofline_ms(cfg, dev, n) for n in batches}
    order = pipeline_order(cfg.steps, cfg.blocks, cfg.clean_pass)
    flops = cfg.spec.block_flops
    bound = "compute" if flops / (dev.peak_tflops * dev.efficiency) > block_bytes(cfg, 1) / (
        dev.mem_bw_gbps * dev.bw_efficiency) * 1e3 else "memory"
    return CostProfile(
        model=cfg.name, device=dev.name, source=f"roofline-model:{dev.name}",
        steps=cfg.steps, blocks=cfg.blocks, stage_ms={s: dict(table) for s in order},
        hop_ms=hop_ms(cfg, dev), **memory_fields(cfg), transport="device",
        notes={"block_gflop": round(flops / 1e9, 3), "bound_at_batch_1": bound,
               "efficiency": dev.efficiency, "bw_efficiency": dev.bw_efficiency,
               "launch_overhead_us": dev.launch_overhead_us,
               "prologue_epilogue": "embed/head not modelled (small next to a block)"},
        clean=cfg.clean_pass, shared_kv=cfg.history == "clean",
    )


# ----------------------------------------------------------------------------- measurement (CPU)

def measure_profile(name: str, batches: Sequence[int] = (1, 2, 4), repeats: int = 5) -> CostProfile:
    """Measure a (tiny) preset in this process with ``physis-profile``'s own measurement
    (:func:`physis_ros.runtime.profiler.measure_profile`): ~1 s for tiny-wam on one thread."""
    from physis_ros.model.spec import load_model_config
    from physis_ros.runtime.profiler import measure_profile as measure

    profile = measure(load_model_config(name), "cpu", tuple(batches), repeats)
    profile.notes["method"] = "in-process (physis_ros.runtime.profiler.measure_profile)"
    return profile


# ----------------------------------------------------------------------------- choosing a profile

def profiles_dir() -> Path:
    return repo_config_dir() / "profiles"


def shipped_profile_path(model: str, device: str) -> Path:
    return profiles_dir() / f"{model}.{device}.json"


def get_profile(cfg: ModelConfig, dev: DeviceSpec, path: str | Path | None = None,
                measure_if_missing: bool = False) -> CostProfile:
    """The profile to schedule ``cfg`` on ``dev`` with: a given file, else a shipped measured
    profile (``config/profiles/<model>.<device>.json``), else in-process measurement (CPU,
    if asked), else the roofline model of ``dev``."""
    if path is not None:
        return load_profile(path, cfg)
    shipped = shipped_profile_path(cfg.name, dev.name)
    if shipped.is_file():
        return load_profile(shipped, cfg)
    if measure_if_missing and dev.name == "cpu":
        return measure_profile(cfg.name)
    return roofline_profile(cfg, dev)
