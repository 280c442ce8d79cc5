"""The sequential reference rollout: the plain loop of DESIGN.md section 2.

Every distributed execution is checked against this. It is written directly
against the model interface (no stage machinery), one stream at a time, so it
is the simplest statement of what the server must compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from physis_ros.model.handoff import Handoff
from physis_ros.model.interface import ServableModel
from physis_ros.model.kv import KVBatch, KVTable
from physis_ros.model.stages import denoise_update

ObservationSource = Callable[[str, int], dict[str, np.ndarray]]


@dataclass
class ReferenceChunk:
    stream: str
    index: int
    output: torch.Tensor  # [*output_shape], float32 on CPU
    ms: float


class ReferenceRollout:
    """Stateful reference for one or more streams: call :meth:`step` once per chunk and stream. Earlier
    chunks' K/V are read by the model's history rule (``config.history``, docs/history.md): ``same_step``,
    chunk c at step k reads the K/V chunks c-window..c-1 wrote at step k (one slot per step: slot k-1);
    ``clean``, every step of chunk c reads the K/V that a pass at t = 0 over each earlier chunk's output
    wrote (one slot, written once per chunk, after its last step); ``latest``, chunk c-j as it was at a later
    step (one slot per step, slot k, and slot 0 the clean pass's)."""

    def __init__(self, model: ServableModel, seed: int = 0):
        self.model = model
        self.seed = seed
        self.clean = model.config.history == "clean"
        self.latest = model.config.history == "latest"   # a slot per step and one for the clean pass (slot k)
        self._tables: dict[str, list[KVTable]] = {}
        self._next_chunk: dict[str, int] = {}

    def _stream_tables(self, stream: str) -> list[KVTable]:
        if stream not in self._tables:
            slots = 1 if self.clean else self.model.config.steps + int(self.latest)
            self._tables[stream] = [self.model.new_kv_table(b, slots) for b in range(self.model.config.blocks)]
            self._next_chunk[stream] = 0
        return self._tables[stream]

    def restart(self, stream: str, chunk: int) -> None:
        """Fresh K/V for ``stream`` from ``chunk`` on, as the server's reset does (a new epoch: the chunks
        in flight are lost, the next one is computed with no history)."""
        self._tables.pop(stream, None)
        self._stream_tables(stream)
        self._next_chunk[stream] = chunk

    def next_chunk(self, stream: str) -> int:
        """The index :meth:`step` computes next for ``stream``."""
        self._stream_tables(stream)
        return self._next_chunk[stream]

    def _sources(self, table: KVTable, step: int) -> list[list[tuple[int, int]]] | None:
        """The latest rule's reads at ``step`` (one sample): chunk c-j, oldest first, from the slot of the step it
        is read at (``ModelConfig.latest_version``), for the chunks the stream has; None for the other rules."""
        if not self.latest:
            return None
        cfg = self.model.config
        own = KVBatch(table, [step], step_slots=[{k: k for k in range(cfg.steps + 1)}])
        return own.with_latest_sources([step], cfg.latest_version, cfg.window).sources

    @torch.no_grad()
    def step(self, stream: str, obs: dict[str, np.ndarray], handoff: Handoff | None = None) -> ReferenceChunk:
        """The stream's next chunk; ``handoff`` guides it towards the previous chunk (as the server did)."""
        model, cfg = self.model, self.model.config
        tables = self._stream_tables(stream)
        c = self._next_chunk[stream]
        start = time.perf_counter()
        x = model.noise(self.seed, stream, c)
        cond = model.encode(model.observation_tensors(obs))
        for k in range(cfg.steps, 0, -1):
            ks = torch.tensor([k], dtype=torch.long, device=x.device)
            t = model.timesteps.timestep(ks)
            slot = 0 if self.clean else k if self.latest else k - 1
            h = model.embed(cond, x, t)
            for b in range(cfg.blocks):
                h = model.block(b, h, t, KVBatch(tables[b], [slot], [not self.clean], self._sources(tables[b], k)))
            x = denoise_update(model, x, model.head(h, t), ks, KVBatch(tables[-1], [slot]), [handoff])
        if self.clean or self.latest:   # the clean pass: the finished chunk at t = 0 writes what later chunks read
            t0 = model.timesteps.timestep(torch.zeros(1, dtype=torch.long, device=x.device))
            h = model.embed(cond, x, t0)
            for b in range(cfg.blocks):
                h = model.block(b, h, t0, KVBatch(tables[b], [0], None, self._sources(tables[b], 0)))
        ms = (time.perf_counter() - start) * 1e3
        self._next_chunk[stream] = c + 1
        return ReferenceChunk(stream, c, x[0].float().cpu(), ms)


def reference_rollout(model: ServableModel, source: ObservationSource, streams: list[str], chunks: int,
                      seed: int = 0) -> Iterator[ReferenceChunk]:
    """Chunks 0..chunks-1 of every stream (round robin), each from ``source(stream, chunk)``."""
    ref = ReferenceRollout(model, seed)
    for c in range(chunks):
        for s in streams:
            yield ref.step(s, source(s, c))
