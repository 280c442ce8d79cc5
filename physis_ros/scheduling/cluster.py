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

Latency jitter. A stream released every ``pace`` ms meets an interval SLO of ``slo`` ms only if
its chunks' latencies vary by at most ``slo - pace`` (its jitter budget), and what varies them is
the other chunks a device runs at the same time. A chunk of stream ``i`` on device ``w`` is
fastest alone (its batch-1 work there) and slowest when it lands in one busy period with a chunk
of every stream that runs with or ahead of it there, batches charged at the batch-cost curve: the
difference, times the device's measured load factor, summed over ``i``'s devices, is its
worst-case jitter (:meth:`Cluster.jitter_ms`). Which streams run ahead depends on the workers'
dispatch: ``oldest`` finishes a chunk it started before a newer one, so every co-located
stream counts; ``edf`` (``deadline_order``) runs the earliest deadline first, so only streams with
a budget no larger than ``i``'s count in full, and each later one delays ``i`` by at most the one
stage task one of them may be running (tasks are not preempted). Paced streams are released at a
phase of their interval (:meth:`Cluster.release_phase`, :mod:`~physis_ros.scheduling.phases`): two at
the same pace, each wholly on the same device, meet only at their relative phase, so one delays the
other by the backlog its earlier chunk leaves there, not by all of its work. CPU workers on one host also share its
cores (``shared_cores``): with more of them busy than there are cores, a device runs at
``cores / busy devices`` of a core while another is busy, and a busy period stretches by that much for
as long as the longest busy period elsewhere overlaps it. Streams without a budget (the simulator's)
are not checked and count in full. What this model leaves out (a chunk's own compute spread, late releases,
transport) is measured on the running server and charged per stream (:meth:`Cluster.set_spreads`): a
stream's worst case is its bound plus its spread, and a phased co-runner's chunk may run its spread longer.

State lives in numpy arrays so that scoring all devices for one rank is a few
vector operations, which keeps a placement decision fast at 1024 devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from physis_ros.scheduling.phases import choose_phase, wait_ms
from physis_ros.scheduling.profiles import CostProfile
from physis_ros.scheduling.ranks import VirtualRank
from physis_ros.scheduling.settings import DeviceSpec


@dataclass
class PlacedStream:
    stream: str
    model: str
    slo_ms: float
    ranks: list[VirtualRank]
    devices: list[int]                    # device of each rank
    method: str = ""                      # how it was placed: best-fit, lds, equal-fallback, equal
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
        self.deadline_order = deadline_order    # the devices dispatch earliest deadline first (edf)
        # Cores the devices share (CPU workers on one host, less what the host keeps for itself); None: each
        # device is its own (GPUs). More busy devices than that slow each other down (:meth:`_contention_ms`).
        self.shared_cores: float | None = None
        # Per stream: how much more its chunks vary than its bound explains, measured as it runs (set_spreads).
        self.spread: dict[str, float] = {}
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

    def set_spreads(self, spreads: dict[str, float]) -> None:
        """Per stream: the latency variation (ms) its published intervals showed beyond its jitter bound
        (measured on the running server): a chunk's own compute spread, a late release, transport."""
        self.spread = {s: max(0.0, float(v)) for s, v in spreads.items()}

    def spread_ms(self, stream: str) -> float:
        """What ``stream``'s chunks vary beyond its bound (ms): as measured, or for one not measured yet (a
        newcomer) the largest measured among the placed streams: the host's noise is not the stream's."""
        if stream in self.spread:
            return self.spread[stream]
        return max((v for s, v in self.spread.items() if s in self.streams), default=0.0)

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

    # -------------------------------------------------------------- latency jitter

    def _shares(self) -> dict[str, np.ndarray]:
        """model -> [block, device]: a task's cost as a fraction of batch 1, as the devices batch now."""
        return {m: self._per_task(m, np.arange(h.shape[0]), np.maximum(h, 1)) for m, h in self.hosts.items()}

    def _chunk_ms(self, placed: PlacedStream, device: int, shares: dict[str, np.ndarray]
                  ) -> tuple[float, float, float]:
        """One chunk of ``placed`` on ``device``: (its work there batched as the device now batches, its
        batch-1 work there, its longest stage task there), in ms."""
        share = shares[placed.model]
        batched = alone = stage = 0.0
        for r, d in zip(placed.ranks, placed.devices):
            if d == device:
                batched += float((share[r.block_index, d] * r.work_array).sum()) + r.hop_ms
                alone += r.work_ms
                stage = max(stage, r.compute_ms / len(r.stages))
        return batched, alone, stage

    def _delays(self, i: PlacedStream, q: PlacedStream) -> bool:
        """Whether a chunk of ``q`` running beside one of ``i`` may delay it by all of its work."""
        if not self.deadline_order or q.jitter_budget_ms is None or i.jitter_budget_ms is None:
            return True
        return q.jitter_budget_ms <= i.jitter_budget_ms + 1e-9

    def jitter_ms(self, placed: PlacedStream, also: Sequence[PlacedStream] = ()) -> float:
        """Worst-case variation of ``placed``'s chunk latency (ms): on each of its devices, the busy period
        of one chunk of every stream that may run with or ahead of it there (``also``: streams placed
        but not yet added, a search's candidate), less its own chunk alone, times the device's load."""
        return self._jitter_ms(placed, also, self._shares())

    def _jitter_ms(self, placed: PlacedStream, also: Sequence[PlacedStream], shares: dict[str, np.ndarray]) -> float:
        streams = [q for q in (*self.streams.values(), *also) if q is not placed and q.stream != placed.stream]
        busy_on = self._busy_periods([*streams, placed], shares) if self.shared_cores is not None else None
        total = 0.0
        for w in set(placed.devices):
            batched, alone, _ = self._chunk_ms(placed, w, shares)
            busy, blocking, apart = batched - alone, 0.0, []
            for q in streams:
                if w not in q.devices:
                    continue
                q_batched, _, q_stage = self._chunk_ms(q, w, shares)
                if not self._delays(placed, q):   # one later-deadline task may be running: no preemption
                    blocking = max(blocking, q_stage)
                elif self._phased_apart(placed, q):
                    apart.append((q, q_batched))
                else:
                    busy += q_batched
            if apart:   # the backlog those released before it leave (each of the rest can add all of its work),
                # in ms as the device runs now
                load = self.load[w]
                busy += wait_ms(placed.slo_ms, placed.phase_ms, batched * load, self._released(placed, apart, load)) / load
            if busy_on is not None:
                busy += self._contention_ms(w, alone + busy + blocking, busy_on)
            total += self.load[w] * max(0.0, busy + blocking)
        return total

    def _released(self, placed: PlacedStream, apart: list[tuple[PlacedStream, float]], load: float
                  ) -> list[tuple[float, float]]:
        """(phase, ms as the device runs now) of each phased co-runner's chunk: its work at the device's load
        plus its spread, since it may run that much longer. Batching mates (one model, one phase) run in the
        same forwards, so one slow forward delays them all once: a batch is charged its largest spread once,
        and ``placed``'s own batch none (its own spread holds it)."""
        out, charged = [], set()
        for q, work in sorted(apart, key=lambda a: -self.spread_ms(a[0].stream)):
            batch = (q.model, round(q.phase_ms, 6)) if self.max_batch > 1 else q.stream
            own = batch == (placed.model, round(placed.phase_ms, 6))
            out.append((q.phase_ms, work * load + (0.0 if own or batch in charged else self.spread_ms(q.stream))))
            charged.add(batch)
        return out

    @staticmethod
    def _phased_apart(i: PlacedStream, q: PlacedStream) -> bool:
        """Whether ``q`` meets ``i`` only at their fixed relative phase: both released at one pace, each
        wholly on one (the same) device, so that its chunk is there from its release on."""
        return (i.phase_ms is not None and q.phase_ms is not None and math.isclose(i.slo_ms, q.slo_ms)
                and len(set(i.devices)) == 1 and set(q.devices) == set(i.devices))

    def release_phase(self, placed: PlacedStream) -> float:
        """The phase of its interval (ms) at which a paced stream placed like ``placed`` should be released:
        a batching mate's (same model and pace, from the same device) when the devices batch, so that their
        tasks arrive together as the batch credit assumes; else the one farthest from the phases of the
        streams of its pace released onto the same device."""
        first = placed.devices[0]
        same = [q for q in self.streams.values() if q.stream != placed.stream and q.phase_ms is not None
                and math.isclose(q.slo_ms, placed.slo_ms) and q.devices[0] == first]
        if self.max_batch > 1:
            for q in same:
                if q.model == placed.model:
                    return q.phase_ms
        return choose_phase(placed.slo_ms, [q.phase_ms for q in same])

    def _busy_periods(self, streams: Sequence[PlacedStream], shares: dict[str, np.ndarray]) -> dict[int, float]:
        """Per device with work: one chunk of every stream there, batched as it batches (ms)."""
        out: dict[int, float] = {}
        for q in streams:
            for w in set(q.devices):
                out[w] = out.get(w, 0.0) + self._chunk_ms(q, w, shares)[0]
        return out

    def _contention_ms(self, w: int, period_ms: float, busy_on: dict[int, float]) -> float:
        """Devices that share ``shared_cores`` cores (CPU workers on one host): while the others run, device
        ``w`` gets ``shared_cores / busy devices`` of a core, so a busy period of ``period_ms`` there
        stretches by that much for as long as another device's busy period overlaps it."""
        busy = len(busy_on.keys() | {w})
        if busy <= self.shared_cores:
            return 0.0
        overlap = min(period_ms, max((ms for d, ms in busy_on.items() if d != w), default=0.0))
        return overlap * (busy / self.shared_cores - 1.0)

    def jitter_breaches(self, new: PlacedStream) -> list[tuple[str, float, float]]:
        """(stream, worst-case jitter ms, budget ms) for every stream whose budget ``new`` (placed, its
        ranks applied, not added) would break: itself and the budgeted streams sharing a device with it. A
        stream's worst case is its bound plus the spread it was measured to have beyond it (:meth:`spread_ms`)."""
        out, shares = [], self._shares()   # the devices' batching is the same for every stream checked
        touched = self.streams.values() if self.shared_cores is not None else (
            q for q in self.streams.values() if set(q.devices) & set(new.devices))   # sharing cores: everyone
        for s in (new, *touched):
            if s.jitter_budget_ms is not None:
                j = self._jitter_ms(s, () if s is new else (new,), shares) + self.spread_ms(s.stream)
                if j > s.jitter_budget_ms + 1e-9:
                    out.append((s.stream, j, s.jitter_budget_ms))
        return out

    def checks_jitter(self, budget_ms: float | None) -> bool:
        """Whether placing a stream with this budget needs the jitter check (someone has a budget)."""
        return budget_ms is not None or any(q.jitter_budget_ms is not None for q in self.streams.values())

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
