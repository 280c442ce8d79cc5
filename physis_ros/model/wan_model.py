"""A Wan trunk from a diffusers directory as a servable model (family ``wan``, :mod:`physis_ros.model.wan_family`).

The stage contract over diffusers' own modules (:mod:`physis_ros.model.wan`):

- ``encode``: prompt embeddings ``[B, L, text_dim]`` -> text tokens ``[B, L, D]`` (the trunk's text embedder);
- ``embed``: the noisy latent ``[B, C, F, H, W]`` -> the hidden state, the text tokens followed by the video
  tokens ``[B, L + T, D]`` (so that every block's cross-attention has the text beside the tokens it carries);
- ``block``: diffusers' ``WanTransformerBlock`` on the video tokens, its self-attention through
  :class:`CachedSelfAttention` over the stage-local K/V, its cross-attention to the text tokens through
  :class:`CachedCrossAttention` (the text's K/V computed once per slot while the text is the same);
- ``head``: the output norm, projection and unpatchify -> velocity ``[B, C, F, H, W]``.

Timesteps: the contract's ``t`` in [0, 1] is the noise level; the trunk is given ``1000 * t``.

History positions (RoPE): a chunk's frames sit after the chunks its K/V cache holds, ``F`` latent frames
each, oldest first (the sink first): chunk ``c`` of a stream within its first ``window`` chunks is at frames
``c*F .. c*F + F - 1``, its absolute positions. Later chunks keep those offsets to every chunk in the window
(RoPE's attention depends on offsets only), so a stream runs for ever inside the trunk's position table.
The cache stores keys before RoPE and rotates them to their place when read.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from physis_ros.model.dit import TimestepCache
from physis_ros.model.interface import ServableModel
from physis_ros.model.kv import KVBatch, KVTable
from physis_ros.model.spec import ModelConfig
from physis_ros.model.wan import head, load_wan, patchify, random_wan, rope_at, time_embedding
from physis_ros.model.wan_family import trunk_of
from physis_ros.model.wan_history import apply_rotary, attend, project_kv, project_query


class CachedSelfAttention:
    """A Wan block's self-attention (diffusers' projections, norms and RoPE arithmetic) over its own tokens and
    the K/V history of each sample's slot: set ``kv`` (the call's :class:`KVBatch`) and ``rope`` (cos, sin
    ``[1, positions, 1, head_dim]``, the cached keys' positions from 0) before the block runs."""

    def __init__(self) -> None:
        self.kv: KVBatch | None = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _place(self, keys: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope
        n = keys.shape[0]
        return apply_rotary(keys[None], cos[:, :n], sin[:, :n])[0]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        kv = self.kv
        if kv is None or self.rope is None:
            raise RuntimeError("the Wan block's K/V cache was not set for this call")
        query = project_query(attn, hidden_states)
        key, value = project_kv(attn, hidden_states)
        query, rotated = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        keys, values, mask = kv.attend_inputs(rotated, value, cached_keys=self._place)
        kv.append(key, value)
        return attend(attn, query, keys, values, mask)


class CachedCrossAttention:
    """A Wan block's cross-attention to the text tokens (diffusers' projections and norms), the text's K/V
    computed once per slot and kept beside its history (:meth:`KVTable.context`) while the text is the same:
    set ``kv`` before the block runs."""

    def __init__(self) -> None:
        self.kv: KVBatch | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        kv = self.kv
        if kv is None:
            raise RuntimeError("the Wan block's K/V cache was not set for this call")

        def project(text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            key, value = project_kv(attn, text[None])
            return key[0], value[0]

        pairs = [kv.table.context(slot, encoder_hidden_states[i], project) for i, slot in enumerate(kv.slots)]
        return attend(attn, project_query(attn, hidden_states), torch.stack([k for k, _ in pairs]),
                      torch.stack([v for _, v in pairs]))


class WanModel(ServableModel):
    """The servable model of a Wan checkpoint directory (see the module's docstring)."""

    sequence_recompute = False      # its history is checked against diffusers' forward (wan_history.recompute)

    def __init__(self, config: ModelConfig, hosted_blocks: Iterable[int] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, hosted_blocks)
        io = config.wan
        assert io is not None
        if io.checkpoint:
            source = load_wan(io.checkpoint, blocks=sorted(self.hosted_blocks), dtype=self.dtype)
        else:    # a real architecture with random weights (a preset for profiling and simulation)
            source = random_wan(trunk_of(io), blocks=sorted(self.hosted_blocks), dtype=self.dtype,
                                seed=config.init_seed)
        self.trunk = source.trunk
        self.blocks = nn.ModuleDict()
        built, source.blocks = dict(source.blocks), {}
        self._source = source               # to build more blocks from the checkpoint
        p_t, p_h, p_w = self.trunk.config.patch_size
        self._grid = (io.frames // p_t, io.height // p_h, io.width // p_w)
        self._video_tokens = self._grid[0] * self._grid[1] * self._grid[2]
        spec = config.spec
        self._context = spec.context_tokens                     # conditioning tokens first in the hidden state
        self._chunk = spec.tokens_per_chunk - spec.context_tokens   # then the tokens that write history K/V
        self._time = TimestepCache(self._time_of)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.to(device=device)
        self.attach_blocks({b: blk.to(device=device) for b, blk in built.items()})

    @property
    def device(self) -> torch.device:
        return self.trunk.proj_out.weight.device

    @property
    def trunk_config(self) -> dict:
        """The trunk's diffusers config (``WanTransformer3DModel``'s keys), as its directory's ``config.json``
        gives it or its random-init ``wan.trunk``."""
        return {k: v for k, v in self._source.config.items() if not k.startswith("_")}

    def _apply(self, fn, recurse=True):     # .to(): the cached time embeddings and RoPE table are stale
        if hasattr(self, "_time"):
            self._time.values.clear()
            self._rope = None
        return super()._apply(fn, recurse)

    def clear_timestep_caches(self) -> None:
        self._time.values.clear()

    def _time_of(self, t: torch.Tensor) -> torch.Tensor:
        """[1, 7, D]: the head's modulation, then the blocks' six, for one noise level ``t`` in [0, 1]."""
        temb, proj = time_embedding(self.trunk, (t.double() * 1000.0).float(), self.dtype)
        return torch.cat([temb[:, None], proj], dim=1)

    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos, sin of the cache's chunks and the chunk itself, in order: [1, (window + sink + 1) * T, 1, hd]."""
        if self._rope is None:
            self._rope = self._video_positions()
        return self._rope

    def _video_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The video tokens' RoPE cos, sin, chunk after chunk: [1, (window + sink + 1) * video tokens, 1, hd]."""
        c, io = self.config, self.config.wan
        chunks = c.window + int(c.sink) + 1
        shape = (1, 1, chunks * io.frames, io.height, io.width)
        return rope_at(self.trunk.rope, torch.empty(shape, device="meta"), 0)

    # ---- the stage contract ----------------------------------------------------------------------
    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.trunk.condition_embedder.text_embedder(obs["prompt_embeds"])

    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([cond, patchify(self.trunk, x)], dim=1)

    def block(self, b: int, h: torch.Tensor, t: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        try:
            blk = self.blocks[str(b)]
        except KeyError:
            raise KeyError(f"block {b} is not hosted here (hosted: {sorted(self.hosted_blocks)})") from None
        text, video = h[:, :self._context].contiguous(), h[:, self._context:].contiguous()
        cos, sin = self._positions()
        n = self._chunk
        offsets = [kv.history_tokens(i) for i in range(len(kv.slots))]     # a chunk sits after what it reads
        if len(set(offsets)) == 1:
            here = (cos[:, offsets[0]:offsets[0] + n], sin[:, offsets[0]:offsets[0] + n])
        else:
            here = (torch.cat([cos[:, o:o + n] for o in offsets]), torch.cat([sin[:, o:o + n] for o in offsets]))
        attention, cross = blk.attn1.processor, blk.attn2.processor
        attention.kv, attention.rope, cross.kv = kv, (cos, sin), kv
        try:
            video = blk(video, text, self._time(t)[:, 1:], here)
        finally:
            attention.kv = attention.rope = cross.kv = None
        return torch.cat([text, video], dim=1)

    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return head(self.trunk, h[:, self._context:], self._time(t)[:, 0], self._grid)

    def new_kv_table(self, block: int, slots: int) -> KVTable:
        """K/V history of the video tokens, and the text's cross-attention K/V kept once per slot."""
        c = self.config
        return KVTable(slots, self._chunk, c.window, c.sink, c.heads, c.head_dim, dtype=self.dtype,
                       device=self.device, context_tokens=self._context)

    # ---- hosting blocks ----------------------------------------------------------------------------
    def new_block(self, b: int) -> nn.Module:
        """Block ``b``'s module, its weights not loaded (they come from the checkpoint: :meth:`build_blocks`)."""
        return self._source.new_block()

    def build_blocks(self, blocks: Iterable[int], weights: dict[str, torch.Tensor] | None = None
                     ) -> dict[int, nn.Module]:
        """Blocks loaded from the checkpoint directory (each from its own tensors; a random-init trunk's seeded
        by their names), on this model's device."""
        if weights is not None:
            raise ValueError(f"model '{self.config.name}' builds its blocks from "
                             f"{self.config.wan.checkpoint or 'its seed'}, not from given weights")
        return {b: self._source.build_block(b).to(device=self.device) for b in sorted(set(blocks))}

    def attach_blocks(self, built: dict[int, nn.Module]) -> None:
        for b, blk in built.items():
            blk.attn1.set_processor(CachedSelfAttention())
            blk.attn2.set_processor(CachedCrossAttention())
            self.blocks[str(b)] = blk
        self.hosted_blocks = frozenset(self.hosted_blocks | set(built))

    def release_blocks(self, blocks) -> None:
        for b in blocks:
            if str(b) in self.blocks:
                del self.blocks[str(b)]
        self.hosted_blocks = frozenset(self.hosted_blocks - set(blocks))
