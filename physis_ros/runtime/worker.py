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

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from physis_ros.config import from_mapping
from physis_ros.model import KVBatch, build_model
from physis_ros.model.checkpoint import load_checkpoint
from physis_ros.model.dit import DiTModel
from physis_ros.model.spec import ModelConfig
from physis_ros.model.stages import OBS_PREFIX, chunk_input, run_stage
from physis_ros.runtime import wire
from physis_ros.runtime.plans import Stage, next_stage
from physis_ros.runtime.scheduler import BatchScheduler

log = logging.getLogger("physis.worker")
HEARTBEAT_S = 0.2


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
    """Stable KV slots: each stream gets an index; slot(block b, step k) is fixed for its life."""

    def __init__(self, max_streams: int, steps_of_block: dict[int, list[int]]):
        self.max_streams = max_streams
        self.steps_of_block = steps_of_block
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

    def slot(self, stream: str, block: int, step: int) -> int:
        if stream not in self.index:
            raise KeyError(f"stream '{stream}' was not started on this worker")
        steps = self.steps_of_block[block]
        return self.index[stream] * len(steps) + steps.index(step)


class Worker:
    def __init__(self, engine_ctrl: str, worker_id: str, *, device: str = "cpu", bind_host: str = "127.0.0.1",
                 transport: str = "tcp", ipc_dir: str | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES):
        self.id = worker_id
        self.device = device
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.ctrl.connect(engine_ctrl)
        self.data_in = self.ctx.socket(zmq.PULL)
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
        self.tables: dict[int, object] = {}
        self.slots: SlotMap | None = None
        self.hosted: set[Stage] = set()
        self.route: dict[Stage, str] = {}  # next stage's data address, or the engine's for the last stage
        self.ready: list[Task] = []
        self.scheduler: BatchScheduler | None = None
        self.running = True
        self.stats = {"tasks": 0, "stages": 0, "batches": 0, "bad_messages": 0, "errors": 0, "compute_ms": 0.0}

    # ---- sockets -------------------------------------------------------------------------
    def _push(self, address: str) -> zmq.Socket:
        sock = self.peers.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 1000)
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
        torch.set_num_threads(int(body.get("threads", 1)))
        config = from_mapping(ModelConfig, body["model"])
        stages = [tuple(s) for s in body["stages"]]
        blocks = sorted({b for _, b in stages})
        if body.get("checkpoint"):
            self.model = load_checkpoint(body["checkpoint"], config=config, device=self.device, hosted_blocks=blocks)
        else:
            self.model = build_model(config, device=self.device, hosted_blocks=blocks)
        self.hosted = set(stages)
        steps_of_block = {b: sorted(k for k, bb in stages if bb == b) for b in blocks}
        max_streams = int(body.get("max_streams", 8))
        self.slots = SlotMap(max_streams, steps_of_block)
        self.tables = {b: self.model.new_kv_table(b, max_streams * len(steps)) for b, steps in steps_of_block.items()}
        self.scheduler = BatchScheduler(policy=body.get("policy", "oldest"), batching=body.get("batching", "off"),
                                        max_batch=int(body.get("max_batch", 4)), profile=body.get("profile"))
        kv_bytes = sum(t.k.numel() * t.k.element_size() * 2 for t in self.tables.values())
        return {"blocks": blocks, "kv_bytes": kv_bytes}

    def cmd_assign(self, body: dict) -> dict:
        self.route = {tuple(map(int, key.split(","))): addr for key, addr in body["routes"].items()}
        missing = [s for s in self.hosted if s not in self.route]
        if missing:
            raise ValueError(f"no route for hosted stages {missing}")
        for addr in set(self.route.values()):
            if addr != self.data_addr:
                self._push(addr)
        return {}

    def cmd_start_stream(self, body: dict) -> dict:
        stream = body["stream"]
        self.slots.add(stream)
        for b, table in self.tables.items():
            for k in self.slots.steps_of_block[b]:
                table.reset(self.slots.slot(stream, b, k))
        return {"slot": self.slots.index[stream]}

    def cmd_stop_stream(self, body: dict) -> dict:
        self.slots.remove(body["stream"])
        self.ready = [t for t in self.ready if t.stream != body["stream"]]
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
            if msg.stage not in self.hosted:
                raise wire.WireError(f"stage {list(msg.stage)} is not hosted by worker {self.id}")
            if self.slots is None or msg.stream not in self.slots.index:
                raise wire.WireError(f"stream '{msg.stream}' was not started on worker {self.id}")
        except wire.WireError as exc:
            self.stats["bad_messages"] += 1
            log.warning("worker %s dropped a malformed message: %s", self.id, exc)
            self._send_ctrl("error", {"error": f"malformed data message: {exc}", "bad_message": True})
            return
        ts = msg.ts
        if "sent" in ts:
            ts.setdefault("hops", []).append((time.perf_counter() - ts.pop("sent")) * 1e3)
        model, state = self.model, msg.tensors
        if "x" not in state:  # the chunk's first stage: observation in, noise made here
            obs = {k[len(OBS_PREFIX):]: v.to(device=model.device, dtype=model.dtype)
                   for k, v in state.items() if k.startswith(OBS_PREFIX)}
            state = chunk_input(obs, model.noise(int(ts.get("seed", 0)), msg.stream, msg.chunk))
        else:
            state = {k: v.to(model.device) for k, v in state.items()}
        self.ready.append(Task(msg.stream, msg.chunk, msg.stage, state, ts))

    def run_next(self) -> None:
        """Run one stage for the task the policy picks, batched with same-block tasks if that pays."""
        model = self.model
        batch = self.scheduler.pick(self.ready, self._slot_key)
        for t in batch:
            self.ready.remove(t)
        b = batch[0].stage[1]
        slots = [self.slots.slot(t.stream, b, t.stage[0]) for t in batch]
        start = time.perf_counter()
        try:
            states = run_stage(model, b, [t.stage[0] for t in batch], [t.state for t in batch],
                               KVBatch(self.tables[b], slots))
            if states[0]["x"].device.type == "cuda":
                torch.cuda.synchronize(states[0]["x"].device)
        except Exception as exc:  # a failing task must not take the worker down
            self.stats["errors"] += 1
            log.exception("stage %s of %d task(s) failed", batch[0].stage, len(batch))
            for t in batch:
                self._send_ctrl("error", {"error": f"task failed: {exc}", "stream": t.stream, "chunk": t.chunk})
            return
        end = time.perf_counter()
        batch_ms = (end - start) * 1e3
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
        nxt = next_stage(task.stage, cfg.steps, cfg.blocks)
        if nxt is not None and nxt in self.hosted:
            task.stage, task.received = nxt, now
            self.ready.append(task)
            return
        self.stats["tasks"] += 1
        task.ts["sent"] = time.perf_counter()
        if nxt is None:
            out = wire.Message("output", task.stream, task.chunk, None, {"x": task.state["x"]}, task.ts,
                               {"worker": self.id})
        else:
            out = wire.Message("task", task.stream, task.chunk, nxt, task.state, task.ts)
        self._push(self.route[task.stage]).send_multipart(wire.encode(out), copy=False)

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
        self.ctx.term()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-worker", description="Run one physis_ros worker process.")
    parser.add_argument("--connect", required=True, help="engine control address, e.g. tcp://10.0.0.2:5555")
    parser.add_argument("--id", default=f"w-{os.getpid()}", help="worker name (unique per engine)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--bind-host", default="127.0.0.1",
                        help="interface for this worker's data socket (loopback unless told otherwise)")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--ipc-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"[worker {args.id}] %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    Worker(args.connect, args.id, device=args.device, bind_host=args.bind_host, transport=args.transport,
           ipc_dir=args.ipc_dir).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
