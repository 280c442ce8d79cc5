"""A worker in-process (no serve loop): slots, placement checks, and the bounded ready queue."""

import pytest
import torch

from physis_ros.config import to_mapping
from physis_ros.model import load_model_config
from physis_ros.runtime import wire, worker as worker_module
from physis_ros.runtime.worker import SlotMap, Worker


@pytest.fixture
def worker():
    w = Worker("tcp://127.0.0.1:9", "w0")  # the engine address is never reached in these tests
    cfg = load_model_config("tiny-wam")
    w.cmd_load({"model": to_mapping(cfg), "max_streams": 2})
    w.cmd_start_stream({"stream": "robot0", "epoch": 0, "stages": [[4, 0], [4, 1]],
                        "routes": {"4,0": w.data_addr, "4,1": "tcp://127.0.0.1:9"}})
    yield w
    w.close()


def task(stream="robot0", chunk=0, stage=(4, 0), epoch=0):
    return wire.encode(wire.Message("task", stream, chunk, stage, {"obs/image": torch.zeros(1, 3, 32, 32),
                                                                   "obs/state": torch.zeros(1, 7)},
                                    {"epoch": epoch, "order": float(chunk)}))


def test_slots_are_stable_per_stream_and_step():
    slots = SlotMap(max_streams=2, steps=4)
    assert slots.add("a") == 0 and slots.add("b") == 1 and slots.add("a") == 0
    assert [slots.slot("b", k) for k in (1, 4)] == [4, 7]
    slots.remove("a")
    assert slots.add("c") == 0
    with pytest.raises(RuntimeError, match="no free KV slot for stream 'd'"):
        slots.add("d")


def test_tasks_are_checked_against_the_streams_placement(worker):
    worker.accept_task(task(stage=(3, 0)))  # not hosted here for this stream
    worker.accept_task(task(stream="nobody"))  # a stream that was never started (or was stopped)
    worker.accept_task(task(epoch=1))  # from an incarnation the worker has not seen
    worker.accept_task(task())
    assert worker.stats["bad_messages"] == 1 and worker.stats["stale"] == 2
    assert [t.chunk for t in worker.ready] == [0]
    assert set(worker.ready[0].state) == {"obs/image", "obs/state", "x"}  # the noise is made here


def test_ready_queue_is_bounded_and_drops_the_oldest(worker, monkeypatch):
    monkeypatch.setattr(worker_module, "MAX_READY", 8)
    for c in range(12):
        worker.accept_task(task(chunk=c))
    assert len(worker.ready) == 8 and worker.stats["dropped_tasks"] == 4
    assert sorted(t.chunk for t in worker.ready) == list(range(4, 12))
