"""Stage pipeline vs the baselines (sequential, step, block) on local worker processes.

For each plan one real engine with real worker processes runs ``--chunks``
chunks of one stream. Steady state excludes the fill phase. In the same run,
two independent sequential rollouts side by side measure this machine's
two-process parallel limit, the yardstick for the pipeline's speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from physis_ros.cli.common import write_json
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout
from physis_ros.runtime.offline import run_chunks
from physis_ros.runtime.plans import PLAN_NAMES, make_plan
from physis_ros.telemetry import percentile, summarize

STREAM = "bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--plans", default="sequential,step,block,stage")
    p.add_argument("--chunks", type=int, default=200)
    p.add_argument("--skip", type=int, default=0, help="fill-phase chunks to exclude (0: 10 + 2 x segments)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over all plans, interleaved (a shared machine's speed drifts); medians reported")
    p.add_argument("--device", default="cpu")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    p.add_argument("--verify", action="store_true", help="compare every chunk with the sequential reference")
    p.add_argument("--no-parallel-limit", action="store_true", help="skip the two-rollouts yardstick")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG: interval over time per plan, latency CDFs")


def parallel_limit(model: str, chunks: int, device: str) -> dict:
    """Throughput of two independent sequential rollouts side by side over one alone."""
    def launch(out: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "physis_ros.cli.rollout", "--model", model, "--chunks",
                                 str(chunks), "--device", device, "--json", out],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def steady_ms(path: str) -> float:
        ms = [c["ms"] for c in json.loads(Path(path).read_text())["chunks"]]
        return float(np.median(ms[len(ms) // 5:]))

    with tempfile.TemporaryDirectory() as tmp:
        alone = os.path.join(tmp, "alone.json")
        if launch(alone).wait() != 0:
            raise RuntimeError("reference rollout failed")
        a, b = os.path.join(tmp, "a.json"), os.path.join(tmp, "b.json")
        procs = [launch(a), launch(b)]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("reference rollout failed")
        ms_alone = steady_ms(alone)
        ms_pair = (steady_ms(a) + steady_ms(b)) / 2
    return {"chunk_ms_alone": ms_alone, "chunk_ms_side_by_side": ms_pair, "speedup": 2 * ms_alone / ms_pair}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    config = load_model_config(args.model)
    scene = SyntheticScene(config.observation_shapes)
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = [p for p in plans if p not in PLAN_NAMES]
    if unknown:
        print(f"error: unknown plan(s) {unknown}; choose from {', '.join(PLAN_NAMES)}", file=sys.stderr)
        return 2
    reference = None
    if args.verify:
        model = build_model(config, device=args.device)
        reference = [r.output for r in reference_rollout(model, scene.observation, [STREAM], args.chunks)]
    result = {"model": config.name, "workers": args.workers, "chunks": args.chunks, "device": args.device,
              "transport": args.transport, "plans": {}}
    series = {}
    runs: dict[str, list[dict]] = {name: [] for name in plans}
    limits = []
    for round_ in range(args.repeats):
        if not args.no_parallel_limit:
            limits.append(parallel_limit(config.name, min(args.chunks, 100), args.device))
        for name in plans:
            entry, records = run_plan(name, config, args, scene, reference)
            runs[name].append(entry)
            series.setdefault(name, records)
            print(f"[{name} {round_ + 1}/{args.repeats}] interval p50 {entry['interval_ms_p50']:.2f} ms, "
                  f"p99 {entry['interval_ms_p99']:.2f} ms, {entry['chunks_per_s']:.1f} chunks/s, "
                  f"efficiency {entry['efficiency']:.2f}, latency p50 {entry['latency_ms_p50']:.1f} ms, "
                  f"max diff {entry['max_abs_diff_vs_reference']}", file=sys.stderr, flush=True)
    # Ratios are taken within a round (same minutes, same machine speed), then the median over rounds.
    if "sequential" in plans:
        for r in range(args.repeats):
            seq = runs["sequential"][r]["chunks_per_s"]
            for name in plans:
                e = runs[name][r]
                e["speedup_vs_sequential"] = e["chunks_per_s"] / seq
                if limits:
                    e["fraction_of_parallel_limit"] = e["speedup_vs_sequential"] / limits[r]["speedup"]
    for name in plans:
        result["plans"][name] = median_entry(runs[name])
    if limits:
        limit = {k: float(np.median([x[k] for x in limits])) for k in limits[0]}
        result["parallel_limit"] = {**limit, "runs": limits}
        result["parallel_limit_speedup"] = limit["speedup"]
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(series, result, args.plot)
    print(json.dumps({n: {k: e[k] for k in ("interval_ms_p50", "chunks_per_s", "efficiency")}
                      for n, e in result["plans"].items()}, indent=1))
    return 0


def run_plan(name: str, config, args: argparse.Namespace, scene: SyntheticScene, reference) -> tuple[dict, list]:
    plan = make_plan(name, config.steps, config.blocks, args.workers)
    engine_cfg = EngineConfig(workers=args.workers, plan=name, devices=[args.device], transport=args.transport)
    outputs = run_chunks(config, engine_cfg, [STREAM], args.chunks, scene.observation, plan)[STREAM]
    records = [o.record for o in outputs]
    skip = args.skip or min(10 + 2 * len(plan.segments()), args.chunks // 2)
    stats = summarize(records, skip)
    steady = records[skip:]
    ideal = percentile([max(r.worker_compute_ms.values()) for r in steady], 50)
    entry = {
        "plan": plan.describe(),
        "hops_per_chunk": plan.hops(),
        "interval_ms_p50": stats["interval_ms_p50"],
        "interval_ms_p99": stats["interval_ms_p99"],
        "latency_ms_p50": stats["latency_ms_p50"],
        "latency_ms_p99": stats["latency_ms_p99"],
        "chunks_per_s": stats["chunks_per_s"],
        "ideal_interval_ms": ideal,
        "efficiency": ideal / stats["interval_ms_p50"],
        "hop_ms_p50": stats["hop_ms_p50"],
        "stage_ms_p50": percentile([ms for r in steady for ms in r.stage_ms], 50),
        "queue_ms_p50": percentile([r.queue_ms for r in steady], 50),
        "transport_ms_p50": percentile([r.transport_ms for r in steady], 50),
        "max_abs_diff_vs_reference": None,
    }
    if reference is not None:
        entry["max_abs_diff_vs_reference"] = max(float(np.abs(o.output - reference[o.chunk].numpy()).max())
                                                 for o in outputs)
    return entry, records


def median_entry(entries: list[dict]) -> dict:
    """Per-field median over rounds (max for the reference difference); every round kept under 'runs'."""
    out = {}
    for key, value in entries[0].items():
        values = [e[key] for e in entries]
        if key == "max_abs_diff_vs_reference":
            out[key] = None if value is None else max(values)
        elif isinstance(value, (int, float)):
            out[key] = float(np.median(values))
        else:
            out[key] = value
    out["runs"] = [{k: e[k] for k in ("interval_ms_p50", "chunks_per_s", "efficiency")} for e in entries]
    return out


def plot(series: dict, result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, records in series.items():
        t0 = records[0].emit
        ax1.plot([r.emit - t0 for r in records[1:]], [r.interval_ms for r in records[1:]], lw=0.8, label=name)
        lat = np.sort([r.latency_ms for r in records])
        ax2.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=name)
    ax1.set(xlabel="time since first chunk [s]", ylabel="output interval [ms]",
            title=f"{result['model']}, {result['workers']} workers: interval over time")
    ax1.set_yscale("log")
    ax2.set(xlabel="response latency [ms]", ylabel="fraction of chunks", title="latency CDF")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)
