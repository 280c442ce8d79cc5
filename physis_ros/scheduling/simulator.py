"""Cluster simulator: an arrival sequence of streams, admitted by ``joint`` or ``equal`` placement.

Nothing runs: admission decisions are made on the cost profiles (modelled for
the paper-size presets, measured for the tiny ones), and the simulator reports
what was admitted, each stream's predicted interval alone, device utilisation
and memory, and the wall time each placement decision took (the only measured
quantity here).

Arrivals go on until the cluster is saturated: ``patience`` consecutive
rejections (a rejected stream changes nothing, so for one model and one SLO the
first rejection is final), or ``arrivals`` streams.

``report24`` runs two settings of 24 devices: the report's own (one SLO of
1,600 ms, the equal split's groups fixed to the report's) and the calibrated
one (config ``scenarios.report24``); :func:`implied_workload` is the arithmetic
of which per-chunk workloads the report's own counts could follow from
(docs/scheduling.md section 7).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from physis_ros.model.spec import load_model_config
from physis_ros.scheduling.admission import Decision, StreamRequest
from physis_ros.scheduling.cluster import Cluster
from physis_ros.scheduling.equal import EqualSplitScheduler
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.runtime.costs import CostProfile
from physis_ros.scheduling.profiles import get_profile
from physis_ros.scheduling.ranks import Unplaceable, group_size, rank_budget_ms
from physis_ros.scheduling.settings import DeviceSpec, SchedulingConfig

POLICIES = ("joint", "equal")
REPORT24_MODELS = ("wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b")
# The report's streams on 24 GPUs (equal -> joint), for the record next to ours.
REPORT24_PAPER = {"wan2.1-1.3b": (12, 39), "wan2.2-5b": (24, 46), "ltx-22b": (8, 18),
                  "h3-33b": (6, 10), "wan2.1-14b": (24, 18)}
# The report's own setting, as it states it: one SLO for every backbone, and the equal
# split's devices per stream (its groups are these, not sized from the SLO).
REPORT24_DEVICES = 24
REPORT24_SLO_MS = 1600.0
REPORT24_GROUPS = {"wan2.1-1.3b": 2, "wan2.2-5b": 1, "wan2.1-14b": 1, "ltx-22b": 3, "h3-33b": 4}


# A placement decision (rank cut, Best-Fit with gap filling, LDS, the jitter bound) may take at most this many
# times the simplest Best-Fit over the same cluster state (p99 over p99, one run): a guard against the next
# slowdown. Measured 1-15x at 24, 128 and 1,024 devices (bench/RESULTS.md, "Placement decision time").
PLACEMENT_VS_BEST_FIT_LIMIT = 30.0

def load_profiles(models: Sequence[str], device: DeviceSpec,
                  paths: dict[str, str] | None = None) -> dict[str, CostProfile]:
    paths = paths or {}
    return {m: get_profile(load_model_config(m), device, paths.get(m)) for m in dict.fromkeys(models)}


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


@dataclass
class Workload:
    """Where arrivals come from: ``next_request(i)`` gives the i-th arriving stream."""

    models: list[str]
    slo_ms: dict[str, float]
    seed: int = 0
    latency_slo_ms: float | None = None

    def requests(self) -> Iterator[StreamRequest]:
        rng = random.Random(self.seed)
        i = 0
        while True:
            model = self.models[0] if len(self.models) == 1 else rng.choice(self.models)
            yield StreamRequest(f"s{i}-{model}", model, self.slo_ms[model], self.latency_slo_ms)
            i += 1


def equal_group(profiles: dict[str, CostProfile], workload: Workload, config: SchedulingConfig,
                device: DeviceSpec) -> int | None:
    """The equal split's fixed group size: the largest any model of the workload needs (None: unreachable)."""
    sizes = []
    for m in dict.fromkeys(workload.models):
        try:
            sizes.append(group_size(profiles[m], workload.slo_ms[m], config.headroom, device.usable_bytes))
        except Unplaceable:
            pass
    return max(sizes) if sizes else None


def run_policy(policy: str, device: DeviceSpec, devices: int, profiles: dict[str, CostProfile],
               workload: Workload, config: SchedulingConfig, *, arrivals: int = 100000,
               patience: int = 1, on_decision: Callable[[Decision], None] | None = None,
               group: int | None = None) -> dict:
    """Admit arrivals under ``policy`` until saturation; the result as a JSON-ready dict.

    ``group``: the equal split's devices per stream, fixed (the report's setting); by default the
    smallest group that meets the SLO (for a mixed workload, the largest any model needs)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy '{policy}'; choose one of: {', '.join(POLICIES)}")
    if group is not None and group < 1:
        raise ValueError(f"the equal split's group must be >= 1 device, got {group}")
    cluster = Cluster([device] * devices, config.headroom, profiles)
    fixed = group is not None
    group = group if fixed else equal_group(profiles, workload, config, device)
    prepare_ms = 0.0
    if policy == "joint":
        sched = JointScheduler(cluster, config)
        t0 = time.perf_counter()
        for m in dict.fromkeys(workload.models):
            sched.prepare(m, workload.slo_ms[m])
        prepare_ms = (time.perf_counter() - t0) * 1e3
    else:
        sched = EqualSplitScheduler(cluster, config, group or devices + 1)
    decisions: list[Decision] = []
    baseline: list[float] = []   # joint: the simplest Best-Fit over the same cluster state, timed the same way
    misses = 0
    for req in workload.requests():
        if len(decisions) >= arrivals or misses >= patience:
            break
        if policy == "joint":
            t0 = time.perf_counter()
            sched.simplest_best_fit(req)
            baseline.append((time.perf_counter() - t0) * 1e3)
        d = sched.admit(req)
        decisions.append(d)
        misses = 0 if d.admitted else misses + 1
        if on_decision:
            on_decision(d)
    admitted = [d for d in decisions if d.admitted]
    times = [d.decision_ms for d in decisions]
    cpu = [d.cpu_ms for d in decisions]
    intervals = [d.placed.interval_alone_ms for d in admitted]
    meets = all(d.placed.interval_alone_ms <= rank_budget_ms(d.request.slo_ms, config.headroom) + 1e-6
                for d in admitted)
    return {
        "policy": policy,
        "admitted": len(admitted),
        "admitted_by_model": dict(Counter(d.request.model for d in admitted)),
        "arrivals": len(decisions),
        "rejections": dict(Counter(d.reason for d in decisions if not d.admitted)),
        "first_rejection": next((d.detail for d in decisions if not d.admitted), None),
        "methods": dict(Counter(d.placed.method for d in admitted)),
        "ranks_per_stream": round(float(np.mean([len(d.placed.ranks) for d in admitted])), 3) if admitted else 0,
        "group_size": group if policy == "equal" else None,
        "group_rule": ("fixed" if fixed else "smallest meeting the SLO") if policy == "equal" else None,
        "predicted_interval_alone_ms": {"p50": round(percentile(intervals, 50), 3),
                                        "max": round(max(intervals, default=0.0), 3)},
        "all_meet_slo": meets,
        "placement_ms": {"p50": round(percentile(times, 50), 4), "p99": round(percentile(times, 99), 4),
                         "max": round(max(times, default=0.0), 4)},
        "placement_cpu_ms": {"p50": round(percentile(cpu, 50), 4), "p99": round(percentile(cpu, 99), 4),
                             "max": round(max(cpu, default=0.0), 4)},
        "baseline_best_fit_ms": ({"p50": round(percentile(baseline, 50), 4), "p99": round(percentile(baseline, 99), 4)}
                                 if baseline else None),
        "decision_ms": [round(t, 4) for t in times],
        "decision_cpu_ms": [round(t, 4) for t in cpu],
        "prepare_ms": round(prepare_ms, 3),
        "search_nodes_max": max((d.nodes for d in decisions), default=0),
        "cluster": cluster.stats(),
    }


def compare(device: DeviceSpec, devices: int, profiles: dict[str, CostProfile], workload: Workload,
            config: SchedulingConfig, *, arrivals: int = 100000, patience: int = 1,
            group: int | None = None) -> dict:
    """Both policies on the same arrival sequence (``group``: the equal split's, fixed; see run_policy)."""
    res = {p: run_policy(p, device, devices, profiles, workload, config, arrivals=arrivals, patience=patience,
                         group=group) for p in POLICIES}
    joint, equal = res["joint"], res["equal"]
    models = list(dict.fromkeys(workload.models))
    one = models[0] if len(models) == 1 else None
    out = {
        "model": one if one else "mixed:" + ",".join(models),
        "devices": devices,
        "slo_ms": workload.slo_ms[one] if one else {m: workload.slo_ms[m] for m in models},
        "admitted": {"joint": joint["admitted"], "equal": equal["admitted"]},
        "ratio": round(joint["admitted"] / equal["admitted"], 3) if equal["admitted"] else None,
        "placement_ms_p99": joint["placement_ms"]["p99"],
        "placement_cpu_ms_p99": joint["placement_cpu_ms"]["p99"],
        # the decision's p99 over the simplest Best-Fit's on the same cluster states (SCHEDULING_RATIO_LIMIT)
        "placement_vs_best_fit_p99": (round(joint["placement_ms"]["p99"] / joint["baseline_best_fit_ms"]["p99"], 2)
                                      if joint["baseline_best_fit_ms"] and joint["baseline_best_fit_ms"]["p99"] > 0
                                      else None),
        "equal_group_size": equal["group_size"],
        "equal_group_rule": equal["group_rule"],
        "headroom": config.headroom,
        "profile_source": {m: profiles[m].source for m in models},
    }
    if one:
        prof = profiles[one]
        budget = rank_budget_ms(workload.slo_ms[one], config.headroom)
        out["stream_compute_ms"] = round(prof.chunk_ms(), 3)
        out["devices_of_compute_per_stream"] = round(prof.chunk_ms() / budget, 3)
        if one in REPORT24_PAPER and devices == 24:
            eq, jt = REPORT24_PAPER[one]
            out["report_paper"] = {"equal": eq, "joint": jt}
    out["joint"] = joint
    out["equal"] = equal
    return out


WORKLOAD_BASIS = (
    "per-chunk workload W = CostProfile.chunk_ms(): one chunk is steps x blocks block forwards (batch 1, "
    "no hops) of the preset's tokens per chunk (Wan presets: 3 latent frames of patches attending to themselves "
    "and a 2-chunk KV window, cross-attending to 512 text tokens; the DiT shapes: action horizon + 1 + 3 latent "
    "frames of patches, with the window), each timed by the roofline of the modelled device "
    "(docs/scheduling.md section 2); x = W / (SLO x (1 - headroom)) is the devices' worth of compute per stream")


def chunk_workload(profile: CostProfile, slo_ms: float, headroom: float) -> dict:
    """The per-chunk workload one stream brings: ms of compute on one device (all its stages at batch 1,
    no hops: ``CostProfile.chunk_ms()``), where it comes from, and the devices' worth of it at ``slo_ms``."""
    chunk = profile.chunk_ms()
    out = {"chunk_ms": round(chunk, 3), "stages": len(profile.order), "steps": profile.steps,
           "blocks": profile.blocks, "stage_ms_mean": round(chunk / len(profile.order), 4),
           "devices_per_stream": round(chunk / rank_budget_ms(slo_ms, headroom), 3),
           "weights_gb": round(profile.block_weight_bytes * profile.blocks / 1e9, 2),
           "kv_gb_per_stream": round(profile.kv_bytes * len(profile.order) / 1e9, 2), "source": profile.source}
    try:
        cfg = load_model_config(profile.model)
    except Exception:  # noqa: BLE001 -- a profile of a model with no preset: its shape is unknown here
        return out
    out.update(tokens_per_chunk=cfg.tokens_per_chunk, cached_tokens=(cfg.window + int(cfg.sink)) * cfg.tokens_per_chunk,
               params_b=round(cfg.block_params() * cfg.blocks / 1e9, 2), bound=profile.notes.get("bound_at_batch_1"))
    return out


def _span(lo: float, hi: float) -> list[float] | None:
    """The interval (lo, hi] of W in ms, or None when it is empty."""
    return [round(lo, 1), round(hi, 1)] if hi > lo + 1e-9 else None


def _meet(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    return _span(max(a[0], b[0]), min(a[1], b[1])) if a and b else None


def implied_workload(group: int, equal: int, joint: int, slo_ms: float, headroom: float,
                     devices: int = REPORT24_DEVICES) -> dict:
    """Which per-chunk workloads W (ms of one device's compute) a pair of counts can follow from.

    ``equal`` streams under an equal split of ``group`` devices per stream and ``joint`` streams jointly
    placed, on ``devices`` devices at ``slo_ms``, each device busy at most ``B = SLO x (1 - headroom)`` per
    interval, time the only binding resource. Each answer is an interval ``(lo, hi]`` of W or None (no W):

    * equal, group **by need** (the split gives a stream the fewest devices that meet its SLO, one stream per
      group): ``floor(N / g)`` streams and ``(g - 1) B < W <= g B``;
    * equal, groups **time-shared** (a group of g holds ``floor(g B / W)`` streams):
      ``equal = floor(N / g) k`` with ``g B / (k + 1) < W <= g B / k``;
    * equal, groups **dedicated** whatever a stream needs: ``floor(N / g)`` streams for any ``W <= g B``;
    * joint, **firm**: ``joint x W <= N B`` (the devices' time), and joint never admits fewer than a split by
      need, ``floor(N / ceil(W / B))``, so ``ceil(W / B) >= m`` for the smallest m with ``floor(N / m) <= joint``;
    * joint **at the packing bound** (as our placement is, within a stream): also ``(joint + 1) W > N B``.
    """
    B = rank_budget_ms(slo_ms, headroom)
    groups = devices // group
    one_each = groups > 0 and equal == groups
    by_need = _span((group - 1) * B, group * B) if one_each else None
    dedicated = _span(0.0, group * B) if one_each else None
    k = equal // groups if groups and equal and equal % groups == 0 else 0
    shared = _span(group * B / (k + 1), group * B / k) if k else None
    if joint > 0:
        m = next(m for m in range(1, devices + 2) if devices // m <= joint)
        firm = _span((m - 1) * B, devices * B / joint)
        packed = _meet(firm, _span(devices * B / (joint + 1), devices * B / joint))
    else:
        firm = packed = None
    return {
        "budget_ms": round(B, 1),
        "equal": {"by_need": by_need, "time_shared": shared, "dedicated": dedicated},
        "joint": {"firm": firm, "at_packing_bound": packed},
        "both": {"by_need": _meet(by_need, firm), "time_shared": _meet(shared, firm),
                 "dedicated": _meet(dedicated, firm), "dedicated_at_packing_bound": _meet(dedicated, packed)},
    }


def report24_stated(config: SchedulingConfig, device: DeviceSpec, profiles: dict[str, CostProfile] | None = None,
                    devices: int = REPORT24_DEVICES) -> dict:
    """The report's own setting: every backbone alone at SLO 1,600 ms, the equal split's groups fixed to the
    report's (not sized from the SLO), joint placement as the scheduler does it; per backbone the per-chunk
    workload assumed and the workloads the report's own counts would imply."""
    profiles = dict(profiles or {})
    missing = [m for m in REPORT24_MODELS if m not in profiles]
    if missing:
        profiles.update(load_profiles(missing, device))
    headrooms = list(dict.fromkeys((config.headroom, 0.0)))
    rows = []
    for m in REPORT24_MODELS:
        r = compare(device, devices, profiles, Workload([m], {m: REPORT24_SLO_MS}), config,
                    group=REPORT24_GROUPS[m])
        r["workload"] = chunk_workload(profiles[m], REPORT24_SLO_MS, config.headroom)
        r["joint_time_bound"] = int(devices * rank_budget_ms(REPORT24_SLO_MS, config.headroom)
                                    // profiles[m].chunk_ms())
        eq, jt = REPORT24_PAPER[m]
        r["report_implies"] = {f"headroom {h:g}": implied_workload(REPORT24_GROUPS[m], eq, jt, REPORT24_SLO_MS, h)
                               for h in headrooms}
        rows.append(r)
    return {"devices": devices, "slo_ms": REPORT24_SLO_MS, "equal_groups": dict(REPORT24_GROUPS),
            "equal_group_rule": "fixed to the report's", "headroom": config.headroom,
            "workload_basis": WORKLOAD_BASIS, "scenarios": rows}


def report24(config: SchedulingConfig, device: DeviceSpec, profiles: dict[str, CostProfile] | None = None,
             devices: int = 24, mixed: bool = True, stated: bool = True) -> dict:
    """24 devices, two settings, each backbone alone (report's counts beside ours):

    * ``report_setting`` (``stated``): the report's own, see :func:`report24_stated`;
    * ``scenarios``: the calibrated one, each backbone at its SLO of config ``scenarios.report24``, the equal
      split's group sized from that SLO, then all five mixed (``mixed``).
    """
    slos = config.scenarios.get("report24")
    if not slos:
        raise ValueError("config scenarios.report24 holds no SLOs (model: ms)")
    models = [m for m in REPORT24_MODELS if m in slos] + [m for m in slos if m not in REPORT24_MODELS]
    profiles = profiles or load_profiles(models, device)
    scenarios = [compare(device, devices, profiles, Workload([m], {m: slos[m]}), config) for m in models]
    if mixed:
        scenarios.append(compare(device, devices, profiles, Workload(models, dict(slos), seed=1), config,
                                 patience=20, arrivals=400))
    out = {"scenarios": scenarios,
           "calibrated_setting": {"devices": devices, "slo_ms": dict(slos),
                                  "equal_group_rule": "smallest meeting the SLO", "headroom": config.headroom,
                                  "workload_basis": WORKLOAD_BASIS}}
    if stated:
        out["report_setting"] = report24_stated(config, device, profiles, devices)
    return out


def slo_sweep(config: SchedulingConfig, device: DeviceSpec, models: Sequence[str],
              factors: Sequence[float], devices: int = 24,
              profiles: dict[str, CostProfile] | None = None) -> list[dict]:
    """Joint vs equal over SLOs: SLO = stream compute / ((1 - headroom) * x) for each x in ``factors``
    (x = devices' worth of compute one stream needs)."""
    profiles = profiles or load_profiles(models, device)
    rows = []
    for m in models:
        chunk = profiles[m].chunk_ms()
        for x in factors:
            slo = round(chunk / ((1 - config.headroom) * x), 3)
            r = compare(device, devices, profiles, Workload([m], {m: slo}), config)
            rows.append({"model": m, "x": x, "slo_ms": slo, "equal_group_size": r["equal_group_size"],
                         "admitted": r["admitted"], "ratio": r["ratio"],
                         "placement_ms_p99": r["placement_ms_p99"],
                         "placement_cpu_ms_p99": r["placement_cpu_ms_p99"],
                         "decision_ms": r["joint"]["decision_ms"], "decision_cpu_ms": r["joint"]["decision_cpu_ms"]})
    return rows


def pooled(rows: Sequence[dict], key: str = "decision_ms") -> dict:
    """Percentiles of the joint decision times of many scenarios taken together."""
    times = [t for r in rows for t in r[key]]
    return {"decisions": len(times), "p50": round(percentile(times, 50), 4), "p99": round(percentile(times, 99), 4),
            "max": round(max(times, default=0.0), 4)}
