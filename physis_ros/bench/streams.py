"""Joint scheduling, live, for the streams of runtime/streams.py: tiny-wam streams admitted one by one onto local
CPU workers until one is rejected; each admitted stream's measured output interval against its SLO.

Admission uses the measured CPU profile (``config/profiles/<model>.cpu.json``,
or measured now); see ``physis_ros.scheduling.live``. Run as
``physis-bench streams --json out.json``.
"""

from __future__ import annotations

import argparse
import json

import torch

from physis_ros.console import write_json
from physis_ros.scheduling.live import run_live


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slo-ms", type=float, default=100.0, help="output-interval SLO of every stream")
    p.add_argument("--pace-margin-ms", type=float, default=10.0,
                   help="streams are paced (and admitted) at SLO minus this, to absorb release jitter")
    p.add_argument("--headroom", type=float, default=0.3, help="device time kept free (shared 2-core machine)")
    p.add_argument("--chunks", type=int, default=120, help="chunks per stream")
    p.add_argument("--stagger-s", type=float, default=1.0, help="seconds between adding two streams")
    p.add_argument("--emit-delay-ms", type=float, default=None,
                   help="jitter buffer: hand chunk c out no earlier than its release + this (default: the SLO; "
                        "0: as soon as it is done)")
    p.add_argument("--json", help="write results here")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    delay = args.slo_ms if args.emit_delay_ms is None else (args.emit_delay_ms or None)
    result = run_live(args.model, args.workers, args.slo_ms, args.pace_margin_ms, args.headroom, args.chunks,
                      args.stagger_s, emit_delay_ms=delay)
    for s in result["streams"]:
        print(f"{s['stream']:<8} devices {s['devices']} SLO {s['slo_ms']:g} ms (paced {s['pace_ms']:g}): "
              f"interval p50 {s['interval_ms_p50']:.1f} p99 {s['interval_ms_p99']:.1f} ms "
              f"{'ok' if s['meets_slo_p99'] else 'MISSED'}; latency p50 {s['latency_ms_p50']:.1f} "
              f"p99 {s['latency_ms_p99']:.1f} ms; compute/chunk measured {s['measured_compute_ms_p50']} "
              f"predicted {s['predicted_work_ms']}")
    rej = result["rejected"]
    print(f"admitted {result['admitted']}; next rejected: {rej['reason'] + ' - ' + rej['detail'] if rej else 'none'}")
    if args.json:
        write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("admitted", "all_meet_slo", "interval_ms_p99_max")}))
    return 0 if result["all_meet_slo"] else 1

