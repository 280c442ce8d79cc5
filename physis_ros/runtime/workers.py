"""The engine's worker pool: processes, the control plane, heartbeats, failure detection and restart.

Workers are local processes started here (``launcher: local``), Ray actors in a
placement group (``launcher: ray``, :mod:`~physis_ros.runtime.launchers`: to this
pool an actor looks like a process) or started by hand elsewhere (``launcher:
external``), each connecting back to the engine's ROUTER control socket (DEALER
with its name as identity). A worker is *lost* when its process
exits or when no heartbeat arrives within ``heartbeat_timeout_s`` (a hung or
stopped process is then killed, so it can never come back half-alive). The pool
reports the loss, then brings the worker back by itself: new process, hello,
load, with retries and exponential backoff, until ``restart_budget_s`` is spent;
a fault during a restart is just one more failed attempt. Only a worker that
cannot be brought back within the budget ends the engine (``on_gone``).

Everything the workers send is decoded into its declared type; malformed or
unknown messages are counted and logged at most once per few seconds, and
every loop handles a bounded number of messages per turn so that a flood on
the control socket cannot starve the heartbeat monitor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from physis_ros.logs import Throttle
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.security import CurveKeys
from physis_ros.runtime.settings import EngineConfig
from physis_ros.runtime.shm_hops import remove_rings_of

log = logging.getLogger("physis.engine")
worker_log = logging.getLogger("physis.worker")
BURST = 64                 # messages handled per turn before yielding to the other tasks
BACKOFF_S = (0.2, 5.0)     # first and longest wait between restart attempts
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class EngineError(RuntimeError):
    """The engine cannot go on: a worker failed to start, died for good, or stopped answering."""


@dataclass
class WorkerProc:
    name: str
    index: int
    proc: subprocess.Popen | None   # or launchers.RayWorker: the same poll/wait/kill/pid/returncode
    data_addr: str = ""
    pid: int = 0
    host: str = ""
    device: str = ""
    last_seen: float = 0.0
    alive: bool = False          # up and loaded: streams may be placed on it
    restarting: bool = False
    restarts: int = 0
    queue: int = 0
    stats: p.WorkerStats = field(default_factory=p.WorkerStats)
    hello: asyncio.Future | None = None


class WorkerPool:
    def __init__(self, ctx: zmq.asyncio.Context, config: EngineConfig, ctrl_addr_base: str, ipc_dir: str | None,
                 keys: CurveKeys | None = None, launcher=None):
        self.ctx = ctx
        self.config = config
        self.launcher = launcher             # launchers.RayLauncher, or None: local processes
        self.ipc_dir = ipc_dir
        self.keys = keys
        self.max_bytes = config.max_message_mb * 1024 * 1024
        self.workers: dict[str, WorkerProc] = {}
        self.counts: Counter = Counter()     # bad_control, unknown_sender, ...
        self.throttle = Throttle(5.0)
        # Set by the engine: what to do when a worker is lost / cannot come back / reports a lost task,
        # and how to load a (re)started worker.
        self.on_lost: Callable[[WorkerProc, str], None] = lambda w, reason: None
        self.on_gone: Callable[[WorkerProc, str], None] = lambda w, reason: None
        self.on_task_lost: Callable[[p.TaskLost], None] = lambda msg: None
        self.on_started: Callable[[WorkerProc], Awaitable[None]] | None = None
        self._req = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._changed = asyncio.Event()      # a worker came up (readmissions wait on it)
        self._restarts: dict[str, asyncio.Task] = {}
        self.ctrl = ctx.socket(zmq.ROUTER)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if keys is not None:
            keys.server(self.ctrl)
        if ctrl_addr_base.startswith("ipc://"):
            self.ctrl_addr = ctrl_addr_base
            self.ctrl.bind(self.ctrl_addr)
        elif config.ctrl_port:
            self.ctrl_addr = f"{ctrl_addr_base}:{config.ctrl_port}"
            self.ctrl.bind(self.ctrl_addr)
        else:
            self.ctrl_addr = f"{ctrl_addr_base}:{self.ctrl.bind_to_random_port(ctrl_addr_base)}"

    # ---- processes ---------------------------------------------------------------------------
    def spawn(self, index: int) -> WorkerProc:
        """Start worker ``w<index>`` (again, if it existed); wait for it with :meth:`wait_hello`."""
        cfg = self.config
        name = f"w{index}"
        old = self.workers.get(name)
        if self.launcher is not None:  # a Ray actor in bundle `index`
            w = WorkerProc(name, index, self.launcher.start(index, self.ctrl_addr), last_seen=time.monotonic(),
                           restarts=0 if old is None else old.restarts + 1,
                           hello=asyncio.get_running_loop().create_future())
            self.workers[name] = w
            return w
        cmd = [sys.executable, "-m", "physis_ros.cli.worker", "--connect", self.ctrl_addr, "--id", name,
               "--device", cfg.device_of(index), "--bind-host", cfg.bind_host, "--transport", cfg.transport,
               "--threads", str(cfg.threads_per_worker), "--parent-pid", str(os.getpid()), "--no-log-stderr"]
        if self.ipc_dir is not None:
            cmd += ["--ipc-dir", self.ipc_dir]
        if cfg.curve_keys:
            cmd += ["--curve-keys", cfg.curve_keys]
        cmd += ["--max-message-mb", str(cfg.max_message_mb)]
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads_per_worker)}
        w = WorkerProc(name, index, subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL),
                       last_seen=time.monotonic(), restarts=0 if old is None else old.restarts + 1,
                       hello=asyncio.get_running_loop().create_future())
        self.workers[name] = w
        return w

    def expect(self, index: int) -> WorkerProc:
        """A worker started by hand elsewhere (``physis-worker --connect``): wait for it to say hello."""
        name = f"w{index}"
        old = self.workers.get(name)
        w = WorkerProc(name, index, None, last_seen=time.monotonic(), restarts=0 if old is None else old.restarts + 1,
                       hello=asyncio.get_running_loop().create_future())
        self.workers[name] = w
        return w

    def start(self, index: int) -> WorkerProc:
        return self.spawn(index) if self.config.spawn_workers else self.expect(index)

    async def wait_hello(self, w: WorkerProc, timeout: float | None = None) -> None:
        timeout = self.config.start_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not w.hello.done():
            self._check_process(w, "before it said hello")
            if time.monotonic() > deadline:
                raise EngineError(f"worker {w.name} did not start within {timeout:.0f} s")
            await asyncio.wait([w.hello], timeout=0.05)
        w.last_seen = time.monotonic()

    @staticmethod
    def _check_process(w: WorkerProc, when: str) -> None:
        if w.proc is not None and w.proc.poll() is not None:
            raise EngineError(f"worker {w.name} exited with code {w.proc.returncode} {when}")

    def kill(self, w: WorkerProc) -> None:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
        self._unlink(w)

    def _unlink(self, w: WorkerProc) -> None:
        """What a gone worker leaves on this host: its ipc socket, and the shared rings it wrote (hops shm)."""
        if w.data_addr.startswith("ipc://"):
            try:
                os.unlink(w.data_addr[len("ipc://"):])
            except FileNotFoundError:
                pass
        if self.config.hops == "shm" and w.pid:
            remove_rings_of(w.pid)

    def mark_up(self, w: WorkerProc) -> None:
        w.alive, w.restarting, w.last_seen = True, False, time.monotonic()
        self._changed.set()

    async def wait_up(self, names: list[str]) -> None:
        """Until every named worker is up (alive and loaded)."""
        while not all(self.workers[n].alive for n in names):
            self._changed.clear()
            await self._changed.wait()

    async def stop(self) -> None:
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        for w in self.workers.values():
            if w.data_addr and (w.proc is None or w.proc.poll() is None) and (w.alive or w.hello.done()):
                try:
                    await self.request(w.name, p.Shutdown(req=0), timeout=1.0)
                except EngineError:
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
            self._unlink(w)
        self.ctrl.close(linger=0)

    # ---- control plane -------------------------------------------------------------------------
    async def request(self, worker: str, msg: p.ToWorker, timeout: float = 10.0) -> p.Ack:
        """Send a request and wait for its ack; EngineError if it failed, timed out or the process died."""
        msg.req = next(self._req)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.req] = (worker, fut)
        await self.ctrl.send_multipart([worker.encode(), *wire.encode(msg)], copy=False)
        deadline = time.monotonic() + timeout
        w = self.workers.get(worker)
        try:
            while not fut.done():
                if w is not None:
                    self._check_process(w, f"while handling {type(msg).__name__}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"worker {worker} did not answer '{type(msg).__name__}' within {timeout:.1f} s")
                await asyncio.wait([fut], timeout=min(0.1, left))
            return fut.result()
        finally:
            self._pending.pop(msg.req, None)

    async def control_loop(self) -> None:
        while True:
            await self.ctrl.poll(flags=zmq.POLLIN)
            for _ in range(BURST):
                try:
                    identity, *frames = await self.ctrl.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_control(bytes(identity.buffer).decode(errors="replace"), frames)
            await asyncio.sleep(0)  # let the monitor, feeders and outputs run under a flood

    def _on_control(self, name: str, frames: list) -> None:
        w = self.workers.get(name)
        if w is None:
            self.counts["unknown_sender"] += 1
            self.throttle.log(log, logging.WARNING, "unknown_sender", f"control message from unknown peer "
                                                                      f"{name[:40]!r} dropped")
            return
        try:
            msg = wire.decode(frames, wire.TO_ENGINE, self.max_bytes).msg
        except wire.WireError as exc:
            self.counts["bad_control"] += 1
            self.throttle.log(log, logging.WARNING, "bad_control", f"malformed control message from {name}: {exc}")
            return
        if w.hello is not None and not w.hello.done():
            expected = None if w.proc is None else w.proc.pid  # None: a Ray actor whose pid is not known yet
            if not isinstance(msg, p.Hello) or (expected is not None and msg.pid != expected):
                return  # an earlier process of this name, still talking
            w.data_addr, w.pid, w.host, w.device = msg.data, msg.pid, msg.host, msg.device
            w.last_seen = time.monotonic()
            w.hello.set_result(msg)
            return
        w.last_seen = time.monotonic()
        if isinstance(msg, p.Heartbeat):
            w.stats, w.queue = msg.stats, msg.queue
        elif isinstance(msg, (p.Ack, p.Failed)):
            worker, fut = self._pending.get(msg.req, (None, None))
            if fut is not None and worker == name and not fut.done():
                if isinstance(msg, p.Ack):
                    fut.set_result(msg)
                else:
                    fut.set_exception(EngineError(f"worker {name}: {msg.error}"))
        elif isinstance(msg, p.TaskLost):
            if w.alive:
                self.on_task_lost(msg)
        elif isinstance(msg, p.LogRecord):
            self.throttle.log(worker_log, _LEVELS[msg.level], f"log:{name}:{msg.text[:60]}", f"[{name}] {msg.text}")

    # ---- liveness ------------------------------------------------------------------------------
    async def monitor_loop(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.05, timeout / 5))
            now = time.monotonic()
            for w in list(self.workers.values()):
                if not w.alive:
                    continue
                if w.proc is not None and w.proc.poll() is not None:  # a Ray actor: Ray says it died
                    why = getattr(w.proc, "exit_reason", "")
                    reason = f"worker {w.name} (pid {w.proc.pid or w.pid}) exited with code {w.proc.returncode}" \
                             + (f": {why}" if why else "")
                elif now - w.last_seen > timeout:
                    reason = (f"worker {w.name} (pid {w.pid}) sent no heartbeat for {now - w.last_seen:.2f} s "
                              f"(timeout {timeout} s); killed")
                    self.kill(w)  # hung or stopped: make sure it never comes back half-alive
                else:
                    continue
                self.lost(w, reason)

    def lost(self, w: WorkerProc, reason: str) -> None:
        """A worker is gone: tell the engine, then bring it back (or give up) in the background."""
        w.alive = False
        self._unlink(w)
        log.error("%s", reason)
        self.on_lost(w, reason)
        if not self.config.restart_workers:
            self.on_gone(w, f"{reason} (restart_workers is off)")
            return
        if w.name not in self._restarts or self._restarts[w.name].done():
            w.restarting = True
            self._restarts[w.name] = asyncio.create_task(self._restart(w.index, reason), name=f"restart-{w.name}")

    async def _restart(self, index: int, reason: str) -> None:
        """New process, hello, load; retried with backoff until it works or the budget is spent."""
        budget = self.config.restart_budget_s
        t0, delay, attempt, last = time.monotonic(), BACKOFF_S[0], 0, reason
        while True:
            attempt += 1
            fresh = self.start(index)
            fresh.restarting = True
            try:
                await self.wait_hello(fresh, timeout=max(0.1, min(self.config.start_timeout_s,
                                                                  budget - (time.monotonic() - t0))))
                if self.on_started is not None:
                    await self.on_started(fresh)
                self.mark_up(fresh)
                log.warning("worker %s restarted (pid %s, attempt %d, %.1f s after: %s)", fresh.name, fresh.pid,
                            attempt, time.monotonic() - t0, reason)
                return
            except (EngineError, OSError) as exc:
                last = str(exc)
                self.kill(fresh)
                log.error("restarting worker w%d failed (attempt %d): %s", index, attempt, last)
            if time.monotonic() - t0 + delay > budget:
                fresh.restarting = False
                self.on_gone(fresh, f"worker w{index} could not be brought back within {budget:g} s "
                                    f"({attempt} attempt(s)); last error: {last}")
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_S[1])
