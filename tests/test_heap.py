"""heap.settle: what is alive is set aside from the collector's scans (checked in a fresh interpreter, so this
test process's own heap is left alone), and in-process workers (tests, tools) never freeze their host's heap."""

import gc
import subprocess
import sys

import pytest

from physis_ros import heap
from physis_ros.config import to_mapping
from physis_ros.model import load_model_config
from physis_ros.runtime import protocol as p
from physis_ros.runtime.worker import Worker

SCRIPT = r"""
import gc, weakref
from physis_ros import heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

garbage = cycle()                 # unreachable already
kept = Node(); kept.me = kept      # alive
heap.settle(collect=True)
assert garbage() is None, "collect=True frees what is garbage first"
frozen = gc.get_freeze_count()
assert frozen > 1000, frozen      # the interpreter's and the package's objects
assert not any(o is kept for o in gc.get_objects()), "a frozen object is not in any scanned generation"
later = cycle()
heap.settle(collect=False)
assert gc.get_freeze_count() > frozen and later() is not None   # freeze only: no collection
print("ok")
"""


@pytest.mark.slow
def test_settle_freezes_what_is_alive_and_collects_only_when_asked():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("serving", [False, True])
def test_a_worker_never_freezes_on_a_stream_start(serving, monkeypatch):
    """Issue 47 item 1: a worker froze the collector's generations at every stream start, and what is frozen is
    never collected: each stream's reference cycles stayed when it left (0.47 MB a join/leave cycle of three
    streams). The freeze is the process's start-up only (serve())."""
    calls = []
    monkeypatch.setattr("physis_ros.heap.settle", lambda collect: calls.append(collect))
    before = gc.get_freeze_count()
    cfg = load_model_config("tiny-wam")
    w = Worker("tcp://127.0.0.1:9", "w0", forward_logs=False)
    try:
        w.serving = serving   # what serve() sets in a worker's own process
        w.cmd_load(p.Load(req=0))
        w.start_stream_now(p.StartStream(req=0, stream="s", epoch=0, model=p.ModelRef(id="tiny-wam", config=to_mapping(cfg)),
                                         stages=[(4, 0)], routes=[p.Route((4, 0), "tcp://127.0.0.1:9")]))
    finally:
        w.close()
    assert calls == []
    assert gc.get_freeze_count() == before


def test_heap_trimmer_trims_once_after_large_inputs_stop():
    trimmer = heap.HeapTrimmer(large_bytes=1000, quiet_s=1.0)
    calls = []
    trimmer._trim = lambda pad: calls.append(pad)
    assert not trimmer.note(10, now=0.0)              # small only: nothing to give back
    assert not trimmer.note(5000, now=1.0)            # large frames: the working set
    assert not trimmer.note(5000, now=1.5)
    assert not trimmer.note(10, now=2.0)              # too soon after the last large one
    assert trimmer.note(10, now=2.6) and calls == [0]
    assert not trimmer.note(10, now=9.0) and calls == [0]   # once per burst
    assert heap.HeapTrimmer()._trim is not None       # glibc here: the real malloc_trim
    assert heap.HeapTrimmer(quiet_s=0.0).note(0) is False
