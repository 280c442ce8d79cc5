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
hidden state crosses the network only where the plan changes worker. What the
worker hosts (blocks, KV tables, placements) is :mod:`~physis_ros.runtime.hosting`.

Nothing a peer sends can stop the loop: every message is decoded into its
declared type or dropped and counted, each turn handles a bounded number of
messages so stages and heartbeats keep running under a flood, and a chunk this
worker cannot pass on (queue full, send refused, stage failed) is reported to
the engine at once so that its stream is reset rather than stalled.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

from physis_ros import heap
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.batching import BatchPolicy
from physis_ros.runtime.device import DeviceIO
from physis_ros.runtime.hops import TorchHops
from physis_ros.runtime.shm_hops import ShmHops
from physis_ros.runtime.hosting import StageHost
from physis_ros.runtime.security import CurveKeys
from physis_ros.runtime.tasks import TaskRunner

log = logging.getLogger("physis.worker")
HEARTBEAT_S = 0.2
POLL_BUSY_S = 0.0005  # with local stages ready, poll the sockets at most this often
DATA_BURST = 32   # data messages accepted per loop turn: a flood cannot starve stages or heartbeats
CTRL_BURST = 16
# How long the loader thread (a model family's import, weights read and built) may hold the interpreter before
# the stage loop gets it back: Python's default, 5 ms, is paid by every stage's step from one torch call to the
# next while a load runs, and a running stream's chunk took over a second (reset by its bound) while another
# stream's model was imported. No cost while the stage loop runs alone.
GIL_SWITCH_S = 0.0002
PEER_CONNECT_WAIT_S = 1.0   # at a stream's start, how long the next stages' sockets may take to connect


class _ForwardToEngine(logging.Handler):
    """Sends this worker's log lines to the engine, which logs them under the worker's name. It sits on
    the ``physis`` logger, so every ``physis.*`` line the worker process makes (``physis.worker``,
    ``physis.hops``, ...) is forwarded once; lines of loggers other than ``physis.worker`` keep their
    source in front (``hops: ...``), since workers spawned by the engine have no stderr log.

    A ZeroMQ socket belongs to one thread: lines logged on other threads (the hop sender and receivers)
    wait in a queue that the worker's loop sends from (:meth:`flush`)."""

    MAX_PENDING = 1000   # lines from other threads waiting for the loop; beyond it they are counted, not kept

    def __init__(self, worker: Worker, level: int):
        super().__init__(level)
        self.worker = worker
        self.owner = threading.get_ident()
        self.pending: queue.SimpleQueue[p.LogRecord] = queue.SimpleQueue()
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        level = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning"}.get(record.levelno, "error")
        try:
            text = self.format(record)
            source = record.name.split(".", 1)[1] if record.name.startswith("physis.") else ""
            if source and source != "worker":
                text = f"{source}: {text}"
            msg = p.LogRecord(worker=self.worker.id, level=level, text=p.clip_text(text))
            if threading.get_ident() == self.owner:
                self.worker.send_ctrl(msg)
            elif self.pending.qsize() < self.MAX_PENDING:
                self.pending.put(msg)
            else:
                self.dropped += 1
        except Exception:  # never let logging take the worker down
            pass

    def flush(self) -> None:
        """Send the lines other threads logged (on the worker's own thread)."""
        while not self.pending.empty():
            self.worker.send_ctrl(self.pending.get_nowait())


class Worker:
    def __init__(self, engine_ctrl: str, worker_id: str, *, device: str = "cpu", bind_host: str = "127.0.0.1",
                 transport: str = "tcp", ipc_dir: str | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, curve_keys: str | CurveKeys | None = None,
                 forward_logs: bool = True):
        self.id = worker_id
        self.device = device
        self.bind_host = bind_host
        self.io = DeviceIO(device)
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context()
        # A key directory (physis-worker --curve-keys), or the keys themselves (a Ray actor: security.ephemeral_keys)
        self.keys = curve_keys if isinstance(curve_keys, CurveKeys) else CurveKeys.load(curve_keys) if curve_keys \
            else None
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
        self.poller = zmq.Poller()
        self.poller.register(self.ctrl, zmq.POLLIN)
        self.poller.register(self.data_in, zmq.POLLIN)
        self.host = StageHost(device)
        self.starting: dict[str, tuple[p.StartStream, list]] = {}  # streams waiting for their blocks
        self.running = True
        self.serving = False   # serve() runs: this process is the worker's own
        self.stats = p.WorkerStats()
        self.tasks = TaskRunner(worker_id, self.host, self.io, self.stats, max_message_bytes, self._push, self.send_ctrl,
                                self._has_task)
        self._log_handler = _ForwardToEngine(self, logging.INFO) if forward_logs else None
        if self._log_handler is not None:   # every physis.* logger, not only physis.worker
            logging.getLogger("physis").addHandler(self._log_handler)

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

    def _has_task(self) -> bool:
        """Whether a task (or a link's arrival) waits for the loop: the data sockets' event flags, no poll and
        no wait. Control messages wait for the loop's next turn."""
        if self.data_in.get(zmq.EVENTS) & zmq.POLLIN:
            return True
        hops = self.tasks.hops
        return hops is not None and bool(hops.wake.get(zmq.EVENTS) & zmq.POLLIN)

    def send_ctrl(self, msg: p.Message) -> None:
        try:
            self.ctrl.send_multipart(wire.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the engine is not reading: it will notice the silence itself
            pass

    # ---- control plane ---------------------------------------------------------------------
    def handle_control(self, rec: wire.Received) -> None:
        msg = rec.msg
        handler = {p.Load: self.cmd_load, p.StartStream: self.cmd_start_stream, p.StopStream: self.cmd_stop_stream,
                   p.Stats: self.cmd_stats, p.Shutdown: self.cmd_shutdown}[type(msg)]
        try:
            fields = handler(msg)
        except Exception as exc:  # reported to the engine, the worker stays up
            self._failed(msg, exc)
            return
        if fields is not None:  # None: answered later (a stream waiting for its blocks)
            self.send_ctrl(p.Ack(req=msg.req, worker=self.id, **fields))

    def _failed(self, msg: p.ToWorker, exc: BaseException) -> None:
        log.warning("worker %s: %s failed: %s", self.id, type(msg).__name__, exc)
        self.send_ctrl(p.Failed(req=msg.req, worker=self.id, error=p.clip_text(f"{type(msg).__name__} failed: {exc}")))

    def cmd_load(self, msg: p.Load) -> dict:
        """How this worker runs: threads, ready-queue bound, batching; streams bring their models."""
        torch.set_num_threads(msg.threads)
        tasks = self.tasks
        tasks.settings, tasks.accepted = msg, 0
        tasks.policy = BatchPolicy(policy=msg.policy, batching=msg.batching, max_batch=msg.max_batch)
        if msg.hops == "torch" and tasks.hops is None:
            tasks.hops = TorchHops(self.id, msg.hop_store, self.device, bind_host=self.bind_host,
                                  timeout_s=msg.hop_timeout_s, ctx=self.ctx, max_bytes=self.max_message_bytes)
            self.poller.register(tasks.hops.wake, zmq.POLLIN)
        if msg.hops == "shm" and tasks.shm is None:
            tasks.shm = ShmHops(self.id, msg.hop_ring_mb * 1024 * 1024)
        return {"kv_bytes": self.host.kv_bytes()}

    def cmd_start_stream(self, msg: p.StartStream) -> dict | None:
        """Host a stream's stages (fresh KV) under a new epoch, once the blocks it needs are here."""
        if self.tasks.policy is None:
            raise RuntimeError("not loaded: the engine sends Load first")
        pending = self.host.prepare(msg) + self._connect(msg)
        self.tasks.drop_stream(msg.stream)
        if pending:
            self.starting[msg.stream] = (msg, pending)
            return None
        return self._start(msg)

    def _connect(self, msg: p.StartStream) -> list:
        """Futures of the links the stream needs that are not built yet (hops: torch; shm rings are made now)."""
        if not msg.links:
            return []
        if self.tasks.shm is not None:  # a ring for each peer this worker hands states to
            to = {r.worker for r in msg.routes}
            for link in msg.links:
                if link.peer in to:
                    self.tasks.shm.connect(link.peer, link.gen)
            return []
        if self.tasks.hops is None:
            raise RuntimeError("the stream names hop links but this worker was loaded with hops 'zmq'")
        return [f for link in msg.links if (f := self.tasks.hops.connect(link.peer, link.gen)) is not None]

    def _attach(self) -> None:
        self.host.attach_ready()
        if self.tasks.hops is not None:
            self.tasks.hops.attach_built()

    def _start(self, msg: p.StartStream) -> dict:
        self.host.start_stream(msg)
        if msg.model.batch_costs:
            for b, by_n in msg.model.batch_costs.items():
                self.tasks.policy.seed((msg.model.id, int(b)), {int(n): ms for n, ms in by_n.items()})
        peers = [self._push(addr) for addr in set(self.host.placements[msg.stream].routes.values())
                 if addr != self.data_addr]
        # A push socket takes a message only once its connection is up (IMMEDIATE): wait for that, bounded,
        # before the stream's first task can arrive, or a loaded host drops chunk 0 (send_failed) at the start.
        deadline = time.monotonic() + PEER_CONNECT_WAIT_S
        for sock in peers:
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms <= 0 or not sock.poll(left_ms, zmq.POLLOUT):
                break   # a peer not up by then: its first send fails loudly (send_failed), as before
        return {"blocks": self.host.blocks().get(msg.model.id, []), "kv_bytes": self.host.kv_bytes()}

    def start_stream_now(self, msg: p.StartStream) -> dict:
        """Load what the stream needs, waiting, then host it (in-process tools and tests)."""
        for future in self.host.prepare(msg) + self._connect(msg):
            future.result()
        self._attach()
        return self._start(msg)

    def finish_starts(self) -> None:
        """Attach what the loader finished and answer the streams whose blocks are all here."""
        try:
            self._attach()
        except Exception as exc:  # a load (or a link) failed: fail every stream waiting (the engine retries or reports)
            for msg, _ in self.starting.values():
                self._failed(msg, exc)
            self.starting.clear()
            return
        for stream, (msg, pending) in list(self.starting.items()):
            failed = next((f.exception() for f in pending if f.done() and f.exception() is not None), None)
            if failed is not None:      # its stages did not fit its model (checked on the loader)
                del self.starting[stream]
                self._failed(msg, failed)
            elif all(f.done() for f in pending) and not self.host.loading_for(msg):
                del self.starting[stream]
                try:
                    self.send_ctrl(p.Ack(req=msg.req, worker=self.id, **self._start(msg)))
                except Exception as exc:
                    self._failed(msg, exc)

    def cmd_stop_stream(self, msg: p.StopStream) -> dict:
        self.starting.pop(msg.stream, None)
        self.host.stop_stream(msg.stream)
        self.tasks.drop_stream(msg.stream)
        return {}

    def cmd_stats(self, msg: p.Stats) -> dict:
        return {"stats": self._stats()}

    def cmd_shutdown(self, msg: p.Shutdown) -> dict:
        self.running = False
        return {}

    def _stats(self) -> p.WorkerStats:
        self.stats.kv_bytes = self.host.kv_bytes()
        self.stats.weight_bytes = self.host.weight_bytes()
        self.stats.device_bytes = torch.cuda.memory_allocated(self.io.device) if self.io.cuda else 0
        self.stats.rss_bytes = int((heap.rss_mb(os.getpid()) or 0.0) * 1024 * 1024)
        return self.stats

    # ---- main loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_S)
        self.send_ctrl(p.Hello(worker=self.id, data=self.data_addr, pid=os.getpid(), device=self.device,
                               host=socket.gethostname()[:128]))
        log.info("up on %s:%s (pid %d), data at %s", socket.gethostname(), self.device, os.getpid(), self.data_addr)
        tasks = self.tasks
        self.serving = True
        heap.settle(collect=True)   # no stream yet: what start-up made is never scanned again
        next_beat = time.monotonic() + HEARTBEAT_S
        next_poll = busy_until = 0.0
        try:
            while self.running:
                now = time.monotonic()
                if tasks.ready and now < next_poll:
                    # Busy with local stages: look at the sockets at most every POLL_BUSY_S, not between every
                    # two stages (a poll costs as much as a small stage's overhead; a chunk runs many stages).
                    events = {}
                else:
                    # Idle: block until a message comes, unless it went idle less than spin_us ago or a Wake
                    # announced one (then poll without sleeping: a sleeping thread's wake-up costs more than a
                    # short spin).
                    idle = not tasks.ready and now >= busy_until and now >= tasks.spin_until
                    timeout = max(0.0, next_beat - now) * 1e3 if idle else 0
                    if self.starting:
                        timeout = min(timeout, 5.0)  # poll the loader
                    events = dict(self.poller.poll(timeout))
                    next_poll = time.monotonic() + POLL_BUSY_S
                if self.ctrl in events:
                    self._drain(self.ctrl, CTRL_BURST, self._on_ctrl)
                if self.data_in in events:
                    self._drain(self.data_in, DATA_BURST, tasks.accept_task)
                if tasks.hops is not None:
                    if tasks.hops.wake in events:
                        tasks.hops.drain_wake()
                    tasks.hops.take_arrivals(tasks.arrived, DATA_BURST)
                if self.starting:
                    self.finish_starts()
                if tasks.ready:
                    tasks.run_next()
                now = time.monotonic()
                if tasks.ready or events:
                    busy_until = now + tasks.settings.spin_us * 1e-6
                if now >= next_beat:
                    if self._log_handler is not None:
                        self._log_handler.flush()
                    self.send_ctrl(p.Heartbeat(worker=self.id, queue=len(tasks.ready), stats=self._stats()))
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
            self.tasks.warn("bad_ctrl", f"dropped a malformed control message: {exc}")
            return
        self.handle_control(rec)

    def close(self) -> None:
        self.host.close()
        if self.tasks.hops is not None:
            self.tasks.hops.close()
        if self.tasks.shm is not None:
            self.tasks.shm.close()
        if self._log_handler is not None:
            logging.getLogger("physis").removeHandler(self._log_handler)
            self._log_handler.flush()   # what the hop threads said last
        for sock in self.peers.values():
            sock.close(linger=1000)
        self.data_in.close(linger=0)
        self.ctrl.close(linger=200)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
