"""Engine (coordinator): starts workers, applies a placement plan, feeds chunks, collects outputs.

Runs on asyncio (uvloop) with zmq.asyncio. The engine sends each chunk's input
(observation tensors + noise seed) to the worker of the first stage and
receives the finished chunk from the worker of the last stage; hidden states
travel worker to worker and never pass through here.

Each stream keeps at most ``max_in_flight`` chunks in the pipeline; a chunk
takes the stream's latest observation at the moment it enters. Outputs are
delivered in chunk order with a :class:`~physis_ros.telemetry.ChunkRecord`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq
import zmq.asyncio

from physis_ros.config import EngineConfig, to_mapping
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime import wire
from physis_ros.runtime.planner import choose_plan
from physis_ros.runtime.plans import Plan, make_plan
from physis_ros.runtime.profiler import Profile, measure_profile
from physis_ros.telemetry import ChunkRecord

log = logging.getLogger("physis.engine")


class EngineError(RuntimeError):
    """The engine cannot go on: a worker failed to start, died, or stopped answering."""


@dataclass
class Observation:
    data: dict[str, np.ndarray]
    stamp: float  # seconds, on the engine's clock


@dataclass
class ChunkOutput:
    stream: str
    chunk: int
    output: np.ndarray  # float32, model output shape
    record: ChunkRecord


# Returns the observation for the next chunk (its index is given), or None if none is available yet.
ObserveFn = Callable[[int], Observation | None]
OutputFn = Callable[[ChunkOutput], None]


@dataclass
class _Stream:
    name: str
    observe: ObserveFn
    on_output: OutputFn | None
    limit: int | None
    slo_interval_ms: float | None
    credits: asyncio.Semaphore
    next_chunk: int = 0
    next_emit: int = 0
    last_emit: float | None = None
    pending: dict[int, ChunkOutput] = field(default_factory=dict)
    entered: dict[int, tuple[float, float]] = field(default_factory=dict)  # chunk -> (obs stamp, enqueue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    feeder: asyncio.Task | None = None
    outputs: list[ChunkOutput] = field(default_factory=list)
    keep_outputs: bool = False


@dataclass
class _WorkerProc:
    name: str
    index: int
    proc: subprocess.Popen | None
    data_addr: str = ""
    pid: int = 0
    last_seen: float = 0.0
    stats: dict = field(default_factory=dict)


class Engine:
    def __init__(self, model: ModelConfig, config: EngineConfig, plan: Plan | None = None,
                 clock: Callable[[], float] = time.monotonic, profile: Profile | None = None):
        """``profile`` (or ``config.profile``, a physis-profile JSON) seeds the workers' adaptive
        batching and lets plan ``auto`` choose the partition."""
        self.model = model
        self.config = config
        if profile is None and config.profile:
            profile = Profile.from_json(json.loads(Path(config.profile).read_text()))
        self.profile = profile
        self.prediction = None
        if plan is None and config.plan == "auto":
            if self.profile is None:
                log.info("plan 'auto' without a profile: measuring %s on %s", model.name, config.device_of(0))
                self.profile = measure_profile(model, config.device_of(0))
            self.prediction = choose_plan(model.steps, model.blocks, config.workers, self.profile,
                                          config.batching, config.max_batch)
            plan = self.prediction.plan
        self.plan = plan or make_plan(config.plan, model.steps, model.blocks, config.workers)
        self.block_profile = {} if self.profile is None else {
            w: self.profile.block_costs(self.plan.stages_of(w)) for w in self.plan.workers_used}
        self.clock = clock
        self.max_bytes = config.max_message_mb * 1024 * 1024
        self.in_flight_limit = config.max_in_flight or self.default_in_flight()
        self.ctx = zmq.asyncio.Context()
        self.workers: dict[str, _WorkerProc] = {}
        self.streams: dict[str, _Stream] = {}
        self.failure: EngineError | None = None
        self.errors: list[str] = []
        self._req = itertools.count(1)
        self._pending_req: dict[int, asyncio.Future] = {}
        self._hello: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._ipc_dir: tempfile.TemporaryDirectory | None = None
        self._first_push: zmq.asyncio.Socket | None = None
        self._started = False

    def default_in_flight(self) -> int:
        """Enough chunks to keep every worker busy: one each, or, with batching, as many as the
        steps it hosts of one block (those chunks then move through its blocks in lockstep), plus one
        so the first worker never waits for the engine's round trip."""
        if self.config.batching == "off":
            return len(self.plan.workers_used) + 1
        total = 0
        for w in self.plan.workers_used:
            per_block: dict[int, int] = {}
            for _, b in self.plan.stages_of(w):
                per_block[b] = per_block.get(b, 0) + 1
            total += min(max(per_block.values()), self.config.max_batch)
        return total + 1

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.ctrl = self.ctx.socket(zmq.ROUTER)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        self.out = self.ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if cfg.transport == "ipc":
            self._ipc_dir = tempfile.TemporaryDirectory(prefix="physis-")
            self.ctrl_addr = f"ipc://{self._ipc_dir.name}/ctrl"
            self.out_addr = f"ipc://{self._ipc_dir.name}/out"
            self.ctrl.bind(self.ctrl_addr)
            self.out.bind(self.out_addr)
        else:
            host = cfg.bind_host
            self.ctrl_addr = f"tcp://{host}:{self.ctrl.bind_to_random_port(f'tcp://{host}')}"
            self.out_addr = f"tcp://{host}:{self.out.bind_to_random_port(f'tcp://{host}')}"
        self._tasks.append(asyncio.create_task(self._control_loop(), name="engine-control"))
        self._tasks.append(asyncio.create_task(self._output_loop(), name="engine-output"))
        try:
            await self._spawn_workers()
            await self._apply_plan()
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="engine-monitor"))
        self._started = True

    async def _spawn_workers(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        for i in self.plan.workers_used:
            name = f"w{i}"
            cmd = [sys.executable, "-m", "physis_ros.runtime.worker", "--connect", self.ctrl_addr, "--id", name,
                   "--device", cfg.device_of(i), "--bind-host", cfg.bind_host, "--transport", cfg.transport,
                   "--threads", str(cfg.threads_per_worker)]
            if self._ipc_dir is not None:
                cmd += ["--ipc-dir", self._ipc_dir.name]
            env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads_per_worker)}
            self._hello[name] = loop.create_future()
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
            self.workers[name] = _WorkerProc(name, i, proc)
        deadline = time.monotonic() + cfg.start_timeout_s
        for name, fut in self._hello.items():
            while not fut.done():
                w = self.workers[name]
                if w.proc.poll() is not None:
                    raise EngineError(f"worker {name} exited with code {w.proc.returncode} before it said hello")
                if time.monotonic() > deadline:
                    raise EngineError(f"worker {name} did not start within {cfg.start_timeout_s:.0f} s")
                await asyncio.wait([fut], timeout=0.05)

    async def _apply_plan(self) -> None:
        model_map = to_mapping(self.model)
        loads = [self.request(name, "load", {
            "model": model_map, "stages": [list(s) for s in self.plan.stages_of(w.index)],
            "threads": self.config.threads_per_worker, "max_streams": self.config.max_streams,
            "batching": self.config.batching, "max_batch": self.config.max_batch, "policy": self.config.policy,
            "profile": self.block_profile.get(w.index),
            "checkpoint": self.config.checkpoint}, timeout=self.config.start_timeout_s)
            for name, w in self.workers.items()]
        await asyncio.gather(*loads)
        addr_of = {w.index: w.data_addr for w in self.workers.values()}
        for name, w in self.workers.items():
            routes = {}
            for s in self.plan.stages_of(w.index):
                nxt = self.plan.next_stage(s)
                routes[f"{s[0]},{s[1]}"] = self.out_addr if nxt is None else addr_of[self.plan.assignment[nxt]]
            await self.request(name, "assign", {"routes": routes})
        first = addr_of[self.plan.assignment[self.plan.first_stage]]
        self._first_push = self.ctx.socket(zmq.PUSH)
        self._first_push.setsockopt(zmq.LINGER, 0)
        self._first_push.connect(first)

    async def stop(self) -> None:
        """Stop streams and workers; leaves no processes or ipc files behind."""
        for s in list(self.streams.values()):
            if s.feeder is not None:
                s.feeder.cancel()
        for name, w in self.workers.items():
            if w.proc is not None and w.proc.poll() is None and w.data_addr:
                try:
                    await self.request(name, "shutdown", {}, timeout=1.0)
                except (EngineError, asyncio.TimeoutError):
                    pass
        for w in self.workers.values():
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                w.proc.terminate()
                try:
                    w.proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            if w.data_addr.startswith("ipc://"):
                Path(w.data_addr[len("ipc://"):]).unlink(missing_ok=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for sock in (getattr(self, "ctrl", None), getattr(self, "out", None), self._first_push):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        if self._ipc_dir is not None:
            self._ipc_dir.cleanup()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- control plane ---------------------------------------------------------------------------
    async def request(self, worker: str, kind: str, body: dict, timeout: float = 10.0) -> dict:
        req = next(self._req)
        fut = asyncio.get_running_loop().create_future()
        self._pending_req[req] = fut
        frames = wire.encode(wire.Message(kind=kind, body={**body, "req": req}))
        await self.ctrl.send_multipart([worker.encode(), *frames], copy=False)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"worker {worker} did not answer '{kind}' within {timeout:.1f} s") from None
        finally:
            self._pending_req.pop(req, None)

    async def _control_loop(self) -> None:
        while True:
            identity, *frames = await self.ctrl.recv_multipart(copy=False)
            name = bytes(identity.buffer).decode(errors="replace")
            try:
                msg = wire.decode(frames, self.max_bytes)
            except wire.WireError as exc:
                log.warning("malformed control message from %s: %s", name, exc)
                continue
            w = self.workers.get(name)
            if w is None:
                log.warning("control message from unknown worker %r ignored", name)
                continue
            w.last_seen = time.monotonic()
            body = msg.body
            if msg.kind == "hello":
                w.data_addr, w.pid = body["data"], body.get("pid", 0)
                fut = self._hello.get(name)
                if fut is not None and not fut.done():
                    fut.set_result(body)
            elif msg.kind == "heartbeat":
                w.stats = body.get("stats", {})
            elif msg.kind in ("ack", "error"):
                fut = self._pending_req.get(body.get("req"))
                if fut is not None and not fut.done():
                    if msg.kind == "ack":
                        fut.set_result(body)
                    else:
                        fut.set_exception(EngineError(f"worker {name}: {body.get('error')}"))
                elif msg.kind == "error":
                    text = f"worker {name}: {body.get('error')}"
                    log.warning(text)
                    self.errors.append(text)

    async def _monitor_loop(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            for w in self.workers.values():
                if w.proc is not None and w.proc.poll() is not None:
                    self._fail(EngineError(f"worker {w.name} (pid {w.proc.pid}) exited with code "
                                           f"{w.proc.returncode}"))
                elif now - w.last_seen > timeout:
                    self._fail(EngineError(f"worker {w.name} (pid {w.pid}) sent no heartbeat for "
                                           f"{now - w.last_seen:.2f} s (timeout {timeout} s)"))
            if self.failure is not None:
                return

    def _fail(self, error: EngineError) -> None:
        if self.failure is None:
            log.error("%s", error)
            self.failure = error
            for s in self.streams.values():
                s.done.set()

    # ---- streams -----------------------------------------------------------------------------
    async def add_stream(self, name: str, observe: ObserveFn, on_output: OutputFn | None = None, *,
                         chunks: int | None = None, slo_interval_ms: float | None = None,
                         keep_outputs: bool = False) -> None:
        """Start feeding a stream: ``chunks`` chunks (None: until removed)."""
        if not self._started:
            raise EngineError("start the engine before adding streams")
        if name in self.streams:
            raise ValueError(f"stream '{name}' already exists")
        await asyncio.gather(*(self.request(w, "start_stream", {"stream": name}) for w in self.workers))
        s = _Stream(name, observe, on_output, chunks, slo_interval_ms, asyncio.Semaphore(self.in_flight_limit),
                    keep_outputs=keep_outputs)
        self.streams[name] = s
        s.feeder = asyncio.create_task(self._feed(s), name=f"feed-{name}")

    async def remove_stream(self, name: str) -> None:
        s = self.streams.pop(name)
        if s.feeder is not None:
            s.feeder.cancel()
        await asyncio.gather(*(self.request(w, "stop_stream", {"stream": name}) for w in self.workers))

    async def wait_stream(self, name: str) -> list[ChunkOutput]:
        """Wait until a finite stream has emitted all its chunks; raises if the engine failed."""
        s = self.streams[name]
        await s.done.wait()
        if self.failure is not None:
            raise self.failure
        return s.outputs

    async def _feed(self, s: _Stream) -> None:
        while s.limit is None or s.next_chunk < s.limit:
            await s.credits.acquire()
            obs = s.observe(s.next_chunk)
            while obs is None:  # no observation yet (a camera not publishing): poll, do not spin
                await asyncio.sleep(0.005)
                obs = s.observe(s.next_chunk)
            c = s.next_chunk
            s.next_chunk += 1
            enqueue = self.clock()
            s.entered[c] = (obs.stamp, enqueue)
            tensors = {f"obs/{k}": torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).unsqueeze(0)
                       for k, v in obs.data.items()}
            order = time.perf_counter()
            slo_s = (s.slo_interval_ms or 1000.0) / 1e3
            msg = wire.Message("task", s.name, c, self.plan.first_stage, tensors,
                               {"seed": self.config.seed, "sent": order, "order": order, "deadline": order + slo_s})
            await self._first_push.send_multipart(wire.encode(msg), copy=False)

    async def _output_loop(self) -> None:
        while True:
            frames = await self.out.recv_multipart(copy=False)
            received = time.perf_counter()
            emit = self.clock()
            try:
                msg = wire.decode(frames, self.max_bytes)
            except wire.WireError as exc:
                log.warning("malformed output message: %s", exc)
                continue
            s = self.streams.get(msg.stream)
            if s is None or msg.chunk not in s.entered:
                continue  # a stream removed while its chunks were in flight
            ts = msg.ts
            hops = list(ts.get("hops", []))
            if "sent" in ts:
                hops.append((received - ts["sent"]) * 1e3)
            obs_stamp, enqueue = s.entered.pop(msg.chunk)
            trace = ts.get("trace", [])
            worker_ms: dict[str, float] = {}
            for entry in trace:
                worker_ms[entry[2]] = worker_ms.get(entry[2], 0.0) + entry[4]
            record = ChunkRecord(stream=s.name, chunk=msg.chunk, obs_stamp=obs_stamp, enqueue=enqueue, emit=emit,
                                 interval_ms=math.nan, stage_ms=[e[4] for e in trace],
                                 queue_ms=sum(e[3] for e in trace), hops_ms=hops,
                                 batch_sizes=[e[5] for e in trace], worker_compute_ms=worker_ms)
            s.pending[msg.chunk] = ChunkOutput(s.name, msg.chunk, msg.tensors["x"][0].float().numpy().copy(), record)
            s.credits.release()
            self._deliver(s)

    def _deliver(self, s: _Stream) -> None:
        while s.next_emit in s.pending:
            out = s.pending.pop(s.next_emit)
            rec = out.record
            if s.last_emit is not None:
                rec.interval_ms = (rec.emit - s.last_emit) * 1e3
                rec.deadline_miss = s.slo_interval_ms is not None and rec.interval_ms > s.slo_interval_ms
            s.last_emit = rec.emit
            s.next_emit += 1
            if s.keep_outputs:
                s.outputs.append(out)
            if s.on_output is not None:
                try:
                    s.on_output(out)
                except Exception:  # a consumer's bug must not stop the pipeline
                    log.exception("output callback of stream %s failed", s.name)
            if s.limit is not None and s.next_emit >= s.limit:
                s.done.set()

    async def worker_stats(self) -> dict[str, dict]:
        return {name: await self.request(name, "stats", {}) for name in self.workers}
