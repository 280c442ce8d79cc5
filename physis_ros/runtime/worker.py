"""Worker process: hosts stages of one model on one device and runs their tasks.

Sockets (all owned by this single-threaded process):

- control: DEALER connected to the engine's ROUTER. Commands in (load, assign,
  start/stop stream, stats, shutdown), acks, errors and heartbeats out.
- data in: PULL bound on this worker's own address (loopback tcp by default,
  or ipc). Tasks arrive here from the engine or from the previous stage's worker.
- data out: one PUSH per peer worker (next stage elsewhere) and one PUSH to the
  engine's output PULL (the chunk leaves the last stage).

A task runs all consecutive stages this worker hosts before it leaves, so a
hidden state crosses the network only where the plan changes worker. KV caches
never move: each hosted block has a persistent table with one slot per
(stream, step).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from physis_ros.config import from_mapping
from physis_ros.model import KVBatch, KVTable, build_model
from physis_ros.model.checkpoint import load_checkpoint
from physis_ros.model.dit import DiTModel
from physis_ros.model.spec import ModelConfig
from physis_ros.model.stages import OBS_PREFIX, chunk_input, run_stage
from physis_ros.runtime import wire
from physis_ros.runtime.device import DeviceIO
from physis_ros.runtime.plans import Stage, next_stage
from physis_ros.runtime.scheduler import BatchScheduler
from physis_ros.runtime.security import CurveKeys

log = logging.getLogger("physis.worker")
HEARTBEAT_S = 0.2
MAX_READY = 1024  # tasks; the engine's in-flight credits keep real loads far below this


@dataclass
class Task:
    stream: str
    chunk: int
    stage: Stage
    state: dict[str, torch.Tensor]
    ts: dict
    received: float = field(default_factory=time.perf_counter)

    @property
    def order(self) -> float:
        """When the chunk entered the pipeline (engine clock): oldest chunk first."""
        return float(self.ts.get("order", 0.0))

    @property
    def deadline(self) -> float:
        return float(self.ts.get("deadline", self.order + 1.0))


class SlotMap:
    """Stable KV slots: each stream gets an index for its life; slot(k) = index * K + (k - 1) in every
    block's table, so a (stream, step) pair always reads and writes the same rows."""

    def __init__(self, max_streams: int, steps: int):
        self.max_streams = max_streams
        self.steps = steps
        self.index: dict[str, int] = {}

    def add(self, stream: str) -> int:
        if stream in self.index:
            return self.index[stream]
        free = sorted(set(range(self.max_streams)) - set(self.index.values()))
        if not free:
            raise RuntimeError(f"no free KV slot for stream '{stream}' (max_streams={self.max_streams})")
        self.index[stream] = free[0]
        return free[0]

    def remove(self, stream: str) -> None:
        self.index.pop(stream, None)

    def slot(self, stream: str, step: int) -> int:
        return self.index[stream] * self.steps + step - 1


@dataclass
class StreamPlacement:
    """What one stream runs here: its hosted stages and where each one's output goes."""

    stages: set[Stage]
    routes: dict[Stage, str]  # next stage's worker data address, or the engine's after the last stage
    epoch: int = 0  # the stream's incarnation: tasks of an earlier one (before a failure) are dropped


class Worker:
    def __init__(self, engine_ctrl: str, worker_id: str, *, device: str = "cpu", bind_host: str = "127.0.0.1",
                 transport: str = "tcp", ipc_dir: str | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, curve_keys: str | None = None):
        self.id = worker_id
        self.device = device
        self.io = DeviceIO(device)
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context()
        self.keys = CurveKeys.load(curve_keys) if curve_keys else None
        self.auth = self.keys.authenticator(self.ctx) if self.keys else None
        self.ctrl = self.ctx.socket(zmq.DEALER)
        if self.keys:
            self.keys.client(self.ctrl)
        self.ctrl.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.ctrl.connect(engine_ctrl)
        self.data_in = self.ctx.socket(zmq.PULL)
        if self.keys:
            self.keys.server(self.data_in)
        self.data_in.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.data_in.setsockopt(zmq.LINGER, 0)
        self.ipc_path: Path | None = None
        if transport == "ipc":
            self.ipc_path = Path(ipc_dir or "/tmp") / f"physis-{os.getpid()}-{worker_id}.sock"
            self.data_addr = f"ipc://{self.ipc_path}"
            self.data_in.bind(self.data_addr)
        else:
            port = self.data_in.bind_to_random_port(f"tcp://{bind_host}")
            self.data_addr = f"tcp://{bind_host}:{port}"
        self.peers: dict[str, zmq.Socket] = {}
        self.model: DiTModel | None = None
        self.load_args: dict = {}
        self.tables: dict[int, KVTable] = {}
        self.slots: SlotMap | None = None
        self.placements: dict[str, StreamPlacement] = {}
        self.ready: list[Task] = []
        self.scheduler: BatchScheduler | None = None
        self.running = True
        self.stats = {"tasks": 0, "stages": 0, "batches": 0, "bad_messages": 0, "errors": 0, "stale": 0,
                      "dropped_sends": 0, "dropped_tasks": 0, "compute_ms": 0.0}

    # ---- sockets -------------------------------------------------------------------------
    def _push(self, address: str) -> zmq.Socket:
        sock = self.peers.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to live connections
            if self.keys:
                self.keys.client(sock)
            sock.connect(address)
            self.peers[address] = sock
        return sock

    def _send_ctrl(self, kind: str, body: dict | None = None, **fields) -> None:
        msg = wire.Message(kind=kind, body={"worker": self.id, **(body or {})}, **fields)
        self.ctrl.send_multipart(wire.encode(msg), copy=False)

    # ---- control plane ---------------------------------------------------------------------
    def handle_control(self, msg: wire.Message) -> None:
        req = msg.body.get("req")
        try:
            result = getattr(self, f"cmd_{msg.kind}")(msg.body) or {}
        except AttributeError:
            self._send_ctrl("error", {"req": req, "error": f"worker cannot handle control kind '{msg.kind}'"})
            return
        except Exception as exc:  # reported to the engine, the worker stays up
            log.exception("control command %s failed", msg.kind)
            self._send_ctrl("error", {"req": req, "error": f"{msg.kind} failed: {exc}"})
            return
        self._send_ctrl("ack", {"req": req, **result})

    def cmd_load(self, body: dict) -> dict:
        """Model, device and scheduling settings; ``blocks`` preloads what the first streams need."""
        torch.set_num_threads(int(body.get("threads", 1)))
        self.load_args = body
        config = from_mapping(ModelConfig, body["model"])
        self.model = None
        self.tables = {}
        self.placements = {}
        self.slots = SlotMap(int(body.get("max_streams", 8)), config.steps)
        self.scheduler = BatchScheduler(policy=body.get("policy", "oldest"), batching=body.get("batching", "off"),
                                        max_batch=int(body.get("max_batch", 4)), profile=body.get("profile"))
        self._ensure_blocks(config, set(body.get("blocks", [])))
        return {"blocks": sorted(self.tables), "kv_bytes": self.kv_bytes()}

    def _ensure_blocks(self, config: ModelConfig, blocks: set[int]) -> None:
        """Hold (at least) these blocks' weights and KV tables; existing tables are kept as they are."""
        have = set() if self.model is None else set(self.model.hosted_blocks)
        if blocks <= have and self.model is not None:
            return
        wanted = sorted(have | blocks)
        ckpt = self.load_args.get("checkpoint")
        if ckpt:
            self.model = load_checkpoint(ckpt, config=config, device=self.device, hosted_blocks=wanted)
        else:
            self.model = build_model(config, device=self.device, hosted_blocks=wanted)
        for b in wanted:
            if b not in self.tables:
                self.tables[b] = self.model.new_kv_table(b, self.slots.max_streams * config.steps)

    def kv_bytes(self) -> int:
        return sum(t.slot_bytes() * t.slots for t in self.tables.values())

    def cmd_start_stream(self, body: dict) -> dict:
        """Host a stream's stages (fresh KV) and learn where each of them sends its output."""
        stream = body["stream"]
        stages = {tuple(s) for s in body["stages"]}
        routes = {tuple(map(int, key.split(","))): addr for key, addr in body["routes"].items()}
        missing = sorted(s for s in stages if s not in routes)
        if missing:
            raise ValueError(f"no route for stages {missing} of stream '{stream}'")
        self._ensure_blocks(self.model.config, {b for _, b in stages})
        self.slots.add(stream)
        for k, b in stages:
            self.tables[b].reset(self.slots.slot(stream, k))
        self.placements[stream] = StreamPlacement(stages, routes, int(body.get("epoch", 0)))
        for addr in set(routes.values()):
            if addr != self.data_addr:
                self._push(addr)
        return {"slot": self.slots.index[stream], "kv_bytes": self.kv_bytes()}

    def cmd_stop_stream(self, body: dict) -> dict:
        stream = body["stream"]
        self.slots.remove(stream)
        self.placements.pop(stream, None)
        self.ready = [t for t in self.ready if t.stream != stream]
        return {}

    def cmd_stats(self, body: dict) -> dict:
        return dict(self.stats)

    def cmd_shutdown(self, body: dict) -> dict:
        self.running = False
        return {}

    # ---- data plane ------------------------------------------------------------------------
    def accept_task(self, frames: list) -> None:
        try:
            msg = wire.decode(frames, self.max_message_bytes)
            if msg.kind != "task" or msg.stage is None:
                raise wire.WireError(f"data socket accepts 'task' messages with a stage, got '{msg.kind}'")
            placement = self.placements.get(msg.stream)
            if placement is None:  # stopped (or never started) here: late tasks of a removed stream
                self.stats["stale"] += 1
                return
            if msg.stage not in placement.stages:
                raise wire.WireError(f"stage {list(msg.stage)} of stream '{msg.stream}' is not hosted by "
                                     f"worker {self.id}")
        except wire.WireError as exc:
            self.stats["bad_messages"] += 1
            log.warning("worker %s dropped a malformed message: %s", self.id, exc)
            self._send_ctrl("error", {"error": f"malformed data message: {exc}", "bad_message": True})
            return
        ts = msg.ts
        if ts.get("epoch", 0) != placement.epoch:
            self.stats["stale"] += 1  # from before the stream was re-admitted: its KV is gone
            return
        if "sent" in ts:
            ts.setdefault("hops", []).append((time.perf_counter() - ts.pop("sent")) * 1e3)
        model, state = self.model, msg.tensors
        if "x" not in state:  # the chunk's first stage: observation in, noise made here
            obs = {k[len(OBS_PREFIX):]: self.io.to_device(v, model.dtype)
                   for k, v in state.items() if k.startswith(OBS_PREFIX)}
            state = chunk_input(obs, model.noise(int(ts.get("seed", 0)), msg.stream, msg.chunk))
        else:
            state = {k: self.io.to_device(v) for k, v in state.items()}
        self.ready.append(Task(msg.stream, msg.chunk, msg.stage, state, ts))
        if len(self.ready) > MAX_READY:  # bounded: a flood costs the oldest work, never memory
            dropped = min(self.ready, key=lambda t: t.order)
            self.ready.remove(dropped)
            self.stats["dropped_tasks"] += 1
            self._send_ctrl("error", {"error": f"ready queue full ({MAX_READY}); dropped chunk {dropped.chunk} "
                                               f"of stream '{dropped.stream}'", "stream": dropped.stream})

    def run_next(self) -> None:
        """Run one stage for the task the policy picks, batched with same-block tasks if that pays."""
        model = self.model
        batch = self.scheduler.pick(self.ready, self._slot_key)
        for t in batch:
            self.ready.remove(t)
        b = batch[0].stage[1]
        slots = [self.slots.slot(t.stream, t.stage[0]) for t in batch]
        try:
            with self.io.timer() as timer:
                states = run_stage(model, b, [t.stage[0] for t in batch], [t.state for t in batch],
                                   KVBatch(self.tables[b], slots))
        except Exception as exc:  # a failing task must not take the worker down
            self.stats["errors"] += 1
            log.exception("stage %s of %d task(s) failed", batch[0].stage, len(batch))
            for t in batch:
                self._send_ctrl("error", {"error": f"task failed: {exc}", "stream": t.stream, "chunk": t.chunk})
            return
        start, end, batch_ms = timer.wall_start, timer.wall_end, timer.ms
        self.scheduler.observe(b, len(batch), batch_ms)
        self.stats["stages"] += len(batch)
        self.stats["batches"] += 1
        self.stats["compute_ms"] += batch_ms
        share = batch_ms / len(batch)  # each chunk is charged its share of the batched forward
        for t, state in zip(batch, states):
            t.ts.setdefault("trace", []).append(
                [t.stage[0], b, self.id, round((start - t.received) * 1e3, 4), round(share, 4), len(batch)])
            t.state = state
            self._forward(t, end)

    def _forward(self, task: Task, now: float) -> None:
        """Queue the task's next stage here, or send it to the next worker or the engine."""
        cfg = self.model.config
        placement = self.placements.get(task.stream)
        if placement is None:  # the stream was stopped while this task ran
            return
        nxt = next_stage(task.stage, cfg.steps, cfg.blocks)
        if nxt is not None and nxt in placement.stages:
            task.stage, task.received = nxt, now
            self.ready.append(task)
            return
        self.stats["tasks"] += 1
        tensors = self.io.to_host({"x": task.state["x"]} if nxt is None else task.state)
        task.ts["sent"] = time.perf_counter()
        kind = "output" if nxt is None else "task"
        out = wire.Message(kind, task.stream, task.chunk, nxt, tensors, task.ts, {"worker": self.id})
        try:
            # Never block on a peer that is gone (a lost worker): drop, count, and let the engine recover.
            self._push(placement.routes[task.stage]).send_multipart(wire.encode(out), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats["dropped_sends"] += 1

    def _slot_key(self, task: Task) -> tuple[str, int, int]:
        return (task.stream, task.stage[0], task.stage[1])

    # ---- main loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        self._send_ctrl("hello", {"data": self.data_addr, "pid": os.getpid(), "device": self.device})
        poller = zmq.Poller()
        poller.register(self.ctrl, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_S
        try:
            while self.running:
                timeout = 0 if self.ready else max(0.0, next_beat - time.monotonic()) * 1e3
                events = dict(poller.poll(timeout))
                if self.ctrl in events:
                    self._drain_ctrl()
                if self.data_in in events:
                    while True:
                        try:
                            frames = self.data_in.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.accept_task(frames)
                if self.ready:
                    self.run_next()
                now = time.monotonic()
                if now >= next_beat:
                    self._send_ctrl("heartbeat", {"stats": self.stats, "queue": len(self.ready)})
                    next_beat = now + HEARTBEAT_S
        finally:
            self.close()

    def _drain_ctrl(self) -> None:
        while True:
            try:
                frames = self.ctrl.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames, self.max_message_bytes)
            except wire.WireError as exc:
                self.stats["bad_messages"] += 1
                log.warning("worker %s dropped a malformed control message: %s", self.id, exc)
                continue
            self.handle_control(msg)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(linger=1000)
        self.data_in.close(linger=0)
        self.ctrl.close(linger=200)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
