"""The engine's worker pool: processes, the control plane, heartbeats and failure detection.

Workers are local processes started here, each connecting back to the
engine's ROUTER control socket (DEALER with its name as identity). A worker is
*lost* when its process exits or when no heartbeat arrives within
``heartbeat_timeout_s`` (a hung or stopped process is then killed, so it can
never come back half-alive); the pool reports the loss through ``on_lost`` and
can start a fresh process under the same name.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from physis_ros.config import EngineConfig
from physis_ros.runtime import wire
from physis_ros.runtime.security import CurveKeys

log = logging.getLogger("physis.engine")


class EngineError(RuntimeError):
    """The engine cannot go on: a worker failed to start, died, or stopped answering."""


@dataclass
class WorkerProc:
    name: str
    index: int
    proc: subprocess.Popen | None
    data_addr: str = ""
    pid: int = 0
    last_seen: float = 0.0
    alive: bool = True
    restarts: int = 0
    stats: dict = field(default_factory=dict)
    hello: asyncio.Future | None = None


class WorkerPool:
    def __init__(self, ctx: zmq.asyncio.Context, config: EngineConfig, ctrl_addr_base: str, ipc_dir: str | None,
                 on_lost: Callable[[WorkerProc, str], Awaitable[None]], keys: CurveKeys | None = None):
        self.ctx = ctx
        self.config = config
        self.ipc_dir = ipc_dir
        self.on_lost = on_lost
        self.max_bytes = config.max_message_mb * 1024 * 1024
        self.workers: dict[str, WorkerProc] = {}
        self.errors: list[str] = []
        self._req = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
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
    async def spawn(self, index: int) -> WorkerProc:
        """Start worker ``w<index>`` (again, if it existed) and wait for its hello."""
        cfg = self.config
        name = f"w{index}"
        cmd = [sys.executable, "-m", "physis_ros.cli.worker", "--connect", self.ctrl_addr, "--id", name,
               "--device", cfg.device_of(index), "--bind-host", cfg.bind_host, "--transport", cfg.transport,
               "--threads", str(cfg.threads_per_worker), "--parent-pid", str(os.getpid())]
        if self.ipc_dir is not None:
            cmd += ["--ipc-dir", self.ipc_dir]
        if cfg.curve_keys:
            cmd += ["--curve-keys", cfg.curve_keys]
        cmd += ["--max-message-mb", str(cfg.max_message_mb)]
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads_per_worker)}
        old = self.workers.get(name)
        w = WorkerProc(name, index, subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL),
                       last_seen=time.monotonic(), restarts=0 if old is None else old.restarts + 1,
                       hello=asyncio.get_running_loop().create_future())
        self.workers[name] = w
        return w

    def expect(self, index: int) -> WorkerProc:
        """A worker started by hand elsewhere (``physis-worker --connect``): wait for it to say hello."""
        name = f"w{index}"
        w = WorkerProc(name, index, None, last_seen=time.monotonic(),
                       hello=asyncio.get_running_loop().create_future())
        self.workers[name] = w
        return w

    async def wait_hello(self, w: WorkerProc) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not w.hello.done():
            if w.proc is not None and w.proc.poll() is not None:
                raise EngineError(f"worker {w.name} exited with code {w.proc.returncode} before it said hello")
            if time.monotonic() > deadline:
                raise EngineError(f"worker {w.name} did not start within {self.config.start_timeout_s:.0f} s")
            await asyncio.wait([w.hello], timeout=0.05)
        w.last_seen = time.monotonic()

    def kill(self, w: WorkerProc) -> None:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
        self._unlink(w)

    @staticmethod
    def _unlink(w: WorkerProc) -> None:
        if w.data_addr.startswith("ipc://"):
            try:
                os.unlink(w.data_addr[len("ipc://"):])
            except FileNotFoundError:
                pass

    async def stop(self) -> None:
        for w in self.workers.values():
            if w.alive and w.data_addr and (w.proc is None or w.proc.poll() is None):
                try:
                    await self.request(w.name, "shutdown", {}, timeout=1.0)
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
    async def request(self, worker: str, kind: str, body: dict, timeout: float = 10.0) -> dict:
        req = next(self._req)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        frames = wire.encode(wire.Message(kind=kind, body={**body, "req": req}))
        await self.ctrl.send_multipart([worker.encode(), *frames], copy=False)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"worker {worker} did not answer '{kind}' within {timeout:.1f} s") from None
        finally:
            self._pending.pop(req, None)

    async def control_loop(self) -> None:
        while True:
            identity, *frames = await self.ctrl.recv_multipart(copy=False)
            name = bytes(identity.buffer).decode(errors="replace")
            try:
                msg = wire.decode(frames, self.max_bytes)
            except wire.WireError as exc:
                log.warning("malformed control message from %s: %s", name, exc)
                continue
            w = self.workers.get(name)
            if w is None or not w.alive:
                continue  # unknown, or a lost worker's last words
            w.last_seen = time.monotonic()
            body = msg.body
            if msg.kind == "hello":
                if w.proc is not None and body.get("pid") != w.proc.pid:
                    continue  # a previous process of this name
                w.data_addr, w.pid = body["data"], body["pid"]
                if not w.hello.done():
                    w.hello.set_result(body)
            elif msg.kind == "heartbeat":
                w.stats = body.get("stats", {})
            elif msg.kind in ("ack", "error"):
                fut = self._pending.get(body.get("req"))
                if fut is not None and not fut.done():
                    if msg.kind == "ack":
                        fut.set_result(body)
                    else:
                        fut.set_exception(EngineError(f"worker {name}: {body.get('error')}"))
                elif msg.kind == "error":
                    text = f"worker {name}: {body.get('error')}"
                    log.warning(text)
                    self.errors.append(text)
                    del self.errors[:-100]  # bounded

    async def monitor_loop(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.05, timeout / 5))
            now = time.monotonic()
            for w in list(self.workers.values()):
                if not w.alive or (w.hello is not None and not w.hello.done()):
                    continue
                if w.proc is not None and w.proc.poll() is not None:
                    reason = f"worker {w.name} (pid {w.proc.pid}) exited with code {w.proc.returncode}"
                elif now - w.last_seen > timeout:
                    reason = (f"worker {w.name} (pid {w.pid}) sent no heartbeat for {now - w.last_seen:.2f} s "
                              f"(timeout {timeout} s); killed")
                    self.kill(w)  # hung or stopped: make sure it never comes back half-alive
                else:
                    continue
                w.alive = False
                self._unlink(w)
                log.error("%s", reason)
                await self.on_lost(w, reason)
