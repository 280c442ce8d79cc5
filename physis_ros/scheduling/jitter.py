"""The latency-jitter bound: how much the chunks sharing a stream's devices may vary its latency.

A stream released every ``pace`` ms meets an interval SLO of ``slo`` ms only if its chunks' latencies
vary by at most ``slo - pace`` (its jitter budget), and what varies them is the other chunks a device
runs at the same time. A chunk of stream ``i`` on device ``w`` is fastest alone (its batch-1 work there)
and slowest when it lands in one busy period with a chunk of every stream that runs with or ahead of it
there, batches charged at the batch-cost curve: the difference, times the device's measured load
factor, summed over ``i``'s devices, is its worst-case jitter (:meth:`JitterBound.bound_ms`).

- **Dispatch.** Which streams run ahead depends on the workers' dispatch: ``oldest`` finishes a chunk it
  started before a newer one, so every co-located stream counts; ``edf`` (``deadline_order``) runs the
  earliest deadline first, so only streams with a budget no larger than ``i``'s count in full, and each
  later one delays ``i`` by at most the one stage task one of them may be running (tasks are not
  preempted).
- **Phases.** Paced streams are released at a phase of their interval (:meth:`JitterBound.release_phase`,
  :mod:`~physis_ros.scheduling.phases`): two at the same pace, each wholly on the same device, meet only
  at their relative phase, so one delays the other by the backlog its earlier chunk leaves there, not by
  all of its work.
- **Shared cores.** CPU workers on one host also share its cores (``shared_cores``): with more of them
  busy than there are cores, a device runs at ``cores / busy devices`` of a core while another is busy,
  and a busy period stretches by that much for as long as the longest busy period elsewhere overlaps it.
- **Measured spread.** What this model leaves out (a chunk's own compute spread, late releases,
  transport) is measured on the running server and charged per stream (:meth:`JitterBound.set_spreads`):
  a stream's worst case is its bound plus its spread, and a phased co-runner's chunk may run its spread
  longer.

Streams without a budget (the simulator's) are not checked and count in full. The bound reads the
cluster's placements, batching and load factors (:class:`~physis_ros.scheduling.cluster.Cluster`) and
changes none of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from physis_ros.scheduling.phases import choose_phase, wait_ms

if TYPE_CHECKING:
    from physis_ros.scheduling.cluster import Cluster, PlacedStream


class JitterBound:
    """Worst-case latency variation of the streams placed on ``cluster``, and whether a placement keeps
    every budgeted stream within its budget."""

    def __init__(self, cluster: Cluster, deadline_order: bool = False):
        self.cluster = cluster
        self.deadline_order = deadline_order    # the devices dispatch earliest deadline first (edf)
        # Cores the devices share (CPU workers on one host, less what the host keeps for itself); None: each
        # device is its own (GPUs). More busy devices than that slow each other down (:meth:`_contention_ms`).
        self.shared_cores: float | None = None
        # Per stream: how much more its chunks vary than its bound explains, measured as it runs (set_spreads).
        self.spread: dict[str, float] = {}

    # -------------------------------------------------------------- the measured part

    def set_spreads(self, spreads: dict[str, float]) -> None:
        """Per stream: the latency variation (ms) its published intervals showed beyond its jitter bound
        (measured on the running server): a chunk's own compute spread, a late release, transport."""
        self.spread = {s: max(0.0, float(v)) for s, v in spreads.items()}

    def charge(self, stream: str, spread_ms: float) -> None:
        """Charge ``stream`` this measured spread (ms, at least 0) from now on."""
        self.spread[stream] = max(0.0, float(spread_ms))

    def forget(self, stream: str) -> None:
        """``stream`` left: its spread no longer counts (nor sets a newcomer's)."""
        self.spread.pop(stream, None)

    def spread_ms(self, stream: str) -> float:
        """What ``stream``'s chunks vary beyond its bound (ms): as measured, or for one not measured yet (a
        newcomer) the largest measured among the placed streams: the host's noise is not the stream's."""
        if stream in self.spread:
            return self.spread[stream]
        return max((v for s, v in self.spread.items() if s in self.cluster.streams), default=0.0)

    # -------------------------------------------------------------- the bound

    def applies(self, budget_ms: float | None) -> bool:
        """Whether placing a stream with this budget needs the jitter check (someone has a budget)."""
        return budget_ms is not None or any(q.jitter_budget_ms is not None for q in self.cluster.streams.values())

    def bound_ms(self, placed: PlacedStream, also: Sequence[PlacedStream] = ()) -> float:
        """Worst-case variation of ``placed``'s chunk latency (ms): on each of its devices, the busy period
        of one chunk of every stream that may run with or ahead of it there (``also``: streams placed
        but not yet added, a search's candidate), less its own chunk alone, times the device's load."""
        return self._bound_ms(placed, also, self.cluster.task_shares())

    def breaches(self, new: PlacedStream) -> list[tuple[str, float, float]]:
        """(stream, worst-case jitter ms, budget ms) for every stream whose budget ``new`` (placed, its
        ranks applied, not added) would break: itself and the budgeted streams sharing a device with it. A
        stream's worst case is its bound plus the spread it was measured to have beyond it (:meth:`spread_ms`)."""
        c = self.cluster
        out, shares = [], c.task_shares()   # the devices' batching is the same for every stream checked
        touched = c.streams.values() if self.shared_cores is not None else (
            q for q in c.streams.values() if set(q.devices) & set(new.devices))   # sharing cores: everyone
        for s in (new, *touched):
            if s.jitter_budget_ms is not None:
                j = self._bound_ms(s, () if s is new else (new,), shares) + self.spread_ms(s.stream)
                if j > s.jitter_budget_ms + 1e-9:
                    out.append((s.stream, j, s.jitter_budget_ms))
        return out

    def release_phase(self, placed: PlacedStream) -> float:
        """The phase of its interval (ms) at which a paced stream placed like ``placed`` should be released:
        a batching mate's (same model and pace, from the same device) when the devices batch, so that their
        tasks arrive together as the batch credit assumes; else the one farthest from the phases of the
        streams of its pace released onto the same device."""
        first = placed.devices[0]
        same = [q for q in self.cluster.streams.values() if q.stream != placed.stream and q.phase_ms is not None
                and math.isclose(q.slo_ms, placed.slo_ms) and q.devices[0] == first]
        if self.cluster.max_batch > 1:
            for q in same:
                if q.model == placed.model:
                    return q.phase_ms
        return choose_phase(placed.slo_ms, [q.phase_ms for q in same])

    # -------------------------------------------------------------- its parts

    def _bound_ms(self, placed: PlacedStream, also: Sequence[PlacedStream], shares: dict[str, np.ndarray]) -> float:
        load_of = self.cluster.load
        streams = [q for q in (*self.cluster.streams.values(), *also) if q is not placed and q.stream != placed.stream]
        busy_on = _busy_periods([*streams, placed], shares) if self.shared_cores is not None else None
        total = 0.0
        for w in set(placed.devices):
            batched, alone, _ = _chunk_ms(placed, w, shares)
            busy, blocking, apart = batched - alone, 0.0, []
            for q in streams:
                if w not in q.devices:
                    continue
                q_batched, _, q_stage = _chunk_ms(q, w, shares)
                if not self._delays(placed, q):   # one later-deadline task may be running: no preemption
                    blocking = max(blocking, q_stage)
                elif _phased_apart(placed, q):
                    apart.append((q, q_batched))
                else:
                    busy += q_batched
            if apart:   # the backlog those released before it leave (each of the rest can add all of its work),
                # in ms as the device runs now
                load = load_of[w]
                released = self._released(placed, apart, load)
                busy += wait_ms(placed.slo_ms, placed.phase_ms, batched * load, released) / load
            if busy_on is not None:
                busy += self._contention_ms(w, alone + busy + blocking, busy_on)
            total += load_of[w] * max(0.0, busy + blocking)
        return total

    def _delays(self, i: PlacedStream, q: PlacedStream) -> bool:
        """Whether a chunk of ``q`` running beside one of ``i`` may delay it by all of its work."""
        if not self.deadline_order or q.jitter_budget_ms is None or i.jitter_budget_ms is None:
            return True
        return q.jitter_budget_ms <= i.jitter_budget_ms + 1e-9

    def _released(self, placed: PlacedStream, apart: list[tuple[PlacedStream, float]], load: float
                  ) -> list[tuple[float, float]]:
        """(phase, ms as the device runs now) of each phased co-runner's chunk: its work at the device's load
        plus its spread, since it may run that much longer. Batching mates (one model, one phase) run in the
        same forwards, so one slow forward delays them all once: a batch is charged its largest spread once,
        and ``placed``'s own batch none (its own spread holds it)."""
        out, charged = [], set()
        for q, work in sorted(apart, key=lambda a: -self.spread_ms(a[0].stream)):
            batch = (q.model, round(q.phase_ms, 6)) if self.cluster.max_batch > 1 else q.stream
            own = batch == (placed.model, round(placed.phase_ms, 6))
            out.append((q.phase_ms, work * load + (0.0 if own or batch in charged else self.spread_ms(q.stream))))
            charged.add(batch)
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


def _chunk_ms(placed: PlacedStream, device: int, shares: dict[str, np.ndarray]) -> tuple[float, float, float]:
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


def _phased_apart(i: PlacedStream, q: PlacedStream) -> bool:
    """Whether ``q`` meets ``i`` only at their fixed relative phase: both released at one pace, each
    wholly on one (the same) device, so that its chunk is there from its release on."""
    return (i.phase_ms is not None and q.phase_ms is not None and math.isclose(i.slo_ms, q.slo_ms)
            and len(set(i.devices)) == 1 and set(q.devices) == set(i.devices))


def _busy_periods(streams: Sequence[PlacedStream], shares: dict[str, np.ndarray]) -> dict[int, float]:
    """Per device with work: one chunk of every stream there, batched as it batches (ms)."""
    out: dict[int, float] = {}
    for q in streams:
        for w in set(q.devices):
            out[w] = out.get(w, 0.0) + _chunk_ms(q, w, shares)[0]
    return out
