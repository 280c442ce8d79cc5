"""Cluster state: per device, time utilisation, memory in use and which blocks' weights it holds.

Utilisation of a device is ``sum(rank.work_ms / stream.slo_ms)`` over the ranks it
hosts: each stream produces one chunk per SLO interval, so that is the
fraction of the device's time its ranks take. A device may be filled to
``1 - headroom``.

Time-sharing (``max_batch > 1``): tasks of the same block of the same model on one
device run batched, so their compute is charged at the measured batch-cost curve:
with ``n`` streams holding a block there, its tasks run as ``n // max_batch`` batches
of ``max_batch`` and one of the rest, a task in a batch of ``m`` costing ``time(b, m) / m / time(b, 1)``
of its batch-1 time. A stream's own stages of a block (its denoising steps) run one after
another, so a stream alone gets no credit. That is the lockstep the workers'
batching reaches when the device is busy, which is when capacity matters; the
admission benchmark measures whether it holds. With earliest-deadline-first dispatch on the worker (issue 4's
``edf`` policy), utilisation <= 1 is the classic schedulability bound for
periodic work with deadlines equal to periods; the headroom covers
non-preemptive stage tasks, transfer jitter and profile error.

Weights are reference counted per (model, block, device): the first stage of
block b of model M placed on a device loads the block, later ones (other
steps of the same stream, or other streams) share it, and the weights leave
when the last stage using them does. Every placed stage holds its own KV slot.

How much the streams' chunk latencies may vary, and so whether a placement keeps their interval SLOs,
is the jitter bound's (:mod:`~physis_ros.scheduling.jitter`, :attr:`Cluster.jitter`).

State lives in numpy arrays so that scoring all devices for one rank is a few
vector operations, which keeps a placement decision fast at 1024 devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from physis_ros.scheduling.jitter import JitterBound
from physis_ros.runtime.costs import CostProfile
from physis_ros.scheduling.ranks import VirtualRank
from physis_ros.scheduling.settings import DeviceSpec


@dataclass
class PlacedStream:
    stream: str
    model: str
    slo_ms: float
    ranks: list[VirtualRank]
    devices: list[int]                    # device of each rank
    method: str = ""                      # how it was placed: best-fit, lds, equal-fallback, equal, unchecked
    latency_slo_ms: float | None = None
    jitter_budget_ms: float | None = None  # how much its chunks' latency may vary (None: not checked)
    phase_ms: float | None = None         # released at this phase of its interval (None: not paced)

    def work_by_device(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for r, d in zip(self.ranks, self.devices):
            out[d] = out.get(d, 0.0) + r.work_ms
        return out

    @property
    def interval_alone_ms(self) -> float:
        """Output interval with the stream alone on its devices: its busiest device's work per chunk."""
        return max(self.work_by_device().values())

    @property
    def latency_alone_ms(self) -> float:
        """Response latency alone: all compute in sequence plus one hop per rank."""
        return sum(r.work_ms for r in self.ranks)

    def as_dict(self) -> dict:
        return {"stream": self.stream, "model": self.model, "slo_ms": self.slo_ms, "method": self.method,
                "devices": self.devices, "ranks": [r.describe() for r in self.ranks],
                "interval_alone_ms": round(self.interval_alone_ms, 4),
                "latency_alone_ms": round(self.latency_alone_ms, 4),
                **({} if self.phase_ms is None else {"phase_ms": round(self.phase_ms, 4)})}


@dataclass
class _Undo:
    device: int
    util: float
    mem: float
    slo_ms: float


class Cluster:
    """Devices and the streams placed on them. Placement policy lives elsewhere."""

    def __init__(self, specs: Sequence[DeviceSpec], headroom: float, profiles: dict[str, CostProfile],
                 max_batch: int = 1, deadline_order: bool = False):
        if not specs:
            raise ValueError("a cluster needs at least one device")
        self.specs = list(specs)
        self.n = len(self.specs)
        self.headroom = headroom
        # Per device: the utilisation (in its profiles' terms) it may be booked to: 1 - headroom, less where
        # the device was measured running busier than its profiles say (set_load_factors).
        self.util_cap = np.full(self.n, 1.0 - headroom)
        self.load = np.ones(self.n)             # per device: measured busy / booked (set_load_factors)
        self.profiles = profiles
        self.mem_cap = np.array([s.usable_bytes for s in self.specs], dtype=np.float64)
        self.util = np.zeros(self.n)
        self.mem = np.zeros(self.n)
        self.refs: dict[str, np.ndarray] = {}   # model -> [block, device]: stages using that block there
        self.work: dict[str, np.ndarray] = {}   # model -> [block, device]: their batch-1 utilisation
        # model -> [block, device]: ranks holding that block there, i.e. the streams whose tasks of it can batch
        # (one stream's stages of a block are its denoising steps, which run one after another, never together)
        self.hosts: dict[str, np.ndarray] = {}
        self.max_batch = max(1, max_batch)
        self._factor: dict[str, np.ndarray] = {}  # model -> [block, n]: per-task cost at batch n / batch 1
        self.streams: dict[str, PlacedStream] = {}
        self.kind = np.array([hash(s) for s in self.specs])  # devices of one kind are interchangeable
        self.uniform = len(set(self.specs)) == 1
        # how much the placed streams' chunk latencies may vary, given the workers' dispatch (edf or oldest)
        self.jitter = JitterBound(self, deadline_order)

    # -------------------------------------------------------------- queries

    def refs_of(self, model: str) -> np.ndarray:
        if model not in self.refs:
            self.refs[model] = np.zeros((self.profiles[model].blocks, self.n), dtype=np.int64)
            self.work[model] = np.zeros((self.profiles[model].blocks, self.n))
            self.hosts[model] = np.zeros((self.profiles[model].blocks, self.n), dtype=np.int64)
        return self.refs[model]

    def set_load_factors(self, factors: Sequence[float]) -> None:
        """Each device's measured load over its booking (>= 1): its cap shrinks by that factor, so what it is
        booked to costs at most 1 - headroom of its time as it runs now."""
        self.load = np.maximum(1.0, np.asarray(factors, dtype=np.float64))
        self.util_cap = (1.0 - self.headroom) / self.load

    def batch_factor(self, model: str) -> np.ndarray:
        """[block, n] for n = 0..max_batch: what a task costs in a batch of n, as a fraction of its batch-1
        cost (mean over the block's steps; never above 1: adaptive batching runs singles then)."""
        if model not in self._factor:
            prof = self.profiles[model]
            f = np.ones((prof.blocks, self.max_batch + 1))
            for b in range(prof.blocks):
                stages = [(k, b) for k in range(prof.steps, 0, -1)]
                single = sum(prof.time_ms(s, 1) for s in stages)
                for n in range(2, self.max_batch + 1):
                    f[b, n] = min(1.0, sum(prof.time_ms(s, n) for s in stages) / n / single)
            self._factor[model] = f
        return self._factor[model]

    def _per_task(self, model: str, blocks: np.ndarray, hosts: np.ndarray) -> np.ndarray:
        """What one task of each of these blocks costs per device, as a fraction of its batch-1 cost, when the
        ``hosts`` streams holding it there batch its tasks as ``n // max_batch`` full batches and one of the rest."""
        f = self.batch_factor(model)
        full, rest = np.divmod(hosts, self.max_batch)
        rows = blocks[:, None]
        tasks = full * self.max_batch * f[rows, self.max_batch] + rest * f[rows, rest]
        return tasks / np.maximum(hosts, 1)

    def _block_util(self, model: str, blocks: np.ndarray, hosts: np.ndarray, work: np.ndarray) -> np.ndarray:
        """Utilisation of these blocks' hosted stages per device, batching credited."""
        return self._per_task(model, blocks, hosts) * work

    def delta_util(self, rank: VirtualRank, slo_ms: float, sign: int = 1) -> np.ndarray:
        """Per device: how its utilisation changes if ``rank`` (of a stream at ``slo_ms``) is added
        (``sign`` 1) or removed (-1) there."""
        self.refs_of(rank.model)
        hosts, work = self.hosts[rank.model][rank.block_index], self.work[rank.model][rank.block_index]
        hop = rank.hop_ms / slo_ms
        if self.max_batch == 1:
            return np.full(self.n, sign * (rank.work_ms / slo_ms))
        added = (rank.work_array / slo_ms)[:, None]
        before = self._block_util(rank.model, rank.block_index, hosts, work)
        after = self._block_util(rank.model, rank.block_index, hosts + sign, work + sign * added)
        return (after - before).sum(axis=0) + sign * hop

    def missing_weight_bytes(self, rank: VirtualRank) -> np.ndarray:
        """Per device: bytes of this rank's blocks that are not loaded there yet."""
        refs = self.refs_of(rank.model)[rank.block_index]
        return (refs == 0).sum(axis=0) * float(self.profiles[rank.model].block_weight_bytes)

    def empty(self) -> np.ndarray:
        return (self.util <= 0.0) & (self.mem <= 0.0)

    def weight_bytes(self) -> np.ndarray:
        out = np.zeros(self.n)
        for model, refs in self.refs.items():
            out += (refs > 0).sum(axis=0) * float(self.profiles[model].block_weight_bytes)
        return out

    def task_shares(self) -> dict[str, np.ndarray]:
        """model -> [block, device]: a task's cost as a fraction of batch 1, as the devices batch now."""
        return {m: self._per_task(m, np.arange(h.shape[0]), np.maximum(h, 1)) for m, h in self.hosts.items()}

    # -------------------------------------------------------------- mutation (with undo for the search)

    def apply(self, rank: VirtualRank, slo_ms: float, device: int) -> _Undo:
        undo = _Undo(device, float(self.util[device]), float(self.mem[device]), slo_ms)
        refs = self.refs_of(rank.model)
        blocks, counts = rank.block_index, rank.count_array
        loads = int((refs[blocks, device] == 0).sum())
        self.util[device] += self.delta_util(rank, slo_ms)[device]
        refs[blocks, device] += counts
        self.hosts[rank.model][blocks, device] += 1
        self.work[rank.model][blocks, device] += rank.work_array / slo_ms
        self.mem[device] += rank.kv_bytes + rank.buffer_bytes + loads * self.profiles[rank.model].block_weight_bytes
        return undo

    def revert(self, rank: VirtualRank, undo: _Undo) -> None:
        d = undo.device
        self.refs[rank.model][rank.block_index, d] -= rank.count_array
        self.hosts[rank.model][rank.block_index, d] -= 1
        self.work[rank.model][rank.block_index, d] -= rank.work_array / undo.slo_ms
        self.util[d] = undo.util
        self.mem[d] = undo.mem

    def add_stream(self, placed: PlacedStream) -> None:
        if placed.stream in self.streams:
            raise ValueError(f"stream '{placed.stream}' is already placed")
        for rank, d in zip(placed.ranks, placed.devices):
            self.apply(rank, placed.slo_ms, d)
        self.streams[placed.stream] = placed

    def remove_stream(self, stream: str) -> PlacedStream:
        """Free a stream's time and KV; weights leave a device with the last stage that used them."""
        try:
            placed = self.streams.pop(stream)
        except KeyError:
            raise KeyError(f"no stream '{stream}' is placed") from None
        prof = self.profiles[placed.model]
        refs = self.refs[placed.model]
        for rank, d in zip(placed.ranks, placed.devices):
            self.util[d] = max(0.0, self.util[d] + self.delta_util(rank, placed.slo_ms, -1)[d])
            refs[rank.block_index, d] -= rank.count_array
            self.hosts[placed.model][rank.block_index, d] -= 1
            self.work[placed.model][rank.block_index, d] -= rank.work_array / placed.slo_ms
            unloaded = int((refs[rank.block_index, d] == 0).sum())
            freed = rank.kv_bytes + rank.buffer_bytes + unloaded * prof.block_weight_bytes
            self.mem[d] = max(0.0, self.mem[d] - freed)
            if not any(r[:, d].any() for r in self.refs.values()):
                self.util[d] = 0.0  # exact zero: no drift left behind on an idle device
                self.mem[d] = 0.0
        return placed

    # -------------------------------------------------------------- reporting

    def stats(self) -> dict:
        used = ~self.empty()
        return {
            "devices": self.n,
            "devices_used": int(used.sum()),
            "utilisation_mean": round(float(self.util.mean()), 4),
            "utilisation_mean_used": round(float(self.util[used].mean()) if used.any() else 0.0, 4),
            "utilisation_max": round(float(self.util.max()), 4),
            "memory_gb_mean_used": round(float(self.mem[used].mean() / 1e9) if used.any() else 0.0, 3),
            "memory_frac_max": round(float((self.mem / self.mem_cap).max()), 4),
            "weight_gb_total": round(float(self.weight_bytes().sum() / 1e9), 3),
        }
