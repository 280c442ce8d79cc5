"""A serving process's heap: the cyclic garbage collector (:func:`settle`) and the C heap (:class:`HeapTrimmer`).

The cyclic garbage collector: what is alive once a process is set up is set aside.

A full collection walks every object the process holds. torch, rclpy and the models' modules make that
hundreds of thousands, and on this VM one full collection took 25-102 ms in the workers, the server and
the synthetic robots alike (measured during ``physis-bench admission`` with ``gc.callbacks``): a stall
that every stream on that process sees as a late chunk, a few times a minute. ``gc.freeze()`` moves the
objects alive now to a generation the collector never scans again; what serving allocates afterwards is
still collected, and a full collection then walks only that.

Only at start-up: objects frozen are never collected, so what is frozen must live as long as the process.
Frozen again at every stream join (once done to keep a stream's own objects out of the scans), each
stream's reference cycles and the cyclic garbage alive at that moment stayed for good when it left: 0.47 MB
a join/leave cycle of three streams in a worker, 0.13 MB in the server (``physis-bench churn``).
"""

from __future__ import annotations

import ctypes
import gc
import time


def rss_mb(pid: int) -> float | None:
    """Resident memory of a local process (Linux), MiB; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def settle(collect: bool) -> None:
    """Set aside every object alive now from the collector's scans, for good: call it once, at a process's
    start-up, before anything is served. ``collect`` first frees what is already garbage (one full
    collection), which would otherwise stay frozen."""
    if collect:
        gc.collect()
    gc.freeze()


class HeapTrimmer:
    """Gives the C heap's free memory back to the OS once large inputs stop coming.

    A burst of large frames leaves freed buffers (DDS reassembly, rclpy deserialization) in glibc's
    heap, which keeps them (its mmap threshold adapts upwards to the largest block freed). The
    executor calls :meth:`note` with each camera message's size; the first message at least
    ``quiet_s`` after the last large one (>= ``large_bytes``) triggers one ``malloc_trim(0)`` (~0.4 ms).
    Nothing is trimmed while large frames keep coming: that memory is the working set. A no-op
    where the C library has no ``malloc_trim``. (glibc's malloc_trim does not shrink the top of
    a thread's own arena: with one arena, MALLOC_ARENA_MAX=1, everything freed comes back.)
    """

    def __init__(self, large_bytes: int = 1 << 20, quiet_s: float = 1.0):
        self.large_bytes = large_bytes
        self.quiet_s = quiet_s
        self.pending = False
        self.last_large = 0.0
        try:
            self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        except OSError:
            self._trim = None

    def note(self, nbytes: int, now: float | None = None) -> bool:
        """Record an input of ``nbytes``; True if it triggered a trim."""
        now = time.monotonic() if now is None else now
        if nbytes >= self.large_bytes:
            self.pending, self.last_large = True, now
            return False
        if not self.pending or now - self.last_large < self.quiet_s:
            return False
        self.pending = False
        if self._trim is not None:
            self._trim(0)
        return True
