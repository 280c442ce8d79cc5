"""Hidden-state bytes of a hop through shared memory, for workers on one host (``engine.hops: shm``).

A socket copies a hop's bytes twice in the kernel and the receiver writes them into fresh pages; here
the sender copies the tensors once into a ring it shares with the receiver, and the receiver reads them
where they are: its tensors are views of the ring, and their region is given back to the sender when the
last view of it is gone (a weakref finalizer on each tensor's buffer, so no code path can forget to
free it, and bytes still in use, e.g. queued or in a ZeroMQ frame, are never overwritten). A hop costs
one memcpy. The ZeroMQ header carries the declarations and where the bytes are
(:class:`~physis_ros.runtime.protocol.ShmRef`).

One ring per (sender, receiver, link generation): a file in ``/dev/shm`` the sender creates
(``physis-hop-<pid>-<sender>-<receiver>-<gen>``, mode 0600), with a 64-byte header whose ``tail`` the
receiver advances as regions are freed (in order: one freed before an older one waits for it).
Positions are byte counters that only grow; a region never wraps (it starts at the ring's beginning
when it would, the skipped bytes counted). The receiver accepts only
the region that must come next (ZeroMQ delivers one sender's headers in order), so a forged or stale
reference is refused and cannot make it read, or the sender overwrite, bytes that are not free. A
region the ring has no room for goes as frames instead (counted), and a header the sender could not
send gives its region back. The engine's link generation (runtime/hops.py, :class:`LinkBook`) moves on
when either worker restarts: both ends then use a fresh ring.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire

SHM_DIR = Path("/dev/shm")
HEADER = 64
MAGIC = b"PHYSHOP1"
ALIGN = 64
TAIL_AT = 16                     # the header's bytes-consumed counter (a native uint64)
NAME = re.compile(r"^physis-hop-(\d+)-([A-Za-z0-9_.-]{1,64})-([A-Za-z0-9_.-]{1,64})-(\d+)$")


class ShmError(RuntimeError):
    """A hop through shared memory that cannot be made (no ring, a reference that is not the next one)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _spec_bytes(spec: p.TensorSpec) -> int:
    n = wire.DTYPES[spec.dtype][0].itemsize
    for d in spec.shape:
        n *= d
    return n


class Ring:
    """One mapped ring: ``size`` bytes of data after the header."""

    def __init__(self, path: Path, size: int, create: bool):
        self.path = path
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, HEADER + size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size <= HEADER:
                os.close(fd)
                raise ShmError(f"{path} is not a hop ring of this user")
            size = st.st_size - HEADER
        try:
            self.mm = mmap.mmap(fd, HEADER + size)
        finally:
            os.close(fd)
        if create:
            self.mm[:8] = MAGIC
            struct.pack_into("<Q", self.mm, 8, size)
        elif self.mm[:8] != MAGIC or struct.unpack_from("<Q", self.mm, 8)[0] != size:
            self.mm.close()
            raise ShmError(f"{path} is not a hop ring")
        self.size = size
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)   # the whole mapping, header included
        # The tail is read by the sender while the receiver writes it: one aligned 8-byte load and store.
        # struct.pack_into zeroes its bytes and then writes them one by one, so a reader saw 0 or a part
        # of the new value (tens of thousands of times in 2 s of a tight loop) and took the ring for full.
        self._tail = np.ndarray((1,), dtype=np.uint64, buffer=self.mm, offset=TAIL_AT)
        if create:
            # Touch every page now: a page first written during a hop costs a fault and a zeroed tmpfs page,
            # which made the first lap of a ring several times slower than the copy itself.
            self.view[HEADER:].fill_(0)

    @property
    def tail(self) -> int:
        return int(self._tail[0])

    @tail.setter
    def tail(self, value: int) -> None:
        if self._tail is not None:       # None: closed (regions freed after it are of no use to anyone)
            self._tail[0] = value

    def start_of(self, position: int, total: int) -> int:
        """Where a region of ``total`` bytes asked for at ``position`` starts (at the ring's beginning if it
        would wrap)."""
        offset = position % self.size
        return position if offset + total <= self.size else position + self.size - offset

    def close(self) -> None:
        self._tail = None
        del self.view
        try:
            self.mm.close()
        except BufferError:   # tensors read in place still view it: unmapped when the last of them goes
            pass


@dataclass
class _Outgoing:
    ring: Ring
    gen: int
    head: int = 0


@dataclass
class _Lease:
    """A region read in place: given back when its last tensor is gone."""

    end: int                 # the ring position just after the region
    views: int               # its tensors still alive


@dataclass
class _Incoming:
    name: str
    ring: Ring
    position: int            # where the next region must start
    leases: deque[_Lease] = field(default_factory=deque)   # oldest first


class ShmHops:
    """One worker's rings: those it writes (one per receiving peer) and those it reads (per sender)."""

    def __init__(self, worker_id: str, ring_bytes: int, directory: Path = SHM_DIR):
        self.me = worker_id
        self.ring_bytes = ring_bytes
        self.dir = directory
        self.out: dict[str, _Outgoing] = {}
        self.into: dict[str, _Incoming] = {}               # by sender
        self._lock = threading.RLock()   # leases are freed from whichever thread drops the last view

    # ---- sending ---------------------------------------------------------------------------------
    def connect(self, peer: str, gen: int, ring_bytes: int | None = None) -> None:
        """The ring this worker writes ``peer``'s hops into at link generation ``gen`` (a new one per gen)."""
        have = self.out.get(peer)
        if have is not None and have.gen >= gen:
            return
        name = f"physis-hop-{os.getpid()}-{self.me}-{peer}-{gen}"
        ring = Ring(self.dir / name, ring_bytes or self.ring_bytes, create=True)
        if have is not None:
            self._unlink(have.ring)
        self.out[peer] = _Outgoing(ring, gen)

    def write(self, peer: str, tensors: Mapping[str, torch.Tensor]) -> p.ShmRef | None:
        """Copy ``tensors`` into ``peer``'s ring; where they are, or None if the ring has no room (send frames)."""
        out = self.out.get(peer)
        if out is None:
            return None
        total = sum(_aligned(t.numel() * t.element_size()) for t in tensors.values())
        start = out.ring.start_of(out.head, total)
        if total > out.ring.size or start + total - out.ring.tail > out.ring.size:
            return None
        offset = HEADER + start % out.ring.size
        for t in tensors.values():
            n = t.numel() * t.element_size()
            out.ring.view[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            offset += _aligned(n)
        ref = p.ShmRef(ring=out.ring.path.name, position=start, nbytes=total)
        out.head = start + total
        return ref

    def unwrite(self, peer: str, ref: p.ShmRef, previous_head: int) -> None:
        """Give back the region of a header that could not be sent (nothing was written after it)."""
        out = self.out.get(peer)
        if out is not None and out.head == ref.position + ref.nbytes:
            out.head = previous_head

    def head(self, peer: str) -> int:
        out = self.out.get(peer)
        return out.head if out is not None else 0

    # ---- receiving -------------------------------------------------------------------------------
    @staticmethod
    def sender_of(ref: p.ShmRef) -> str:
        m = NAME.match(ref.ring)
        return m.group(2) if m else ""

    def read(self, ref: p.ShmRef, specs: list[p.TensorSpec]) -> dict[str, torch.Tensor]:
        """The declared tensors, as views of the ring ``ref`` names (their region is freed when they are all
        gone); ShmError unless ``ref`` is exactly the region that comes next from that sender (then nothing is
        read and the ring is left as it was)."""
        m = NAME.match(ref.ring)
        if m is None or m.group(3) != self.me:
            raise ShmError(f"ring {ref.ring!r} is not one written for {self.me}")
        sender = m.group(2)
        with self._lock:
            have = self.into.get(sender)
            if have is None or have.name != ref.ring:
                if have is not None and int(NAME.match(have.name).group(4)) > int(m.group(4)):
                    raise ShmError(f"ring {ref.ring!r} is of an older link generation than {have.name!r}")
                try:
                    ring = Ring(self.dir / ref.ring, 0, create=False)
                except (OSError, ValueError) as exc:   # no such ring (forged, or its writer is gone)
                    raise ShmError(f"cannot open ring {ref.ring!r}: {exc}") from None
                if have is not None:
                    have.ring.close()
                have = _Incoming(ref.ring, ring, ring.tail)
                self.into[sender] = have
            ring = have.ring
            total = sum(_aligned(_spec_bytes(s)) for s in specs)
            if total != ref.nbytes or ref.position != ring.start_of(have.position, total) or total > ring.size:
                raise ShmError(f"reference to bytes {ref.position}+{ref.nbytes} of {have.name} is not the region "
                               f"that comes next ({ring.start_of(have.position, total)}+{total})")
            have.position = ref.position + total
            lease = _Lease(end=have.position, views=0)
            have.leases.append(lease)
            offset = HEADER + ref.position % ring.size
            tensors = {}
            for spec in specs:
                n = _spec_bytes(spec)
                dtype = wire.DTYPES[spec.dtype][1]
                if n == 0:
                    tensors[spec.name] = torch.empty(spec.shape, dtype=dtype)
                    continue
                # One buffer object per tensor: torch keeps it alive as long as the tensor or any view of it,
                # so its finalizer runs exactly when the bytes are no longer used.
                buf = memoryview(ring.mm)[offset:offset + n]
                lease.views += 1
                weakref.finalize(buf, self._release, have, lease)
                tensors[spec.name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(spec.shape)
                del buf
                offset += _aligned(n)
            if lease.views == 0:
                self._release(have, lease, view=False)
            return tensors

    def _release(self, have: _Incoming, lease: _Lease, view: bool = True) -> None:
        """One tensor of ``lease`` is gone (any thread: ZeroMQ frees sent frames on its own); the sender may
        write over every region up to the oldest still in use."""
        with self._lock:
            lease.views -= view
            if lease.views > 0:
                return
            tail = None
            while have.leases and have.leases[0].views <= 0:
                tail = have.leases.popleft().end
            if tail is not None:
                have.ring.tail = tail

    def in_use(self, sender: str) -> int:
        """Regions from ``sender`` read in place and not yet freed."""
        have = self.into.get(sender)
        return 0 if have is None else len(have.leases)

    # ---- end -------------------------------------------------------------------------------------
    def _unlink(self, ring: Ring) -> None:
        ring.close()
        ring.path.unlink(missing_ok=True)

    def close(self) -> None:
        for out in self.out.values():
            self._unlink(out.ring)
        with self._lock:
            for have in self.into.values():
                have.ring.close()
        self.out.clear()
        self.into.clear()


def remove_rings_of(pid: int, directory: Path = SHM_DIR) -> int:
    """Unlink the rings a (dead) worker process created; how many."""
    count = 0
    for path in directory.glob(f"physis-hop-{pid}-*"):
        if NAME.match(path.name):
            path.unlink(missing_ok=True)
            count += 1
    return count
