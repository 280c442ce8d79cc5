"""What a servable model provides, so that the runtime can run any stage ``(k, b)``.

The runtime never asks which model it serves. It only knows that a chunk is
computed as in DESIGN.md section 2 and that the model exposes these pieces:

- ``encode(obs)``: observation (WAM) or conditioning (ACWM) -> condition tokens,
  once per chunk;
- ``embed(cond, x, t)``: condition tokens + noisy chunk at timestep ``t`` -> hidden
  state ``h`` (prologue of stage ``(k, 0)``);
- ``block(b, h, t, kv)``: transformer block ``b`` with per-sample timesteps and a
  :class:`~physis_ros.model.kv.KVBatch` (per-sample slots of a stage-local
  cache: read, then append);
- ``head(h, t)``: velocity of the chunk (epilogue of stage ``(k, L-1)``);
- ``timesteps``: flow-matching timesteps and the Euler update;
- ``noise(seed, stream, chunk)``: the deterministic initial noise;
- ``new_block(b)`` (each block seeded by its name), ``build_blocks`` (from it, or a checkpoint's weights) /
  ``attach_blocks`` / ``release_blocks``: host blocks one by one, so a worker loads what a new stream needs
  without touching what running streams use;
- metadata: :class:`~physis_ros.model.spec.ModelConfig` (shapes, tokens per
  chunk, KV bytes per slot).

Every method takes a leading batch dimension and per-sample timesteps, so one
call can serve tasks of one block at different steps, chunks and streams.
A model may hold only some of its blocks (``hosted_blocks``): a worker loads
just what its stages need.
"""

from __future__ import annotations

import itertools

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from physis_ros.model.kv import KVBatch, KVTable
from physis_ros.model.timesteps import FlowMatchingTimesteps
from physis_ros.model.spec import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (stable across processes and hosts)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class ServableModel(nn.Module, ABC):
    """Base class of a model the server can cut into stages."""

    sequence_recompute = True
    """Whether :mod:`physis_ros.recompute` can run it: its ``block`` attends through ``kv.attend_inputs`` and
    ``kv.append`` alone (a whole sequence under a mask in place of the cache)."""

    def __init__(self, config: ModelConfig, hosted_blocks: Iterable[int] | None = None):
        super().__init__()
        self.config = config
        self.timesteps = FlowMatchingTimesteps(config.steps, config.timestep_shift, config.sigmas)
        blocks = range(config.blocks) if hosted_blocks is None else hosted_blocks
        self.hosted_blocks = frozenset(int(b) for b in blocks)
        bad = sorted(b for b in self.hosted_blocks if not 0 <= b < config.blocks)
        if bad:
            raise ValueError(f"blocks {bad} do not exist; model '{config.name}' has blocks 0..{config.blocks - 1}")

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.config.dtype]

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abstractmethod
    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Batched observation tensors (see ``config.observation_shapes``) -> condition tokens [B, Tc, D]."""

    @abstractmethod
    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Condition tokens + noisy chunk [B, *output_shape] at timesteps t [B] -> hidden [B, T, D]."""

    @abstractmethod
    def block(self, b: int, h: torch.Tensor, t: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """Block ``b`` on hidden [B, T, D], reading then appending each sample's KV slot."""

    @abstractmethod
    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Hidden [B, T, D] -> velocity [B, *output_shape]."""

    @abstractmethod
    def new_block(self, b: int) -> nn.Module:
        """A fresh module for block ``b`` with its own seeded init: exactly the weights block ``b`` of the full
        model has, whichever worker builds it (seed it by its name, e.g. ``derived_seed(..., f"blocks.{b}")``)."""

    def build_blocks(self, blocks: Iterable[int], weights: dict[str, torch.Tensor] | None = None
                     ) -> dict[int, nn.Module]:
        """Modules for more blocks (:meth:`new_block`, or ``weights``: state-dict entries ``blocks.{b}.*``),
        ready on this model's device and dtype; safe to call from a loader thread: nothing of the model
        changes until :meth:`attach_blocks`."""
        built = {}
        for b in sorted(set(blocks)):
            if not 0 <= b < self.config.blocks:
                raise ValueError(f"block {b} does not exist; model '{self.config.name}' has blocks "
                                 f"0..{self.config.blocks - 1}")
            blk = self.new_block(b)
            if weights is not None:
                prefix = f"blocks.{b}."
                blk.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
            built[b] = blk.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        return built

    @abstractmethod
    def attach_blocks(self, built: dict[int, nn.Module]) -> None:
        """Host blocks built by :meth:`build_blocks` (``hosted_blocks`` grows)."""

    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer this model holds now (trunk, head and hosted blocks)."""
        return sum(t.numel() * t.element_size() for t in itertools.chain(self.parameters(), self.buffers()))

    @abstractmethod
    def release_blocks(self, blocks: Iterable[int]) -> None:
        """Stop hosting blocks (their weights are freed once nothing else holds them)."""

    def clear_timestep_caches(self) -> None:
        """Forget what the model memoised per timestep (its time modulation); training calls it whenever the
        weights change. Nothing memoised here."""

    def action_rows(self) -> int | None:
        """How many rows of an output chunk's actions (``spec.actions_of``) are control steps, which the
        hand-off between chunks applies to (:mod:`physis_ros.model.handoff`); None: the output has no
        actions (a world model's frames), there is nothing to hand off."""
        shape = self.config.spec.actions_shape
        return None if shape is None else shape[0]

    def noise(self, seed: int, stream: str, chunk: int) -> torch.Tensor:
        """Initial noise of one chunk, [1, *output_shape]; identical on every device and host."""
        gen = torch.Generator().manual_seed(derived_seed("noise", seed, stream, chunk))
        x = torch.randn((1, *self.config.output_shape), generator=gen, dtype=torch.float32)
        return x.to(device=self.device, dtype=self.dtype)

    def new_kv_table(self, block: int, slots: int) -> KVTable:
        """A persistent KV table for ``slots`` (stream, step) slots of block ``block``."""
        c = self.config
        return KVTable(slots, c.tokens_per_chunk, c.window, c.sink, c.heads, c.head_dim,
                       dtype=self.dtype, device=self.device)

    def observation_tensors(self, obs: dict[str, object]) -> dict[str, torch.Tensor]:
        """Validate one unbatched observation against the model's shapes; batch it (B = 1)."""
        out = {}
        for name, shape in self.config.observation_shapes.items():
            if name not in obs:
                raise ValueError(f"observation is missing '{name}' (expected shape {shape})")
            value = torch.as_tensor(obs[name], dtype=torch.float32)
            if tuple(value.shape) != shape:
                raise ValueError(f"observation '{name}' has shape {tuple(value.shape)}, expected {shape}")
            out[name] = value.to(device=self.device, dtype=self.dtype).unsqueeze(0)
        return out
