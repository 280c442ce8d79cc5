"""The server's noisy-KV computation (DESIGN.md section 2), differentiable, for training.

At serving time chunk ``c`` at denoising step ``k`` attends, in every block, to its own tokens and to
the K/V that the previous ``window`` chunks of its stream wrote (plus the stream's first chunk when the
model keeps a sink), by the model's history rule (docs/history.md):

- ``same_step``: the K/V they wrote at the same step ``k``. Training runs exactly that on sequences of
  consecutive chunks that are all at one step ``k`` (one noise level), chunk by chunk.
- ``clean``: the K/V a pass at t = 0 over each earlier chunk's finished output wrote. Training feeds that
  pass the expert's chunk (teacher forcing: the clean K/V a perfect policy's outputs would write), chunk by
  chunk, and gradients flow through it as through the noisy pass.

Both run through the model's own pieces (``encode``, ``embed``, ``block``, ``head``). Two details make it
trainable, and neither changes the arithmetic:

- :class:`ListKV` stands in for :class:`~physis_ros.model.kv.KVBatch`: the previous chunks' K/V
  are kept in a Python list (the window and sink rule of :class:`~physis_ros.model.kv.KVTable`)
  instead of being copied into a preallocated table, so autograd sees no in-place writes; a
  model's conditioning K/V (a Wan block's cross-attention) is projected on every call, not kept.
- The model memoises its time modulation per timestep; :func:`sequence_velocities` clears that memo
  before each forward, so within one forward the modulation of a timestep is computed once (and
  differentiated through), and never survives an optimiser step.

Any model on the stage contract trains through these pieces: the tiny DiT families and the Wan
world-action model (:mod:`physis_ros.model.wan_wam`, whose blocks place cached keys at their RoPE
positions through ``cached_keys``).

:func:`rollout` runs the whole denoising loop with these pieces; ``tests/train`` checks that it
equals :class:`~physis_ros.reference.ReferenceRollout` (what the server computes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from physis_ros.model.interface import ServableModel
from physis_ros.model.presets import build_model
from physis_ros.model.spec import ModelConfig


def trainable_model(config: ModelConfig, device: torch.device | str = "cpu") -> ServableModel:
    """The model of ``config`` with its seeded init (the weights of ``build_model(config)``), gradients
    on. Its ``state_dict`` is the served model's, so :func:`~physis_ros.model.checkpoint.save_checkpoint`
    writes a servable checkpoint."""
    return build_model(config, device=device).requires_grad_(True)


class ListKV:
    """What one block of a batch of sequences has written so far at one step: duck-types
    :class:`~physis_ros.model.kv.KVBatch` (``attend_inputs``, ``append``) with no in-place writes.

    All samples of a batch are at the same position of their sequences, so every sample has the same
    number of cached chunks and no padding mask is needed. Keeps at most ``window`` chunks, plus the
    first chunk for good when ``sink`` (the rule of :class:`~physis_ros.model.kv.KVTable`).
    ``batch``: the samples of a call (``slots`` are ``0 .. batch-1``).
    """

    def __init__(self, window: int, sink: bool = False, batch: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1 chunk, got {window}")
        self.window = window
        self.sink = sink
        self.slots = list(range(batch))
        self.table = self          # what a block asks the table for (its conditioning K/V: :meth:`context`)
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.writes = True         # False: calls read the cached chunks and keep nothing (a clean-rule noisy pass)

    def history_tokens(self, i: int) -> int:
        """Tokens of K/V every sample reads before its own."""
        return sum(ck.shape[1] for ck, _ in self.chunks)

    def attend_inputs(self, k: torch.Tensor, v: torch.Tensor, cached_keys=None
                      ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """As :meth:`KVBatch.attend_inputs`: the cached chunks' keys (through ``cached_keys``, one sample at a
        time, where given) and values, then the call's own."""
        if not self.chunks:
            return k, v, None
        keys = torch.cat([ck for ck, _ in self.chunks], dim=1)
        if cached_keys is not None:
            keys = torch.stack([cached_keys(sample) for sample in keys])
        values = torch.cat([cv for _, cv in self.chunks] + [v], dim=1)
        return torch.cat([keys, k], dim=1), values, None

    def context(self, slot: int, tokens: torch.Tensor, project):
        """A sample's conditioning K/V (:meth:`KVTable.context`), projected again on every call."""
        return project(tokens)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.writes:
            return
        self.chunks.append((k, v))
        if len(self.chunks) > self.window + int(self.sink):
            del self.chunks[1 if self.sink else 0]


def new_kvs(model: ServableModel, batch: int = 1) -> list[ListKV]:
    """One empty :class:`ListKV` per block of ``model``, for calls of ``batch`` samples."""
    c = model.config
    return [ListKV(c.window, c.sink, batch) for _ in range(c.blocks)]


def chunk_velocity(model: ServableModel, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor,
                   kvs: Sequence[ListKV]) -> torch.Tensor:
    """One denoising step of one chunk (per sample): the velocity the head predicts for noisy chunks
    ``x`` at timesteps ``t``; every block reads then appends its ``kvs[b]`` (as the server's stage
    ``(k, b)`` does with its KV slot)."""
    h = model.embed(cond, x, t)
    for b in range(model.config.blocks):
        h = model.block(b, h, t, kvs[b])
    return model.head(h, t)


def writing(kvs: Sequence[ListKV], writes: bool) -> Sequence[ListKV]:
    """``kvs`` set to keep what the next calls write (``writes``) or only read."""
    for kv in kvs:
        kv.writes = writes
    return kvs


def clean_pass(model: ServableModel, cond: torch.Tensor, x0: torch.Tensor, kvs: Sequence[ListKV]) -> None:
    """The clean rule's pass over finished chunks ``x0`` (per sample) at t = 0: every block reads the clean K/V
    of the chunks before and appends this chunk's (what the server's clean row of stages does)."""
    t0 = model.timesteps.timestep(torch.zeros(x0.shape[0], dtype=torch.long, device=x0.device)).to(x0.dtype)
    h = model.embed(cond, x0, t0)
    for b, kv in enumerate(writing(kvs, True)):
        h = model.block(b, h, t0, kv)


def sequence_velocities(model: ServableModel, obs: Sequence[dict[str, torch.Tensor]], x: torch.Tensor,
                        k: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
    """Velocities of a batch of chunk sequences, each sequence at one denoising step.

    ``obs[s]``: the batched observation tensors of position ``s`` ([B, ...] each); ``x``: the noisy
    chunks [B, S, *output_shape] (at the noise level of step ``k``); ``k``: step index per sequence,
    [B] integers in 1..K. Under ``same_step`` chunk ``s`` attends to the K/V chunks ``s - window .. s - 1``
    wrote at the same step; under ``clean`` to the K/V a t = 0 pass over their clean chunks ``x0`` (same shape
    as ``x``; required) wrote. Returns [B, S, *output_shape].
    """
    rule = model.config.history
    if rule not in ("same_step", "clean"):
        raise ValueError(f"history '{rule}' is not trained here; train under same_step or clean and serve the "
                         f"checkpoint under '{rule}'")
    clean = rule == "clean"
    if clean and x0 is None:
        raise ValueError("the clean history rule trains on the clean chunks x0 (teacher-forced K/V); pass x0")
    model.clear_timestep_caches()   # the weights may have changed since the last call
    t = model.timesteps.timestep(k).to(dtype=x.dtype)
    kvs = new_kvs(model, x.shape[0])
    out = []
    for s, o in enumerate(obs):
        cond = model.encode(o)
        out.append(chunk_velocity(model, cond, x[:, s], t, writing(kvs, not clean)))
        if clean and s + 1 < len(obs):
            clean_pass(model, cond, x0[:, s], kvs)
    model.clear_timestep_caches()   # hold no graph, and no values of these weights, past the call
    return torch.stack(out, dim=1)


@torch.no_grad()
def rollout(model: ServableModel, observations: Sequence[dict[str, torch.Tensor]], seed: int, stream: str
            ) -> list[torch.Tensor]:
    """The sequential reference loop of one stream written with :class:`ListKV` and
    :func:`chunk_velocity` (the training computation): chunk outputs [*output_shape], one per
    observation (batched tensors, B = 1), under the ``same_step`` or ``clean`` rule. Equal to
    :class:`~physis_ros.reference.ReferenceRollout`."""
    model.clear_timestep_caches()
    cfg = model.config
    clean = cfg.history == "clean"
    shared = new_kvs(model)
    kvs = {k: shared if clean else new_kvs(model) for k in range(1, cfg.steps + 1)}
    outputs = []
    for c, obs in enumerate(observations):
        x = model.noise(seed, stream, c)
        cond = model.encode(obs)
        for k in range(cfg.steps, 0, -1):
            ks = torch.tensor([k], dtype=torch.long, device=x.device)
            t = model.timesteps.timestep(ks)
            x = model.timesteps.update(x, chunk_velocity(model, cond, x, t, writing(kvs[k], not clean)), ks)
        if clean:
            clean_pass(model, cond, x, shared)
        outputs.append(x[0].float().cpu())
    return outputs
