"""Joint placement: virtual ranks placed by Best-Fit guided by Limited Discrepancy Search.

Placing one arriving stream (running streams never move):

1. **Virtual ranks.** The stream's stages, in pipeline order, are cut into ranks
   that each fit the SLO budget ``SLO x (1 - headroom)`` and one device's memory
   (:mod:`~physis_ros.scheduling.ranks`); a stage that alone breaks either
   rejects the stream at once (``slo-unreachable``, ``memory-unreachable``).
2. **Best-Fit candidates.** Ranks are placed front to back. For the rank that
   starts at stage ``p`` the candidates, in order, are: busy devices that take
   the whole virtual rank (the fewest-ranks cut from ``p``), least time capacity
   left after placing first, then most weight bytes already loaded there
   (weight sharing), then least memory left; if ``lds.split`` is on, busy
   devices whose gap is too small for the whole rank, taking the longest prefix
   that fits (at least ``lds.min_piece`` of a rank budget, at most
   ``lds.max_extra_ranks`` extra ranks per stream); last, one empty device per
   device kind (empty devices are interchangeable).
3. **Limited Discrepancy Search** (Harvey & Ginsberg, IJCAI 1995) over that
   order: iteration i visits the placements that deviate from Best-Fit by
   exactly i discrepancies (taking the j-th candidate costs j; Korf's improved
   LDS, so no placement is visited twice), i = 0..``lds.discrepancies``;
   iteration 0 is greedy Best-Fit. A complete placement is acceptable if it
   opens at most as many empty devices as the stream's fewest ranks (the equal
   split's group size) and meets the latency SLO if one is set. The search
   keeps the acceptable placement opening the fewest empty devices and stops
   as soon as that count reaches a lower bound, or at ``lds.max_nodes``.
4. **Fallback.** If the search finds nothing, the equal split's own placement
   (its balanced cut, one empty device per rank) is tried. Since every joint
   placement opens at most the split's group of empty devices, joint admits at
   least every stream the split admits on the same arrivals (docs/scheduling.md).
5. **Rejection** otherwise, with the resource that ran out: a quick check of
   total time left comes first (``time-capacity``), else greedy Best-Fit is
   replayed to the first rank no device takes and that rank's shortage is
   named (``time-capacity`` or ``memory``).

Every admitted stream's predicted interval alone (its busiest device's work per
chunk) is within its SLO budget, and every device stays within ``1 - headroom``
of its time and within its memory.
"""

from __future__ import annotations

import time

import numpy as np

from physis_ros.scheduling.admission import Decision, Scheduler, StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.ranks import EPS, StageSeq, Unplaceable, VirtualRank, equal_ranks, make_rank
from physis_ros.scheduling.settings import SchedulingConfig


def _nz(mask: np.ndarray) -> np.ndarray:
    return mask.nonzero()[0]


class JointScheduler(Scheduler):
    """Best-Fit + LDS placement of virtual ranks, with the equal split's placement as a fallback."""

    def __init__(self, cluster: Cluster, config: SchedulingConfig):
        super().__init__(cluster, config)
        self._seqs: dict[tuple[str, float], StageSeq] = {}
        self._jitter_miss: tuple[str, float, float] | None = None   # (stream, jitter, budget) of this decision
        self._equal: dict[tuple[str, float], list[VirtualRank]] = {}

    def seq(self, model: str, slo_ms: float) -> StageSeq:
        key = (model, slo_ms)
        if key not in self._seqs:
            self._seqs[key] = StageSeq(self.cluster.profiles[model], slo_ms, self.headroom, self.device_bytes)
        return self._seqs[key]

    def prepare(self, model: str, slo_ms: float) -> None:
        """Precompute a stream class's cuts (fewest ranks, equal split's balanced cut, rank ends).

        Done once per (model, SLO) when the class is configured, not per arriving stream;
        ``admit`` does it lazily for a class it has not seen.
        """
        try:
            seq = self.seq(model, slo_ms)
        except Unplaceable:
            return
        for p in range(seq.n):
            seq.full_end(p)
        self._equal_ranks(model, slo_ms)

    def _equal_ranks(self, model: str, slo_ms: float) -> list[VirtualRank]:
        key = (model, slo_ms)
        if key not in self._equal:
            self._equal[key] = equal_ranks(self.cluster.profiles[model], slo_ms, self.headroom, self.device_bytes)
        return self._equal[key]

    def ranks_for(self, model: str, slo_ms: float) -> list[VirtualRank]:
        """The stream's fewest virtual ranks (what it is cut into when nothing needs filling)."""
        return self.seq(model, slo_ms).fewest

    def simplest_best_fit(self, req: StreamRequest) -> list[int] | None:
        """The baseline a benchmark times a decision against: each of the stream's fewest ranks on the fullest
        device it fits (time and memory), one rank after another, no gap filling, no search, nothing placed.
        The devices it would take, or None."""
        seq = self.seq(req.model, req.slo_ms)
        devices: list[int] = []
        for rank in seq.fewest:
            util_after, _, _, ok = self._fit(rank, req.slo_ms)
            ok = ok.copy()
            ok[devices] = False
            if not ok.any():
                return None
            devices.append(int(np.argmax(np.where(ok, util_after, -np.inf))))
        return devices

    def place_unchecked(self, req: StreamRequest) -> PlacedStream | None:
        """Admission off (a measurement's baseline, never a default): place the stream whatever its SLO and the
        devices' time: its fewest ranks, each on the device with the least time booked (after its earlier ranks)
        that has the memory for it. None when no device has the memory for a rank; raises
        :class:`~physis_ros.scheduling.ranks.Unplaceable` when a stage alone breaks the SLO budget or a device's
        memory."""
        c = self.cluster
        ranks = self.seq(req.model, req.slo_ms).fewest
        devices: list[int] = []
        undos = []
        try:
            for rank in ranks:
                _, mem_after, _, _ = self._fit(rank, req.slo_ms)
                fits = mem_after <= c.mem_cap + EPS
                if not fits.any():
                    return None
                d = int(np.argmin(np.where(fits, c.util, np.inf)))
                undos.append((rank, c.apply(rank, req.slo_ms, d)))
                devices.append(d)
        finally:
            for r, u in reversed(undos):
                c.revert(r, u)
        placed = PlacedStream(req.stream, req.model, req.slo_ms, list(ranks), devices, "unchecked",
                              req.latency_slo_ms, req.jitter_budget_ms)
        if req.paced:
            placed.phase_ms = c.jitter.release_phase(placed)
        c.add_stream(placed)
        return placed

    # ------------------------------------------------------------------ candidates

    def _fit(self, rank: VirtualRank, slo_ms: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        c = self.cluster
        missing = c.missing_weight_bytes(rank)
        util_after = c.util + c.delta_util(rank, slo_ms)
        mem_after = c.mem + missing + (rank.kv_bytes + rank.buffer_bytes)
        time_ok = util_after <= c.util_cap + EPS
        mem_ok = mem_after <= c.mem_cap
        return util_after, mem_after, missing, time_ok & mem_ok

    def _memory_end(self, seq: StageSeq, p: int, q_max: int, d: int) -> int:
        """Longest prefix ``[p, q)``, q <= q_max, whose weights not yet on device d + KV + buffers fit there."""
        c = self.cluster
        prof = seq.profile
        loaded = c.refs_of(prof.model)[:, d] > 0
        free = c.mem_cap[d] - c.mem[d] - 2 * prof.hidden_bytes
        seen: set[int] = set()
        need = 0.0
        q = p
        while q < q_max:
            b = seq.order[q][1]
            extra = prof.kv_bytes + (prof.block_weight_bytes if not loaded[b] and b not in seen else 0)
            if need + extra > free:
                break
            need += extra
            seen.add(b)
            q += 1
        return q

    def candidates(self, seq: StageSeq, p: int, room_for_more: bool,
                   limit: int | None = None) -> list[tuple[int, int]]:
        """(device, end) choices for the rank starting at stage ``p``, in Best-Fit order:

        1. busy devices that take the whole virtual rank ``[p, full_end(p))``, least time left first
           (then most weight bytes already loaded, then least memory left);
        2. if splitting is on and the stream may take another rank: busy devices with a gap
           too small for the whole rank, filled with the longest prefix that fits, biggest first;
        3. one empty device per device kind, taking the whole rank.
        """
        c = self.cluster
        slo = seq.slo_ms
        q_full = seq.full_end(p)
        rank = seq.rank(p, q_full)
        util_after, mem_after, missing, ok = self._fit(rank, slo)
        empty = c.empty()
        out: list[tuple[int, int]] = []
        busy = _nz(ok & ~empty)
        if busy.size:
            time_left = np.round(c.util_cap[busy] - util_after[busy], 9)
            shared = -(len(rank.block_list) * c.profiles[rank.model].block_weight_bytes - missing[busy])
            mem_left = (c.mem_cap[busy] - mem_after[busy]) / c.mem_cap[busy]
            out += [(int(d), q_full) for d in busy[np.lexsort((busy, mem_left, shared, time_left))]]
        lds = self.config.lds
        if lds.split and room_for_more and q_full - p > 1 and not seq.profile.clean:
            free_ms = (c.util_cap - c.util) * slo - seq.profile.hop_ms
            ends = seq.cum_arr.searchsorted(seq.cum[p] + free_ms + EPS, side="right") - 1
            ends = np.minimum(ends, q_full)
            piece_ms = seq.cum_arr[np.maximum(ends, p)] - seq.cum[p]
            gap = _nz(~ok & ~empty & (ends > p) & (piece_ms >= lds.min_piece * seq.budget))
            for d in gap[np.lexsort((gap, -piece_ms[gap]))][: (limit or len(gap))]:
                q = self._memory_end(seq, p, int(ends[d]), int(d))
                if q > p and seq.cum[q] - seq.cum[p] >= lds.min_piece * seq.budget:
                    out.append((int(d), q))
        fresh = _nz(ok & empty)
        if fresh.size:  # interchangeable: the lowest-numbered empty device of each kind
            if c.uniform:
                out.append((int(fresh[0]), q_full))
            else:
                _, first = np.unique(c.kind[fresh], return_index=True)
                out += [(int(d), q_full) for d in sorted(fresh[first])]
        return out if limit is None else out[:limit]

    def _time_shortfall(self, seq: StageSeq) -> str | None:
        """A quick necessary condition: all devices' time left (each capped at one rank budget) must
        hold the stream's compute; else the reason, without searching."""
        c = self.cluster
        if c.max_batch > 1:
            return None  # batched, a stream's marginal cost is not its batch-1 work: no cheap bound; search
        free_ms = np.clip((c.util_cap - c.util) * seq.slo_ms, 0.0, seq.budget)
        if not self.config.lds.split:  # whole ranks only: count only devices that can take the smallest
            smallest = min(r.work_ms for r in seq.fewest)
            free_ms = np.where(free_ms + EPS >= smallest, free_ms, 0.0)
        total = float(free_ms.sum())
        need = seq.cum[-1] + seq.profile.hop_ms
        if total + EPS >= need:
            return None
        return (f"the stream needs {need:.2f} ms of device time per {seq.slo_ms:g} ms interval; all devices "
                f"together have {total:.2f} ms left (each device capped at 1 - headroom = {1 - c.headroom:g}"
                f"{_measured(c)})")

    def _fresh_lower_bound(self, seq: StageSeq) -> int:
        """Empty devices any placement must open (a bound, so the search may stop early)."""
        c = self.cluster
        empty = c.empty()
        lds = self.config.lds
        if lds.split:
            # f empty devices hold at most f rank budgets; the other ranks (at most max_ranks - f) go
            # to the largest gaps: the least f with enough room is a lower bound.
            gaps = np.clip((c.util_cap[~empty] - c.util[~empty]) * seq.slo_ms - seq.profile.hop_ms, 0, seq.budget)
            gaps = np.sort(gaps[gaps >= lds.min_piece * seq.budget])[::-1]
            top = np.concatenate(([0.0], np.cumsum(gaps)))
            max_ranks = len(seq.fewest) + lds.max_extra_ranks
            w = seq.cum[-1]
            for f in range(len(seq.fewest) + 1):
                k = min(max(max_ranks - f, 0), len(gaps))
                if top[k] + f * (seq.budget - seq.profile.hop_ms) + EPS >= w:
                    return f
            return len(seq.fewest)
        return sum(1 for r in seq.fewest if not (self._fit(r, seq.slo_ms)[3] & ~empty).any())

    # ------------------------------------------------------------------ search

    def _jitter_holds(self, req: StreamRequest, ranks: list[VirtualRank], devices: list[int]) -> bool:
        """Whether the complete placement of ``ranks`` on ``devices`` (applied) keeps every stream's latency
        jitter within its budget; the closest breach is kept for the rejection's detail."""
        new = PlacedStream(req.stream, req.model, req.slo_ms, ranks, devices, jitter_budget_ms=req.jitter_budget_ms)
        if req.paced:
            new.phase_ms = self.cluster.jitter.release_phase(new)
        breaches = self.cluster.jitter.breaches(new)
        for b in breaches:
            if self._jitter_miss is None or b[1] - b[2] < self._jitter_miss[1] - self._jitter_miss[2]:
                self._jitter_miss = b   # the closest miss: what the rejection names
        return not breaches

    def _lds(self, seq: StageSeq, req: StreamRequest) -> tuple[list[tuple[int, int, int]] | None, int, int]:
        """Best placement found by LDS: ([(device, start, end)] or None, discrepancies, nodes)."""
        lds = self.config.lds
        c = self.cluster
        slo = seq.slo_ms
        latency_slo_ms = req.latency_slo_ms
        jitter = c.jitter.applies(req.jitter_budget_ms)
        empty0 = c.empty()
        max_ranks = len(seq.fewest) + (lds.max_extra_ranks if lds.split else 0)
        max_fresh = len(seq.fewest)      # never open more devices than the equal split's group
        lower = self._fresh_lower_bound(seq) if lds.min_new_devices else 0
        best: list = [None, 0, (0, 0)]   # pieces, discrepancies, (fresh devices, ranks)
        nodes = 0
        path: list[tuple[int, int, int]] = []

        def probe(p: int, left: int, used: int) -> bool:
            """Placements of stages [p:] with exactly ``left`` more discrepancies; True stops the search."""
            nonlocal nodes
            if p == seq.n:
                if left:
                    return False
                fresh = len({d for d, _, _ in path if empty0[d]})
                latency = seq.cum[-1] + len(path) * seq.profile.hop_ms
                if fresh > max_fresh or (latency_slo_ms is not None and latency > latency_slo_ms + EPS):
                    return False
                if jitter and not self._jitter_holds(req, [seq.rank(a, b) for _, a, b in path],
                                                     [d for d, _, _ in path]):
                    return False
                score = (fresh, len(path))
                if best[0] is None or score < best[2]:
                    best[:] = [list(path), used, score]
                return not lds.min_new_devices or fresh <= lower
            depth = len(path)
            if depth >= max_ranks or nodes >= lds.max_nodes:
                return nodes >= lds.max_nodes
            nodes += 1
            remaining = max_ranks - depth - 1
            for j, (d, q) in enumerate(self.candidates(seq, p, remaining > 0, lds.branch)):
                if j > left:
                    break
                if left - j > remaining * (lds.branch - 1):
                    continue
                rank = seq.rank(p, q)
                undo = c.apply(rank, slo, d)
                path.append((d, p, q))
                stop = probe(q, left - j, used + j)
                path.pop()
                c.revert(rank, undo)
                if stop:
                    return True
            return False

        for k in range(lds.discrepancies + 1):
            if probe(0, k, 0):
                break
        return best[0], best[1], nodes

    def _equal_fallback(self, req: StreamRequest) -> list[int] | None:
        """The equal split's placement of this stream: its balanced cut, one whole empty device per rank (None
        when none is free, or it would break a stream's jitter budget)."""
        ranks = self._equal_ranks(req.model, req.slo_ms)
        c = self.cluster
        free = [int(d) for d in _nz(c.empty())]
        chosen: list[int] = []
        for r in ranks:
            need = r.alone_bytes(c.profiles[req.model])
            d = next((d for d in free if d not in chosen and need <= c.mem_cap[d]
                      and r.work_ms / req.slo_ms <= c.util_cap[d] + EPS), None)
            if d is None:
                return None
            chosen.append(d)
        if c.jitter.applies(req.jitter_budget_ms):
            # empty devices, yet not free of jitter where devices share cores (CPU workers on one host)
            undos = [(r, c.apply(r, req.slo_ms, d)) for r, d in zip(ranks, chosen)]
            try:
                if not self._jitter_holds(req, list(ranks), chosen):
                    return None
            finally:
                for r, u in reversed(undos):
                    c.revert(r, u)
        return chosen

    def _diagnose(self, seq: StageSeq) -> tuple[str, str]:
        """Greedy Best-Fit to the first rank no device takes; name what that rank lacks."""
        c = self.cluster
        slo = seq.slo_ms
        undos = []
        p = 0
        try:
            while p < seq.n:
                cands = self.candidates(seq, p, True, 1)
                if cands:
                    d, q = cands[0]
                    undos.append((seq.rank(p, q), c.apply(seq.rank(p, q), slo, d)))
                    p = q
                    continue
                r = seq.rank(p, seq.full_end(p))
                util_after, mem_after, _, _ = self._fit(r, slo)
                time_ok = util_after <= c.util_cap + EPS
                if not time_ok.any():
                    most = float((c.util_cap - c.util).max())
                    return "time-capacity", (
                        f"rank {r.describe()} needs {r.work_ms / slo:.3f} of a device's time "
                        f"({r.work_ms:.2f} ms per {slo:g} ms interval); the most any device has left "
                        f"is {max(most, 0.0):.3f} (cap {1 - c.headroom:g} = 1 - headroom{_measured(c)})")
                short = float((mem_after - c.mem_cap)[time_ok].min())
                return "memory", (
                    f"rank {r.describe()}: the {int(time_ok.sum())} devices with time left are short of "
                    f"memory by at least {short / 1e9:.2f} GB (weights not yet loaded + KV + buffers)")
            if self._jitter_miss is not None:
                stream, j, budget = self._jitter_miss
                spread = c.jitter.spread_ms(stream)
                measured = f", plus the {spread:.1f} ms its intervals were measured to vary beyond that" if spread else ""
                return "latency-jitter", (
                    f"every placement found would let stream '{stream}''s chunk latency vary by up to {j:.1f} ms "
                    f"(the chunks sharing its devices or their cores, at their measured load{measured}), beyond the "
                    f"{budget:.1f} ms its interval SLO leaves over its release interval")
            return "time-capacity", (f"no placement within the search budget opens at most "
                                     f"{len(seq.fewest)} empty devices (the equal split's group)")
        finally:
            for r, u in reversed(undos):
                c.revert(r, u)

    # ------------------------------------------------------------------ admission

    def _admit(self, req: StreamRequest) -> Decision:
        t0 = time.perf_counter()
        self._check_request(req)
        try:
            seq = self.seq(req.model, req.slo_ms)
        except Unplaceable as exc:
            return self._reject(req, exc.reason, exc.detail, t0)
        latency = sum(r.work_ms for r in seq.fewest)
        if req.latency_slo_ms is not None and latency > req.latency_slo_ms + EPS:
            return self._reject(req, "latency-unreachable",
                                f"{len(seq.fewest)} ranks: {latency:.2f} ms compute + hops > latency SLO "
                                f"{req.latency_slo_ms:g} ms", t0)
        short = self._time_shortfall(seq)
        if short is not None:
            return self._reject(req, "time-capacity", short, t0)
        self._jitter_miss = None
        pieces, disc, nodes = self._lds(seq, req)
        if pieces is not None:
            ranks = [make_rank(seq.profile, i, seq.order[p:q]) for i, (_, p, q) in enumerate(pieces)]
            devices = [d for d, _, _ in pieces]
            method = "best-fit" if disc == 0 else "lds"
        else:
            fallback = self.config.equal_fallback and not seq.profile.clean   # clean: one rank, never split
            devices = self._equal_fallback(req) if fallback else None
            if devices is None:
                reason, detail = self._diagnose(seq)
                return self._reject(req, reason, detail, t0, nodes)
            ranks, method = self._equal[(req.model, req.slo_ms)], "equal-fallback"
        placed = PlacedStream(req.stream, req.model, req.slo_ms, list(ranks), devices, method, req.latency_slo_ms,
                              req.jitter_budget_ms)
        if req.paced:
            placed.phase_ms = self.cluster.jitter.release_phase(placed)
        assert placed.interval_alone_ms <= seq.budget + 1e-6, (placed.interval_alone_ms, seq.budget)
        self.cluster.add_stream(placed)
        return Decision(req, True, None, f"{method}: {len(ranks)} ranks on devices {devices}", placed,
                        (time.perf_counter() - t0) * 1e3, nodes, disc)


def _measured(c: Cluster) -> str:
    """Where devices were measured busier than their profiles: their caps, for a rejection's detail."""
    nominal = 1.0 - c.headroom
    lower = [f"d{d} {cap:.2f}" for d, cap in enumerate(c.util_cap) if cap < nominal - 1e-9]
    return f"; measured busier than profiled, caps {', '.join(lower)}" if lower else ""
