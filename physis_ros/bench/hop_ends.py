"""The two ends of a measured hop (``physis-bench hop``): each runs in its own spawned process, as workers
do, and bounces a tensor over one transport; :func:`measure_transport` drives both from the parent and
returns the round-trip times. The transports, and what each measures: :mod:`physis_ros.bench.hop`.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import queue
import struct
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire

TIMEOUT_S = 60.0            # a side that hears nothing for this long gives up (a dead peer)
STOP = "stop"


# ---- one side of a hop (runs in a spawned process) ----------------------------------------------
@dataclass
class Setup:
    """What both sides of one transport's measurement need (pickled to the spawned processes)."""

    transport: str
    sizes: list[int]
    repeats: list[int]
    warmup: int
    max_bytes: int
    ipc_dir: str = ""
    store: str = ""                        # LinkBook address (gloo, nccl)
    devices: dict[str, str] = field(default_factory=dict)   # role -> device


class ZmqEnd:
    """A worker's data plane: a PULL bound here, a PUSH to the peer; tensors as frames
    (``host-bounce``: staged through pinned host memory with DeviceIO, as a CUDA worker does)."""

    def __init__(self, role: str, setup: Setup):
        from physis_ros.runtime.device import DeviceIO

        self.setup = setup
        self.device = torch.device(setup.devices.get(role, "cpu"))
        self.io = DeviceIO(self.device)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.MAXMSGSIZE, setup.max_bytes)
        self.pull.setsockopt(zmq.LINGER, 0)
        if setup.transport == "zmq-ipc" or setup.transport in FLOOR_MODES:
            self.address = f"ipc://{Path(setup.ipc_dir) / role}.sock"
            self.pull.bind(self.address)
        else:
            self.address = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.setsockopt(zmq.SNDHWM, 1000)
        self.push.setsockopt(zmq.IMMEDIATE, 1)
        self.push.setsockopt(zmq.SNDTIMEO, int(TIMEOUT_S * 1e3))

    def connect(self, peer_address: str, peer: str) -> None:
        self.push.connect(peer_address)

    def send(self, task: p.Task, h: torch.Tensor | None) -> None:
        tensors = {} if h is None else self.io.to_host({"h": h})
        self.push.send_multipart(wire.encode(task, tensors), copy=False)

    def _header(self) -> wire.Received[p.Task]:
        if not self.pull.poll(int(TIMEOUT_S * 1e3)):
            raise TimeoutError(f"nothing arrived in {TIMEOUT_S:.0f} s")
        return wire.decode(self.pull.recv_multipart(copy=False), wire.DATA, self.setup.max_bytes)

    def recv(self) -> tuple[p.Task, torch.Tensor | None]:
        rec = self._header()
        h = rec.tensors.get("h")
        if h is not None and self.io.cuda:
            h = self.io.to_device(h)
            torch.cuda.current_stream(self.device).synchronize()
        return rec.msg, h

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.destroy(linger=0)


class TorchEnd(ZmqEnd):
    """The header over ZeroMQ, the tensor over the pair's torch.distributed link (runtime/hops.py)."""

    def __init__(self, role: str, setup: Setup):
        super().__init__(role, setup)
        from physis_ros.runtime.hops import TorchHops

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.me = role
        self.hops = TorchHops(role, setup.store, str(self.device), timeout_s=TIMEOUT_S, ctx=self.ctx,
                              max_bytes=setup.max_bytes)
        self.peer = ""

    def connect(self, peer_address: str, peer: str) -> None:
        super().connect(peer_address, peer)
        self.peer = peer
        future = self.hops.connect(peer, 0)
        if future is not None:
            future.result(timeout=TIMEOUT_S)
        self.hops.attach_built()

    def send(self, task: p.Task, h: torch.Tensor | None) -> None:
        if h is None:
            task.link = None
            super().send(task, None)
            return
        tensors = {"h": h}
        task.link = self.hops.reserve(self.peer, len(tensors))
        self.push.send_multipart(wire.encode(task, tensors), copy=False)
        self.hops.post(self.peer, task.link, tensors)

    def recv(self) -> tuple[p.Task, torch.Tensor | None]:
        from physis_ros.runtime.hops import empty_like_specs

        rec = self._header()
        task = rec.msg
        if task.link is None:
            return task, None
        declared = empty_like_specs(task.tensors, "meta", self.setup.max_bytes)
        self.hops.receive(task.link, {k: torch.empty_like(v, device=self.hops.recv_device)
                                      for k, v in declared.items()}, rec)
        arrival = self._arrival()
        if arrival.tensors is None:
            raise RuntimeError(arrival.error)
        if self.device.type == "cuda":      # NCCL's wait() only orders streams: the bytes are here after a sync
            torch.cuda.current_stream(self.device).synchronize()
        return task, arrival.tensors["h"]

    def _arrival(self):
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                return self.hops.arrivals.get_nowait()
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not self.hops.wake.poll(max(1, int(left * 1e3))):
                raise TimeoutError(f"the link's receive did not finish in {TIMEOUT_S:.0f} s")
            self.hops.drain_wake()

    def close(self) -> None:
        self.hops.close()
        super().close()


class ShmEnd(ZmqEnd):
    """The header over ZeroMQ, the tensor through the shared ring this side writes for its peer
    (runtime/shm_hops.py), read in place on the other side as a worker does (the echo is copied from that
    view into this side's own ring)."""

    def __init__(self, role: str, setup: Setup):
        super().__init__(role, setup)
        from physis_ros.runtime.shm_hops import ShmHops

        self.shm = ShmHops(role, 1 << 20)
        self.peer = ""
        self.size = 0

    def connect(self, peer_address: str, peer: str) -> None:
        super().connect(peer_address, peer)
        self.peer = peer
        self.shm.connect(peer, 0)

    def send(self, task: p.Task, h: torch.Tensor | None) -> None:
        tensors = {} if h is None else {"h": h}
        n = 0 if h is None else h.numel() * h.element_size()
        if n > self.size:  # a ring sized for this traffic (4 hops), as hop_ring_mb would be for a model
            self.size = n
            self.shm.connect(self.peer, self.shm.out[self.peer].gen + 1, 4 * n + (64 << 10))
        task.shm = self.shm.write(self.peer, tensors) if tensors else None
        if tensors and task.shm is None:
            raise RuntimeError("the ring had no room for one hop")
        self.push.send_multipart(wire.encode(task, tensors), copy=False)

    def recv(self) -> tuple[p.Task, torch.Tensor | None]:
        rec = self._header()
        if rec.msg.shm is None:
            return rec.msg, None
        return rec.msg, self.shm.read(rec.msg.shm, rec.msg.tensors)["h"]

    def close(self) -> None:
        self.shm.close()
        super().close()


FLOOR_MODES = ("floor-block", "floor-spin")
_FLOOR_HEADER = struct.Struct("<qq")   # slot, bytes (-1: stop)


class FloorEnd(ZmqEnd):
    """Not a transport of the product: the least a hop whose header goes over ZeroMQ can cost on this
    machine. A 16-byte header (which slot, how many bytes) over ZeroMQ ipc and one copy into a mapping the
    peer reads in place, with no framing, no checks and no bookkeeping; ``floor-spin`` polls the socket
    instead of sleeping on it. What a product transport costs beyond this is its own work."""

    SLOTS = 2

    def __init__(self, role: str, setup: Setup):
        super().__init__(role, setup)
        self.spin = setup.transport == "floor-spin"
        self.slot_bytes = max(setup.sizes)
        self.path = Path("/dev/shm") / f"physis-floor-{os.getpid()}-{role}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.SLOTS * self.slot_bytes)
            self.mine = mmap.mmap(fd, self.SLOTS * self.slot_bytes)
        finally:
            os.close(fd)
        self.out = torch.frombuffer(self.mine, dtype=torch.uint8)
        self.out.fill_(0)   # no page faults while measured
        self.theirs: mmap.mmap | None = None
        self.into: torch.Tensor | None = None
        self.next_slot = 0
        self.address = f"{self.address}|{self.path}"   # the peer maps this side's slots at connect

    def connect(self, peer_address: str, peer: str) -> None:
        address, path = peer_address.split("|")
        super().connect(address, peer)
        fd = os.open(path, os.O_RDWR)
        try:
            self.theirs = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.into = torch.frombuffer(self.theirs, dtype=torch.uint8)

    def send(self, task: p.Task, h: torch.Tensor | None) -> None:
        if h is None:
            self.push.send(_FLOOR_HEADER.pack(0, -1))
            return
        n = h.numel() * h.element_size()
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.SLOTS
        self.out[slot * self.slot_bytes:slot * self.slot_bytes + n].copy_(h.reshape(-1).view(torch.uint8))
        self.push.send(_FLOOR_HEADER.pack(slot, n))

    def recv(self) -> tuple[p.Task, torch.Tensor | None]:
        if self.spin:
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                try:
                    header = self.pull.recv(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"nothing arrived in {TIMEOUT_S:.0f} s") from None
        else:
            if not self.pull.poll(int(TIMEOUT_S * 1e3)):
                raise TimeoutError(f"nothing arrived in {TIMEOUT_S:.0f} s")
            header = self.pull.recv()
        slot, n = _FLOOR_HEADER.unpack(header)
        if n < 0:
            return p.Task(stream=STOP, chunk=0, stage=(1, 0), epoch=0), None
        start = slot * self.slot_bytes
        h = self.into[start:start + n]
        return p.Task(stream="hop", chunk=0, stage=(1, 0), epoch=0), h.view(torch.float32) if n % 4 == 0 else h

    def close(self) -> None:
        del self.out, self.into
        self.mine.close()
        if self.theirs is not None:
            self.theirs.close()
        self.path.unlink(missing_ok=True)
        super().close()


def _payload(n: int, device: torch.device) -> torch.Tensor:
    """A hidden state of ``n`` bytes: float32 when ``n`` allows it (no NaN: the echo is compared)."""
    gen = torch.Generator().manual_seed(n)
    t = torch.rand(n // 4, generator=gen) if n % 4 == 0 else torch.randint(0, 256, (n,), dtype=torch.uint8,
                                                                             generator=gen)
    return t.to(device)


def _ping(end: ZmqEnd, setup: Setup, conn) -> None:
    """Bounce each size ``warmup + repeats`` times; report each size's one-way times (s) as it ends."""
    device = end.device
    for n, repeats in zip(setup.sizes, setup.repeats):
        h = _payload(n, device)
        samples = []
        last = setup.warmup + repeats - 1
        for i in range(last + 1):
            task = p.Task(stream="hop", chunk=i, stage=(1, 0), epoch=0)
            t0 = time.perf_counter()
            end.send(task, h)
            _, back = end.recv()
            dt = time.perf_counter() - t0
            if i >= setup.warmup:
                samples.append(dt / 2)
            if i in (0, last) and (back is None or back.shape != h.shape or not torch.equal(back.to(device), h)):
                raise RuntimeError(f"the echo of {n} bytes differs from what was sent (round {i})")
        conn.send(("size", n, samples))
    end.send(p.Task(stream=STOP, chunk=0, stage=(1, 0), epoch=0), None)


def _pong(end: ZmqEnd) -> None:
    """Send every tensor straight back, until told to stop."""
    while True:
        task, h = end.recv()
        if task.stream == STOP:
            return
        end.send(task, h)


def _side(role: str, setup: Setup, conn) -> None:
    """One process of the pair (``ping`` or ``pong``); talks to the parent over ``conn``."""
    end = None
    try:
        torch.set_num_threads(1)
        end = (TorchEnd if setup.transport in ("gloo", "nccl") else ShmEnd if setup.transport == "shm"
               else FloorEnd if setup.transport in FLOOR_MODES else ZmqEnd)(role, setup)
        conn.send(("address", end.address))
        peer_address = conn.recv()
        end.connect(peer_address, "pong" if role == "ping" else "ping")
        if role == "ping":
            _ping(end, setup, conn)
        else:
            _pong(end)
        conn.send(("done", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which reports the transport failed
        try:
            conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
        except Exception:
            pass
    finally:
        if end is not None:
            end.close()


# ---- the parent: one pair of processes per transport ---------------------------------------------
class TransportFailed(RuntimeError):
    pass


def _receive(conn, gone: str) -> tuple:
    """A side's next message; TransportFailed with ``gone`` if it exited, or with the error it reported."""
    try:
        msg = conn.recv()
    except EOFError:
        raise TransportFailed(gone) from None
    if msg[0] == "error":
        raise TransportFailed(msg[1])
    return msg


def _expect(conn, kind: str, timeout: float = TIMEOUT_S) -> Any:
    if not conn.poll(timeout):
        raise TransportFailed(f"no '{kind}' from a side in {timeout:.0f} s")
    msg = _receive(conn, f"a side exited before its '{kind}'")
    if msg[0] != kind:
        raise TransportFailed(f"expected '{kind}', got '{msg[0]}'")
    return msg[1]


def measure_transport(setup: Setup, progress) -> dict[int, list[float]]:
    """One-way hop times (s) per size for ``setup.transport``, between two spawned processes."""
    ctx = multiprocessing.get_context("spawn")
    book = None
    tmp = None
    procs, conns = {}, {}
    try:
        if setup.transport == "zmq-ipc" or setup.transport in FLOOR_MODES:
            tmp = tempfile.mkdtemp(prefix="physis-hop-")
            setup.ipc_dir = tmp
        if setup.transport in ("gloo", "nccl"):
            from physis_ros.runtime.hops import LinkBook

            book = LinkBook("127.0.0.1", TIMEOUT_S)
            setup.store = book.address
        for role in ("ping", "pong"):
            conns[role], child = ctx.Pipe()
            procs[role] = ctx.Process(target=_side, args=(role, setup, child), name=f"hop-{role}", daemon=True)
            procs[role].start()
            child.close()
        addresses = {role: _expect(conns[role], "address") for role in procs}
        conns["ping"].send(addresses["pong"])
        conns["pong"].send(addresses["ping"])
        results: dict[int, list[float]] = {}
        done: set[str] = set()
        while len(done) < len(procs):
            ready = multiprocessing.connection.wait([c for r, c in conns.items() if r not in done], TIMEOUT_S * 2)
            if not ready:
                raise TransportFailed(f"no progress in {TIMEOUT_S * 2:.0f} s")
            for conn in ready:
                role = next(r for r, c in conns.items() if c is conn)
                msg = _receive(conn, f"the {role} process exited (code {procs[role].exitcode})")
                if msg[0] == "done":
                    done.add(role)
                elif msg[0] == "size":
                    results[msg[1]] = msg[2]
                    progress(setup.transport, msg[1], msg[2])
        if len(results) != len(setup.sizes):
            raise TransportFailed(f"measured {len(results)} of {len(setup.sizes)} sizes")
        return results
    finally:
        for proc in procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in conns.values():
            conn.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        del book
