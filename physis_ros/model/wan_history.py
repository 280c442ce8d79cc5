"""The arithmetic of a Wan block's attention over history K/V (diffusers' own projections, norms and RoPE),
and the full recompute the served Wan model (model/wan_model.py) is checked against.

:func:`recompute` runs diffusers' own ``WanTransformer3DModel.forward`` over the whole history at once (every
chunk's latents concatenated along frames, absolute RoPE positions ``c*F ..``, one timestep per token: 0 for
clean history) under the rule's block-causal mask, no cache:

- ``same_step``: chunk ``c`` at step ``k`` reads the step-``k`` K/V of chunks ``c-window .. c-1``;
- ``clean``: every step of chunk ``c`` reads the K/V a pass at timestep 0 over the finished outputs of chunks
  ``c-window .. c-1`` wrote.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from physis_ros.model.wan import sample

RULES = ("same_step", "clean")   # what the recompute covers


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan RoPE on ``x`` [B, T, heads, head_dim] (pairs of channels rotated)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def project_query(attn, hidden: torch.Tensor) -> torch.Tensor:
    """An attention's queries of ``hidden`` [B, T, D] as diffusers' Wan processor makes them: [B, T, heads, hd]."""
    return attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))


def project_kv(attn, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention's keys (normed) and values of ``source`` [B, L, D], as diffusers' Wan processor makes them."""
    key = attn.norm_k(attn.to_k(source)).unflatten(2, (attn.heads, -1))
    return key, attn.to_v(source).unflatten(2, (attn.heads, -1))


def attend(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention over [B, *, heads, hd] tensors and the attention's output projection."""
    out = F.scaled_dot_product_attention(query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3),
                                         value.permute(0, 2, 1, 3), attn_mask=mask)
    out = out.permute(0, 2, 1, 3).flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


class HistoryAttention:
    """A Wan block's self-attention processor over its own tokens and a history of K/V: set ``past``
    (``(k, v)`` [B, T_past, heads, head_dim], after RoPE, or None) and ``mask`` (an SDPA mask over all keys,
    or None) before the call; after it ``written`` holds this call's own K/V."""

    def __init__(self) -> None:
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mask: torch.Tensor | None = None
        self.written: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = project_query(attn, hidden_states)
        key, value = project_kv(attn, hidden_states)
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        self.written = (key, value)
        if self.past is not None:
            key = torch.cat([self.past[0], key], dim=1)
            value = torch.cat([self.past[1], value], dim=1)
        return attend(attn, query, key, value, self.mask)


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
