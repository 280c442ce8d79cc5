"""Time-sharing: batching off vs on vs adaptive, with the planner's choice of partition.

Profiles the model on this machine (or loads ``--profile``), lets the planner
choose a plan per batching mode for ``--workers`` workers, runs each through
real worker processes, and compares measured intervals with the prediction.
Without ``--profile`` the model is re-profiled right before every run: this
VM's speed swings by 20 % and more within seconds (consecutive 1.6 s profiles
of tiny-wam: 25.5-37.4 ms per chunk), and a prediction from a profile taken
minutes earlier would measure the drift, not the cost model. Each run also
reports how fast its stages ran against the profile it was planned with
(``traced_vs_profile``: the workers' traced stage times over the profile's at
the batch sizes used), so the reader can tell drift from model error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from physis_ros.console import device_arg, write_json
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout
from physis_ros.runtime.offline import run_chunks
from physis_ros.runtime.planner import choose_plan
from physis_ros.runtime.plans import pipeline_order
from physis_ros.runtime.profiler import measure_corun_slowdown, measure_profile
from physis_ros.runtime.costs import CostProfile, profile_from_json
from physis_ros.telemetry import summarize

MODES = ("off", "on", "adaptive")
STREAM = "bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--chunks", type=int, default=150)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--profile", help="physis-profile JSON (measured now if omitted)")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the three modes, interleaved")
    p.add_argument("--json", help="write results here")


def run_mode(mode: str, config, args: argparse.Namespace, profile: CostProfile, scene: SyntheticScene,
             reference: list) -> dict:
    host_cpus = os.cpu_count() if args.device == "cpu" else None  # the workers share this host's cores
    pred = choose_plan(config.steps, config.blocks, args.workers, profile, mode, args.max_batch, host_cpus)
    engine_cfg = EngineConfig(workers=args.workers, devices=[args.device], batching=mode, max_batch=args.max_batch)
    outputs = run_chunks(config, engine_cfg, [STREAM], args.chunks, scene.observation, pred.plan, profile)[STREAM]
    skip = min(20, args.chunks // 3)
    stats = summarize([o.record for o in outputs], skip)
    diff = max(float(np.abs(o.output - reference[o.chunk]).max()) for o in outputs)
    order = pipeline_order(config.steps, config.blocks)
    traced = sum(sum(o.record.stage_ms) for o in outputs[skip:])
    planned = sum(profile.forward_ms(s, n) / n for o in outputs[skip:] for s, n in zip(order, o.record.batch_sizes))
    scale = max(float(np.abs(r).max()) for r in reference)
    return {
        "plan": pred.plan.describe(),
        "interval_ms_p50": stats["interval_ms_p50"],
        "interval_ms_p99": stats["interval_ms_p99"],
        "chunks_per_s": stats["chunks_per_s"],
        "latency_ms_p50": stats["latency_ms_p50"],
        "mean_batch": float(np.mean([np.mean(o.record.batch_sizes) for o in outputs[skip:]])),
        "predicted_interval_ms": pred.interval_ms,
        "predicted_mean_batch": pred.simulated.task_batch,
        "predicted_cpu_bound_ms": pred.cpu_bound_ms,
        "profile_sum_batch1_ms": sum(profile.forward_ms(s, 1) for s in profile.stage_ms),
        "traced_vs_profile": traced / planned,
        "max_abs_diff_vs_reference": diff,
        "max_abs_diff_relative": diff / scale,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    config = load_model_config(args.model)
    fixed = (profile_from_json(json.loads(Path(args.profile).read_text()), config, where=args.profile)
             if args.profile else None)
    corun = 1.0
    if fixed is None and args.workers > 1 and args.device == "cpu":
        print(f"measuring co-run slowdown of {args.workers} processes ...", file=sys.stderr, flush=True)
        corun = measure_corun_slowdown(config, args.workers)

    def profile_now() -> CostProfile:
        if fixed is not None:
            return fixed
        print(f"profiling {config.name} ...", file=sys.stderr, flush=True)
        fresh = measure_profile(config, args.device)
        fresh.corun_slowdown = corun
        return fresh
    scene = SyntheticScene(config.observation_shapes)
    reference = [r.output.numpy() for r in
                 reference_rollout(build_model(config, device=args.device), scene.observation, [STREAM], args.chunks)]
    result = {"model": config.name, "workers": args.workers, "chunks": args.chunks, "device": args.device,
              "profile_source": fixed.source if fixed else "measured before each round", "corun_slowdown": corun,
              "host_cpus": os.cpu_count()}
    rounds: list[dict[str, dict]] = []
    for round_ in range(args.repeats):  # modes interleaved: a shared machine's speed drifts
        rounds.append({mode: run_mode(mode, config, args, profile_now(), scene, reference) for mode in MODES})
        r = rounds[-1]
        print(f"[round {round_ + 1}/{args.repeats}] " + ", ".join(
            f"{m} {r[m]['chunks_per_s']:.1f}/s (batch {r[m]['mean_batch']:.2f}, predicted "
            f"{r[m]['predicted_interval_ms']:.1f} ms vs {1e3 / r[m]['chunks_per_s']:.1f}, stages ran "
            f"{r[m]['traced_vs_profile']:.2f}x the profile)" for m in MODES),
            file=sys.stderr, flush=True)
    for mode in MODES:
        key = f"batching_{mode}" if mode != "adaptive" else "adaptive"
        entries = [r[mode] for r in rounds]
        result[key] = {k: (float(np.median([e[k] for e in entries])) if isinstance(v, float) else v)
                       for k, v in entries[0].items()}
        for e in entries:  # each run against the prediction made from the profile taken just before it
            e["prediction_error"] = e["predicted_interval_ms"] / (1e3 / e["chunks_per_s"]) - 1.0
        result[key]["prediction_error"] = float(np.median([e["prediction_error"] for e in entries]))
        result[key]["runs"] = [{k: e[k] for k in ("plan", "interval_ms_p50", "chunks_per_s", "predicted_interval_ms",
                                                  "prediction_error", "traced_vs_profile", "mean_batch",
                                                  "predicted_mean_batch")} for e in entries]
    ratio = lambda a, b: float(np.median([r[a]["chunks_per_s"] / r[b]["chunks_per_s"] for r in rounds]))  # noqa
    result["speedup_adaptive_vs_off"] = ratio("adaptive", "off")
    result["speedup_on_vs_off"] = ratio("on", "off")
    result["predicted_interval_ms"] = result["adaptive"]["predicted_interval_ms"]
    result["max_abs_diff_vs_reference"] = max(r["adaptive"]["max_abs_diff_vs_reference"] for r in rounds)
    if args.json:
        write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("speedup_adaptive_vs_off", "speedup_on_vs_off",
                                             "predicted_interval_ms", "max_abs_diff_vs_reference")}, indent=1))
    return 0
