"""Stage-local noisy KV cache: one persistent table per hosted block.

A table holds, for each *slot* (one (stream, step) pair), the keys and values
that earlier chunks wrote at that block and step: an optional *sink* chunk (the
stream's first chunk, kept for good) followed by a rolling window of the last
``window`` chunks, oldest first. A slot is allocated when its (stream, stage) is
admitted and freed when the stream leaves; its storage never moves meanwhile;
tasks name their slot and the table gathers from it (no re-layout per task).

Keys stay in chronological order (the window is shifted, not a ring buffer) so
that attention reduces over keys in one fixed order: the sequential reference
and every distributed execution then produce bit-identical fp32 results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class KVTable:
    """Keys/values of one block, one slot per (stream, step) the block serves.

    Slots are allocated one by one (:meth:`add`) and freed (:meth:`remove`), so a
    worker holds KV only for the (stream, stage) pairs admitted to it; a table built
    with ``slots=n`` starts with slots ``0..n-1`` (the reference, the profiler).
    """

    def __init__(self, slots: int, tokens_per_chunk: int, window: int, sink: bool,
                 heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", context_tokens: int = 0):
        if window < 1:
            raise ValueError(f"window must be >= 1 chunk, got {window}")
        self.tokens_per_chunk = tokens_per_chunk
        self.window = window
        self.sink = sink
        self.capacity = (window + int(sink)) * tokens_per_chunk
        self.shape = (self.capacity, heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        # The head stage's hand-off cache: the clean-action estimate the slot's last chunk left at a step,
        # by (slot, step) (physis_ros.model.handoff); empty for every other block.
        self.actions: dict[tuple[int, int], torch.Tensor] = {}
        self.length: dict[int, int] = {}
        self.chunks_written: dict[int, int] = {}
        # A slot's conditioning K/V (cross-attention over tokens every chunk of the stream shares, e.g. a
        # prompt's): the tokens they were computed from, K and V ([context_tokens, heads, head_dim] each),
        # valid until the slot is reset or the tokens change (:meth:`context`).
        self.context_tokens = context_tokens
        self._context: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._context_valid: dict[int, bool] = {}
        for slot in range(slots):
            self.add(slot)

    @property
    def slots(self) -> int:
        return len(self.length)

    def slot_bytes(self) -> int:
        """Bytes one slot holds (keys and values of the full window)."""
        n = 1
        for d in self.shape:
            n *= d
        context = self.context_tokens * self.shape[1] * self.shape[2]
        return (2 * n + 3 * context) * torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        return self.slots * self.slot_bytes()

    def add(self, slot: int) -> None:
        """Allocate a slot (empty history)."""
        if slot in self.length:
            raise ValueError(f"KV slot {slot} already exists")
        self.k[slot] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.v[slot] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.length[slot] = 0
        self.chunks_written[slot] = 0
        if self.context_tokens:
            shape = (self.context_tokens, *self.shape[1:])
            self._context[slot] = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(3))
            self._context_valid[slot] = False

    def remove(self, slot: int) -> None:
        """Free a slot's memory."""
        for store in (self.k, self.v, self.length, self.chunks_written, self._context, self._context_valid):
            store.pop(slot, None)
        self._forget_actions(slot)

    def context(self, slot: int, tokens: torch.Tensor,
                project: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditioning K/V of ``tokens`` ([context_tokens, heads, head_dim] as ``tokens`` [context_tokens,
        heads * head_dim] reshaped) for ``slot``: kept from an earlier call while the tokens are the same,
        else ``project(tokens)`` (K, V), kept for the next."""
        stored, k, v = self._context[slot]
        flat = stored.view(tokens.shape)
        if self._context_valid[slot] and torch.equal(flat, tokens):
            return k, v
        new_k, new_v = project(tokens)
        flat.copy_(tokens)
        k.copy_(new_k)
        v.copy_(new_v)
        self._context_valid[slot] = True
        return k, v

    def _forget_actions(self, slot: int) -> None:
        for key in [key for key in self.actions if key[0] == slot]:
            del self.actions[key]

    def reset(self, slot: int) -> None:
        """Forget a slot's history (its stream restarts)."""
        self.length[slot] = 0
        self.chunks_written[slot] = 0
        if slot in self._context_valid:
            self._context_valid[slot] = False
        self._forget_actions(slot)

    def cached(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values cached in a slot, oldest first: [n, heads, head_dim]."""
        n = self.length[slot]
        return self.k[slot][:n], self.v[slot][:n]

    def gather(self, entries: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of chunks from several slots, in the order given: ``(slot, back)`` is the chunk
        ``back`` entries before the newest of ``slot`` (1: the newest), which must be there."""
        t = self.tokens_per_chunk
        if not entries:
            return self.k[next(iter(self.k))][:0], self.v[next(iter(self.v))][:0]
        ks, vs = [], []
        for slot, back in entries:
            n = self.length[slot]
            if not 1 <= back <= n // t:
                raise ValueError(f"K/V slot {slot} holds {n // t} chunks; chunk {back} back is not there")
            ks.append(self.k[slot][n - back * t:n - (back - 1) * t])
            vs.append(self.v[slot][n - back * t:n - (back - 1) * t])
        return torch.cat(ks), torch.cat(vs)

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one chunk's keys/values ([T, heads, head_dim]); drop the oldest window chunk if full."""
        t = self.tokens_per_chunk
        if k.shape[0] != t:
            raise ValueError(f"expected {t} tokens per chunk, got {k.shape[0]}")
        n = self.length[slot]
        ks, vs = self.k[slot], self.v[slot]
        if n + t <= self.capacity:
            ks[n:n + t] = k
            vs[n:n + t] = v
            self.length[slot] = n + t
        else:
            start = t if self.sink else 0  # the sink chunk never leaves
            ks[start:-t] = ks[start + t:].clone()
            vs[start:-t] = vs[start + t:].clone()
            ks[-t:] = k
            vs[-t:] = v
        self.chunks_written[slot] += 1


@dataclass
class KVBatch:
    """The slots one batched block call reads and appends to: sample i uses ``slots[i]``; ``writes[i]`` False:
    sample i reads its slot's history and leaves it as it was (the ``clean`` history rule's denoising steps,
    which read what a clean pass wrote); None: every sample appends."""

    table: KVTable
    slots: list[int]
    writes: list[bool] | None = None
    sources: list[list[tuple[int, int]]] | None = None
    """Sample i reads these ``(slot, back)`` chunks (:meth:`KVTable.gather`), oldest first, instead of its own
    slot's history (the latest rule's versions); None: its own slot's."""
    step_slots: list[dict[int, int]] | None = None
    """Sample i's stream's slot of each step (0: the clean pass), from which :meth:`with_latest_sources` finds
    ``sources`` under the latest rule; None: the sample reads its own slot."""

    def history_tokens(self, i: int) -> int:
        """How many tokens of K/V sample ``i`` reads before its own (without gathering them)."""
        if self.sources is not None:
            return len(self.sources[i]) * self.table.tokens_per_chunk
        return self.table.length[self.slots[i]]

    def history(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values sample ``i`` reads before its own tokens, oldest first."""
        if self.sources is not None:
            return self.table.gather(self.sources[i])
        return self.table.cached(self.slots[i])

    def attend_inputs(self, k: torch.Tensor, v: torch.Tensor,
                      cached_keys: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys/values to attend to: each sample's cache followed by its own tokens.

        ``k``/``v``: [B, T, heads, head_dim]. ``cached_keys`` maps a sample's cached keys (oldest first,
        [n, heads, head_dim]) to what its queries attend (a model that stores keys before their position
        encoding applies it here; None: as stored). Returns keys, values of shape
        [B, L, heads, head_dim] and the ``attn_mask`` of ``scaled_dot_product_attention`` over them
        (boolean, True = attend, [B, 1, 1, L] here; [B, 1, T, L] where each query has its own keys), or None
        when every key is attended (always the case for B == 1).
        """
        if len(self.slots) != k.shape[0]:
            raise ValueError(f"{len(self.slots)} slots for a batch of {k.shape[0]}")
        cached = [self.history(i) for i in range(len(self.slots))]
        if cached_keys is not None:
            cached = [(cached_keys(ck) if ck.shape[0] else ck, cv) for ck, cv in cached]
        lengths = [ck.shape[0] for ck, _ in cached]
        if len(set(lengths)) == 1:
            if lengths[0] == 0:
                return k, v, None
            ks = torch.cat([torch.stack([ck for ck, _ in cached]), k], dim=1)
            vs = torch.cat([torch.stack([cv for _, cv in cached]), v], dim=1)
            return ks, vs, None
        longest = max(lengths)
        b, t = k.shape[:2]
        keys = k.new_zeros((b, longest + t, *k.shape[2:]))
        vals = v.new_zeros((b, longest + t, *v.shape[2:]))
        mask = torch.zeros((b, longest + t), dtype=torch.bool, device=k.device)
        for i, ((ck, cv), n) in enumerate(zip(cached, lengths)):
            keys[i, :n] = ck
            vals[i, :n] = cv
            keys[i, n:n + t] = k[i]
            vals[i, n:n + t] = v[i]
            mask[i, :n + t] = True
        return keys, vals, mask[:, None, None, :]

    def with_latest_sources(self, steps: list[int], version: Callable[[int, int], int], window: int) -> KVBatch:
        """This batch reading by the latest rule: sample i at step ``steps[i]`` reads chunk c-j (j = window..1)
        from the slot of step ``version(step, j)`` of its stream (``step_slots``), where that slot holds it."""
        if self.step_slots is None:
            return self
        sources = []
        for step, slots in zip(steps, self.step_slots):
            entries = [(slots[version(step, j)], j) for j in range(window, 0, -1)]
            sources.append([(slot, j) for slot, j in entries if self.table.chunks_written.get(slot, 0) >= j])
        return KVBatch(self.table, self.slots, self.writes, sources, self.step_slots)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for i, slot in enumerate(self.slots):
            if self.writes is not None and not self.writes[i]:
                continue
            self.table.append(slot, k[i], v[i])
