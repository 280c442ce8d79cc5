"""Soak: two streams served continuously; memory over time, lost chunks, interval drift.

Samples the resident memory of the engine process and of every worker, the
chunks delivered and the window's p99 interval every ``--sample-s`` seconds.
A lost chunk is a gap in a stream's delivered indices.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
import torch
import uvloop

from physis_ros.console import write_json
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.runtime.engine import ChunkOutput, Engine, Observation, ServedModel
from physis_ros.heap import rss_mb
from physis_ros.runtime.planner import resolve_plan
from physis_ros.telemetry import percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--plan", default="stage")
    p.add_argument("--batching", default="adaptive")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG of RSS and p99 interval over time")


def _rss(pid: int) -> float:
    return rss_mb(pid) or float("nan")


class Tally:
    """Per-stream delivery bookkeeping: gaps are lost chunks."""

    def __init__(self):
        self.next = 0
        self.lost = 0
        self.intervals: list[float] = []

    def __call__(self, out: ChunkOutput) -> None:
        if out.chunk != self.next:
            self.lost += out.chunk - self.next
        self.next = out.chunk + 1
        if not np.isnan(out.record.interval_ms):
            self.intervals.append(out.record.interval_ms)


async def soak(args: argparse.Namespace) -> dict:
    cfg = load_model_config(args.model)
    scene = SyntheticScene(cfg.observation_shapes)
    engine_cfg = EngineConfig(workers=args.workers, plan=args.plan, batching=args.batching)
    resolved = resolve_plan(cfg, engine_cfg)
    served = ServedModel(cfg, profile=resolved.profile)
    engine = Engine(engine_cfg)
    await engine.start()
    tallies = {f"robot{i}": Tally() for i in range(args.streams)}
    samples = []
    try:
        for name, tally in tallies.items():
            await engine.add_stream(name, lambda c, n=name: Observation(scene.observation(n, c % 1000), engine.clock()),
                                    tally, model=served, plan=resolved.plan)
        start = time.monotonic()
        end = start + args.minutes * 60
        while time.monotonic() < end:
            await asyncio.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            window = [iv for t in tallies.values() for iv in t.intervals]
            for t in tallies.values():
                t.intervals.clear()
            sample = {
                "t_s": round(time.monotonic() - start, 2),
                "rss_mb": {"engine": _rss(os.getpid()),
                           **{w.name: _rss(w.proc.pid) for w in engine.pool.workers.values() if w.proc}},
                "chunks": {n: t.next for n, t in tallies.items()},
                "interval_ms_p99": percentile(window, 99),
                "interval_ms_p50": percentile(window, 50),
            }
            samples.append(sample)
            print(f"t={sample['t_s']:7.1f}s chunks={sum(sample['chunks'].values()):7d} "
                  f"p99={sample['interval_ms_p99']:6.1f}ms rss=" +
                  " ".join(f"{k}:{v:.0f}MB" for k, v in sample["rss_mb"].items()), file=sys.stderr, flush=True)
        failures = [e.reason for e in engine.events]
    finally:
        await engine.stop()
    # Growth from the first sample after warm-up (a fifth of the run) to the last.
    base = samples[max(0, len(samples) // 5)]
    growth = {k: 100 * (samples[-1]["rss_mb"][k] - v) / v for k, v in base["rss_mb"].items()}
    first_p99 = samples[max(0, len(samples) // 5)]["interval_ms_p99"]
    last_p99 = samples[-1]["interval_ms_p99"]
    return {
        "model": cfg.name, "minutes": args.minutes, "streams": args.streams, "workers": args.workers,
        "plan": args.plan, "batching": args.batching, "samples": samples,
        "chunks_total": {n: t.next for n, t in tallies.items()},
        "lost_chunks": sum(t.lost for t in tallies.values()),
        "rss_growth_pct": growth, "rss_growth_pct_max": max(growth.values()),
        "p99_interval_ms_first": first_p99, "p99_interval_ms_last": last_p99,
        "p99_drift_pct": 100 * (last_p99 - first_p99) / first_p99,
        "engine_events": failures,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    result = uvloop.run(soak(args))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    print(f"lost chunks {result['lost_chunks']}, RSS growth max {result['rss_growth_pct_max']:.1f} %, "
          f"p99 interval {result['p99_interval_ms_first']:.1f} -> {result['p99_interval_ms_last']:.1f} ms")
    return 0 if result["lost_chunks"] == 0 else 1


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in result["samples"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for proc in result["samples"][0]["rss_mb"]:
        ax1.plot(t, [s["rss_mb"][proc] for s in result["samples"]], label=proc)
    ax1.set(xlabel="minutes", ylabel="RSS [MB]", title="resident memory")
    ax2.plot(t, [s["interval_ms_p99"] for s in result["samples"]], label="p99")
    ax2.plot(t, [s["interval_ms_p50"] for s in result["samples"]], label="p50")
    ax2.set(xlabel="minutes", ylabel="output interval [ms]", title="interval per sample window")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
