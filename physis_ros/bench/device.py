"""The device check (of runtime/device.py's device): one run that says what a device does for this server
(``bench/device_check.sh``).

On ``--device`` (a GPU, or ``cpu`` as the CI smoke test of this same code):

1. profiles the model on the device (stage time per batch size, hop, memory);
2. runs one stream through 1 worker (sequential plan), then through ``--workers``
   workers time-sharing the device (stage plan, batching adaptive), once per
   hidden-state transport that can run there;
3. checks every chunk against the sequential reference computed on the same
   device (unbatched: bit-identical; batched: the stated tolerance). A run
   whose stream was reset (a worker lost: on an overloaded host gloo once
   said "Connection reset by peer") computes its later chunks afresh; they
   are compared with the reference restarted where the server restarted,
   and the run lists its ``resets`` and ``chunks_after_a_reset``;
4. writes one JSON: interval, per-stage time, worker-to-worker hop time per
   transport, and each worker's memory (KV, weights, device allocator).

Transports: ``zmq`` always (on CUDA a host bounce: pinned copy, frames, copy
back); ``torch`` where it can pair the workers: gloo on CPU, NCCL between
workers on *different* GPUs; ``shm`` on CPU. NCCL cannot make two ranks of one
GPU a pair, so with one GPU the time-sharing workers hop over zmq and the JSON
says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import torch
import uvloop

from physis_ros.console import device_arg, write_json
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout, reference_rollout
from physis_ros.runtime.engine import Engine, Observation, ServedModel
from physis_ros.runtime.plans import make_plan, pipeline_order
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.settings import EngineConfig
from physis_ros.telemetry import percentile, summarize

STREAM = "device-check"
TOLERANCE = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}   # batched vs reference, relative to max |x|


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam", help="preset (a backbone shape on a GPU, e.g. wan2.1-1.3b)")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    p.add_argument("--workers", type=int, default=2, help="workers time-sharing the device in the second run")
    p.add_argument("--chunks", type=int, default=24)
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument("--json", required=True, help="write results here")


def transports_for(device: str, workers: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per transport, the device of each worker; and the transports that cannot run here, with why."""
    runs, skipped = {"zmq": [device] * workers}, {}
    if not device.startswith("cuda"):
        runs["torch"] = [device] * workers
        runs["shm"] = [device] * workers
    else:
        if torch.cuda.device_count() >= workers:
            runs["torch"] = [f"cuda:{i}" for i in range(workers)]   # NCCL: one GPU per worker
        else:
            skipped["torch"] = (f"NCCL pairs ranks on different GPUs; {workers} workers, {torch.cuda.device_count()} "
                                f"GPU(s) here")
        skipped["shm"] = "host shared memory: CPU workers only"
    return runs, skipped


async def serve(config, engine_cfg: EngineConfig, plan, chunks: int, scene: SyntheticScene) -> tuple[list, dict]:
    """One stream of ``chunks`` chunks; each worker's memory as its last heartbeat reported it."""
    async with Engine(engine_cfg) as engine:
        await engine.add_stream(STREAM, lambda c: Observation(scene.observation(STREAM, c), engine.clock()),
                                model=ServedModel(config), plan=plan, chunks=chunks, keep_outputs=True)
        outputs = await engine.wait_stream(STREAM)
        await asyncio.sleep(0.3)   # one more heartbeat: stats after the last chunk
        memory = {w.name: {"device": w.device, "kv_bytes": w.stats.kv_bytes, "weight_bytes": w.stats.weight_bytes,
                           "device_bytes": w.stats.device_bytes} for w in engine.pool.workers.values()}
        resets = [{"time": e.time, "cause": e.cause, "reason": e.reason, "lost": e.lost}
                  for e in engine.events if e.stream == STREAM and e.kind == "failed"]
    return outputs, memory, resets


def epochs_of(outputs: list, resets: list[dict]) -> list[int]:
    """The epoch of each output: how many resets came before its chunk entered the pipeline (a reset drops
    the chunks in flight; the next chunk starts with fresh K/V)."""
    times = sorted(r["time"] for r in resets)
    return [sum(t <= o.record.enqueue for t in times) for o in outputs]


class EpochReference:
    """The sequential reference of one stream, restarted (fresh K/V) where the server's stream was reset, so
    that every chunk is compared with what the server should have computed in its epoch."""

    def __init__(self, model, scene: SyntheticScene, uninterrupted: list[np.ndarray]):
        self.model, self.scene, self.uninterrupted = model, scene, uninterrupted

    def expected(self, outputs: list, epochs: list[int]) -> list[np.ndarray]:
        want, ref, current = [], None, 0
        for o, epoch in zip(outputs, epochs):
            if epoch == 0:
                want.append(self.uninterrupted[o.chunk])
                continue
            if epoch != current:          # the first chunk of a new epoch: the reference restarts there
                ref, current = ReferenceRollout(self.model), epoch
                ref.restart(STREAM, o.chunk)
            while True:                   # (within an epoch no chunk is skipped; a skipped one would be run)
                c = ref.next_chunk(STREAM)
                r = ref.step(STREAM, self.scene.observation(STREAM, c))
                if c >= o.chunk:
                    break
            want.append(r.output.numpy())
        return want


def run_one(config, device: list[str], plan_name: str, workers: int, batching: str, hops: str, chunks: int,
            scene: SyntheticScene, reference: EpochReference) -> dict:
    plan = make_plan(plan_name, config.steps, config.blocks, workers)
    cfg = EngineConfig(workers=workers, plan=plan_name, devices=device, batching=batching, hops=hops)
    t0 = time.perf_counter()
    outputs, memory, resets = uvloop.run(serve(config, cfg, plan, chunks, scene))
    records = [o.record for o in outputs]
    skip = min(10 + 2 * len(plan.segments()), chunks // 2)
    stats = summarize(records, skip)
    # A reset (a worker lost mid-run, e.g. gloo's "Connection reset by peer" on an overloaded host) starts the
    # stream afresh: its later chunks are compared with the reference restarted where the server restarted.
    epochs = epochs_of(outputs, resets)
    want = reference.expected(outputs, epochs)
    diffs = [float(np.abs(o.output - w).max()) for o, w in zip(outputs, want)]
    diff = max(diffs)
    scale = max(float(np.abs(r).max()) for r in reference.uninterrupted)
    for r in resets:   # seconds after the first chunk entered the pipeline
        r["time"] = round(r["time"] - outputs[0].record.enqueue, 3)
    between = [h for r in records[skip:] for h in r.hops_ms[1:-1]]   # worker to worker (not engine hops)
    return {"plan": plan.describe(), "workers": workers, "devices": device, "batching": batching, "hops": hops,
            "chunks": len(outputs), "interval_ms_p50": stats["interval_ms_p50"],
            "interval_ms_p99": stats["interval_ms_p99"], "chunks_per_s": stats["chunks_per_s"],
            "latency_ms_p50": stats["latency_ms_p50"],
            "stage_ms_p50": percentile([ms for r in records[skip:] for ms in r.stage_ms], 50),
            "hop_ms_p50": percentile(between, 50) if between else None,
            "hop_ms_p99": percentile(between, 99) if between else None,
            "mean_batch": float(np.mean([np.mean(r.batch_sizes) for r in records[skip:]])),
            "max_abs_diff_vs_reference": diff, "max_abs_diff_relative": diff / scale if scale else diff,
            "worst_chunk": outputs[diffs.index(diff)].chunk,
            "resets": resets, "chunks_after_a_reset": sum(e > 0 for e in epochs),
            "memory": memory, "wall_s": time.perf_counter() - t0}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    config = load_model_config(args.model)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"physis-bench: error: --device {args.device}, but this torch has no CUDA", file=sys.stderr)
        return 2
    scene = SyntheticScene(config.observation_shapes)
    log = lambda text: print(f"[device check] {text}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"profiling {config.name} on {args.device} ...")
    profile = measure_profile(config, args.device, batch_sizes=(1, 2), repeats=args.profile_repeats)
    order = pipeline_order(config.steps, config.blocks)
    log("sequential reference on the device ...")
    model = build_model(config, device=args.device)
    reference = EpochReference(model, scene, [r.output.numpy() for r in reference_rollout(
        model, scene.observation, [STREAM], args.chunks)])
    result = {"model": config.name, "dtype": config.dtype, "device": args.device, "chunks": args.chunks,
              "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
              "profile": {"stage_ms_batch1_p50": float(np.median([profile.forward_ms(s, 1) for s in order])),
                          "stage_ms_batch2_p50": float(np.median([profile.forward_ms(s, 2) for s in order])),
                          "hop_ms": profile.hop_ms, "block_weight_bytes": profile.block_weight_bytes,
                          "kv_bytes_per_stage": profile.kv_bytes, "hidden_bytes": profile.hidden_bytes},
              "runs": []}
    log("1 worker, sequential ...")
    result["runs"].append(run_one(config, [args.device], "sequential", 1, "off", "zmq", args.chunks, scene,
                                  reference))
    runs, skipped = transports_for(args.device, args.workers)
    result["skipped"] = skipped
    for hops, devices in runs.items():
        log(f"{args.workers} workers, stage plan, batching adaptive, hops {hops} ...")
        result["runs"].append(run_one(config, devices, "stage", args.workers, "adaptive", hops, args.chunks, scene,
                                      reference))
    tolerance = TOLERANCE[config.dtype]
    failures = []
    for r in result["runs"]:
        exact = r["batching"] == "off"
        ok = r["max_abs_diff_vs_reference"] == 0.0 if exact else r["max_abs_diff_relative"] <= tolerance
        r["equivalent"] = ok
        if not ok:
            need = "bit-identical required" if exact else f"tolerance {tolerance:g} relative"
            failures.append(f"{r['workers']} worker(s), hops {r['hops']}: max |diff| {r['max_abs_diff_vs_reference']:.3g} "
                            f"at chunk {r['worst_chunk']} ({need}; {len(r['resets'])} reset(s) in the run)")
    result["equivalent"] = not failures
    result["hop_ms_p50_by_transport"] = {r["hops"]: r["hop_ms_p50"] for r in result["runs"] if r["workers"] > 1}
    write_json(args.json, result)
    for r in result["runs"]:
        log(f"{r['workers']} worker(s) {r['hops']}: interval p50 {r['interval_ms_p50']:.2f} ms, stage p50 "
            f"{r['stage_ms_p50']:.3f} ms, hop p50 {r['hop_ms_p50']}, max diff {r['max_abs_diff_vs_reference']:.3g}, "
            f"resets {len(r['resets'])}")
    if failures:
        print("physis-bench: device check: not equivalent to the reference: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(json.dumps({k: result[k] for k in ("device", "equivalent", "hop_ms_p50_by_transport")}))
    return 0
