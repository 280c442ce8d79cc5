"""Virtual ranks: a stream's stages, in pipeline order, cut into pieces that each fit one device.

A rank's per-chunk *work* is the compute of its stages plus one outgoing hop
(the hidden state to the next rank, or the chunk to the engine). A stream that
hosts a rank on a device uses ``work / SLO`` of that device's time, since the
stream produces one chunk per SLO interval. A rank fits when ``work <= SLO *
(1 - headroom)`` and its memory (distinct blocks' weights + one KV slot per
stage + in/out hidden buffers) fits an empty device.

``pack_ranks`` returns the fewest ranks (greedy fill in pipeline order is
optimal for the minimum count of contiguous pieces under per-piece additive
limits). Filling each rank to the brim leaves big ranks that fill a device and
one small remainder, which is what packs well next to other streams; all
streams of one model with one SLO get the same cut, so their remainders host
the same blocks and share weights when co-located.

``equal_ranks`` is the equal-split baseline's cut: the same number of ranks,
balanced with :func:`physis_ros.runtime.plans.linear_partition`.

``StageSeq`` serves the placer, which may also cut a rank shorter than the
fewest-ranks cut to fill a gap left on a busy device (gap filling, see
:mod:`~physis_ros.scheduling.placement`); every rank, whole or shorter, still
fits the SLO budget.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from physis_ros.runtime.plans import Stage, linear_partition
from physis_ros.runtime.costs import CostProfile

EPS = 1e-9


@dataclass(frozen=True)
class VirtualRank:
    """Stages of one stream that share one device."""

    model: str
    index: int                       # position in the stream's pipeline
    stages: tuple[Stage, ...]
    compute_ms: float                # sum of stage times (batch 1)
    hop_ms: float                    # the outgoing transfer
    kv_bytes: int                    # one KV slot per stage
    buffer_bytes: int                # hidden state in and out
    blocks: frozenset[int]           # distinct blocks: their weights are needed on the device
    block_list: tuple[int, ...] = ()  # the distinct blocks, sorted
    block_counts: tuple[int, ...] = ()  # stages of the rank per block in block_list
    block_index: np.ndarray | None = field(default=None, compare=False, repr=False)   # block_list as an array
    count_array: np.ndarray | None = field(default=None, compare=False, repr=False)   # block_counts as an array
    work_array: np.ndarray | None = field(default=None, compare=False, repr=False)    # batch-1 ms per block

    @property
    def work_ms(self) -> float:
        return self.compute_ms + self.hop_ms

    def weight_bytes(self, profile: CostProfile) -> int:
        return len(self.blocks) * profile.block_weight_bytes

    def alone_bytes(self, profile: CostProfile) -> int:
        """Memory on a device that holds nothing else."""
        return self.weight_bytes(profile) + self.kv_bytes + self.buffer_bytes

    def describe(self) -> str:
        (k0, b0), (k1, b1) = self.stages[0], self.stages[-1]
        return f"r{self.index}[{k0},{b0}..{k1},{b1}] {self.work_ms:.2f}ms"


class Unplaceable(Exception):
    """The stream cannot meet its SLO (or fit memory) even with a device per rank."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def make_rank(profile: CostProfile, index: int, stages: list[Stage]) -> VirtualRank:
    counts = Counter(b for _, b in stages)
    blocks = sorted(counts)
    return VirtualRank(
        model=profile.model, index=index, stages=tuple(stages),
        compute_ms=sum(profile.time_ms(s) for s in stages), hop_ms=profile.hop_ms,
        kv_bytes=(len(blocks) if profile.kv_per_block else len(stages)) * profile.kv_bytes,  # clean: a slot per block
        buffer_bytes=2 * profile.hidden_bytes,
        blocks=frozenset(blocks), block_list=tuple(blocks), block_counts=tuple(counts[b] for b in blocks),
        block_index=np.array(blocks, dtype=np.intp), count_array=np.array([counts[b] for b in blocks], dtype=np.int64),
        work_array=np.array([sum(profile.time_ms(s) for s in stages if s[1] == b) for b in blocks]),
    )


def rank_budget_ms(slo_ms: float, headroom: float) -> float:
    return slo_ms * (1.0 - headroom)


def check_reachable(profile: CostProfile, slo_ms: float, headroom: float, device_bytes: float) -> None:
    """Raise :class:`Unplaceable` when one stage alone breaks the SLO budget or the device memory; for a model
    with the clean history rule, the whole chunk (its stages run one after another, one chunk in flight, all on
    one device: it is one rank)."""
    budget = rank_budget_ms(slo_ms, headroom)
    if profile.clean:
        whole = make_rank(profile, 0, profile.order)
        if whole.work_ms > budget + EPS:
            raise Unplaceable("slo-unreachable",
                              f"a chunk of {profile.model} takes {whole.work_ms:.3f} ms (its {len(profile.order)} "
                              f"stages, the clean pass included, one after another: the clean history rule keeps "
                              f"one chunk in flight) > SLO {slo_ms:g} ms x (1 - headroom {headroom:g}) = "
                              f"{budget:.3f} ms, even alone")
        need = whole.alone_bytes(profile)
        if need > device_bytes:
            raise Unplaceable("memory-unreachable",
                              f"a chunk of {profile.model} (clean history rule: all its stages on one device) "
                              f"needs {need / 1e9:.2f} GB > {device_bytes / 1e9:.2f} GB usable on one device")
        return
    for s in profile.order:
        ms = profile.time_ms(s) + profile.hop_ms
        if ms > budget + EPS:
            raise Unplaceable("slo-unreachable",
                              f"stage {s} of {profile.model} takes {ms:.3f} ms (with its hop) > SLO "
                              f"{slo_ms:g} ms x (1 - headroom {headroom:g}) = {budget:.3f} ms, even alone")
        need = make_rank(profile, 0, [s]).alone_bytes(profile)
        if need > device_bytes:
            raise Unplaceable("memory-unreachable",
                              f"stage {s} of {profile.model} needs {need / 1e9:.2f} GB > "
                              f"{device_bytes / 1e9:.2f} GB usable on one device")


def pack_ranks(profile: CostProfile, slo_ms: float, headroom: float, device_bytes: float) -> list[VirtualRank]:
    """Fewest contiguous ranks, each within the SLO budget and one empty device's memory (clean history rule:
    one rank of every stage)."""
    check_reachable(profile, slo_ms, headroom, device_bytes)
    if profile.clean:
        return [make_rank(profile, 0, profile.order)]
    budget = rank_budget_ms(slo_ms, headroom)
    ranks: list[VirtualRank] = []
    current: list[Stage] = []
    work = profile.hop_ms
    blocks: set[int] = set()
    for s in profile.order:
        ms = profile.time_ms(s)
        new_blocks = len(blocks | {s[1]})
        mem = (new_blocks * profile.block_weight_bytes + (len(current) + 1) * profile.kv_bytes
               + 2 * profile.hidden_bytes)
        if current and (work + ms > budget + EPS or mem > device_bytes):
            ranks.append(make_rank(profile, len(ranks), current))
            current, work, blocks = [], profile.hop_ms, set()
        current.append(s)
        work += ms
        blocks.add(s[1])
    ranks.append(make_rank(profile, len(ranks), current))
    return ranks


def _fits(rank: VirtualRank, profile: CostProfile, budget: float, device_bytes: float) -> bool:
    return rank.work_ms <= budget + EPS and rank.alone_bytes(profile) <= device_bytes


def equal_ranks(profile: CostProfile, slo_ms: float, headroom: float, device_bytes: float,
                group: int | None = None) -> list[VirtualRank]:
    """The equal split's cut: ``group`` ranks (default: the fewest that meet the SLO), balanced
    by ``linear_partition``; the greedy cut when balancing breaks a memory limit."""
    fewest = pack_ranks(profile, slo_ms, headroom, device_bytes)
    parts = len(fewest) if group is None else group
    if parts < len(fewest):
        raise Unplaceable("slo-unreachable",
                          f"{profile.model} needs {len(fewest)} devices for SLO {slo_ms:g} ms; a group has {parts}")
    order = profile.order
    sizes = linear_partition(profile.costs(), parts)
    ranks, i = [], 0
    for size in sizes:
        ranks.append(make_rank(profile, len(ranks), order[i:i + size]))
        i += size
    budget = rank_budget_ms(slo_ms, headroom)
    if all(_fits(r, profile, budget, device_bytes) for r in ranks):
        return ranks
    return fewest


def group_size(profile: CostProfile, slo_ms: float, headroom: float, device_bytes: float) -> int:
    """Smallest number of devices one stream needs for its SLO: the equal split's group size."""
    return len(pack_ranks(profile, slo_ms, headroom, device_bytes))


class StageSeq:
    """One stream's stages in pipeline order with what the placer asks of them, memoised.

    ``full_end(p)`` is where the rank that starts at stage ``p`` ends when filled
    to the SLO budget (and one empty device's memory): the fewest-ranks cut
    restarted at ``p``. ``rank(p, q)`` is the rank of stages ``[p, q)``.
    """

    def __init__(self, profile: CostProfile, slo_ms: float, headroom: float, device_bytes: float):
        check_reachable(profile, slo_ms, headroom, device_bytes)
        self.profile = profile
        self.slo_ms = slo_ms
        self.budget = rank_budget_ms(slo_ms, headroom)
        self.device_bytes = device_bytes
        self.order = profile.order
        self.n = len(self.order)
        self.cum = [0.0]
        for ms in profile.costs():
            self.cum.append(self.cum[-1] + ms)
        self.cum_arr = np.asarray(self.cum)
        self.fewest = pack_ranks(profile, slo_ms, headroom, device_bytes)
        self._ranks: dict[tuple[int, int], VirtualRank] = {}
        self._full_end: dict[int, int] = {}

    def work(self, p: int, q: int) -> float:
        return self.cum[q] - self.cum[p] + self.profile.hop_ms

    def rank(self, p: int, q: int) -> VirtualRank:
        key = (p, q)
        if key not in self._ranks:
            self._ranks[key] = make_rank(self.profile, 0, self.order[p:q])
        return self._ranks[key]

    def full_end(self, p: int) -> int:
        if self.profile.clean:      # one rank of every stage (checked to fit when the sequence was made)
            return self.n
        if p not in self._full_end:
            prof = self.profile
            blocks = {self.order[p][1]}
            q = p + 1
            while q < self.n:
                b = self.order[q][1]
                mem = (len(blocks | {b}) * prof.block_weight_bytes + (q + 1 - p) * prof.kv_bytes
                       + 2 * prof.hidden_bytes)
                if self.work(p, q + 1) > self.budget + EPS or mem > self.device_bytes:
                    break
                blocks.add(b)
                q += 1
            self._full_end[p] = q
        return self._full_end[p]
