"""Hidden states through shared-memory rings (hops: shm): exact bytes, a ring that fills up sends frames, a
region read in place is never written over while a view of it lives (freed in order, from any thread), a
reference that is not the next region is refused without reading or freeing anything, rings of a restarted
worker are replaced and a dead worker's are removed. (Bit-identity of plans over shm:
tests/runtime/test_engine.py::test_out_of_band_hops_are_bit_identical_to_reference.)"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time

import pytest
import torch
import uvloop

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.shm_hops import HEADER, Ring, ShmError, ShmHops, remove_rings_of

KB = 1024


def specs(tensors: dict[str, torch.Tensor]) -> list[p.TensorSpec]:
    return [p.TensorSpec(k, wire.TORCH_TO_NAME[v.dtype], list(v.shape)) for k, v in tensors.items()]


@pytest.fixture
def pair(tmp_path):
    a, b = ShmHops("w0", 64 * KB, tmp_path), ShmHops("w1", 64 * KB, tmp_path)
    a.connect("w1", 0)
    yield a, b
    a.close()
    b.close()


def test_round_trip_is_exact_for_every_dtype_and_wraps_around(pair, tmp_path):
    a, b = pair
    gen = torch.Generator().manual_seed(0)
    for i in range(200):  # 200 x ~10 KB through a 64 KB ring: it wraps many times
        state = {"cond": torch.randn(1, 7, 33, generator=gen), "x": torch.randn(1, 16, 7, generator=gen).bfloat16(),
                 "h": torch.randn(1, 3, 5, generator=gen).half()[..., :4]}   # not contiguous: sent as its values
        ref = a.write("w1", state)
        assert ref is not None
        got = b.read(ref, specs(state))
        for k, v in state.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (i, k)
    ring = next(tmp_path.iterdir())
    assert stat.S_IMODE(ring.stat().st_mode) == 0o600 and ring.name == f"physis-hop-{os.getpid()}-w0-w1-0"


def test_a_full_ring_sends_frames_and_frees_as_the_receiver_reads(pair):
    a, b = pair
    chunk = {"x": torch.ones(1, 4 * KB)}            # 16 KB each: four fill the 64 KB ring
    refs = [a.write("w1", chunk) for _ in range(5)]
    assert all(r is not None for r in refs[:4]) and refs[4] is None
    b.read(refs[0], specs(chunk))                   # frees one region
    assert a.write("w1", chunk) is not None
    assert a.write("w1", {"x": torch.ones(1, 20 * KB)}) is None   # larger than the ring: never fits


def test_a_region_read_in_place_is_not_written_over_until_its_last_view_is_gone(pair):
    a, b = pair
    chunk = {"x": torch.ones(1, 4 * KB)}                            # 16 KB: four fill the 64 KB ring
    held = [b.read(a.write("w1", {"x": torch.full((1, 4 * KB), float(i))}), specs(chunk))["x"] for i in range(4)]
    assert b.in_use("w0") == 4 and a.write("w1", chunk) is None   # full: the receiver still uses every byte
    first_row = held[0][0, :8]                                     # a view of a view keeps the region too
    del held[0]
    assert a.write("w1", chunk) is None and b.in_use("w0") == 4
    del first_row
    assert b.in_use("w0") == 3
    ref = a.write("w1", {"x": torch.full((1, 4 * KB), 9.0)})       # the freed region, written over...
    assert ref is not None and ref.position % (64 * KB) == 0
    assert [float(t[0, 0]) for t in held] == [1.0, 2.0, 3.0]       # ...while the held ones keep their values
    assert torch.equal(b.read(ref, specs(chunk))["x"], torch.full((1, 4 * KB), 9.0))


def test_regions_are_freed_in_order_whichever_view_goes_first(pair):
    a, b = pair
    chunk = {"x": torch.ones(1, 4 * KB)}
    older, newer = (b.read(a.write("w1", chunk), specs(chunk)) for _ in range(2))
    tail = b.into["w0"].ring.tail
    del newer                                                      # freed, but after one still in use
    assert b.into["w0"].ring.tail == tail and b.in_use("w0") == 2
    del older
    assert b.into["w0"].ring.tail == tail + 2 * 16 * KB and b.in_use("w0") == 0


def test_a_view_dropped_on_another_thread_frees_its_region(pair):
    import threading

    a, b = pair
    chunk = {"x": torch.ones(1, 4 * KB)}
    box = [b.read(a.write("w1", chunk), specs(chunk))["x"]]
    t = threading.Thread(target=box.clear)     # as ZeroMQ's I/O thread drops a frame sent with copy=False
    t.start()
    t.join()
    assert b.in_use("w0") == 0


def test_a_ring_replaced_while_views_of_it_live_keeps_them_valid(pair):
    a, b = pair
    kept = b.read(a.write("w1", {"x": torch.full((1, 100), 7.0)}), specs({"x": torch.zeros(1, 100)}))["x"]
    a.connect("w1", 1)                          # the old ring is unlinked by its writer, closed by its reader
    new = a.write("w1", {"x": torch.full((1, 100), 5.0)})
    assert torch.equal(b.read(new, specs({"x": torch.zeros(1, 100)}))["x"], torch.full((1, 100), 5.0))
    assert torch.equal(kept, torch.full((1, 100), 7.0))
    del kept


def test_a_reference_that_is_not_the_next_region_is_refused_and_changes_nothing(pair, tmp_path):
    a, b = pair
    first = a.write("w1", {"x": torch.full((1, 100), 1.0)})
    second = a.write("w1", {"x": torch.full((1, 100), 2.0)})
    declared = specs({"x": torch.zeros(1, 100)})
    for forged in (second, p.ShmRef(first.ring, first.position + 64, first.nbytes),
                   p.ShmRef(first.ring, first.position, first.nbytes + 64)):
        with pytest.raises(ShmError, match="not the region that comes next"):
            b.read(forged, declared)
    with pytest.raises(ShmError, match="not the region"):                # the declarations must match its size
        b.read(first, specs({"x": torch.zeros(1, 116)}))
    assert torch.equal(b.read(first, declared)["x"], torch.full((1, 100), 1.0))   # still there, in order
    assert torch.equal(b.read(second, declared)["x"], torch.full((1, 100), 2.0))
    with pytest.raises(ShmError, match="not one written for w1"):
        b.read(p.ShmRef(first.ring.replace("-w1-", "-w2-"), 0, 64), declared)
    with pytest.raises(ShmError, match="cannot open ring"):          # named, but nobody made it
        b.read(p.ShmRef(first.ring.replace("-w0-", "-w7-"), 0, 448), declared)
    (tmp_path / "physis-hop-1-w8-w1-0").write_bytes(b"x" * 200)         # made, but not a ring
    with pytest.raises(ShmError, match="not a hop ring"):
        b.read(p.ShmRef("physis-hop-1-w8-w1-0", 0, 448), declared)


def test_a_header_that_could_not_be_sent_gives_its_region_back(pair):
    a, b = pair
    head = a.head("w1")
    lost = a.write("w1", {"x": torch.full((1, 10), 9.0)})
    a.unwrite("w1", lost, head)
    kept = a.write("w1", {"x": torch.full((1, 10), 3.0)})
    assert kept.position == lost.position and torch.equal(b.read(kept, specs({"x": torch.zeros(1, 10)}))["x"],
                                                            torch.full((1, 10), 3.0))


def test_a_new_generation_is_a_new_ring_and_older_ones_are_refused(pair, tmp_path):
    a, b = pair
    old = a.write("w1", {"x": torch.ones(1, 10)})
    b.read(old, specs({"x": torch.ones(1, 10)}))
    a.connect("w1", 1)                              # the receiver restarted: both ends start afresh
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"physis-hop-{os.getpid()}-w0-w1-1"]
    new = a.write("w1", {"x": torch.full((1, 10), 5.0)})
    assert new.position == 0 and torch.equal(b.read(new, specs({"x": torch.ones(1, 10)}))["x"],
                                             torch.full((1, 10), 5.0))
    with pytest.raises(ShmError, match="older link generation"):
        b.read(old, specs({"x": torch.ones(1, 10)}))


def test_rings_of_a_dead_process_are_removed(tmp_path):
    a = ShmHops("w0", 4 * KB, tmp_path)
    a.connect("w1", 0)
    a.connect("w2", 3)
    assert remove_rings_of(os.getpid(), tmp_path) == 2 and not list(tmp_path.iterdir())
    assert HEADER == 64


@pytest.mark.slow
def test_engine_over_shm_survives_a_killed_worker_and_leaves_no_ring():
    from physis_ros.model import load_model_config
    from physis_ros.observations import SyntheticScene
    from physis_ros.runtime.engine import Engine, Observation, ServedModel
    from physis_ros.runtime.plans import make_plan
    from physis_ros.runtime.settings import EngineConfig

    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    got: list = []

    async def until(cond, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def main():
        engine = Engine(EngineConfig(workers=2, hops="shm", heartbeat_timeout_s=0.5))
        async with engine:
            await engine.add_stream("a", lambda c: Observation(scene.observation("a", c), engine.clock()), got.append,
                                    model=ServedModel(cfg), plan=make_plan("stage", cfg.steps, cfg.blocks, 2),
                                    slo_interval_ms=100.0)
            await until(lambda: len(got) >= 3 and engine.pool.workers["w1"].stats.link_hops > 0)
            pids = [w.pid for w in engine.pool.workers.values()]
            os.kill(engine.pool.workers["w0"].proc.pid, signal.SIGKILL)   # the writer of the ring
            await until(lambda: engine.stream_status("a")["epoch"] >= 1)
            n = len(got)
            await until(lambda: len(got) >= n + 3)
            assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"physis-hop-{pids[0]}-")]
            pids = [w.pid for w in engine.pool.workers.values()]
        return pids

    pids = uvloop.run(main())
    assert not [f for f in os.listdir("/dev/shm") if any(f.startswith(f"physis-hop-{pid}-") for pid in pids)]


def test_shm_is_for_cpu_workers_on_this_host():
    from physis_ros.config import ConfigError
    from physis_ros.runtime.settings import EngineConfig

    EngineConfig(workers=2, hops="shm").validate()
    for bad in ({"devices": ["cuda:0", "cuda:1"]}, {"launcher": "external"}):
        with pytest.raises(ConfigError, match="hops shm"):
            EngineConfig(workers=2, hops="shm", **bad).validate()



@pytest.mark.slow
def test_workers_give_every_region_back_as_chunks_move_on():
    """A worker that kept a view of what it read (a queued job, a pass-through tensor) would fill a 1 MB
    ring within a few dozen hops; hops would then go as frames (``ring_full``)."""
    from physis_ros.model import load_model_config
    from physis_ros.observations import SyntheticScene
    from physis_ros.runtime.engine import Engine, Observation, ServedModel
    from physis_ros.runtime.plans import make_plan
    from physis_ros.runtime.settings import EngineConfig

    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    chunks = 40
    hops = 2 * chunks * (2 * cfg.steps - 1)    # block plan: w0 -> w1 within each step, w1 -> w0 between steps

    async def main():
        engine = Engine(EngineConfig(workers=2, hops="shm", hop_ring_mb=1))
        async with engine:
            for name in ("a", "b"):
                await engine.add_stream(name, lambda c, n=name: Observation(scene.observation(n, c), engine.clock()),
                                        lambda out: None, model=ServedModel(cfg), chunks=chunks,
                                        plan=make_plan("block", cfg.steps, cfg.blocks, 2))
            for name in ("a", "b"):
                await engine.wait_stream(name)
            deadline = time.monotonic() + 10.0     # worker stats come with their heartbeats
            stats = lambda: [w.stats for w in engine.pool.workers.values()]   # noqa: E731
            while sum(s.link_hops for s in stats()) < hops * 0.9 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return stats()

    stats = uvloop.run(main())
    assert sum(s.link_hops for s in stats) >= hops * 0.9 and all(s.ring_full == 0 for s in stats), [(s.link_hops, s.ring_full, s.tasks) for s in stats]


@pytest.mark.slow
def test_the_sender_never_reads_a_tail_lower_than_one_already_written(tmp_path):
    """The receiver advances the tail while the sender reads it. A tail read low (struct.pack_into zeroes the
    bytes before writing them) made a 1 MB ring look full for a hop now and then on a busy host."""
    import subprocess
    import sys

    path = tmp_path / "physis-hop-1-a-b-0"
    ring = Ring(path, 4096, create=True)
    ring.tail = 1 << 40
    writer = subprocess.Popen([sys.executable, "-c", f"""
import time
from pathlib import Path
from physis_ros.runtime.shm_hops import Ring
ring = Ring(Path({str(path)!r}), 0, create=False)
value, end = 1 << 40, time.monotonic() + 1.5
while time.monotonic() < end:
    for _ in range(1000):
        value += 0x10101
        ring.tail = value
"""])
    reads = lower = highest = 0
    while writer.poll() is None:
        value = ring.tail
        reads += 1
        lower += value < highest
        highest = max(highest, value)
    assert writer.returncode == 0
    assert highest > 1 << 40 and reads > 1000, (reads, highest)
    assert lower == 0, f"{lower} of {reads} reads went backwards"
    ring.close()
