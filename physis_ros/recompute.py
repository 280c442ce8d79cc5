"""The full-recompute reference of the history rules (docs/history.md): no K/V cache at all.

:class:`~physis_ros.reference.ReferenceRollout` (and every server plan, bit for bit) keeps each block's K/V
of earlier chunks in a rolling :class:`~physis_ros.model.kv.KVTable`. This module computes the same chunks
from the chunks' outputs and noisy states alone: for every chunk and step it runs the whole history again,
concatenated into one sequence, with the rule's attention mask, so the window, the sink and which pass wrote
the K/V a chunk reads are stated once here, as a mask, and not as the cache's bookkeeping:

- ``same_step``: at step k the chunks 0..c, each at its own step-k noisy state, form one sequence (one
  timestep for all); chunk i's tokens attend to chunk i and to chunk j where ``i - window <= j < i`` or
  ``j == 0`` with a sink; chunk c's velocity is the head over its own tokens.
- ``clean``: the finished chunks 0..c-1 at t = 0 (each its output) form one sequence under the same mask,
  recomputed in every block; chunk c at step k attends, in block b, to its own tokens and to the block-b K/V of
  the chunks the mask lets it see, as the clean sequence computed them (chunk c's noisy steps write nothing).

- ``latest``: chunk c at step k reads chunk c-j (j = 1..window) as it was at step ``latest_version(k, j)``
  (0: the clean pass over its output); each of those is itself computed from its state then and the versions
  it read, once, remembered by (chunk, step): no rolling cache, no slots.

Positions restart every chunk (each chunk is embedded on its own), as the model embeds them.
Equal to the cached reference up to float rounding (attention reduces over another key order and length).
"""

from __future__ import annotations

import torch

from physis_ros.model.interface import ServableModel


def visible(i: int, j: int, window: int, sink: bool) -> bool:
    """Does chunk ``i`` read chunk ``j``'s K/V (itself included)?"""
    return j == i or i - window <= j < i or (sink and j == 0 and j < i)


def chunk_mask(chunks: int, tokens: int, window: int, sink: bool, device: torch.device) -> torch.Tensor:
    """The attention mask of a sequence of ``chunks`` chunks of ``tokens`` tokens: [1, 1, n, n], True = attend."""
    seen = torch.tensor([[visible(i, j, window, sink) for j in range(chunks)] for i in range(chunks)],
                        device=device)
    return seen.repeat_interleave(tokens, 0).repeat_interleave(tokens, 1)[None, None]


class _Sequence:
    """Duck-types :class:`~physis_ros.model.kv.KVBatch` for one sample's whole sequence: attends under
    ``mask``, remembers the block's K/V (``written``) instead of caching them."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.written: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend_inputs(self, k: torch.Tensor, v: torch.Tensor):
        return k, v, self.mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.written = (k, v)


class _Given:
    """Duck-types :class:`~physis_ros.model.kv.KVBatch`: attends to given history K/V, then its own; writes
    nothing."""

    def __init__(self, k: torch.Tensor | None, v: torch.Tensor | None):
        self.k, self.v = k, v

    def attend_inputs(self, k: torch.Tensor, v: torch.Tensor):
        if self.k is None:
            return k, v, None
        return torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1), None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.written = (k, v)


class RecomputeRollout:
    """One stream's chunks by full recompute; call :meth:`step` once per chunk with its batched observation
    tensors (``model.observation_tensors``). ``history`` overrides the model's rule."""

    def __init__(self, model: ServableModel, seed: int = 0, stream: str = "s0", history: str | None = None):
        self.model, self.seed, self.stream = model, seed, stream
        self.history = history or model.config.history
        self.conds: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []           # each finished chunk, [1, *output_shape]
        self.states: list[dict[int, torch.Tensor]] = []  # each chunk's noisy state entering step k
        self.written: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}   # latest: (chunk, step)

    def _t(self, k: int, like: torch.Tensor) -> torch.Tensor:
        return self.model.timesteps.timestep(torch.tensor([k], dtype=torch.long, device=like.device))

    def _same_step(self, c: int, k: int, t: torch.Tensor) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        n = cfg.tokens_per_chunk
        h = torch.cat([model.embed(self.conds[j], self.states[j][k], t) for j in range(c + 1)], dim=1)
        mask = chunk_mask(c + 1, n, cfg.window, cfg.sink, h.device)
        for b in range(cfg.blocks):
            h = model.block(b, h, t, _Sequence(mask))
        return model.head(h[:, c * n:], t)

    def _clean_history(self, c: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per block, the K/V of the finished chunks chunk ``c`` reads, from one masked pass at t = 0."""
        model, cfg = self.model, self.model.config
        n = cfg.tokens_per_chunk
        seen = [j for j in range(c) if visible(c, j, cfg.window, cfg.sink)]
        if not seen:
            return [None] * cfg.blocks
        t0 = self._t(0, self.outputs[0])
        h = torch.cat([model.embed(self.conds[j], self.outputs[j], t0) for j in range(c)], dim=1)
        mask = chunk_mask(c, n, cfg.window, cfg.sink, h.device)
        rows = torch.cat([torch.arange(j * n, (j + 1) * n) for j in seen]).to(h.device)
        history = []
        for b in range(cfg.blocks):
            seq = _Sequence(mask)
            h = model.block(b, h, t0, seq)
            k, v = seq.written
            history.append((k[:, rows], v[:, rows]))
        return history

    def _latest_pass(self, i: int, k: int) -> torch.Tensor:
        """The latest rule: chunk ``i`` at step ``k`` (0: its clean pass over its output) reading chunk ``i - j``
        as it was at step ``latest_version(k, j)``, each computed the same way (once, remembered: no rolling
        cache); records the K/V it writes per block and returns its last block's hidden state."""
        model, cfg = self.model, self.model.config
        state = self.outputs[i] if k == 0 else self.states[i][k]
        t = self._t(k, state)
        reads = [(i - j, cfg.latest_version(k, j)) for j in range(cfg.window, 0, -1) if i - j >= 0]
        history = [self._latest_written(a, v) for a, v in reads]
        h = model.embed(self.conds[i], state, t)
        written = []
        for b in range(cfg.blocks):
            given = _Given(torch.cat([w[b][0] for w in history], dim=1) if history else None,
                           torch.cat([w[b][1] for w in history], dim=1) if history else None)
            h = model.block(b, h, t, given)
            written.append(given.written)
        self.written[(i, k)] = written
        return h

    def _latest_written(self, i: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if (i, k) not in self.written:
            self._latest_pass(i, k)
        return self.written[(i, k)]

    @torch.no_grad()
    def step(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The stream's next chunk, [*output_shape] float32 on CPU."""
        model, cfg = self.model, self.model.config
        c = len(self.outputs)
        x = model.noise(self.seed, self.stream, c)
        self.conds.append(model.encode(obs))
        self.states.append({})
        history = self._clean_history(c) if self.history == "clean" else None
        for k in range(cfg.steps, 0, -1):
            self.states[c][k] = x
            t = self._t(k, x)
            if self.history == "latest":
                v = model.head(self._latest_pass(c, k), t)
            elif history is None:
                v = self._same_step(c, k, t)
            else:
                h = model.embed(self.conds[c], x, t)
                for b in range(cfg.blocks):
                    h = model.block(b, h, t, _Given(*(history[b] or (None, None))))
                v = model.head(h, t)
            x = model.timesteps.update(x, v, torch.tensor([k], dtype=torch.long, device=x.device))
        self.outputs.append(x)
        return x[0].float().cpu()
