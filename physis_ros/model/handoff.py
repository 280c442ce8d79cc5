"""Delay-aware hand-off between consecutive action chunks, applied inside the sampler at every step.

While chunk ``c`` is computed the robot keeps executing chunk ``c-1``: by the time ``c`` arrives,
``d`` more control steps (the inference delay) have been executed from ``c-1``. Chunk ``c``'s rows
are steps ``sigma(c) + i``; chunk ``c-1``'s row ``shift + i`` is the same step (``shift`` =
``sigma(c) - sigma(c-1)``, the execution horizon ``s`` on a steady timeline). So chunk ``c``'s
first ``d`` rows must equal what ``c-1`` committed for them, and the rest of their overlap
(rows ``< H - shift``) should lean towards it: real-time chunking's inpainting (Black et al. 2025),
with its soft mask ``W_i = 1`` for ``i < d``, ``c (e^c - 1) / (e - 1)`` with
``c = (H-shift-i) / (H-shift-d+1)`` for ``d <= i < H - shift``, ``0`` beyond (``hard``: only the
first ``d`` rows, weight 1).

It needs no waiting for chunk ``c-1`` to finish: at every step ``k`` the worker that runs the head of
that step has just run chunk ``c-1`` at step ``k`` (same KV slot, in order), so it keeps chunk
``c-1``'s clean-action estimate at step ``k`` beside the noisy KV (``KVTable.actions``) and guides
chunk ``c`` towards it at the same noise level. With flow matching (``x_t = t eps + (1-t) x0``,
``v = eps - x0``) the clean estimate at ``t_k`` is ``x - t_k v``; the guided estimate replaces it, and
``v`` is re-derived so the Euler step lands on it. The pull is applied at each of the ``K`` denoising
steps and compounds (each step moves ``x`` to its guided estimate's noise level, so a row pulled by
``w`` at every step ends up pulled by up to ``1 - (1 - w)^K``): a soft row is pulled by
``1 - (1 - W_i)^(1/K)`` per step, so that the chunk as a whole leans towards the previous one by
``W_i`` at most, as the schedule says (frozen rows, ``W_i = 1``, stay exactly 1). At the last step
the chunk IS its clean estimate, so with ``hard`` (and ``soft``, whose first ``d`` weights are 1)
chunk ``c``'s first ``d`` actions equal chunk ``c-1``'s committed ones exactly. The sequential reference applies the same
function, so every execution plan still equals it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("none", "hard", "soft")


@dataclass(frozen=True)
class Handoff:
    mode: str    # hard | soft
    d: int       # inference delay in control steps: rows [0, d) are frozen to the previous chunk
    shift: int   # control steps between the previous chunk's row 0 and this chunk's


def weights(h: Handoff, rows: int) -> torch.Tensor:
    """Per-row weight of the previous chunk's actions in the finished chunk (float32 [rows])."""
    overlap = max(0, rows - h.shift)
    d = min(h.d, overlap)
    w = torch.zeros(rows, dtype=torch.float32)
    w[:d] = 1.0
    if h.mode == "soft":
        for i in range(d, overlap):
            c = (overlap - i) / (overlap - d + 1)
            w[i] = c * (math.exp(c) - 1.0) / (math.e - 1.0)
    return w


def step_weights(h: Handoff, rows: int, steps: int) -> torch.Tensor:
    """Per-row pull at each of ``steps`` sampler steps, compounding to at most :func:`weights`."""
    w = weights(h, rows)
    if steps <= 1:
        return w
    return torch.where(w >= 1.0, w, 1.0 - (1.0 - w) ** (1.0 / steps))


def guide(x: torch.Tensor, v: torch.Tensor, t_k: float, t_next: float, previous: torch.Tensor | None,
          h: Handoff, steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One of ``steps`` sampler steps of one chunk ([rows, ...] tensors, no batch dimension) with the
    hand-off: (the next x, the clean estimate to keep for the next chunk). ``previous``: the previous
    chunk's clean estimate at this step (None: nothing to hand off from, e.g. the stream's first chunk)."""
    clean = x - t_k * v
    if previous is not None:
        rows = x.shape[0]
        overlap = max(0, rows - h.shift)
        target = clean.clone()
        target[:overlap] = previous[h.shift:h.shift + overlap]
        w = step_weights(h, rows, steps).to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
        clean = torch.where(w == 1.0, target, w * target + (1.0 - w) * clean)
    if t_next == 0.0:
        return clean, clean   # the last step: the chunk is its clean estimate (frozen rows exactly equal)
    v = (x - clean) / t_k
    return x + (t_next - t_k) * v, clean
