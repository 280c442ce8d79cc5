"""Cost profiles: per-stage compute versus batch size, weight and KV memory, hop time.

A profile is either

* **measured** (``source: "measured:<host>"``): the JSON that ``physis-profile``
  writes, or :func:`measure_profile` run in-process for the tiny CPU presets, or
* **modelled** (``source: "roofline-model:<device>"``): :func:`roofline_profile`,
  a roofline estimate for the paper-size presets on a named device (H200). The
  formula is in ``docs/scheduling.md``; no such device was used.

Memory numbers always come from the model's shape (``ModelConfig``): weights of a
block are loaded once per device however many streams use it, and each stream
keeps one KV slot per stage it runs there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError, repo_config_dir
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.plans import Stage, pipeline_order
from physis_ros.scheduling.settings import DeviceSpec

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_BATCHES = (1, 2, 4, 8)


@dataclass
class CostProfile:
    """What the scheduler knows about one model on one device kind."""

    model: str
    device: str
    source: str                                  # "measured:<host>" or "roofline-model:<device>"
    steps: int
    blocks: int
    stage_ms: dict[Stage, dict[int, float]]      # stage -> batch size -> ms per forward
    hop_ms: float                                # one hidden-state transfer between devices
    block_weight_bytes: int                      # weights of one block (loaded once per device)
    kv_bytes: int                                # one stream's KV slot of one stage
    hidden_bytes: int                            # one chunk's hidden state (what a hop carries)
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def modelled(self) -> bool:
        return self.source.startswith("roofline-model")

    @property
    def order(self) -> list[Stage]:
        return pipeline_order(self.steps, self.blocks)

    def time_ms(self, stage: Stage, batch: int = 1) -> float:
        """Per-forward time at ``batch`` (linear between profiled sizes, extrapolated past the largest)."""
        table = self.stage_ms[stage]
        if batch in table:
            return table[batch]
        sizes = sorted(table)
        if batch <= sizes[0]:
            return table[sizes[0]] * batch / sizes[0]
        lo = max(s for s in sizes if s < batch)
        hi = min((s for s in sizes if s > batch), default=None)
        if hi is None:  # past the largest measured batch: keep the last per-sample slope
            prev = max((s for s in sizes if s < lo), default=None)
            slope = (table[lo] - table[prev]) / (lo - prev) if prev is not None else table[lo] / lo
            return table[lo] + slope * (batch - lo)
        return table[lo] + (table[hi] - table[lo]) * (batch - lo) / (hi - lo)

    def costs(self, batch: int = 1) -> list[float]:
        """Per-chunk ms of every stage in pipeline order (one stream, batch of one)."""
        return [self.time_ms(s, batch) for s in self.order]

    def chunk_ms(self) -> float:
        """Compute of one chunk, all stages on one device, no hops."""
        return sum(self.costs())

    def to_json(self) -> dict:
        return {
            "model": self.model, "device": self.device, "source": self.source,
            "steps": self.steps, "blocks": self.blocks,
            "stage_ms": {f"{k},{b}": {str(n): round(ms, 6) for n, ms in sorted(t.items())}
                         for (k, b), t in self.stage_ms.items()},
            "hop_ms": round(self.hop_ms, 6),
            "block_weight_bytes": self.block_weight_bytes, "kv_bytes": self.kv_bytes,
            "hidden_bytes": self.hidden_bytes, "notes": self.notes,
        }


def _memory_fields(cfg: ModelConfig) -> dict[str, int]:
    s = ITEMSIZE[cfg.dtype]
    return {"block_weight_bytes": cfg.block_params() * s, "kv_bytes": cfg.kv_slot_bytes(),
            "hidden_bytes": cfg.tokens_per_chunk * cfg.hidden * s}


def profile_from_json(data: dict, cfg: ModelConfig, *, where: str = "profile") -> CostProfile:
    """Parse the ``physis-profile`` JSON (``stage_ms: {"k,b": {"1": ms, ...}}, hop_ms``) for model ``cfg``."""
    def need(key):
        if key not in data:
            raise ConfigError(key, f"missing in {where}")
        return data[key]

    if need("model") != cfg.name:
        raise ConfigError("model", f"{where} profiles '{data['model']}', not '{cfg.name}'")
    source = str(need("source"))
    if not (source.startswith("measured:") or source.startswith("roofline-model:")):
        raise ConfigError("source", f"{source!r} in {where}: expected 'measured:<host>' or 'roofline-model:<device>'")
    overhead = float(data.get("overhead_ms_per_call", 0.0))  # worker loop cost per forward (physis-profile)
    # Streams share CPU workers that run at once on the host's cores: use the co-run speed, not the alone one.
    slowdown = float(data.get("corun_slowdown", 1.0))
    stage_ms: dict[Stage, dict[int, float]] = {}
    for key, table in need("stage_ms").items():
        try:
            k, b = (int(x) for x in key.split(","))
            parsed = {int(n): float(ms) for n, ms in table.items()}
        except (ValueError, AttributeError):
            raise ConfigError(f"stage_ms.{key}", f"expected 'k,b': {{batch: ms}} in {where}") from None
        if not parsed or any(ms <= 0 or n < 1 for n, ms in parsed.items()):
            raise ConfigError(f"stage_ms.{key}", f"needs positive ms at batch sizes >= 1 in {where}")
        stage_ms[(k, b)] = {n: ms * slowdown + overhead for n, ms in parsed.items()}
    missing = [s for s in pipeline_order(cfg.steps, cfg.blocks) if s not in stage_ms]
    if missing:
        raise ConfigError("stage_ms", f"{where} lacks stages {missing[:4]}{'...' if len(missing) > 4 else ''}")
    mem = _memory_fields(cfg)
    return CostProfile(
        model=cfg.name, device=str(data.get("device", "cpu")), source=source,
        steps=cfg.steps, blocks=cfg.blocks, stage_ms=stage_ms, hop_ms=float(need("hop_ms")),
        block_weight_bytes=int(data.get("block_weight_bytes", mem["block_weight_bytes"])),
        kv_bytes=int(data.get("kv_bytes", mem["kv_bytes"])),
        hidden_bytes=int(data.get("hidden_bytes", mem["hidden_bytes"])),
        notes={**dict(data.get("notes", {})), "overhead_ms_per_call_included": overhead,
               "corun_slowdown_included": slowdown},
    )


def load_profile(path: str | Path, cfg: ModelConfig) -> CostProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("<profile>", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("<profile>", f"{path} is not JSON: {exc}") from None
    return profile_from_json(data, cfg, where=str(path))


# ----------------------------------------------------------------------------- roofline model

def block_flops(cfg: ModelConfig) -> float:
    """FLOPs of one block forward for one sample: dense matmuls + attention over own + cached tokens."""
    t = cfg.tokens_per_chunk
    cached = (cfg.window + int(cfg.sink)) * t
    return 2.0 * cfg.block_params() * t + 4.0 * t * (t + cached) * cfg.hidden


def block_bytes(cfg: ModelConfig, batch: int) -> float:
    """HBM traffic of one block forward: weights once per batch; KV and activations per sample."""
    s = ITEMSIZE[cfg.dtype]
    t, d, f = cfg.tokens_per_chunk, cfg.hidden, cfg.ffn_dim
    cached = (cfg.window + int(cfg.sink)) * t
    kv_read = 2 * cached * d * s
    kv_write = 2 * t * d * s
    activations = t * (20 * d + 2 * f) * s
    return cfg.block_params() * s + batch * (kv_read + kv_write + activations)


def roofline_ms(cfg: ModelConfig, dev: DeviceSpec, batch: int) -> float:
    compute_s = batch * block_flops(cfg) / (dev.peak_tflops * 1e12 * dev.efficiency)
    memory_s = block_bytes(cfg, batch) / (dev.mem_bw_gbps * 1e9 * dev.bw_efficiency)
    return max(compute_s, memory_s) * 1e3 + dev.launch_overhead_us * 1e-3


def hop_ms(cfg: ModelConfig, dev: DeviceSpec) -> float:
    hidden = cfg.tokens_per_chunk * cfg.hidden * ITEMSIZE[cfg.dtype]
    return hidden / (dev.link_gbps * 1e9) * 1e3 + dev.link_latency_us * 1e-3


def roofline_profile(cfg: ModelConfig, dev: DeviceSpec,
                     batches: Iterable[int] = DEFAULT_BATCHES) -> CostProfile:
    """Modelled per-stage times of ``cfg`` on ``dev`` (every stage is one block forward)."""
    table = {n: roofline_ms(cfg, dev, n) for n in batches}
    order = pipeline_order(cfg.steps, cfg.blocks)
    flops = block_flops(cfg)
    bound = "compute" if flops / (dev.peak_tflops * dev.efficiency) > block_bytes(cfg, 1) / (
        dev.mem_bw_gbps * dev.bw_efficiency) * 1e3 else "memory"
    return CostProfile(
        model=cfg.name, device=dev.name, source=f"roofline-model:{dev.name}",
        steps=cfg.steps, blocks=cfg.blocks, stage_ms={s: dict(table) for s in order},
        hop_ms=hop_ms(cfg, dev), **_memory_fields(cfg),
        notes={"block_gflop": round(flops / 1e9, 3), "bound_at_batch_1": bound,
               "efficiency": dev.efficiency, "bw_efficiency": dev.bw_efficiency,
               "launch_overhead_us": dev.launch_overhead_us,
               "prologue_epilogue": "embed/head not modelled (small next to a block)"},
    )


# ----------------------------------------------------------------------------- measurement (CPU)

def measure_profile(name: str, batches: Sequence[int] = (1, 2, 4), repeats: int = 5) -> CostProfile:
    """Measure a (tiny) preset in this process with ``physis-profile``'s own measurement
    (:func:`physis_ros.runtime.profiler.measure_profile`): ~1 s for tiny-wam on one thread."""
    from physis_ros.model.presets import load_model_config
    from physis_ros.runtime.profiler import measure_profile as measure

    cfg = load_model_config(name)
    data = measure(cfg, "cpu", tuple(batches), repeats).to_json()
    data.setdefault("notes", {})["method"] = "in-process (physis_ros.runtime.profiler.measure_profile)"
    return profile_from_json(data, cfg, where="in-process measurement")


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
