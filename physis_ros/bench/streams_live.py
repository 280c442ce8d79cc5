"""Joint scheduling, live, for the streams of runtime/streams.py: robots join one served model through the
Server API, as any client does, one every ``--stagger-s`` until the server refuses one; then each admitted
stream's measured output interval against its SLO, and the work its placement predicted on each worker
against what the workers measured.

The server decides on the model's CPU profile measured when the first robot asks (``admission.profiles``
empty) or read from ``--profiles``, on ``--workers`` CPU workers, and paces each stream at its admitted
interval. Every robot is a simulator (the stream's ``source``: the bundled scene's observation of its next
chunk). Run as ``physis-bench streams --json out.json``.

JSON: ``admitted``, ``rejected`` (the refused robot's reason label and detail), ``predicted_utilisation``
per worker, ``streams`` (per stream: workers, ranks, predicted interval alone and work per worker, measured
compute per chunk per worker, interval and latency p50/p99, deadline misses, ``meets_slo_p99``),
``all_meet_slo`` and ``interval_ms_p99_max``. Exit status 0 when every admitted stream met its SLO at p99.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from physis_ros.console import write_json
from physis_ros.observations import SyntheticScene
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.server import Server
from physis_ros.telemetry import summarize
from physis_ros.timeline import release_pace_ms


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slo-ms", type=float, default=100.0, help="output-interval SLO of every stream")
    p.add_argument("--headroom", type=float, default=None,
                   help="admission.headroom: the workers' time kept free (default: the serve config's)")
    p.add_argument("--profiles", default="", help="admission.profiles (default: measured when the first robot asks)")
    p.add_argument("--chunks", type=int, default=120, help="chunks per stream")
    p.add_argument("--stagger-s", type=float, default=1.0, help="seconds between two robots joining")
    p.add_argument("--max-streams", type=int, default=16, help="stop asking after this many are admitted")
    p.add_argument("--json", help="write results here")


def run_live(args: argparse.Namespace) -> dict:
    """Robots join until one is refused; every admitted one is served ``args.chunks`` chunks."""
    config = {"model": args.model, "engine": {"workers": args.workers, "batching": "off", "policy": "edf"},
              "admission": {"profiles": args.profiles,
                            **({} if args.headroom is None else {"headroom": args.headroom})}}
    skip = min(10, args.chunks // 4)
    t0 = time.perf_counter()
    chunks: dict[str, list] = {}
    done = threading.Semaphore(0)
    rejection = None
    with Server.from_config(config) as server:
        model = server.catalog.config_of(args.model)
        scene = SyntheticScene(model.observation_shapes)
        joints = [f"joint{i + 1}" for i in range(model.observation_shapes["state"][0])]
        for i in range(args.max_streams):
            name = f"robot{i}"
            got = chunks[name] = []

            def source(c: int, name: str = name):
                return scene.observation(name, c), server.clock()

            def on_chunk(chunk, got: list = got) -> None:
                if len(got) < args.chunks:
                    got.append(chunk.telemetry)
                    if len(got) == args.chunks:
                        done.release()

            try:
                server.join(name, model=args.model, slo_ms=args.slo_ms, joint_names=joints, source=source,
                            on_chunk=on_chunk)
            except Rejected as exc:
                rejection = {"stream": name, "reason": exc.label, "detail": exc.detail}
                del chunks[name]
                break
            print(f"{name} admitted on {', '.join(server.session(name).workers)}", flush=True)
            time.sleep(args.stagger_s)
        deadline = time.monotonic() + 60.0 + args.chunks * args.slo_ms / 1e3 * 10
        for _ in chunks:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        placed = {name: server.admission.admitted[name] for name in chunks}
        utilisation = server.admission.utilisation()
        source_of_profile = next(iter(placed.values())).model.profile.source if placed else None
        pace_ms = release_pace_ms(args.slo_ms, server.config.admission.pace_margin, 50.0)
        headroom = server.config.admission.headroom
    streams = []
    for name, records in chunks.items():
        p = placed[name].placed
        stats = summarize(records, skip) if len(records) > skip + 1 else {}
        measured = {}   # per worker: compute per chunk, measured inside the workers
        for w in sorted(set(p.devices)):
            per_chunk = [r.worker_compute_ms.get(f"w{w}", 0.0) for r in records[skip:]]
            measured[f"w{w}"] = round(float(np.median(per_chunk)), 3) if per_chunk else None
        p99 = stats.get("interval_ms_p99", float("nan"))
        streams.append({
            "stream": name, "slo_ms": args.slo_ms, "chunks": len(records), "devices": list(p.devices),
            "ranks": [r.describe() for r in p.ranks], "predicted_interval_alone_ms": round(p.interval_alone_ms, 3),
            "predicted_work_ms": {f"w{d}": round(ms, 3) for d, ms in sorted(p.work_by_device().items())},
            "measured_compute_ms_p50": measured,
            "interval_ms_p50": round(stats.get("interval_ms_p50", float("nan")), 3), "interval_ms_p99": round(p99, 3),
            "latency_ms_p50": round(stats.get("latency_ms_p50", float("nan")), 3),
            "latency_ms_p99": round(stats.get("latency_ms_p99", float("nan")), 3),
            "deadline_misses": stats.get("deadline_misses", 0),
            "meets_slo_p99": bool(len(records) == args.chunks and p99 <= args.slo_ms),
        })
    return {
        "benchmark": "streams", "model": args.model, "workers": args.workers, "slo_ms": args.slo_ms,
        "pace_ms": pace_ms, "headroom": headroom, "profile_source": source_of_profile,
        "chunks_per_stream": args.chunks, "admitted": len(streams), "rejected": rejection,
        "predicted_utilisation": utilisation, "streams": streams,
        "all_meet_slo": bool(streams) and all(s["meets_slo_p99"] for s in streams),
        "interval_ms_p99_max": max((s["interval_ms_p99"] for s in streams), default=float("nan")),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    result = run_live(args)
    for s in result["streams"]:
        print(f"{s['stream']:<8} devices {s['devices']} SLO {s['slo_ms']:g} ms (paced {result['pace_ms']:g}): "
              f"interval p50 {s['interval_ms_p50']:.1f} p99 {s['interval_ms_p99']:.1f} ms "
              f"{'ok' if s['meets_slo_p99'] else 'MISSED'}; latency p50 {s['latency_ms_p50']:.1f} "
              f"p99 {s['latency_ms_p99']:.1f} ms; compute/chunk measured {s['measured_compute_ms_p50']} "
              f"predicted {s['predicted_work_ms']}")
    rej = result["rejected"]
    print(f"admitted {result['admitted']}; next refused: {rej['reason'] + ' - ' + rej['detail'] if rej else 'none'}")
    if args.json:
        write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("admitted", "all_meet_slo", "interval_ms_p99_max")}))
    return 0 if result["all_meet_slo"] else 1
