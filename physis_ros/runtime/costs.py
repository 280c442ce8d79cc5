"""A model's cost profile: per-stage compute versus batch size, weight and KV memory, hop time.

The one cost model the runtime and the scheduler share: the runtime measures it (``physis-profile``,
:mod:`~physis_ros.runtime.profiler`), plans and seeds the workers' adaptive batching with it; the joint
scheduler places and admits on it (:mod:`physis_ros.scheduling.profiles` adds the roofline model of a
named device and picks a profile for a model). A profile is **measured** (``source: "measured:<host>"``)
or **modelled** (``source: "roofline-model:<device>"``).

Memory numbers always come from the model's shape (``ModelConfig``): weights of a block are loaded once
per device however many streams use it, and each stream keeps one KV slot per stage it runs there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.plans import Stage, pipeline_order

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class CostProfile:
    """The one cost model of a model on a device kind: what the planner, the pipeline simulation, the
    workers' adaptive batching, the joint scheduler and admission all read.

    ``stage_ms`` holds the model's own time of one forward of a stage at each measured batch size;
    a worker pays ``overhead_ms_per_call`` of its own per forward on top, and CPU workers sharing
    a host run ``corun_slowdown`` times slower than the profile's one busy process."""

    model: str
    device: str
    source: str                                  # "measured:<host>" or "roofline-model:<device>"
    steps: int
    blocks: int
    stage_ms: dict[Stage, dict[int, float]]      # stage -> batch size -> ms of one forward (model only)
    hop_ms: float                                # one hidden-state transfer between workers, on the transport used
    block_weight_bytes: int                      # weights of one block (loaded once per device)
    kv_bytes: int                                # one stream's KV slot of one stage
    hidden_bytes: int                            # one chunk's hidden state (what a hop carries)
    overhead_ms_per_call: float = 0.0            # the worker's own time per forward, beyond the model
    corun_slowdown: float = 1.0                  # CPU workers sharing a host vs one busy process alone
    engine_ms: float = 0.0                       # the engine's messages per chunk (observation out, chunk in)
    transport: str = "tcp"                       # what hop_ms was measured over (or modelled for)
    notes: dict[str, object] = field(default_factory=dict)
    clean: bool = False                          # a row 0 of clean-pass stages (the clean and latest rules)
    shared_kv: bool | None = None                # one K/V slot per block, every step's, not one per stage (None:
                                                 # as `clean` says; the latest rule has the row 0 and a slot a stage)

    @property
    def kv_per_block(self) -> bool:
        """One K/V slot per (stream, block) rather than per stage."""
        return self.clean if self.shared_kv is None else self.shared_kv

    @property
    def modelled(self) -> bool:
        return self.source.startswith("roofline-model")

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(next(iter(self.stage_ms.values())))

    @property
    def order(self) -> list[Stage]:
        return pipeline_order(self.steps, self.blocks, self.clean)

    def forward_ms(self, stage: Stage, batch: int = 1) -> float:
        """The model's time of one forward at ``batch`` (linear between profiled sizes, extrapolated past
        the largest with the last per-sample slope). A clean-pass stage ``(0, b)`` not profiled costs what the
        block's last denoising step ``(1, b)`` costs (the same block forward; the last block's head is left
        out in the pass and counted here, a small overestimate)."""
        table = self.stage_ms.get(stage) or self.stage_ms[(1, stage[1])]
        if batch in table:
            return table[batch]
        sizes = sorted(table)
        if batch <= sizes[0]:
            return table[sizes[0]] * batch / sizes[0]
        lo = max(s for s in sizes if s < batch)
        hi = min((s for s in sizes if s > batch), default=None)
        if hi is None:
            prev = max((s for s in sizes if s < lo), default=None)
            slope = (table[lo] - table[prev]) / (lo - prev) if prev is not None else table[lo] / lo
            return table[lo] + slope * (batch - lo)
        return table[lo] + (table[hi] - table[lo]) * (batch - lo) / (hi - lo)

    def time_ms(self, stage: Stage, batch: int = 1) -> float:
        """What a worker sharing its host pays for one forward at ``batch``: the model's time at the
        co-run speed plus the worker's own overhead (the admission and placement unit)."""
        return self.forward_ms(stage, batch) * self.corun_slowdown + self.overhead_ms_per_call

    def costs(self, batch: int = 1) -> list[float]:
        """Per-forward ms of every stage in pipeline order (one stream, batch of one)."""
        return [self.time_ms(s, batch) for s in self.order]

    def chunk_ms(self) -> float:
        """Compute of one chunk, all stages on one device, no hops."""
        return sum(self.costs())

    def block_costs(self, stages: Iterable[Stage]) -> dict[str, dict[str, float]]:
        """{"block": {"n": ms}} over the given stages (mean over steps): a worker's batching seeds."""
        stages = list(stages)
        out: dict[str, dict[str, float]] = {}
        for b in sorted({b for _, b in stages}):
            mine = [s for s in stages if s[1] == b]
            out[str(b)] = {str(n): sum(self.stage_ms[s][n] for s in mine) / len(mine) for n in self.batch_sizes}
        return out

    def to_json(self) -> dict:
        return {
            "model": self.model, "device": self.device, "source": self.source,
            "steps": self.steps, "blocks": self.blocks, "batch_sizes": self.batch_sizes,
            "stage_ms": {f"{k},{b}": {str(n): round(ms, 6) for n, ms in sorted(t.items())}
                         for (k, b), t in self.stage_ms.items()},
            "hop_ms": round(self.hop_ms, 6), "transport": self.transport,
            "overhead_ms_per_call": round(self.overhead_ms_per_call, 6),
            "corun_slowdown": round(self.corun_slowdown, 4), "engine_ms": round(self.engine_ms, 6),
            "block_weight_bytes": self.block_weight_bytes, "kv_bytes": self.kv_bytes,
            "hidden_bytes": self.hidden_bytes, "notes": self.notes,
        }


def memory_fields(cfg: ModelConfig) -> dict[str, int]:
    """Weights of a block, one KV slot of a (stream, stage) and one hidden state, from the model's shape:
    the same arithmetic the workers allocate with."""
    s = ITEMSIZE[cfg.dtype]
    return {"block_weight_bytes": cfg.block_params() * s, "kv_bytes": cfg.kv_slot_bytes(),
            "hidden_bytes": cfg.tokens_per_chunk * cfg.hidden * s}


def stream_memory_bytes(cfg: ModelConfig) -> dict[str, int]:
    """What one stream of ``cfg`` needs in the workers' memory together, at least, from the model's shape
    alone (no profile, no build): the weights of every block, a KV slot for every stage (step x block; one per
    block under the clean history rule)
    and two hidden-state buffers (what placement charges its ranks, summed)."""
    m = memory_fields(cfg)
    slots = cfg.history_slots                       # per block: the clean pass's one, one per step (+ clean's)
    return {"weights": cfg.blocks * m["block_weight_bytes"], "kv": slots * cfg.blocks * m["kv_bytes"],
            "buffers": 2 * m["hidden_bytes"]}


def profile_from_json(data: dict, cfg: ModelConfig, *, where: str = "profile") -> CostProfile:
    """Parse the ``physis-profile`` JSON (``stage_ms: {"k,b": {"1": ms, ...}}, hop_ms, ...``) for model ``cfg``."""
    if not isinstance(data, dict):
        raise ConfigError("<profile>", f"{where} is not a JSON object")

    def need(key):
        if key not in data:
            raise ConfigError(key, f"missing in {where}")
        return data[key]

    def number(key, default):
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(key, f"expected a number >= 0 in {where}, got {value!r}")
        return float(value)

    if need("model") != cfg.name:
        raise ConfigError("model", f"{where} profiles '{data['model']}', not '{cfg.name}'")
    source = str(need("source"))
    if not (source.startswith("measured:") or source.startswith("roofline-model:")):
        raise ConfigError("source", f"{source!r} in {where}: expected 'measured:<host>' or 'roofline-model:<device>'")
    table = need("stage_ms")
    if not isinstance(table, dict):
        raise ConfigError("stage_ms", f"expected a mapping in {where}")
    stage_ms: dict[Stage, dict[int, float]] = {}
    for key, by_n in table.items():
        try:
            k, b = (int(x) for x in key.split(","))
            parsed = {int(n): float(ms) for n, ms in by_n.items()}
        except (ValueError, AttributeError):
            raise ConfigError(f"stage_ms.{key}", f"expected 'k,b': {{batch: ms}} in {where}") from None
        if not parsed or any(not ms > 0 or n < 1 for n, ms in parsed.items()):
            raise ConfigError(f"stage_ms.{key}", f"needs positive ms at batch sizes >= 1 in {where}")
        stage_ms[(k, b)] = parsed
    missing = [s for s in pipeline_order(cfg.steps, cfg.blocks) if s not in stage_ms]
    if missing:
        raise ConfigError("stage_ms", f"{where} lacks stages {missing[:4]}{'...' if len(missing) > 4 else ''}")
    if len({tuple(sorted(t)) for t in stage_ms.values()}) != 1:
        raise ConfigError("stage_ms", f"every stage needs the same batch sizes in {where}")
    mem = memory_fields(cfg)
    return CostProfile(
        model=cfg.name, device=str(data.get("device", "cpu")), source=source,
        steps=cfg.steps, blocks=cfg.blocks, stage_ms=stage_ms, hop_ms=number("hop_ms", None),
        block_weight_bytes=int(number("block_weight_bytes", mem["block_weight_bytes"])),
        kv_bytes=int(number("kv_bytes", mem["kv_bytes"])),
        hidden_bytes=int(number("hidden_bytes", mem["hidden_bytes"])),
        overhead_ms_per_call=number("overhead_ms_per_call", 0.0),
        corun_slowdown=max(1.0, number("corun_slowdown", 1.0)),
        engine_ms=number("engine_ms", 2 * number("hop_ms", 0.0)),
        transport=str(data.get("transport", "tcp")),
        notes=dict(data.get("notes", {})) if isinstance(data.get("notes", {}), dict) else {},
        clean=cfg.clean_pass, shared_kv=cfg.history == "clean",
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
