"""ROS domain IDs for the tests: each test process (a pytest run, or one pytest-xdist worker) gets a block of
its own, one domain per kind of use inside it, so that tests running at the same time never share a domain.

A block is ``SLOTS`` consecutive domains chosen by the process id: two processes collide only when their pids
are equal modulo ``BLOCKS`` (never for the consecutive pids of xdist workers). Fast DDS maps domains above 232
to ports that do not exist; the highest used here is 1 + BLOCKS * SLOTS - 1 = 224.
"""

from __future__ import annotations

import os

SLOTS = 8      # kinds of use within one process (below)
BLOCKS = 28    # process blocks
KINDS = ("servers", "bags", "cli", "msgs", "raw", "unit", "bench", "spare")


def domain(kind: str, pid: int | None = None) -> int:
    """This process's domain for ``kind`` (one of :data:`KINDS`)."""
    pid = os.getpid() if pid is None else pid
    return 1 + SLOTS * (pid % BLOCKS) + KINDS.index(kind)
