"""Live check of admission (issue 5 item 7): tiny-wam streams admitted one by one onto local CPU workers.

The joint scheduler decides on the measured CPU profile of the model, on a
cluster of ``workers`` CPU devices, admitting streams until the first
rejection; every admitted stream then runs on real worker processes with the
plan its placement implies (worker index = device index), added one at a time
while the earlier ones keep running (they never move), and its measured output
interval is compared with its SLO.

Pacing: the admission model assumes each stream releases one chunk per
interval, so each stream is paced by the engine (``release_interval_ms``) at
``pace_ms = SLO - pace_margin_ms`` and admitted at that interval; release
jitter then stays inside the SLO.

The engine places each stream by its own plan (``add_stream(..., plan=...)``);
workers load the blocks a stream needs when it is placed on them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np

from physis_ros.runtime.settings import EngineConfig
from physis_ros.model.spec import load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.runtime.plans import Plan
from physis_ros.scheduling.admission import StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.profiles import measure_profile
from physis_ros.scheduling.settings import load_device, load_scheduling
from physis_ros.telemetry import summarize


def plan_of(placed: PlacedStream, steps: int, blocks: int) -> Plan:
    """The runtime plan of a placed stream: each stage on the device of its rank."""
    assignment = {s: d for r, d in zip(placed.ranks, placed.devices) for s in r.stages}
    return Plan("joint", steps, blocks, assignment)


def admit_until_rejected(model: str, workers: int, pace_ms: float, headroom: float, max_streams: int = 32):
    """Joint admission on ``workers`` CPU devices until the first rejection: (placed streams, rejection)."""
    cfg = load_model_config(model)
    device = load_device("cpu")
    # Measured now, not a shipped file: a shared machine's speed drifts, and admission must use today's.
    profile = measure_profile(model)
    config = replace(load_scheduling(), headroom=headroom, device="cpu")
    cluster = Cluster([device] * workers, headroom, {model: profile})
    sched = JointScheduler(cluster, config)
    placed, rejection = [], None
    for i in range(max_streams):
        d = sched.admit(StreamRequest(f"robot{i}", model, pace_ms))
        if not d.admitted:
            rejection = d
            break
        placed.append(d.placed)
    return cfg, profile, cluster, placed, rejection


async def _run(cfg, placed: list[PlacedStream], slo_ms: float, pace_ms: float, workers: int, chunks: int,
               stagger_s: float, emit_delay_ms: float | None) -> dict[str, list]:
    from physis_ros.runtime.engine import Engine, Observation, ServedModel

    scene = SyntheticScene(cfg.observation_shapes)
    engine_cfg = EngineConfig(workers=workers, devices=["cpu"], batching="off", policy="edf",
                              max_streams=max(8, len(placed) * cfg.steps))
    served = ServedModel(cfg)
    async with Engine(engine_cfg) as engine:
        for p in placed:
            def observe(c: int, name: str = p.stream) -> Observation:
                return Observation(scene.observation(name, c), engine.clock())

            await engine.add_stream(p.stream, observe, chunks=chunks, slo_interval_ms=slo_ms, keep_outputs=True,
                                    model=served, plan=plan_of(p, cfg.steps, cfg.blocks), release_interval_ms=pace_ms,
                                    emit_delay_ms=emit_delay_ms)
            await asyncio.sleep(stagger_s)
        return {p.stream: await engine.wait_stream(p.stream) for p in placed}


def run_live(model: str = "tiny-wam", workers: int = 2, slo_ms: float = 100.0, pace_margin_ms: float = 10.0,
             headroom: float = 0.3, chunks: int = 120, stagger_s: float = 1.0, skip: int = 10,
             emit_delay_ms: float | None = None) -> dict:
    """Admit streams until rejected, run the admitted ones live, report SLO vs measured intervals.

    ``emit_delay_ms``: the engine's jitter buffer (chunk c leaves no earlier than its release plus
    this), trading response latency for a steady output cadence; None hands chunks out when done."""
    import uvloop

    pace_ms = slo_ms - pace_margin_ms
    cfg, profile, cluster, placed, rejection = admit_until_rejected(model, workers, pace_ms, headroom)
    t0 = time.perf_counter()
    outputs = uvloop.run(_run(cfg, placed, slo_ms, pace_ms, workers, chunks, stagger_s, emit_delay_ms)) \
        if placed else {}
    streams = []
    for p in placed:
        records = [o.record for o in outputs[p.stream]]
        stats = summarize(records, skip)
        measured_work = {}  # per worker: compute per chunk, measured inside the workers
        for w in sorted({d for d in p.devices}):
            per_chunk = [r.worker_compute_ms.get(f"w{w}", 0.0) for r in records[skip:]]
            measured_work[f"w{w}"] = round(float(np.median(per_chunk)), 3) if per_chunk else None
        predicted_work = {f"w{d}": round(ms, 3) for d, ms in sorted(p.work_by_device().items())}
        streams.append({
            "stream": p.stream, "slo_ms": slo_ms, "pace_ms": pace_ms,
            "devices": p.devices, "ranks": [r.describe() for r in p.ranks],
            "predicted_interval_alone_ms": round(p.interval_alone_ms, 3),
            "predicted_work_ms": predicted_work, "measured_compute_ms_p50": measured_work,
            "interval_ms_p50": round(stats["interval_ms_p50"], 3),
            "interval_ms_p99": round(stats["interval_ms_p99"], 3),
            "latency_ms_p50": round(stats["latency_ms_p50"], 3),
            "latency_ms_p99": round(stats["latency_ms_p99"], 3),
            "deadline_misses": stats["deadline_misses"],
            "meets_slo_p99": bool(stats["interval_ms_p99"] <= slo_ms),
        })
    return {
        "model": model, "workers": workers, "slo_ms": slo_ms, "pace_ms": pace_ms, "headroom": headroom,
        "emit_delay_ms": emit_delay_ms,
        "profile_source": profile.source, "chunks_per_stream": chunks,
        "admitted": len(placed),
        "rejected": None if rejection is None else {"stream": rejection.request.stream, "reason": rejection.reason,
                                                    "detail": rejection.detail},
        "predicted_utilisation": [round(float(u), 4) for u in cluster.util],
        "streams": streams,
        "all_meet_slo": all(s["meets_slo_p99"] for s in streams),
        "interval_ms_p99_max": max((s["interval_ms_p99"] for s in streams), default=float("nan")),
        "wall_s": round(time.perf_counter() - t0, 2),
        "mean_interval_ms": round(float(np.mean([s["interval_ms_p50"] for s in streams])), 3) if streams else None,
    }
