"""The cyclic garbage collector on a serving process: what is alive once a process is set up is set aside.

A full collection walks every object the process holds. torch, rclpy and the models' modules make that
hundreds of thousands, and on this VM one full collection took 25-102 ms in the workers, the server and
the synthetic robots alike (measured during ``physis-bench admission`` with ``gc.callbacks``): a stall
that every stream on that process sees as a late chunk, a few times a minute. ``gc.freeze()`` moves the
objects alive now to a generation the collector never scans again; what serving allocates afterwards is
still collected, and a full collection then walks only that.
"""

from __future__ import annotations

import gc


def settle(collect: bool) -> None:
    """Set aside every object alive now from the collector's scans. ``collect`` first frees what is already
    garbage, which is itself one full collection: only where nothing is served yet (a process's start-up);
    later (a stream starts, its blocks loaded) freeze only (the little garbage then alive stays)."""
    if collect:
        gc.collect()
    gc.freeze()
