"""What one worker hosts: blocks of one or more models, their KV, and each stream's stages and routes.

- Weights: a block of a model is loaded once per worker and shared by every
  stream placed there (a model is identified by its ``ModelRef.id``: same id,
  same weights). Blocks a new stream needs are built on a loader thread while
  the worker keeps running the others; they are attached between two stages,
  so running streams never wait for a load and their blocks are never rebuilt.
  Blocks no stream uses any more are released.
- KV: one slot per admitted (stream, stage) (under the clean history rule one per (stream, block), which
  every step reads and the clean pass writes), allocated when the stream starts
  here and freed when it stops (:meth:`StageHost.kv_bytes` is exactly that
  sum, which the scheduler's memory accounting predicts). KV never moves; a
  stream that starts again (a new epoch) gets its slots reset.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from torch import nn

from physis_ros.config import from_mapping
from physis_ros.model import KVTable, build_model
from physis_ros.model.checkpoint import load_trunk, read_block_weights, read_checkpoint_config
from physis_ros.model.interface import ServableModel
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime import protocol as p
from physis_ros.runtime.plans import Stage


@dataclass
class Placement:
    """What one stream runs here: its model, hosted stages, where each stage's output goes, its KV slots."""

    model: str                   # ModelRef.id
    stages: set[Stage]
    routes: dict[Stage, str]     # next stage's worker data address, or the engine's after the last stage
    epoch: int                   # the stream's incarnation: tasks of an earlier one are dropped
    slots: dict[int, int] = field(default_factory=dict)   # step -> KV slot id (same id in each block's table)
    peers: dict[Stage, str] = field(default_factory=dict)  # next stage's worker id ("": the engine)


class ModelHost:
    """One model's hosted blocks and their KV tables."""

    def __init__(self, ref: p.ModelRef, config: ModelConfig, model: ServableModel):
        self.ref = ref
        self.config = config
        self.model = model
        self.tables: dict[int, KVTable] = {}

    def kv_bytes(self) -> int:
        return sum(t.nbytes() for t in self.tables.values())


def _config_of(ref: p.ModelRef) -> ModelConfig:
    config = from_mapping(ModelConfig, ref.config)
    if ref.checkpoint:
        stored = read_checkpoint_config(ref.checkpoint)
        if stored != config:
            raise ValueError(f"checkpoint {ref.checkpoint} holds model '{stored.name}' with another config than "
                             f"the one given for '{ref.id}'")
    return config


class StageHost:
    """Models, KV and stream placements of one worker (no sockets). Loading runs on one loader thread."""

    def __init__(self, device: str):
        self.device = device
        self.models: dict[str, ModelHost] = {}
        self.placements: dict[str, Placement] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block-loader")
        self._loading: dict[tuple[str, int], Future] = {}
        self._new_model: dict[str, Future] = {}
        self._slot_ids = itertools.count()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    # ---- loading -------------------------------------------------------------------------------
    @staticmethod
    def check(msg: p.StartStream, cfg: ModelConfig) -> ModelConfig:
        """ValueError unless the stream's stages and routes make sense for its model ``cfg``."""
        stages = set(msg.stages)
        clean = cfg.clean_pass          # a row 0 of clean-pass stages, and each block's rows together
        bad = sorted(s for s in stages if not ((0 if clean else 1) <= s[0] <= cfg.steps and 0 <= s[1] < cfg.blocks))
        if bad:
            raise ValueError(f"stages {bad} do not exist in model '{cfg.name}' ({cfg.steps} steps x {cfg.blocks} "
                             f"blocks, {cfg.history} history)")
        split = sorted({b for _, b in stages if clean and any((k, b) not in stages for k in range(cfg.steps + 1))})
        if split:
            raise ValueError(f"blocks {split} of model '{cfg.name}' have only some of their stages here; under the "
                             f"clean history rule a block's steps read the K/V its clean pass writes here")
        routes = {r.stage for r in msg.routes}
        missing = sorted(stages - routes)
        if missing:
            raise ValueError(f"no route for stages {missing} of stream '{msg.stream}'")
        return cfg

    def prepare(self, msg: p.StartStream) -> list[Future]:
        """Start loading whatever the stream needs that is not hosted (or loading) yet; the futures to
        wait for before :meth:`start_stream` (none if everything is here). A model not hosted yet is read and
        checked on the loader thread, as its weights are: its config may import its family and read its files'
        headers, which must not hold up the stages and heartbeats of this thread."""
        ref, futures = msg.model, []
        host = self.models.get(ref.id)
        if host is not None:
            self.check(msg, host.config)
        else:
            if ref.id not in self._new_model:
                self._new_model[ref.id] = self._loader.submit(self._build_model, ref)
            model = self._new_model[ref.id]
            futures.append(model)
            futures.append(self._loader.submit(lambda: self.check(msg, model.result().config)))
        for b in sorted({b for _, b in msg.stages}):
            if host is not None and b in host.model.hosted_blocks:
                continue
            key = (ref.id, b)
            if key not in self._loading:
                self._loading[key] = self._loader.submit(self._build_block, ref, b)
            futures.append(self._loading[key])
        return futures

    def _build_model(self, ref: p.ModelRef) -> ModelHost:
        config = _config_of(ref)
        model = build_model(config, device=self.device, hosted_blocks=[])  # trunk and head, no blocks yet
        if ref.checkpoint:
            load_trunk(ref.checkpoint, model)
        return ModelHost(ref, config, model)

    def _build_block(self, ref: p.ModelRef, b: int) -> dict[int, nn.Module]:
        model_future = self._new_model.get(ref.id)
        host = model_future.result() if model_future is not None else self.models[ref.id]
        weights = read_block_weights(ref.checkpoint, host.config, [b]) if ref.checkpoint else None
        return host.model.build_blocks([b], weights)

    def attach_ready(self) -> None:
        """Attach whatever the loader finished (main thread, between stages). Raises a load's error."""
        for model_id, fut in list(self._new_model.items()):
            if fut.done():
                del self._new_model[model_id]
                self.models.setdefault(model_id, fut.result())
        for key, fut in list(self._loading.items()):
            model_id, b = key
            if fut.done() and model_id in self.models:
                del self._loading[key]
                host = self.models[model_id]
                host.model.attach_blocks(fut.result())
                if b not in host.tables:
                    host.tables[b] = host.model.new_kv_table(b, 0)

    def loading_for(self, msg: p.StartStream) -> bool:
        """Whether blocks of this stream are still loading (or loaded but not attached yet)."""
        if msg.model.id not in self.models:
            return True
        hosted = self.models[msg.model.id].model.hosted_blocks
        return any(b not in hosted for _, b in msg.stages)

    # ---- streams -------------------------------------------------------------------------------
    def start_stream(self, msg: p.StartStream) -> list[int]:
        """Host a stream whose blocks are attached: fresh KV under ``msg.epoch``; its KV slot ids."""
        host = self.models[msg.model.id]
        stages = set(msg.stages)
        old = self.placements.get(msg.stream)
        if old is not None and (old.model != msg.model.id or old.stages != stages):
            self.stop_stream(msg.stream)  # a different placement (never happens to a running stream)
            old = None
        if old is None:
            if host.config.history == "clean":   # one history slot per block, which every step reads
                shared = next(self._slot_ids)
                slots = {k: shared for k in sorted({k for k, _ in stages})}
            else:                                 # one per (step, block): what that step of earlier chunks wrote
                slots = {k: next(self._slot_ids) for k in sorted({k for k, _ in stages})}
            for slot, b in {(slots[k], b) for k, b in stages}:
                host.tables[b].add(slot)
        else:
            slots = old.slots
            for slot, b in {(slots[k], b) for k, b in stages}:
                host.tables[b].reset(slot)
        self.placements[msg.stream] = Placement(msg.model.id, stages, {r.stage: r.address for r in msg.routes},
                                                msg.epoch, slots, {r.stage: r.worker for r in msg.routes})
        return sorted(slots.values())

    def stop_stream(self, stream: str) -> None:
        """Free the stream's KV; release blocks (and models) no stream uses any more."""
        placement = self.placements.pop(stream, None)
        if placement is None:
            return
        host = self.models[placement.model]
        for slot, b in {(placement.slots[k], b) for k, b in placement.stages}:
            host.tables[b].remove(slot)
        unused = [b for b, t in host.tables.items() if t.slots == 0]
        for b in unused:
            del host.tables[b]
        host.model.release_blocks(unused)
        if not host.tables and not any(m == placement.model for m, _ in self._loading):
            del self.models[placement.model]

    def kv_bytes(self) -> int:
        return sum(h.kv_bytes() for h in self.models.values())

    def weight_bytes(self) -> int:
        """Weights held: each hosted model's trunk and the blocks its streams here need."""
        return sum(h.model.weight_bytes() for h in self.models.values())

    def blocks(self) -> dict[str, list[int]]:
        return {m: sorted(h.model.hosted_blocks) for m, h in self.models.items()}
