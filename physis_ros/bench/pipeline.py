"""Stage pipeline vs the baselines (sequential, step, block) on local worker processes or Ray actors.

For each plan one real engine with real worker processes runs ``--chunks``
chunks of one stream. Steady state excludes the fill phase. In the same run,
two independent sequential rollouts side by side measure this machine's
two-process parallel limit, the yardstick for the pipeline's speed-up.

``--launcher local,ray`` runs every plan with both launchers, interleaved within
each round (entries ``PLAN@local``, ``PLAN@ray``, and ``ray_vs_local``): Ray only
places and watches the workers, so chunks/s and hop time should agree within
noise. The JSON also has Ray's start-up times (joining or starting the cluster
once; placement group and actors per engine) and each worker's resident memory.
Ray always runs CurveZMQ on routable addresses; ``--local-curve`` gives the local
workers the same (keys, this host's address), so that only Ray differs.

``--transport zmq,torch,shm`` does the same for the hidden-state transport between
workers (frames beside the ZeroMQ header, torch.distributed links: gloo on CPU,
NCCL on GPUs, or shared-memory rings; entries ``PLAN@zmq``, ``PLAN@torch``, ...
and ``torch_vs_zmq``, ``shm_vs_zmq``),
and ``--spin-us 0,200`` for how long an idle worker polls before it sleeps
(entries ``PLAN@spin200``, and ``spin_vs_block``): whether spinning recovers the
wake-up cost of an idle core. ``--socket ipc`` puts the sockets on ipc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import numpy as np
import torch
import uvloop

from physis_ros.console import device_arg, write_json
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout
from physis_ros.runtime.engine import Engine, Observation, ServedModel
from physis_ros.heap import rss_mb
from physis_ros.runtime.planner import predict
from physis_ros.runtime.plans import PLAN_NAMES, make_plan
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.settings import LAUNCHERS, RayConfig
from physis_ros.telemetry import percentile, summarize

STREAM = "bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--plans", default="sequential,step,block,stage")
    p.add_argument("--history", choices=("same_step", "clean", "latest"),
                   help="serve the model under this history rule instead of its own (docs/history.md)")
    p.add_argument("--chunks", type=int, default=200)
    p.add_argument("--skip", type=int, default=0, help="fill-phase chunks to exclude (0: 10 + 2 x segments)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over all plans, interleaved (a shared machine's speed drifts); medians reported")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    p.add_argument("--socket", choices=("tcp", "ipc"), default="tcp", help="ZeroMQ sockets (ray: tcp only)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="a worker silent this long is killed and its streams reset (s; the engine's default 1; a "
                        "run on a host loaded beyond its cores may need more)")
    p.add_argument("--transport", type=transports, default=["zmq"],
                   help="hidden states between workers: zmq, torch (torch.distributed: gloo on CPU, NCCL on GPU), "
                        "shm (shared-memory rings, CPU workers), or several (zmq,torch,shm): every plan with each, "
                        "interleaved per round")
    p.add_argument("--spin-us", type=spins, default=[0],
                   help="an idle worker polls this long before it sleeps (comma list: each, interleaved)")
    p.add_argument("--launcher", type=launchers, default=["local"],
                   help="local, ray, or both (local,ray): every plan with each, interleaved per round")
    p.add_argument("--ray-address", default="", help="Ray cluster to join (auto, HOST:PORT, ray://HOST:PORT); "
                                                     "empty: start a local one once for the whole run")
    p.add_argument("--ray-strategy", default="PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    p.add_argument("--local-curve", action="store_true",
                   help="local workers with CurveZMQ on this host's routable address, as Ray's: only Ray differs")
    p.add_argument("--verify", action="store_true", help="compare every chunk with the sequential reference")
    p.add_argument("--no-parallel-limit", action="store_true", help="skip the two-rollouts yardstick")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG: interval over time per plan, latency CDFs")


def launchers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LAUNCHERS or n == "external"]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give local, ray or local,ray, got {text!r}")
    return names


def transports(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ("zmq", "torch", "shm") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give one or more of zmq, torch, shm (comma-separated), got {text!r}")
    return names


def spins(text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 100_000 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"give microseconds in [0, 100000], comma-separated, got {text!r}")
    return values


@dataclass(frozen=True)
class Variant:
    """How one entry's workers run, beside its plan."""

    launcher: str
    hops: str
    spin_us: int

    def suffix(self, args: argparse.Namespace) -> str:
        """``@...`` for each dimension the run varies (none: plain plan names)."""
        parts = [v for v, many in ((self.launcher, len(args.launcher) > 1), (self.hops, len(args.transport) > 1),
                                   (f"spin{self.spin_us}", len(args.spin_us) > 1)) if many]
        return "".join(f"@{p}" for p in parts)


def routable_ip() -> str:
    """This host's address on its default route (what Ray picks too); loopback if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))  # UDP: nothing is sent, the kernel only picks the interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


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
    if args.history:
        config = replace(config, history=args.history)
    scene = SyntheticScene(config.observation_shapes)
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = [p for p in plans if p not in PLAN_NAMES]
    if unknown:
        print(f"error: unknown plan(s) {unknown}; choose from {', '.join(PLAN_NAMES)}", file=sys.stderr)
        return 2
    for name in plans:
        try:
            make_plan(name, config.steps, config.blocks, args.workers, clean=config.clean_pass)
        except ValueError as exc:
            print(f"error: --plans {name}: {exc}", file=sys.stderr)
            return 2
    # The planner's prediction of each plan's interval, from a profile measured here first (physis-profile's).
    args.profile = measure_profile(config, args.device)
    reference = None
    if args.verify:
        model = build_model(config, device=args.device)
        reference = [r.output for r in reference_rollout(model, scene.observation, [STREAM], args.chunks)]
    if "ray" in args.launcher and args.socket != "tcp":
        print("error: --launcher ray needs --socket tcp (workers on other hosts)", file=sys.stderr)
        return 2
    result = {"model": config.name, "history": config.history, "workers": args.workers, "chunks": args.chunks,
              "device": args.device,
              "socket": args.socket, "transports": args.transport, "spin_us": args.spin_us,
              "launchers": args.launcher, "plans": {}}
    args.curve = None
    if args.local_curve:  # keys in a private temporary directory, removed at the end
        from physis_ros.runtime.security import generate_keys

        args.curve = (str(generate_keys(tempfile.mkdtemp(prefix="physis-bench-keys-"))), routable_ip())
        result["local_curve"] = {"bind_host": args.curve[1]}
    # Entries keep their plan names, with @LAUNCHER, @TRANSPORT, @spinN for each dimension that varies.
    variants = [Variant(*v) for v in product(args.launcher, args.transport, args.spin_us)]
    keys = [(name, v, name + v.suffix(args)) for name in plans for v in variants]
    series = {}
    runs: dict[str, list[dict]] = {key: [] for _, _, key in keys}
    limits = []
    ray_owned = False
    if "ray" in args.launcher:  # join or start the cluster once; every engine then only adds its bundles
        from physis_ros.runtime.launchers import connect

        t0 = time.perf_counter()
        # A local cluster gets a small object store: no tensor ever goes through it.
        ray_owned = connect(RayConfig(address=args.ray_address, object_store_mb=100), args.workers)
        import ray
        result["ray"] = {"version": ray.__version__, "address": args.ray_address or "local (started here)",
                         "strategy": args.ray_strategy, "cluster_start_s": time.perf_counter() - t0}
    try:
        rounds(args, config, scene, reference, keys, runs, series, limits)
    finally:
        if ray_owned:
            import ray
            ray.shutdown()
        if args.curve is not None:
            shutil.rmtree(args.curve[0], ignore_errors=True)
    # Ratios are taken within a round (same minutes, same machine speed), then the median over rounds.
    for name, variant, key in keys:
        seq_key = "sequential" + variant.suffix(args)
        if seq_key not in runs:
            continue
        for r in range(args.repeats):
            e = runs[key][r]
            e["speedup_vs_sequential"] = e["chunks_per_s"] / runs[seq_key][r]["chunks_per_s"]
            if limits:
                e["fraction_of_parallel_limit"] = e["speedup_vs_sequential"] / limits[r]["speedup"]
    for _, _, key in keys:
        result["plans"][key] = median_entry(runs[key])
    compare(args, plans, runs, result)
    if set(args.launcher) == {"local", "ray"} and len(variants) == 2:
        result["ray_vs_local"] = {name: {
            "chunks_per_s_ratio": float(np.median([ray_e["chunks_per_s"] / loc["chunks_per_s"] for loc, ray_e in
                                                   zip(runs[f"{name}@local"], runs[f"{name}@ray"])])),
            "hop_ms_p50_delta": float(np.median([ray_e["hop_ms_p50"] - loc["hop_ms_p50"] for loc, ray_e in
                                                 zip(runs[f"{name}@local"], runs[f"{name}@ray"])])),
            "engine_start_s_local": result["plans"][f"{name}@local"]["engine_start_s"],
            "engine_start_s_ray": result["plans"][f"{name}@ray"]["engine_start_s"]} for name in plans}
    result["worker_rss_mb_p50"] = {}  # per launcher: a worker process, or a Ray actor (its process)
    for launcher in args.launcher:
        entries = [e for (_, v, key) in keys if v.launcher == launcher for e in runs[key]]
        rss = [mb for e in entries for mb in e["worker_rss_mb"].values() if mb is not None]
        result["worker_rss_mb_p50"][launcher] = float(np.median(rss)) if rss else None
        if launcher == "ray":
            result["ray"]["engine_start_s_p50"] = float(np.median([e["engine_start_s"] for e in entries]))
            result["ray"]["actor_rss_mb_p50"] = result["worker_rss_mb_p50"]["ray"]
    if limits:
        limit = {k: float(np.median([x[k] for x in limits])) for k in limits[0]}
        result["parallel_limit"] = {**limit, "runs": limits}
        result["parallel_limit_speedup"] = limit["speedup"]
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(series, result, args.plot)
    print(json.dumps({n: {k: e[k] for k in ("interval_ms_p50", "predicted_interval_ms", "chunks_per_s", "efficiency")}
                      for n, e in result["plans"].items()}, indent=1))
    differ = {n: e["max_abs_diff_vs_reference"] for n, e in result["plans"].items()
              if e["max_abs_diff_vs_reference"] not in (None, 0.0)}
    if differ:   # no batching here: every plan must reproduce the reference bit for bit
        print(f"physis-bench: pipeline: not bit-identical to the reference: "
              f"{', '.join(f'{n} (max |diff| {d:.3g})' for n, d in differ.items())}", file=sys.stderr)
        return 1
    return 0


def rounds(args, config, scene, reference, keys, runs, series, limits) -> None:
    for round_ in range(args.repeats):
        if not args.no_parallel_limit:
            limits.append(parallel_limit(config.name, min(args.chunks, 100), args.device))
        for name, variant, key in keys:
            entry, records = run_plan(name, config, args, scene, reference, variant)
            runs[key].append(entry)
            series.setdefault(key, records)
            print(f"[{key} {round_ + 1}/{args.repeats}] interval p50 {entry['interval_ms_p50']:.2f} ms, "
                  f"p99 {entry['interval_ms_p99']:.2f} ms, {entry['chunks_per_s']:.1f} chunks/s, "
                  f"efficiency {entry['efficiency']:.2f}, latency p50 {entry['latency_ms_p50']:.1f} ms, "
                  f"max diff {entry['max_abs_diff_vs_reference']}, engine start {entry['engine_start_s']:.2f} s",
                  file=sys.stderr, flush=True)


async def serve(config, engine_cfg: EngineConfig, plan, chunks: int, scene: SyntheticScene) -> tuple[list, dict]:
    """One engine, one stream of ``chunks`` chunks (what offline.run_chunks does), timing the engine's start
    (workers up and loaded: processes, or placement group + actors) and each worker's memory at the end."""
    engine = Engine(engine_cfg)
    t0 = time.perf_counter()
    await engine.start()
    info: dict = {"engine_start_s": time.perf_counter() - t0}
    if engine.launcher is not None:  # of which: reserving the bundles (the rest: actors up, hello, load)
        info["placement_group_s"] = engine.launcher.timings.get("placement_group_s")
    try:
        await engine.add_stream(STREAM, lambda c: Observation(scene.observation(STREAM, c), engine.clock()),
                                model=ServedModel(config, engine_cfg.checkpoint), plan=plan, chunks=chunks,
                                keep_outputs=True)
        outputs = await engine.wait_stream(STREAM)
        if engine.launcher is not None:
            info["worker_rss_mb"] = await asyncio.to_thread(engine.launcher.memory_mb)
        else:
            info["worker_rss_mb"] = {w.name: rss_mb(w.pid) for w in engine.pool.workers.values()}
    finally:
        await engine.stop()
    return outputs, info


def compare(args: argparse.Namespace, plans: list[str], runs: dict[str, list[dict]], result: dict) -> None:
    """torch_vs_zmq and spin_vs_block: per plan, the median over rounds of the within-round ratio."""
    def ratios(key_a: str, key_b: str) -> dict:
        a, b = runs[key_a], runs[key_b]
        return {"chunks_per_s_ratio": float(np.median([y["chunks_per_s"] / x["chunks_per_s"] for x, y in zip(a, b)])),
                "hop_ms_p50": [float(np.median([e["hop_ms_p50"] for e in a])), float(np.median([e["hop_ms_p50"]
                                                                                             for e in b]))]}
    if len(args.launcher) == 1 and len(args.spin_us) == 1 and "zmq" in args.transport and len(args.transport) > 1:
        for other in set(args.transport) - {"zmq"}:
            result[f"{other}_vs_zmq"] = {n: ratios(f"{n}@zmq", f"{n}@{other}") for n in plans}
    if len(args.launcher) == 1 and len(args.transport) == 1 and len(args.spin_us) == 2 and 0 in args.spin_us:
        spin = max(args.spin_us)
        result["spin_vs_block"] = {n: {"spin_us": spin, **ratios(f"{n}@spin0", f"{n}@spin{spin}")} for n in plans}


def run_plan(name: str, config, args: argparse.Namespace, scene: SyntheticScene, reference,
             variant: Variant = Variant("local", "zmq", 0)) -> tuple[dict, list]:
    plan = make_plan(name, config.steps, config.blocks, args.workers, clean=config.clean_pass)
    predicted = predict(plan, args.profile, host_cpus=os.cpu_count() if variant.launcher == "local" else None)
    launcher = variant.launcher
    curve = {"curve_keys": args.curve[0], "bind_host": args.curve[1]} if launcher == "local" and args.curve else {}
    engine_cfg = EngineConfig(workers=args.workers, plan=name, devices=[args.device], transport=args.socket,
                              hops=variant.hops, spin_us=variant.spin_us, launcher=launcher,
                              ray=RayConfig(address=args.ray_address, strategy=args.ray_strategy),
                              heartbeat_timeout_s=args.heartbeat_timeout, **curve)
    outputs, info = uvloop.run(serve(config, engine_cfg, plan, args.chunks, scene))
    records = [o.record for o in outputs]
    skip = args.skip or min(10 + 2 * len(plan.segments()), args.chunks // 2)
    stats = summarize(records, skip)
    steady = records[skip:]
    ideal = percentile([max(r.worker_compute_ms.values()) for r in steady], 50)
    entry = {
        "plan": plan.describe(),
        "hops_per_chunk": plan.hops(),
        "interval_ms_p50": stats["interval_ms_p50"],
        "predicted_interval_ms": predicted.interval_ms,
        "in_flight": plan.in_flight(False, 1),
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
        "launcher": launcher,
        "hops": variant.hops,
        "spin_us": variant.spin_us,
        **info,
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
