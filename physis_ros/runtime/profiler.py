"""Measuring a model's cost profile on the current device: stage time vs batch size, hop time.

The result is a :class:`~physis_ros.runtime.costs.CostProfile`, the one cost model the
planner, the workers' adaptive batching and the joint scheduler start from.
Each stage is timed through the same ``run_stage`` the workers call, with the
KV slots filled to the window so attention reads a realistic cache, in the
pipeline's order so weights are as cold as in service. Beside the stages: one
hidden-state hop, the worker's own time per forward (a real in-process
worker), the engine's messages per chunk, and optionally the co-run slowdown
of CPU workers. JSON form::

    {"model": "tiny-wam", "device": "cpu", "source": "measured:<host>",
     "batch_sizes": [1, 2, 4], "stage_ms": {"4,0": {"1": 0.61, "2": 0.80, "4": 1.21}, ...},
     "hop_ms": 0.21, "hidden_bytes": 16896, "overhead_ms_per_call": 0.036, "corun_slowdown": 1.0,
     "engine_ms": 0.4}
"""

from __future__ import annotations

import socket
import statistics
import time

import numpy as np
import torch
import zmq

from physis_ros.model import KVBatch, build_model
from physis_ros.model.spec import ModelConfig
from physis_ros.model.stages import chunk_input, observation_payload, run_stage
from physis_ros.observations import SyntheticScene
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.plans import Stage, pipeline_order
from physis_ros.runtime.costs import CostProfile, memory_fields


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageBench:
    """A model with full KV caches and a representative input per stage kind, to time stages with."""

    def __init__(self, config: ModelConfig, device: str = "cpu", max_batch: int = 1):
        self.config = config
        self.model = model = build_model(config, device=device)
        self.scene = scene = SyntheticScene(config.observation_shapes)
        # Fill every slot with `window` chunks of keys/values so attention reads a full cache.
        self.tables = [model.new_kv_table(b, max_batch) for b in range(config.blocks)]
        kv = torch.randn(self.tables[0].tokens_per_chunk, config.heads, config.head_dim, device=model.device,
                         dtype=model.dtype)   # the tokens a chunk writes (a model may carry more, e.g. text)
        for table in self.tables:
            for slot in range(max_batch):
                for _ in range(config.window + int(config.sink)):
                    table.append(slot, kv, kv)
        base = chunk_input(model.observation_tensors(scene.observation("profile", 0)), model.noise(0, "profile", 0))
        with torch.no_grad():
            cond = model.encode(model.observation_tensors(scene.observation("profile", 0)))
            h = model.embed(cond, base["x"], model.timesteps.timestep(torch.tensor([config.steps], device=model.device)))
        self.first, self.step0, self.mid = base, {"cond": cond, "x": base["x"]}, {"cond": cond, "x": base["x"], "h": h}
        self.order = pipeline_order(config.steps, config.blocks, config.clean_pass)

    def run(self, stage: Stage, n: int) -> float:
        """One forward of ``stage`` at batch n; wall ms. Appends roll each slot's window, so the cache stays
        full and every run reads the same amount."""
        k, b = stage
        state = self.first if stage == (self.config.steps, 0) else self.step0 if b == 0 else self.mid
        _sync(self.model.device)
        start = time.perf_counter()
        run_stage(self.model, b, [k] * n, [state] * n, KVBatch(self.tables[b], list(range(n))))
        _sync(self.model.device)
        return (time.perf_counter() - start) * 1e3


IDLE_MS = 30.0   # the idle gap before each timed pass (a paced worker sleeps between chunks)


def measure_profile(config: ModelConfig, device: str = "cpu", batch_sizes: tuple[int, ...] = (1, 2, 4),
                    repeats: int = 15, progress=None, corun: int = 0, idle_ms: float = IDLE_MS) -> CostProfile:
    """``corun``: also measure the slowdown with that many processes running stages at once (CPU)."""
    bench = StageBench(config, device, max(batch_sizes))
    # Each round walks the whole pipeline order, as a worker does, so a stage finds its block's weights
    # as cold as it will in service (timing one stage over and over keeps them in cache: 15-25 % fast
    # at batch 1 on the dev VM). Each pass follows an idle gap, as a paced worker's chunk follows a
    # sleep: back-to-back passes measured a chunk at 13.1 ms where the same workers served it in 16-20
    # ms (physis-bench admission, 2-core VM), and admission then over-filled the workers. Sizes
    # alternate within the round so drift hits them alike.
    times: dict[tuple[Stage, int], list[float]] = {(s, n): [] for s in bench.order for n in batch_sizes}
    for r in range(repeats + 2):
        for n in batch_sizes:
            if idle_ms > 0:
                time.sleep(idle_ms / 1e3)
            for stage in bench.order:
                ms = bench.run(stage, n)
                if r >= 2:  # warm-up rounds excluded
                    times[(stage, n)].append(ms)
        if progress is not None:
            progress(r + 1, repeats + 2)
    stage_ms = {s: {n: statistics.median(times[(s, n)]) for n in batch_sizes} for s in bench.order}
    hidden_bytes = sum(v.numel() * v.element_size() for v in bench.mid.values())
    hop_ms = measure_hop(bench.mid)
    trace = [[k, b, "w0", 0.0, 1.0, 1] for k, b in bench.order]  # the output carries every stage's trace entry
    engine_ms = (measure_hop(observation_payload(bench.scene.observation("profile", 0)))
                 + measure_hop({"x": bench.first["x"]}, trace))
    slowdown = measure_corun_slowdown(config, corun) if corun > 1 and device == "cpu" else 1.0
    return CostProfile(config.name, device, f"measured:{socket.gethostname()}", config.steps, config.blocks,
                       stage_ms, hop_ms, **{**memory_fields(config), "hidden_bytes": hidden_bytes},
                       overhead_ms_per_call=measure_worker_overhead(config, device), corun_slowdown=slowdown,
                       engine_ms=engine_ms, transport="tcp", clean=config.clean_pass,
                       shared_kv=config.history == "clean")


def pipeline_pass_ms(config: ModelConfig, seconds: float, start_at: float = 0.0, wait_ms: float = 0.0) -> float:
    """Compute time of one pass over every stage in pipeline order at batch 1 (ms, mean), looping for
    ``seconds`` from the wall time ``start_at`` (one thread). ``wait_ms``: sleep that long after each
    step's blocks, as a pipelined worker waits for its next hidden state; the sleeps are not counted."""
    torch.set_num_threads(1)
    bench = StageBench(config)
    for stage in bench.order:
        bench.run(stage, 1)
    time.sleep(max(0.0, start_at - time.time()))
    compute, passes, start = 0.0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for i, stage in enumerate(bench.order):
            compute += bench.run(stage, 1)
            if wait_ms and i % config.blocks == config.blocks - 1:
                time.sleep(wait_ms / 1e3)
        passes += 1
    return compute / passes


# How long a co-running worker idles between bursts in the measurement below: about one hop's wait.
CORUN_WAIT_MS = 1.0


def measure_corun_slowdown(config: ModelConfig, procs: int, seconds: float = 2.0, rounds: int = 2) -> float:
    """Compute time of a model pass in ``procs`` processes at once, each idling ``CORUN_WAIT_MS`` after
    every step as pipelined workers wait for messages, over one process computing without pause (how
    the profile is taken); median over ``rounds`` interleaved rounds.

    Both parts matter on the dev VM: two processes computing without pause run as fast as one
    (1.00-1.04x), but a core that idles between bursts comes back slower (cold caches, a vCPU
    descheduled by the host): 1 ms of sleep every 8 stages costs 9-19 % alone and 15-33 % with a
    second process, which is what pipelined CPU workers showed against their profile."""
    import json
    import subprocess
    import sys

    from physis_ros.config import to_mapping
    code = ("import json, sys; from physis_ros.config import from_mapping; from physis_ros.model.spec import "
            "ModelConfig; from physis_ros.runtime.profiler import pipeline_pass_ms; "
            "print(pipeline_pass_ms(from_mapping(ModelConfig, json.loads(sys.argv[1])), *map(float, sys.argv[2:])))")

    def pass_ms(n: int, wait_ms: float) -> float:
        start_at = time.time() + 3.0 + 0.5 * n  # all loops start together, after every model is built
        args = [sys.executable, "-c", code, json.dumps(to_mapping(config)), str(seconds), str(start_at), str(wait_ms)]
        ps = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        return statistics.fmean(float(proc.communicate()[0].strip().splitlines()[-1]) for proc in ps)

    ratios = [pass_ms(procs, CORUN_WAIT_MS) / pass_ms(1, 0.0) for _ in range(rounds)]
    return max(1.0, statistics.median(ratios))


def measure_hop(state: dict[str, torch.Tensor | np.ndarray], trace: list | None = None, repeats: int = 200) -> float:
    """One message of ``state`` through encode, tcp loopback and decode (median, ms)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    msg = p.Task(stream="profile", chunk=0, stage=(1, 0), epoch=0,
                 trace=[p.TraceEntry(*entry) for entry in trace or []])
    tensors = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            push.send_multipart(wire.encode(msg, tensors), copy=False)
            wire.decode(pull.recv_multipart(copy=False), wire.DATA)
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    return statistics.median(times[20:])


def measure_worker_overhead(config: ModelConfig, device: str = "cpu", chunks: int = 12) -> float:
    """The worker's own time per forward beyond the model (accepting and decoding a message, making the
    noise, picking, tracing, forwarding, encoding the output), ms: a real :class:`Worker` in-process
    hosting the whole model runs ``chunks`` chunks one at a time; its wall time minus its traced
    compute, over the forwards it ran."""
    from physis_ros.config import to_mapping
    from physis_ros.runtime.worker import Worker

    # The engine's control address is never reached; outputs go to a real socket drained at the end.
    worker = Worker("tcp://127.0.0.1:9", "profile", device=device, forward_logs=False)
    sink = worker.ctx.socket(zmq.PULL)
    sink_addr = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        worker.cmd_load(p.Load(req=0, threads=torch.get_num_threads()))
        order = pipeline_order(config.steps, config.blocks, config.clean_pass)
        worker.start_stream_now(p.StartStream(
            req=0, stream="profile", epoch=0, model=p.ModelRef(id=config.name, config=to_mapping(config)),
            stages=order, routes=[p.Route(s, sink_addr) for s in order]))
        time.sleep(0.1)  # let the output connection come up (the worker sends with IMMEDIATE)
        scene = SyntheticScene(config.observation_shapes)
        messages = []
        for c in range(chunks):
            task = p.Task(stream="profile", chunk=c, stage=order[0], epoch=0, order=float(c), sent=time.perf_counter())
            messages.append(wire.encode(task, observation_payload(scene.observation("profile", c))))
        per_forward = []
        for c, frames in enumerate(messages):
            compute, forwards = worker.stats.compute_ms, worker.stats.batches
            start = time.perf_counter()
            worker.tasks.accept_task(frames)
            while worker.tasks.ready:
                worker.tasks.run_next()
            wall = (time.perf_counter() - start) * 1e3
            if c >= 2:  # warm-up chunks excluded
                forwards = worker.stats.batches - forwards
                per_forward.append((wall - (worker.stats.compute_ms - compute)) / forwards)
        return statistics.median(per_forward)
    finally:
        sink.close(linger=0)
        worker.close()
