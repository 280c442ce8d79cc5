"""Engine (coordinator): places streams on workers, feeds chunks, collects outputs, survives faults.

Runs on asyncio (uvloop) with zmq.asyncio. For each stream the engine sends
every chunk's input (observation tensors + noise seed) to the worker of the
stream's first stage and receives the finished chunk from the worker of its
last stage; hidden states travel worker to worker and never pass through here.

Each stream has its own placement plan (by default the engine's plan), keeps
at most ``max_in_flight`` chunks in its pipeline, and takes its latest
observation at the moment a chunk enters. Outputs are delivered in chunk
order with a :class:`~physis_ros.telemetry.ChunkRecord`.

Faults: when a worker is lost, only the streams placed on it fail (they stop
publishing, the failure is recorded with worker and streams named); the
others carry on untouched. With ``restart_workers`` the worker is started
again and the failed streams are re-admitted with fresh KV, under a new
*epoch* so that nothing of the old incarnation can leak into the new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
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
from physis_ros.runtime.security import CurveKeys
from physis_ros.runtime.streams import ChunkOutput, Observation, ObserveFn, OutputFn, StreamEvent, StreamState
from physis_ros.runtime.workers import EngineError, WorkerPool, WorkerProc
from physis_ros.telemetry import ChunkRecord

log = logging.getLogger("physis.engine")
__all__ = ["ChunkOutput", "Engine", "EngineError", "Observation", "ObserveFn", "OutputFn", "StreamEvent"]


class Engine:
    def __init__(self, model: ModelConfig, config: EngineConfig, plan: Plan | None = None,
                 clock: Callable[[], float] = time.monotonic, profile: Profile | None = None,
                 on_event: Callable[[StreamEvent], None] | None = None):
        """``profile`` (or ``config.profile``, a physis-profile JSON) seeds the workers' adaptive
        batching and lets plan ``auto`` choose the partition. ``on_event`` hears stream failures
        and re-admissions."""
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
            # Workers spawned here share this host's cores with the engine; external ones have their own.
            host_cpus = (os.cpu_count() or 1) if config.spawn_workers else None
            self.prediction = choose_plan(model.steps, model.blocks, config.workers, self.profile,
                                          config.batching, config.max_batch, host_cpus)
            plan = self.prediction.plan
            log.info("plan auto (%s batching): %s; predicted interval %.2f ms", config.batching, plan.describe(),
                     self.prediction.interval_ms)
        self.plan = plan or make_plan(config.plan, model.steps, model.blocks, config.workers)
        if max(self.plan.workers_used) >= config.workers:
            raise ValueError(f"plan uses worker w{max(self.plan.workers_used)} but only {config.workers} exist")
        self.clock = clock
        self.on_event = on_event
        self.events: list[StreamEvent] = []
        self.max_bytes = config.max_message_mb * 1024 * 1024
        self.ctx = zmq.asyncio.Context()
        self.streams: dict[str, StreamState] = {}
        self.failure: EngineError | None = None
        self.pool: WorkerPool | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._ipc_dir: tempfile.TemporaryDirectory | None = None
        self._auth = None
        self._started = False

    def in_flight_limit(self, plan: Plan) -> int:
        """Chunks a stream placed by ``plan`` may have in flight (config override, else from the plan)."""
        return self.config.max_in_flight or plan.in_flight(self.config.batching != "off", self.config.max_batch)

    @property
    def workers(self) -> dict[str, WorkerProc]:
        return self.pool.workers if self.pool is not None else {}

    @property
    def errors(self) -> list[str]:
        return self.pool.errors if self.pool is not None else []

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.keys = CurveKeys.load(cfg.curve_keys) if cfg.curve_keys else None
        self._auth = self.keys.authenticator(self.ctx) if self.keys else None
        self.out = self.ctx.socket(zmq.PULL)
        if self.keys:
            self.keys.server(self.out)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if cfg.transport == "ipc":
            self._ipc_dir = tempfile.TemporaryDirectory(prefix="physis-")
            ctrl_base = f"ipc://{self._ipc_dir.name}/ctrl"
            self.out_addr = f"ipc://{self._ipc_dir.name}/out"
            self.out.bind(self.out_addr)
        else:
            ctrl_base = f"tcp://{cfg.bind_host}"
            self.out_addr = f"tcp://{cfg.bind_host}:{self.out.bind_to_random_port(ctrl_base)}"
        self.pool = WorkerPool(self.ctx, cfg, ctrl_base, self._ipc_dir.name if self._ipc_dir else None,
                               self._worker_lost, self.keys)
        self._tasks.append(asyncio.create_task(self.pool.control_loop(), name="engine-control"))
        self._tasks.append(asyncio.create_task(self._output_loop(), name="engine-output"))
        try:
            if cfg.spawn_workers:
                procs = [await self.pool.spawn(i) for i in range(cfg.workers)]
            else:
                procs = [self.pool.expect(i) for i in range(cfg.workers)]
                log.warning("waiting for %d workers: physis-worker --connect %s --id w<N>", cfg.workers,
                            self.pool.ctrl_addr)
            for w in procs:
                await self.pool.wait_hello(w)
            await asyncio.gather(*(self._load(w) for w in procs))
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self.pool.monitor_loop(), name="engine-monitor"))
        self._started = True

    async def _load(self, w: WorkerProc) -> None:
        cfg = self.config
        await self.pool.request(w.name, "load", {
            "model": to_mapping(self.model),
            "blocks": sorted({b for _, b in self.plan.stages_of(w.index)}),
            "threads": cfg.threads_per_worker, "max_streams": cfg.max_streams,
            "batching": cfg.batching, "max_batch": cfg.max_batch, "policy": cfg.policy,
            "profile": None if self.profile is None else self.profile.block_costs(self.plan.order),
            "checkpoint": cfg.checkpoint}, timeout=cfg.start_timeout_s)

    async def stop(self) -> None:
        """Stop streams and workers; leaves no processes or ipc files behind."""
        for s in self.streams.values():
            if s.feeder is not None:
                s.feeder.cancel()
        if self.pool is not None:
            await self.pool.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for sock in [getattr(self, "out", None), *self._push.values()]:
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if self._ipc_dir is not None:
            self._ipc_dir.cleanup()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def request(self, worker: str, kind: str, body: dict, timeout: float = 10.0) -> dict:
        return await self.pool.request(worker, kind, body, timeout)

    # ---- streams -----------------------------------------------------------------------------
    async def add_stream(self, name: str, observe: ObserveFn, on_output: OutputFn | None = None, *,
                         chunks: int | None = None, slo_interval_ms: float | None = None,
                         keep_outputs: bool = False, plan: Plan | None = None,
                         release_interval_ms: float | None = None, emit_delay_ms: float | None = None) -> None:
        """Start feeding a stream: ``chunks`` chunks (None: until removed), placed by ``plan``.

        ``release_interval_ms`` paces the stream: chunk c enters the pipeline no earlier than
        c intervals after the first, so it cannot run ahead of the robot's control timeline.
        ``emit_delay_ms`` (with a release interval) is a jitter buffer: chunk c is handed out no
        earlier than its release plus this delay, so outputs leave at the steady release cadence
        whenever the response latency stays under the delay (the latency is the price)."""
        if not self._started:
            raise EngineError("start the engine before adding streams")
        if name in self.streams:
            raise ValueError(f"stream '{name}' already exists")
        plan = plan or self.plan
        limit = self.in_flight_limit(plan)
        s = StreamState(name, plan, observe, on_output, chunks, slo_interval_ms, asyncio.Semaphore(limit),
                    keep_outputs=keep_outputs)
        if release_interval_ms:
            s.release_interval_s = release_interval_ms / 1e3
            s.release_t0 = time.monotonic()
            if emit_delay_ms is not None:
                s.emit_delay_s = emit_delay_ms / 1e3
        await self._place(s)
        self.streams[name] = s
        s.feeder = asyncio.create_task(self._feed(s), name=f"feed-{name}")

    def _workers_of(self, s: StreamState) -> list[WorkerProc]:
        by_index = {w.index: w for w in self.workers.values()}
        return [by_index[i] for i in s.plan.workers_used]

    async def _place(self, s: StreamState) -> None:
        """Tell each of the stream's workers its stages (fresh KV) and where to send each stage's output."""
        procs = self._workers_of(s)
        dead = [w.name for w in procs if not w.alive]
        if dead:
            raise EngineError(f"stream '{s.name}' needs worker(s) {', '.join(dead)}, which are down")
        addr = {w.index: w.data_addr for w in procs}
        requests = []
        for w in procs:
            stages = s.plan.stages_of(w.index)
            routes = {}
            for st in stages:
                nxt = s.plan.next_stage(st)
                routes[f"{st[0]},{st[1]}"] = self.out_addr if nxt is None else addr[s.plan.assignment[nxt]]
            requests.append(self.request(w.name, "start_stream", {
                "stream": s.name, "epoch": s.epoch, "stages": [list(st) for st in stages], "routes": routes}))
        await asyncio.gather(*requests)
        first = addr[s.plan.assignment[s.plan.first_stage]]
        if first not in self._push:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if self.keys:
                self.keys.client(sock)
            sock.connect(first)
            self._push[first] = sock
        s.first_addr = first

    async def remove_stream(self, name: str) -> None:
        s = self.streams.pop(name)
        if s.feeder is not None:
            s.feeder.cancel()
        s.done.set()
        await asyncio.gather(*(self.request(w.name, "stop_stream", {"stream": name})
                               for w in self._workers_of(s) if w.alive), return_exceptions=True)

    async def wait_stream(self, name: str) -> list[ChunkOutput]:
        """Wait until a finite stream has emitted all its chunks; raises if it failed."""
        s = self.streams[name]
        await s.done.wait()
        if s.failed is not None:
            raise EngineError(s.failed)
        return s.outputs

    def stream_status(self, name: str) -> dict:
        s = self.streams[name]
        return {"failed": s.failed, "epoch": s.epoch, "lost_chunks": s.lost_chunks, "next_chunk": s.next_chunk,
                "in_flight": len(s.entered), "workers": [f"w{i}" for i in s.plan.workers_used]}

    async def _feed(self, s: StreamState) -> None:
        while s.limit is None or s.next_chunk < s.limit:
            await s.credits.acquire()
            if s.release_interval_s is not None:
                delay = s.release_t0 + s.next_chunk * s.release_interval_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
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
            msg = wire.Message("task", s.name, c, s.plan.first_stage, tensors,
                               {"seed": self.config.seed, "epoch": s.epoch, "sent": order, "order": order,
                                "deadline": order + slo_s})
            await self._push[s.first_addr].send_multipart(wire.encode(msg), copy=False)

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
            ts = msg.ts
            if s is None or ts.get("epoch", 0) != s.epoch or msg.chunk not in s.entered:
                continue  # a removed stream, or an incarnation before a failure
            hops = list(ts.get("hops", []))
            if "sent" in ts:
                hops.append((received - ts["sent"]) * 1e3)
            obs_stamp, enqueue = s.entered.pop(msg.chunk)
            record = ChunkRecord.from_trace(s.name, msg.chunk, obs_stamp, enqueue, emit, ts.get("trace", []), hops)
            s.pending[msg.chunk] = ChunkOutput(s.name, msg.chunk, msg.tensors["x"][0].float().numpy().copy(), record)
            s.credits.release()
            self._deliver(s)

    def _deliver(self, s: StreamState) -> None:
        while s.next_emit in s.pending:
            if s.emit_delay_s is not None:  # jitter buffer: hold the chunk until its slot on the timeline
                wait = s.release_t0 + s.next_emit * s.release_interval_s + s.emit_delay_s - time.monotonic()
                if wait > 0:
                    if not s.emit_scheduled:
                        s.emit_scheduled = True
                        asyncio.get_running_loop().call_later(wait, self._paced_deliver, s)
                    return
            out = s.pending.pop(s.next_emit)
            rec = out.record
            if s.emit_delay_s is not None:
                rec.emit = self.clock()
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

    def _paced_deliver(self, s: StreamState) -> None:
        s.emit_scheduled = False
        if self.streams.get(s.name) is s:
            self._deliver(s)

    # ---- faults --------------------------------------------------------------------------------
    def _event(self, event: StreamEvent) -> None:
        event.time = self.clock()
        self.events.append(event)
        del self.events[:-1000]  # bounded
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("event callback failed")

    async def _worker_lost(self, w: WorkerProc, reason: str) -> None:
        affected = [s for s in self.streams.values() if w.index in s.plan.workers_used and s.failed is None]
        names = ", ".join(s.name for s in affected) or "none"
        log.error("%s; streams affected: %s", reason, names)
        for s in affected:
            if s.feeder is not None:
                s.feeder.cancel()
            lost = len(s.entered) + len(s.pending)
            s.lost_chunks += lost
            s.failed = reason
            self._event(StreamEvent(s.name, "failed", f"{reason} (streams on it: {names})", lost))
        if not (self.config.restart_workers and self.config.spawn_workers):
            if self.failure is None:
                self.failure = EngineError(reason)
            for s in affected:
                s.done.set()
            return
        self._tasks.append(asyncio.create_task(self._recover(w, affected), name=f"recover-{w.name}"))

    async def _recover(self, w: WorkerProc, affected: list[StreamState]) -> None:
        try:
            fresh = await self.pool.spawn(w.index)
            await self.pool.wait_hello(fresh)
            await self._load(fresh)
            for s in affected:
                if self.streams.get(s.name) is not s:
                    continue  # removed meanwhile
                # Drop the old incarnation everywhere, then place it again with fresh KV.
                await asyncio.gather(*(self.request(p.name, "stop_stream", {"stream": s.name})
                                       for p in self._workers_of(s) if p.alive and p is not fresh),
                                     return_exceptions=True)
                s.epoch += 1
                s.entered.clear()
                s.pending.clear()
                s.next_emit = s.next_chunk  # the chunks in flight are lost; counted in lost_chunks
                s.credits = asyncio.Semaphore(self.in_flight_limit(s.plan))
                await self._place(s)
                s.failed = None
                self._event(StreamEvent(s.name, "readmitted", f"worker {w.name} restarted (pid {fresh.pid})"))
                s.feeder = asyncio.create_task(self._feed(s), name=f"feed-{s.name}")
        except Exception as exc:  # recovery failed: the streams stay failed, loudly
            text = f"could not restart worker {w.name}: {exc}"
            log.error(text)
            self.failure = EngineError(text)
            for s in affected:
                s.failed = f"{s.failed}; {text}"
                s.done.set()
