"""Cluster simulator: an arrival sequence of streams, admitted by ``joint`` or ``equal`` placement.

Nothing runs: admission decisions are made on the cost profiles (modelled for
the paper-size presets, measured for the tiny ones), and the simulator reports
what was admitted, each stream's predicted interval alone, device utilisation
and memory, and the wall time each placement decision took (the only measured
quantity here).

Arrivals go on until the cluster is saturated: ``patience`` consecutive
rejections (a rejected stream changes nothing, so for one model and one SLO the
first rejection is final), or ``arrivals`` streams.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from physis_ros.model.presets import load_model_config
from physis_ros.scheduling.admission import Decision, StreamRequest
from physis_ros.scheduling.cluster import Cluster
from physis_ros.scheduling.equal import EqualSplitScheduler
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.profiles import CostProfile, get_profile
from physis_ros.scheduling.ranks import Unplaceable, group_size, rank_budget_ms
from physis_ros.scheduling.settings import DeviceSpec, SchedulingConfig

POLICIES = ("joint", "equal")
REPORT24_MODELS = ("wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b")
# The report's streams on 24 GPUs (equal -> joint), for the record next to ours.
REPORT24_PAPER = {"wan2.1-1.3b": (12, 39), "wan2.2-5b": (24, 46), "ltx-22b": (8, 18),
                  "h3-33b": (6, 10), "wan2.1-14b": (24, 18)}


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
               patience: int = 1, on_decision: Callable[[Decision], None] | None = None) -> dict:
    """Admit arrivals under ``policy`` until saturation; the result as a JSON-ready dict."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy '{policy}'; choose one of: {', '.join(POLICIES)}")
    cluster = Cluster([device] * devices, config.headroom, profiles)
    group = equal_group(profiles, workload, config, device)
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
    misses = 0
    for req in workload.requests():
        if len(decisions) >= arrivals or misses >= patience:
            break
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
        "predicted_interval_alone_ms": {"p50": round(percentile(intervals, 50), 3),
                                        "max": round(max(intervals, default=0.0), 3)},
        "all_meet_slo": meets,
        "placement_ms": {"p50": round(percentile(times, 50), 4), "p99": round(percentile(times, 99), 4),
                         "max": round(max(times, default=0.0), 4)},
        "placement_cpu_ms": {"p50": round(percentile(cpu, 50), 4), "p99": round(percentile(cpu, 99), 4),
                             "max": round(max(cpu, default=0.0), 4)},
        "decision_ms": [round(t, 4) for t in times],
        "decision_cpu_ms": [round(t, 4) for t in cpu],
        "prepare_ms": round(prepare_ms, 3),
        "search_nodes_max": max((d.nodes for d in decisions), default=0),
        "cluster": cluster.stats(),
    }


def compare(device: DeviceSpec, devices: int, profiles: dict[str, CostProfile], workload: Workload,
            config: SchedulingConfig, *, arrivals: int = 100000, patience: int = 1) -> dict:
    """Both policies on the same arrival sequence."""
    res = {p: run_policy(p, device, devices, profiles, workload, config, arrivals=arrivals, patience=patience)
           for p in POLICIES}
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
        "equal_group_size": equal["group_size"],
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


def report24(config: SchedulingConfig, device: DeviceSpec, profiles: dict[str, CostProfile] | None = None,
             devices: int = 24, mixed: bool = True) -> dict:
    """The report's setting: 24 devices, each backbone alone at its SLO (config), then all five mixed."""
    slos = config.scenarios.get("report24")
    if not slos:
        raise ValueError("config scenarios.report24 holds no SLOs (model: ms)")
    models = [m for m in REPORT24_MODELS if m in slos] + [m for m in slos if m not in REPORT24_MODELS]
    profiles = profiles or load_profiles(models, device)
    scenarios = [compare(device, devices, profiles, Workload([m], {m: slos[m]}), config) for m in models]
    if mixed:
        scenarios.append(compare(device, devices, profiles, Workload(models, dict(slos), seed=1), config,
                                 patience=20, arrivals=400))
    return {"scenarios": scenarios}


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
