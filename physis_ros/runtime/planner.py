"""Cost-model planner: the partition of a model's stages over workers, with or without batching.

Load of a worker that hosts ``n_b`` steps of block ``b``, if chunks moved
through its blocks in lockstep: per chunk, per hosted block, one batched
forward of size ``n_b`` (batching on), ``n_b`` single forwards (batching off),
or the cheaper of the two (adaptive), plus the hidden-state hops it sends.
That closed form balances the candidate partitions. The predicted output
interval comes from replaying the plan event by event
(:mod:`~physis_ros.runtime.pipesim`), because lockstep is not what happens:
chunks re-entering after the engine's round trip miss their group's batch,
and plans that ping-pong between workers leave one idle. Where CPU workers
share a host's cores with the engine, the interval is at least their total
CPU time per chunk over those cores.

Candidates: the ``stage`` plan (contiguous cut of the pipeline order at the
measured costs), ``block``-grouped plans (same-block stages of every step
co-located so they batch, block ranges balanced at their batched costs) and
``step`` plans. The cheapest predicted plan wins.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from physis_ros.config import ConfigError
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.pipesim import SimResult, simulate
from physis_ros.runtime.plans import Plan, Stage, linear_partition, make_plan, pipeline_order, segment_assignment
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.costs import CostProfile, profile_from_json
from physis_ros.runtime.settings import EngineConfig

log = logging.getLogger("physis.engine")


@dataclass
class Prediction:
    plan: Plan
    interval_ms: float
    batch_of_block: dict[int, dict[int, int]]  # worker -> block -> batch size used in lockstep
    simulated: SimResult | None = None
    cpu_bound_ms: float = 0.0                  # host CPU time per chunk / host cores (0: not bounded)


def worker_time(profile: CostProfile, stages: list[Stage], batching: str, max_batch: int
                ) -> tuple[float, dict[int, int]]:
    """Per-chunk time of a worker hosting ``stages``, and the batch size it runs each block at."""
    by_block: dict[int, list[Stage]] = {}
    for s in stages:
        by_block.setdefault(s[1], []).append(s)
    total, sizes = 0.0, {}
    for b, mine in by_block.items():
        n = len(mine)
        single = sum(profile.forward_ms(s, 1) for s in mine) + n * profile.overhead_ms_per_call
        if batching == "off" or n == 1:
            total, sizes[b] = total + single, 1
            continue
        # Groups of at most max_batch tasks, each one forward costing the mean stage's batched time.
        mean_at = lambda m: sum(profile.forward_ms(s, m) for s in mine) / n  # noqa: E731
        groups = [min(max_batch, n - i) for i in range(0, n, max_batch)]
        batched = sum(mean_at(g) + profile.overhead_ms_per_call for g in groups)
        if batching == "adaptive" and single <= batched:
            total, sizes[b] = total + single, 1
        else:
            total, sizes[b] = total + batched, max(groups)
    return total, sizes


def predict(plan: Plan, profile: CostProfile, batching: str = "off", max_batch: int = 4,
            host_cpus: int | None = None) -> Prediction:
    """``host_cpus``: cores that CPU workers share with the engine (None: workers have their own)."""
    if plan.clean:      # one chunk in flight: a worker never has two tasks of a block to batch
        batching = "off"
    # Co-located CPU workers run slower than the profile's one busy process (CostProfile.corun_slowdown).
    cpu = profile.device == "cpu"
    slowdown = profile.corun_slowdown if len(plan.workers_used) > 1 and cpu else 1.0
    sizes = {w: worker_time(profile, plan.stages_of(w), batching, max_batch)[1] for w in plan.workers_used}
    sim = simulate(plan, profile, batching, max_batch, slowdown=slowdown)
    cpu_bound = 0.0
    if cpu and host_cpus:
        cpu_bound = (sum(sim.busy_ms_per_chunk.values()) + profile.engine_ms) / host_cpus
    return Prediction(plan, max(sim.interval_ms, cpu_bound), sizes, sim, cpu_bound)


def _block_grouped(steps: int, blocks: int, workers: int, profile: CostProfile, batching: str,
                   max_batch: int, clean: bool = False) -> Plan:
    """Contiguous block ranges (all steps of a block on one worker, its clean pass too), balanced at batched
    cost."""
    low = -1 if clean else 0
    per_block = [worker_time(profile, [(k, b) for k in range(steps, low, -1)], batching, max_batch)[0]
                 for b in range(blocks)]
    sizes = linear_partition(per_block, workers)
    owner, b = {}, 0
    for w, size in enumerate(sizes):
        for _ in range(size):
            owner[b] = w
            b += 1
    return Plan("block", steps, blocks, {(k, bb): owner[bb] for k, bb in pipeline_order(steps, blocks, clean)},
                clean)


def candidates(steps: int, blocks: int, workers: int, profile: CostProfile, batching: str, max_batch: int
               ) -> list[Plan]:
    if profile.clean:   # a block's stages stay together: sequential or blocks split over workers
        out = [_block_grouped(steps, blocks, workers, profile, "off", max_batch, clean=True)]
        return out + [make_plan("sequential", steps, blocks, 1, clean=True)] if workers == 1 else out
    order = pipeline_order(steps, blocks)
    single = [profile.forward_ms(s, 1) for s in order]
    out = [Plan("stage", steps, blocks, segment_assignment(order, linear_partition(single, workers))),
           _block_grouped(steps, blocks, workers, profile, batching, max_batch),
           make_plan("step", steps, blocks, workers)]
    if workers == 1:
        out.append(make_plan("sequential", steps, blocks, 1))
    return out


# A plan with more hops must win by this margin: every extra hop is a chance for the lockstep of
# batched chunks to slip on timing noise (a late hidden state splits a batch), which the
# simulation, fed the profile's median costs, does not see.
HOP_MARGIN = 0.10


def choose_plan(steps: int, blocks: int, workers: int, profile: CostProfile, batching: str = "off",
                max_batch: int = 4, host_cpus: int | None = None) -> Prediction:
    """The candidate plan with the lowest predicted interval; fewer hops wins within ``HOP_MARGIN``."""
    preds = sorted((predict(p, profile, batching, max_batch, host_cpus)
                    for p in candidates(steps, blocks, workers, profile, batching, max_batch)),
                   key=lambda p: (p.plan.hops(), p.interval_ms))
    best = preds[0]
    for p in preds[1:]:
        if p.interval_ms < best.interval_ms * (1 - HOP_MARGIN):
            best = p
    return best


@dataclass
class ResolvedPlan:
    """The default placement an engine serves with, the profile behind it and, for ``auto``, the planner's
    prediction."""

    plan: Plan
    profile: CostProfile | None
    prediction: Prediction | None = None


def resolve_plan(model: ModelConfig, config: EngineConfig, profile: CostProfile | None = None) -> ResolvedPlan:
    """``config.plan`` made concrete: a named plan, or for ``auto`` the planner's choice from ``profile``
    (or ``config.profile``, or a profile measured here). Done before an Engine is built."""
    if profile is None and config.profile:
        try:
            profile = profile_from_json(json.loads(Path(config.profile).read_text()), model, where=config.profile)
        except ConfigError as exc:
            raise ConfigError(f"engine.profile ({exc.key})", exc.problem) from None
        except (OSError, ValueError) as exc:
            raise ConfigError("engine.profile", f"cannot read {config.profile}: {exc}") from None
    if config.plan != "auto":
        try:
            plan = make_plan(config.plan, model.steps, model.blocks, config.workers, clean=model.clean_pass)
        except ValueError as exc:
            raise ConfigError("engine.plan", str(exc)) from None
        return ResolvedPlan(plan, profile)
    if profile is None:
        log.info("plan 'auto' without a profile: measuring %s on %s", model.name, config.device_of(0))
        profile = measure_profile(model, config.device_of(0))
    # Workers spawned here share this host's cores with the engine; external ones and Ray actors have their own.
    host_cpus = (os.cpu_count() or 1) if config.launcher == "local" else None
    prediction = choose_plan(model.steps, model.blocks, config.workers, profile, config.batching, config.max_batch,
                             host_cpus)
    log.info("plan auto (%s batching): %s; predicted interval %.2f ms", config.batching, prediction.plan.describe(),
             prediction.interval_ms)
    return ResolvedPlan(prediction.plan, profile, prediction)
