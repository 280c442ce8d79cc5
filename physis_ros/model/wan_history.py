"""History K/V across chunks for Wan trunks (model/wan.py's stage path), and the full recompute it is
checked against.

A chunk is ``F`` latent frames; chunk ``c``'s frames sit at absolute RoPE positions ``c*F .. c*F + F - 1``
(positions past the trunk's ``rope_max_seq_len`` frames are refused). Each block's self-attention
(:class:`HistoryAttention`, diffusers' own projections, norms and RoPE arithmetic; positions from
:func:`physis_ros.model.wan.rope_at`) reads the K/V earlier
chunks wrote (after RoPE) and hands on the K/V of its own tokens:

- ``same_step``: chunk ``c`` at step ``k`` reads the step-``k`` K/V of chunks ``c-window .. c-1``;
- ``clean``: every step of chunk ``c`` reads the K/V a pass at timestep 0 over the finished outputs of chunks
  ``c-window .. c-1`` wrote (that pass reads the clean K/V before it likewise).

:func:`rollout` runs chunks one after another with those caches (what the server's stages do);
:func:`recompute` runs diffusers' own ``WanTransformer3DModel.forward`` over the whole history at once (every
chunk's latents concatenated along frames, one timestep per token: 0 for clean history) under the rule's
block-causal mask, no cache. tests/model/test_wan.py checks one against the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from physis_ros.model.wan import WanStages, sample

RULES = ("same_step", "clean")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan RoPE on ``x`` [B, T, heads, head_dim] (pairs of channels rotated)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class HistoryAttention:
    """A Wan block's self-attention processor over its own tokens and a history of K/V: set ``past``
    (``(k, v)`` [B, T_past, heads, head_dim], after RoPE, or None) and ``mask`` (an SDPA mask over all keys,
    or None) before the call; after it ``written`` holds this call's own K/V."""

    def __init__(self) -> None:
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mask: torch.Tensor | None = None
        self.written: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        self.written = (key, value)
        if self.past is not None:
            key = torch.cat([self.past[0], key], dim=1)
            value = torch.cat([self.past[1], value], dim=1)
        out = F.scaled_dot_product_attention(query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3),
                                             value.permute(0, 2, 1, 3), attn_mask=self.mask)
        out = out.permute(0, 2, 1, 3).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class HistoryStages:
    """:class:`WanStages` whose blocks read and write history K/V (one :class:`HistoryAttention` per block)."""

    def __init__(self, stages: WanStages):
        self.stages = stages
        self.attention = {}
        for b, block in stages.wan.blocks.items():
            self.attention[b] = HistoryAttention()
            block.attn1.set_processor(self.attention[b])

    def velocity(self, x, t, text, frame_offset: int, past: dict[int, tuple] | None):
        """One model call on chunk latent ``x`` at positions from ``frame_offset``, block ``b`` reading
        ``past[b]``; returns (velocity, {block: its own K/V})."""
        h, step = self.stages.embed(x, t, frame_offset)
        written = {}
        for b in range(self.stages.wan.num_layers):
            attention = self.attention[b]
            attention.past = None if past is None else past.get(b)
            attention.mask = None
            h = self.stages.block(b, h, text, step)
            written[b] = attention.written
        return self.stages.head(h, step), written


def _joined(entries: list[dict[int, tuple]], b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not entries:
        return None
    return (torch.cat([e[b][0] for e in entries], dim=1), torch.cat([e[b][1] for e in entries], dim=1))


def rollout(stages: WanStages, noises: list[torch.Tensor], sigmas: list[float], text: torch.Tensor,
            rule: str, window: int) -> list[torch.Tensor]:
    """Chunks one after another (noise ``noises[c]``, [B, C, F, H, W]) with history K/V by ``rule`` over
    ``window`` chunks; returns each chunk's output latent."""
    if rule not in RULES:
        raise ValueError(f"history rule {rule!r}: one of {', '.join(RULES)}")
    hs = HistoryStages(stages)
    frames = noises[0].shape[2]
    outputs, clean = [], []
    per_step: list[list[dict]] = []           # chunk -> step -> {block: (k, v)}
    for c, noise in enumerate(noises):
        first = max(0, c - window)
        x, writes = noise, []
        for k in range(len(sigmas) - 1):
            t = torch.full((x.shape[0],), 1000.0 * sigmas[k], dtype=torch.float32)
            history = clean[first:c] if rule == "clean" else [per_step[j][k] for j in range(first, c)]
            past = {b: _joined(history, b) for b in stages.wan.blocks} if history else None
            v, written = hs.velocity(x, t, text, c * frames, past)
            writes.append(written)
            x = x + (sigmas[k + 1] - sigmas[k]) * v
        per_step.append(writes)
        outputs.append(x)
        if rule == "clean":   # the pass at t = 0 over the finished chunk writes what later chunks read
            history = clean[first:c]
            past = {b: _joined(history, b) for b in stages.wan.blocks} if history else None
            _, written = hs.velocity(x, torch.zeros(x.shape[0]), text, c * frames, past)
            clean.append(written)
    return outputs


def chunk_mask(chunks: int, tokens_per_chunk: int, window: int) -> torch.Tensor:
    """Boolean SDPA mask [T, T] over ``chunks`` chunks' tokens: chunk i's tokens see chunks i-window .. i."""
    ids = torch.arange(chunks).repeat_interleave(tokens_per_chunk)
    gap = ids[:, None] - ids[None, :]
    return (gap >= 0) & (gap <= window)


def recompute(model, noises: list[torch.Tensor], sigmas: list[float], prompt: torch.Tensor, rule: str,
              window: int) -> list[torch.Tensor]:
    """The outputs :func:`rollout` must give, from diffusers' ``WanTransformer3DModel.forward`` (``model``,
    every block) over the whole history at once, no cache: ``same_step`` denoises every chunk together
    (one sequence, one timestep); ``clean`` denoises chunk ``c`` in one sequence after the finished
    outputs of chunks 0..c-1 at timestep 0 (per-token timesteps)."""
    if rule not in RULES:
        raise ValueError(f"history rule {rule!r}: one of {', '.join(RULES)}")
    processors = [HistoryAttention() for _ in model.blocks]
    for block, proc in zip(model.blocks, processors):
        block.attn1.set_processor(proc)
    p_t, p_h, p_w = model.config.patch_size
    _, _, frames, height, width = noises[0].shape
    per_chunk = (frames // p_t) * (height // p_h) * (width // p_w)

    def forward(x: torch.Tensor, timestep: torch.Tensor, chunks: int) -> torch.Tensor:
        mask = chunk_mask(chunks, per_chunk, window)
        for proc in processors:
            proc.past, proc.mask = None, mask
        return model(x, timestep, prompt, return_dict=False)[0]

    if rule == "same_step":
        x = torch.cat(noises, dim=2)

        def velocity(x, t, _context):
            return forward(x, t, len(noises))

        out = sample(velocity, x, sigmas, prompt)
        return list(out.split(frames, dim=2))
    outputs: list[torch.Tensor] = []
    for c, noise in enumerate(noises):
        def velocity(x, t, _context, c=c):
            sequence = torch.cat([*outputs, x], dim=2)
            ts = torch.cat([torch.zeros(x.shape[0], c * per_chunk), t[:, None].expand(-1, per_chunk)], dim=1)
            return forward(sequence, ts, c + 1)[:, :, c * frames:]

        outputs.append(sample(velocity, noise, sigmas, prompt))
    return outputs
