"""Worker process: hosts stages of one model on one device and runs their tasks.

Sockets (all owned by this single-threaded process):

- control: DEALER connected to the engine's ROUTER. Requests in (load, start/stop
  stream, stats, shutdown); acks, failures, lost-task reports, log lines and
  heartbeats out.
- data in: PULL bound on this worker's own address (loopback tcp or ipc). Tasks
  arrive here from the engine or from the previous stage's worker.
- data out: one PUSH per peer worker (next stage elsewhere) and one PUSH to the
  engine's output PULL (the chunk leaves the last stage).

A task runs all consecutive stages this worker hosts before it leaves, so a
hidden state crosses the network only where the plan changes worker. KV caches
never move: each hosted block has a persistent table with one slot per
(stream, step).

Nothing a peer sends can stop the loop: every message is decoded into its
declared type or dropped and counted, each turn handles a bounded number of
messages so stages and heartbeats keep running under a flood, and a chunk this
worker cannot pass on (queue full, send refused, stage failed) is reported to
the engine at once so that its stream is reset rather than stalled.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from physis_ros.config import from_mapping
from physis_ros.logs import Throttle
from physis_ros.model import KVBatch, KVTable, build_model
from physis_ros.model.checkpoint import load_checkpoint
from physis_ros.model.dit import DiTModel
from physis_ros.model.spec import ModelConfig
from physis_ros.model.stages import check_payload, first_state, run_stage
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.batching import BatchPolicy
from physis_ros.runtime.device import DeviceIO
from physis_ros.runtime.plans import Stage, next_stage
from physis_ros.runtime.security import CurveKeys

log = logging.getLogger("physis.worker")
HEARTBEAT_S = 0.2
DATA_BURST = 32   # data messages accepted per loop turn: a flood cannot starve stages or heartbeats
CTRL_BURST = 16


@dataclass
class Job:
    """A chunk's task while it is on this worker: its header, travelling state and arrival time."""

    task: p.Task
    state: dict[str, torch.Tensor]
    received: float = field(default_factory=time.perf_counter)

    @property
    def stream(self) -> str:
        return self.task.stream

    @property
    def chunk(self) -> int:
        return self.task.chunk

    @property
    def stage(self) -> Stage:
        return self.task.stage

    @property
    def order(self) -> float:
        return self.task.order

    @property
    def deadline(self) -> float:
        return self.task.deadline


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
    epoch: int = 0  # the stream's incarnation: tasks of an earlier one (before a reset) are dropped


class _ForwardToEngine(logging.Handler):
    """Sends this worker's log lines to the engine, which logs them under the worker's name."""

    def __init__(self, worker: Worker, level: int):
        super().__init__(level)
        self.worker = worker

    def emit(self, record: logging.LogRecord) -> None:
        level = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning"}.get(record.levelno, "error")
        try:
            self.worker.send_ctrl(p.LogRecord(worker=self.worker.id, level=level,
                                              text=p.clip_text(self.format(record))))
        except Exception:  # never let logging take the worker down
            pass


class Worker:
    def __init__(self, engine_ctrl: str, worker_id: str, *, device: str = "cpu", bind_host: str = "127.0.0.1",
                 transport: str = "tcp", ipc_dir: str | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, curve_keys: str | None = None,
                 forward_logs: bool = True):
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
        self.ctrl.setsockopt(zmq.SNDHWM, 10000)
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
        self.load: p.Load | None = None
        self.tables: dict[int, KVTable] = {}
        self.slots: SlotMap | None = None
        self.placements: dict[str, StreamPlacement] = {}
        self.ready: list[Job] = []
        self.policy: BatchPolicy | None = None
        self.running = True
        self.accepted = 0
        self.stats = p.WorkerStats()
        self.throttle = Throttle(5.0)
        self._log_handler = _ForwardToEngine(self, logging.INFO) if forward_logs else None
        if self._log_handler is not None:
            log.addHandler(self._log_handler)

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

    def send_ctrl(self, msg: p.Message) -> None:
        try:
            self.ctrl.send_multipart(wire.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the engine is not reading: it will notice the silence itself
            pass

    def _warn(self, key: str, text: str) -> None:
        self.throttle.log(log, logging.WARNING, key, f"worker {self.id}: {text}")

    def _lost(self, task: p.Task, reason: str, detail: str) -> None:
        """Report a chunk this worker cannot pass on, so the engine resets its stream now."""
        self._warn(f"lost:{reason}", f"chunk {task.chunk} of stream '{task.stream}' lost ({reason}): {detail}")
        self.send_ctrl(p.TaskLost(worker=self.id, stream=task.stream, chunk=task.chunk, epoch=task.epoch,
                                  reason=reason, detail=p.clip_text(detail)))

    # ---- control plane ---------------------------------------------------------------------
    def handle_control(self, rec: wire.Received) -> None:
        msg = rec.msg
        handler = {p.Load: self.cmd_load, p.StartStream: self.cmd_start_stream, p.StopStream: self.cmd_stop_stream,
                   p.Stats: self.cmd_stats, p.Shutdown: self.cmd_shutdown}[type(msg)]
        try:
            fields = handler(msg) or {}
        except Exception as exc:  # reported to the engine, the worker stays up
            log.warning("worker %s: %s failed: %s", self.id, msg.kind if hasattr(msg, "kind") else type(msg).__name__,
                        exc)
            self.send_ctrl(p.Failed(req=msg.req, worker=self.id,
                                    error=p.clip_text(f"{type(msg).__name__} failed: {exc}")))
            return
        self.send_ctrl(p.Ack(req=msg.req, worker=self.id, **fields))

    def cmd_load(self, msg: p.Load) -> dict:
        """Model, device and scheduling settings; ``blocks`` preloads what the first streams need."""
        config = from_mapping(ModelConfig, msg.model)
        torch.set_num_threads(msg.threads)
        self.load = msg
        self.model = None
        self.tables = {}
        self.placements = {}
        self.ready = []
        self.accepted = 0
        self.slots = SlotMap(msg.max_streams, config.steps)
        self.policy = BatchPolicy(policy=msg.policy, batching=msg.batching, max_batch=msg.max_batch,
                                  profile=msg.profile)
        self._ensure_blocks(config, set(msg.blocks))
        return {"blocks": sorted(self.tables), "kv_bytes": self.kv_bytes()}

    def _ensure_blocks(self, config: ModelConfig, blocks: set[int]) -> None:
        """Hold (at least) these blocks' weights and KV tables; existing tables are kept as they are."""
        have = set() if self.model is None else set(self.model.hosted_blocks)
        if blocks <= have and self.model is not None:
            return
        wanted = sorted(have | blocks)
        if self.load.checkpoint:
            self.model = load_checkpoint(self.load.checkpoint, config=config, device=self.device, hosted_blocks=wanted)
        else:
            self.model = build_model(config, device=self.device, hosted_blocks=wanted)
        for b in wanted:
            if b not in self.tables:
                self.tables[b] = self.model.new_kv_table(b, self.slots.max_streams * config.steps)

    def kv_bytes(self) -> int:
        return sum(t.slot_bytes() * t.slots for t in self.tables.values())

    def cmd_start_stream(self, msg: p.StartStream) -> dict:
        """Host a stream's stages (fresh KV) under a new epoch; drop whatever it had queued here."""
        if self.model is None:
            raise RuntimeError("no model loaded")
        stages = set(msg.stages)
        routes = {r.stage: r.address for r in msg.routes}
        cfg = self.model.config
        bad = sorted(s for s in stages if not (1 <= s[0] <= cfg.steps and 0 <= s[1] < cfg.blocks))
        if bad:
            raise ValueError(f"stages {bad} do not exist in model '{cfg.name}' ({cfg.steps} steps x {cfg.blocks} "
                             f"blocks)")
        missing = sorted(s for s in stages if s not in routes)
        if missing:
            raise ValueError(f"no route for stages {missing} of stream '{msg.stream}'")
        self._ensure_blocks(cfg, {b for _, b in stages})
        self.slots.add(msg.stream)
        for k, b in stages:
            self.tables[b].reset(self.slots.slot(msg.stream, k))
        self.ready = [j for j in self.ready if j.stream != msg.stream]
        self.placements[msg.stream] = StreamPlacement(stages, routes, msg.epoch)
        for addr in set(routes.values()):
            if addr != self.data_addr:
                self._push(addr)
        return {"slot": self.slots.index[msg.stream], "kv_bytes": self.kv_bytes()}

    def cmd_stop_stream(self, msg: p.StopStream) -> dict:
        if self.slots is not None:
            self.slots.remove(msg.stream)
        self.placements.pop(msg.stream, None)
        self.ready = [j for j in self.ready if j.stream != msg.stream]
        return {}

    def cmd_stats(self, msg: p.Stats) -> dict:
        return {"stats": self._stats()}

    def cmd_shutdown(self, msg: p.Shutdown) -> dict:
        self.running = False
        return {}

    def _stats(self) -> p.WorkerStats:
        self.stats.kv_bytes = self.kv_bytes()
        return self.stats

    # ---- data plane ------------------------------------------------------------------------
    def accept_task(self, frames: list) -> None:
        try:
            rec = wire.decode(frames, wire.DATA, self.max_message_bytes)
        except wire.WireError as exc:
            self.stats.bad_messages += 1
            self._warn("bad_data", f"dropped a malformed data message: {exc}")
            return
        task = rec.msg
        placement = self.placements.get(task.stream)
        if placement is None or task.epoch < placement.epoch:  # a stopped stream, or an earlier incarnation
            self.stats.stale += 1
            return
        if task.epoch > placement.epoch:
            self._lost(task, "epoch_ahead", f"task of epoch {task.epoch}, this worker hosts epoch {placement.epoch}")
            return
        if task.stage not in placement.stages:
            self.stats.bad_messages += 1
            self._warn("not_hosted", f"dropped a task for stage {list(task.stage)} of stream '{task.stream}', "
                                     f"which is not hosted here")
            return
        model = self.model
        first = task.stage == (model.config.steps, 0)
        try:
            check_payload(model.config, first, task.stage[1], rec.tensors)
        except ValueError as exc:
            self.stats.bad_messages += 1
            self._lost(task, "task_failed", f"malformed payload: {exc}")
            return
        self.accepted += 1
        if self.load.faults.drop_task and self.accepted == self.load.faults.drop_task:
            self.stats.injected_drops += 1  # fault injection: vanish without a word, as a lost message would
            return
        if task.sent:
            task.hops.append(min(max(0.0, (time.perf_counter() - task.sent) * 1e3), 1e9))
        if first:  # the chunk's first stage: observation in, noise made here
            state = first_state(rec.tensors, model.noise(task.seed, task.stream, task.chunk),
                                lambda t: self.io.to_device(t, model.dtype))
        else:
            state = {k: self.io.to_device(v) for k, v in rec.tensors.items()}
        self.ready.append(Job(task, state))
        if len(self.ready) > self.load.max_ready:  # bounded: a burst costs the oldest chunk, reported
            dropped = min(self.ready, key=lambda j: j.order)
            self.ready.remove(dropped)
            self.stats.dropped_tasks += 1
            self._lost(dropped.task, "queue_full", f"ready queue full ({self.load.max_ready} tasks)")

    def run_next(self) -> None:
        """Run one stage for the task the policy picks, batched with same-block tasks if that pays."""
        model = self.model
        batch = self.policy.pick(self.ready, self._slot_key)
        for j in batch:
            self.ready.remove(j)
        b = batch[0].stage[1]
        slots = [self.slots.slot(j.stream, j.stage[0]) for j in batch]
        try:
            with self.io.timer() as timer:
                states = run_stage(model, b, [j.stage[0] for j in batch], [j.state for j in batch],
                                   KVBatch(self.tables[b], slots))
        except Exception as exc:  # a failing task must not take the worker down
            self.stats.errors += 1
            log.exception("worker %s: stage %s of %d task(s) failed", self.id, batch[0].stage, len(batch))
            for j in batch:
                self._lost(j.task, "task_failed", f"stage {list(j.stage)} raised {type(exc).__name__}: {exc}")
            return
        start, end, batch_ms = timer.wall_start, timer.wall_end, timer.ms
        self.policy.observe(b, len(batch), batch_ms)
        self.stats.stages += len(batch)
        self.stats.batches += 1
        self.stats.compute_ms += batch_ms
        share = batch_ms / len(batch)  # each chunk is charged its share of the batched forward
        for j, state in zip(batch, states):
            j.task.trace.append(p.TraceEntry(j.stage[0], b, self.id, round(max(0.0, start - j.received) * 1e3, 4),
                                             round(share, 4), len(batch)))
            j.state = state
            self._forward(j, end)

    def _forward(self, job: Job, now: float) -> None:
        """Queue the job's next stage here, or send it to the next worker or the engine."""
        cfg = self.model.config
        task = job.task
        placement = self.placements.get(task.stream)
        if placement is None or placement.epoch != task.epoch:  # stopped or reset while this task ran
            return
        nxt = next_stage(task.stage, cfg.steps, cfg.blocks)
        if nxt is not None and nxt in placement.stages:
            task.stage, job.received = nxt, now
            self.ready.append(job)
            return
        self.stats.tasks += 1
        route = placement.routes[task.stage]
        sent = time.perf_counter()
        if nxt is None:
            out: p.Message = p.Output(stream=task.stream, chunk=task.chunk, epoch=task.epoch, worker=self.id,
                                      sent=sent, hops=task.hops, trace=task.trace)
            tensors = self.io.to_host({"x": job.state["x"]})
        else:
            task.stage, task.sent, out = nxt, sent, task
            tensors = self.io.to_host(job.state)
        try:
            # Never block on a peer that is gone (a lost worker): drop, report, and let the engine recover.
            self._push(route).send_multipart(wire.encode(out, tensors), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.dropped_sends += 1
            self._lost(task, "send_failed", "the next stage's worker did not take the message")

    def _slot_key(self, job: Job) -> tuple[str, int, int]:
        return (job.stream, job.stage[0], job.stage[1])

    # ---- main loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        self.send_ctrl(p.Hello(worker=self.id, data=self.data_addr, pid=os.getpid(), device=self.device,
                               host=socket.gethostname()[:128]))
        poller = zmq.Poller()
        poller.register(self.ctrl, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_S
        try:
            while self.running:
                timeout = 0 if self.ready else max(0.0, next_beat - time.monotonic()) * 1e3
                events = dict(poller.poll(timeout))
                if self.ctrl in events:
                    self._drain(self.ctrl, CTRL_BURST, self._on_ctrl)
                if self.data_in in events:
                    self._drain(self.data_in, DATA_BURST, self.accept_task)
                if self.ready:
                    self.run_next()
                now = time.monotonic()
                if now >= next_beat:
                    self.send_ctrl(p.Heartbeat(worker=self.id, queue=len(self.ready), stats=self._stats()))
                    next_beat = now + HEARTBEAT_S
        finally:
            self.close()

    @staticmethod
    def _drain(sock: zmq.Socket, limit: int, handle) -> None:
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _on_ctrl(self, frames: list) -> None:
        try:
            rec = wire.decode(frames, wire.TO_WORKER, self.max_message_bytes)
        except wire.WireError as exc:
            self.stats.bad_messages += 1
            self._warn("bad_ctrl", f"dropped a malformed control message: {exc}")
            return
        self.handle_control(rec)

    def close(self) -> None:
        if self._log_handler is not None:
            log.removeHandler(self._log_handler)
        for sock in self.peers.values():
            sock.close(linger=1000)
        self.data_in.close(linger=0)
        self.ctrl.close(linger=200)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
