"""Measured cost profile of a model on the current device: stage time vs batch size, hop time.

The profile is what the planner and the workers' adaptive batching start from.
Each stage is timed through the same ``run_stage`` the workers call, with the
KV slots filled to the window so attention reads a realistic cache. JSON form::

    {"model": "tiny-wam", "device": "cpu", "source": "measured:<host>",
     "batch_sizes": [1, 2, 4], "stage_ms": {"4,0": {"1": 0.61, "2": 0.80, "4": 1.21}, ...},
     "hop_ms": 0.21, "hidden_bytes": 16896, "overhead_ms_per_call": 0.05}
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import zmq

from physis_ros.model import KVBatch, build_model
from physis_ros.model.spec import ModelConfig
from physis_ros.model.stages import chunk_input, run_stage
from physis_ros.observations import SyntheticScene
from physis_ros.runtime import wire
from physis_ros.runtime.plans import Stage, pipeline_order


@dataclass
class Profile:
    model: str
    device: str
    source: str
    batch_sizes: list[int]
    stage_ms: dict[Stage, dict[int, float]]
    hop_ms: float
    hidden_bytes: int
    overhead_ms_per_call: float = 0.0
    # How much slower a stage runs when every core runs a worker at once (memory bandwidth, caches,
    # the engine's own share): what co-located CPU workers see next to this alone-measured profile.
    corun_slowdown: float = 1.0
    extra: dict = field(default_factory=dict)

    def cost(self, stage: Stage, n: int = 1) -> float:
        """Time of one forward of ``stage`` at batch size n (linear between measured sizes)."""
        by_n = self.stage_ms[stage]
        if n in by_n:
            return by_n[n]
        sizes = sorted(by_n)
        lo = max([s for s in sizes if s <= n], default=sizes[0])
        hi = min([s for s in sizes if s >= n], default=sizes[-1])
        if lo == hi:  # beyond the measured range: extrapolate with the last per-task slope
            a, b = sizes[-2], sizes[-1]
            slope = (by_n[b] - by_n[a]) / (b - a)
            return by_n[b] + slope * (n - b)
        return by_n[lo] + (by_n[hi] - by_n[lo]) * (n - lo) / (hi - lo)

    def block_costs(self, stages: list[Stage]) -> dict[str, dict[str, float]]:
        """{"block": {"n": ms}} over the given stages (mean over steps), for worker-side batching seeds."""
        out: dict[str, dict[str, float]] = {}
        for b in sorted({b for _, b in stages}):
            mine = [s for s in stages if s[1] == b]
            out[str(b)] = {str(n): statistics.fmean(self.stage_ms[s][n] for s in mine) for n in self.batch_sizes}
        return out

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "source": self.source,
                "batch_sizes": self.batch_sizes,
                "stage_ms": {f"{k},{b}": {str(n): round(ms, 5) for n, ms in by_n.items()}
                             for (k, b), by_n in self.stage_ms.items()},
                "hop_ms": round(self.hop_ms, 5), "hidden_bytes": self.hidden_bytes,
                "overhead_ms_per_call": round(self.overhead_ms_per_call, 5),
                "corun_slowdown": round(self.corun_slowdown, 4), **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        try:
            stage_ms = {tuple(int(x) for x in key.split(",")): {int(n): float(ms) for n, ms in by_n.items()}
                        for key, by_n in data["stage_ms"].items()}
            return cls(model=data["model"], device=data.get("device", "cpu"), source=data.get("source", "unknown"),
                       batch_sizes=[int(n) for n in data.get("batch_sizes", [1])], stage_ms=stage_ms,
                       hop_ms=float(data.get("hop_ms", 0.0)), hidden_bytes=int(data.get("hidden_bytes", 0)),
                       overhead_ms_per_call=float(data.get("overhead_ms_per_call", 0.0)),
                       corun_slowdown=float(data.get("corun_slowdown", 1.0)))
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a physis profile ({exc.__class__.__name__}: {exc}); "
                             "write one with physis-profile") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_profile(config: ModelConfig, device: str = "cpu", batch_sizes: tuple[int, ...] = (1, 2, 4),
                    repeats: int = 15, progress=None, corun: int = 0) -> Profile:
    """``corun``: also measure the slowdown with that many processes running stages at once (CPU)."""
    model = build_model(config, device=device)
    scene = SyntheticScene(config.observation_shapes)
    nmax = max(batch_sizes)
    # Fill every slot with `window` chunks of keys/values so attention reads a full cache.
    tables = [model.new_kv_table(b, nmax) for b in range(config.blocks)]
    kv = torch.randn(config.tokens_per_chunk, config.heads, config.head_dim, device=model.device, dtype=model.dtype)
    for table in tables:
        for slot in range(nmax):
            for _ in range(config.window + int(config.sink)):
                table.append(slot, kv, kv)
    base = chunk_input(model.observation_tensors(scene.observation("profile", 0)), model.noise(0, "profile", 0))
    states = {}
    with torch.no_grad():
        cond = model.encode({k[4:]: v for k, v in base.items() if k.startswith("obs/")})
        t = model.schedule.timestep(torch.tensor([config.steps], device=model.device))
        h = model.embed(cond, base["x"], t)
    states["first"] = base
    states["mid"] = {"cond": cond, "x": base["x"], "h": h}
    states["step0"] = {"cond": cond, "x": base["x"]}
    stage_ms: dict[Stage, dict[int, float]] = {}
    order = pipeline_order(config.steps, config.blocks)
    for i, (k, b) in enumerate(order):
        if (k, b) == (config.steps, 0):
            state = states["first"]
        else:
            state = states["step0"] if b == 0 else states["mid"]
        stage_ms[(k, b)] = {}
        for n in batch_sizes:
            slots = list(range(n))
            times = []
            for r in range(repeats + 2):
                # Appends roll each slot's window; the cache stays full, so every run reads the same amount.
                _sync(model.device)
                start = time.perf_counter()
                run_stage(model, b, [k] * n, [state] * n, KVBatch(tables[b], slots))
                _sync(model.device)
                if r >= 2:  # warm-up runs excluded
                    times.append((time.perf_counter() - start) * 1e3)
            stage_ms[(k, b)][n] = statistics.median(times)
        if progress is not None:
            progress(i + 1, len(order))
    hidden_bytes = sum(v.numel() * v.element_size() for v in states["mid"].values())
    hop_ms = measure_hop(states["mid"])
    slowdown = measure_corun_slowdown(config, corun) if corun > 1 and device == "cpu" else 1.0
    return Profile(config.name, device, f"measured:{socket.gethostname()}", list(batch_sizes), stage_ms, hop_ms,
                   hidden_bytes, overhead_ms_per_call=measure_call_overhead(), corun_slowdown=slowdown)


def stage_loop_rate(config: ModelConfig, seconds: float) -> float:
    """Forwards per second of one mid-pipeline stage, looped for ``seconds`` (one thread)."""
    torch.set_num_threads(1)
    model = build_model(config)
    table = model.new_kv_table(1, 1)
    scene = SyntheticScene(config.observation_shapes)
    base = chunk_input(model.observation_tensors(scene.observation("corun", 0)), model.noise(0, "corun", 0))
    with torch.no_grad():
        cond = model.encode({k[4:]: v for k, v in base.items() if k.startswith("obs/")})
        h = model.embed(cond, base["x"], model.schedule.timestep(torch.tensor([1])))
    state = {"cond": cond, "x": base["x"], "h": h}
    block = min(1, config.blocks - 1)
    for _ in range(5):
        run_stage(model, block, [1], [state], KVBatch(table, [0]))
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_stage(model, block, [1], [state], KVBatch(table, [0]))
        n += 1
    return n / (time.perf_counter() - start)


def measure_corun_slowdown(config: ModelConfig, procs: int, seconds: float = 2.0) -> float:
    """Rate of one process alone over the mean rate of ``procs`` processes running at once."""
    import json
    import subprocess
    import sys

    from physis_ros.config import to_mapping
    code = ("import json, sys; from physis_ros.config import from_mapping; from physis_ros.model.spec import "
            "ModelConfig; from physis_ros.runtime.profiler import stage_loop_rate; "
            "print(stage_loop_rate(from_mapping(ModelConfig, json.loads(sys.argv[1])), float(sys.argv[2])))")
    args = [sys.executable, "-c", code, json.dumps(to_mapping(config)), str(seconds)]

    def rates(n: int) -> list[float]:
        ps = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        return [float(p.communicate()[0].strip().splitlines()[-1]) for p in ps]

    alone = rates(1)[0]
    together = rates(procs)
    return max(1.0, alone / (sum(together) / len(together)))


def measure_hop(state: dict[str, torch.Tensor], repeats: int = 200) -> float:
    """One hidden-state message through encode, tcp loopback and decode (median, ms)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    msg = wire.Message("task", "profile", 0, (1, 0), {k: v.cpu() for k, v in state.items()}, {"trace": []})
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            push.send_multipart(wire.encode(msg), copy=False)
            wire.decode(pull.recv_multipart(copy=False))
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    return statistics.median(times[20:])


def measure_call_overhead(repeats: int = 2000) -> float:
    """The worker loop's per-forward bookkeeping (poll, pick, trace), approximated by an idle poll cycle."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind_to_random_port("tcp://127.0.0.1")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    start = time.perf_counter()
    for _ in range(repeats):
        poller.poll(0)
        poller.poll(0)
    elapsed = (time.perf_counter() - start) * 1e3 / repeats
    sock.close(linger=0)
    ctx.term()
    return elapsed
