"""Discrete-event simulation of one stream's chunks through a plan, for the planner's predictions.

A closed-form steady state ("every worker's per-chunk time, the busiest one
sets the interval") assumes batched chunks move through a worker's blocks in
perfect lockstep. They do not always: a chunk that re-enters the pipeline
after the engine's round trip arrives too late to join its group's batch, and
plans that ping-pong between workers idle one while the other computes. So the
planner replays the pipeline here, event by event, with the profile's costs
and the workers' own batch policy (:class:`~physis_ros.runtime.batching.BatchPolicy`,
the same pick and adaptive rule), and reads the interval off the simulated
emits.

Costs: a forward of n same-block tasks costs the mean of their stages'
profiled time at batch n, plus the per-call loop overhead; every message a
worker sends costs it one hop (``CostProfile.hop_ms``); the engine turns an output
into the next chunk's input in ``CostProfile.engine_ms``. CPU workers that share the host
run ``CostProfile.corun_slowdown`` times slower than the profile measured alone.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from physis_ros.runtime.plans import Plan, Stage
from physis_ros.runtime.costs import CostProfile
from physis_ros.runtime.batching import BatchPolicy


@dataclass
class _Task:
    chunk: int
    stage: Stage
    order: float

    @property
    def deadline(self) -> float:
        return self.order

    @property
    def weights(self) -> int:
        return self.stage[1]


@dataclass
class _Worker:
    policy: BatchPolicy
    ready: list[_Task] = field(default_factory=list)
    busy: bool = False
    busy_ms: float = 0.0


@dataclass
class SimResult:
    interval_ms: float                 # mean interval between emits in steady state
    mean_batch: float                  # per forward
    task_batch: float                  # per task: the batch size the average task ran in (as telemetry counts)
    utilisation: dict[int, float]      # busy fraction per worker over the steady-state window
    busy_ms_per_chunk: dict[int, float]  # each worker's compute + sends per emitted chunk (steady state)


def simulate(plan: Plan, profile: CostProfile, batching: str = "off", max_batch: int = 4, in_flight: int | None = None,
             chunks: int = 200, warmup: int = 50, slowdown: float = 1.0
             ) -> SimResult:
    """Feed ``chunks`` chunks as fast as ``in_flight`` credits allow (the engine's latest-observation mode)."""
    if chunks <= warmup + 1:
        raise ValueError(f"chunks ({chunks}) must exceed warmup ({warmup}) + 1")
    limit = in_flight or plan.in_flight(batching != "off", max_batch)
    turnaround = profile.engine_ms
    seeds = {int(b): {int(n): ms for n, ms in by_n.items()}  # what the engine seeds every worker's policy with
             for b, by_n in profile.block_costs(plan.order).items()}
    workers = {w: _Worker(BatchPolicy("oldest", batching, max_batch, seeds)) for w in plan.workers_used}
    first = plan.first_stage
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    fed = 0
    emits: dict[int, float] = {}
    batch_sizes: list[int] = []

    def feed(now: float) -> None:
        nonlocal fed
        push(now + turnaround, "arrive", _Task(fed, first, now))
        fed += 1

    def start(w: int, now: float) -> None:
        wk = workers[w]
        if wk.busy or not wk.ready:
            return
        batch = wk.policy.pick(wk.ready, lambda t: t.stage)
        for t in batch:
            wk.ready.remove(t)
        n, b = len(batch), batch[0].stage[1]
        compute = sum(profile.forward_ms(t.stage, n) for t in batch) / n * slowdown
        wk.policy.observe(b, n, compute)  # what the worker's timer sees: the model, not its own loop
        sends = sum(1 for t in batch if plan.assignment.get(plan.next_stage(t.stage)) != w)
        busy = compute + profile.overhead_ms_per_call * slowdown + sends * profile.hop_ms
        wk.busy, wk.busy_ms = True, wk.busy_ms + busy
        batch_sizes.append(n)
        push(now + busy, "done", (w, batch))

    for _ in range(min(limit, chunks)):
        feed(0.0)
    window_busy: dict[int, float] = {}
    while events and len(emits) < chunks:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            task = payload
            w = plan.assignment[task.stage]
            workers[w].ready.append(task)
            start(w, now)
            continue
        w, batch = payload
        workers[w].busy = False
        for t in batch:
            nxt = plan.next_stage(t.stage)
            if nxt is None:
                emits[t.chunk] = now
                if len(emits) == warmup + 1:
                    window_busy = {v: wk.busy_ms for v, wk in workers.items()}
                if fed < chunks:
                    feed(now)
                continue
            t.stage = nxt
            owner = plan.assignment[nxt]
            if owner == w:
                workers[w].ready.append(t)
            else:
                push(now, "arrive", t)
        start(w, now)
    times = sorted(emits.values())
    lo, hi = times[warmup], times[-1]
    span = hi - lo
    window = {w: wk.busy_ms - window_busy.get(w, 0.0) for w, wk in workers.items()}
    return SimResult(
        interval_ms=span / (len(times) - 1 - warmup),
        mean_batch=sum(batch_sizes) / len(batch_sizes),
        task_batch=sum(n * n for n in batch_sizes) / sum(batch_sizes),
        utilisation={w: busy / span if span > 0 else 0.0 for w, busy in window.items()},
        busy_ms_per_chunk={w: busy / (len(times) - 1 - warmup) for w, busy in window.items()})
