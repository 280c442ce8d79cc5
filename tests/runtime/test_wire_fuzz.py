"""Hostile wire input: 12,000 generated messages of every kind, on every channel, never crash the typed
decoders nor allocate past the limit, and a live worker fed garbage keeps serving correct chunks."""

import copy
import random

import msgpack
import numpy as np
import pytest
import torch
import uvloop
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.engine import Engine, Observation, ServedModel
from physis_ros.runtime.plans import make_plan

LIMIT = 64 * 1024
TRACE = [p.TraceEntry(4, 0, "w0", 0.1, 0.2, 1)]
# One valid message of every kind, on the channel that takes it, with the tensors it may carry.
VALID = [
    (wire.DATA, p.Task(stream="robot0", chunk=3, stage=(4, 0), epoch=0, seed=1, order=1.0, deadline=1.1,
                       sent=1.0, hops=[0.1], trace=TRACE), {"x": torch.randn(1, 16, 7), "obs/state": torch.randn(1, 7)}),
    (wire.OUTPUT, p.Output(stream="robot0", chunk=3, epoch=0, worker="w1", sent=2.0, trace=TRACE),
     {"x": torch.randn(1, 16, 7)}),
    (wire.DATA, p.Wake(stream="robot0", chunk=3, seed=1), {}),
    (wire.OUTPUT, p.Wake(stream="robot0", chunk=3), {}),
    (wire.TO_WORKER, p.Load(req=1, batching="on"), {}),
    (wire.TO_WORKER, p.StartStream(req=2, stream="robot0", epoch=1, stages=[(4, 0)],
                                   model=p.ModelRef(id="m", config={"name": "m"}, batch_costs={"0": {"1": 0.5}}),
                                   routes=[p.Route((4, 0), "tcp://127.0.0.1:5")]), {}),
    (wire.TO_WORKER, p.StopStream(req=3, stream="robot0"), {}),
    (wire.TO_ENGINE, p.Hello(worker="w0", data="tcp://127.0.0.1:5", pid=4, device="cpu"), {}),
    (wire.TO_ENGINE, p.Heartbeat(worker="w0", queue=1, stats=p.WorkerStats(tasks=3)), {}),
    (wire.TO_ENGINE, p.Ack(req=1, worker="w0", blocks=[0]), {}),
    (wire.TO_ENGINE, p.TaskLost(worker="w0", stream="r", chunk=1, epoch=0, reason="send_failed"), {}),
    (wire.TO_ENGINE, p.LogRecord(worker="w0", level="info", text="x"), {}),
]
VALID_FRAMES = [(ch, [bytes(f) for f in wire.encode(msg, tensors)]) for ch, msg, tensors in VALID]
CHANNELS = [wire.DATA, wire.OUTPUT, wire.TO_WORKER, wire.TO_ENGINE]
JUNK = [None, True, -1, 2**63, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 9, "x" * 5000, b"\x00", [],
        [1, [2]], {}, {"a": 1}, [4, 0], [0, 0], [-1, 2], ["x", "float32", [1]]]


def junk(rng: random.Random, extra=()):
    return copy.deepcopy(rng.choice([*JUNK, *extra]))  # a copy: mutating it must not touch JUNK (or form cycles)


def mutate(rng: random.Random, value):
    """A random hostile change somewhere inside a decoded msgpack value."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        roll = rng.random()
        if roll < 0.15:
            value.pop(key)
        elif roll < 0.25:
            value[rng.choice(["zz", "kind", "v", key])] = junk(rng)
        else:
            value[key] = mutate(rng, value[key])
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        roll = rng.random()
        if roll < 0.15:
            value.pop(i)
        elif roll < 0.25:
            value.append(junk(rng))
        else:
            value[i] = mutate(rng, value[i])
        return value
    return junk(rng, ["task", "output", "load", "hello", "float32", "bfloat16", 2, 0, 7])


def hostile(seed: int):
    """One hostile message for one channel: a valid one of any kind with its header fields, tensor specs or
    frames mutated, sent to any channel, or noise."""
    rng = random.Random(seed)
    channel = rng.choice(CHANNELS)
    if rng.randrange(6) == 0:  # pure noise frames
        return channel, [rng.randbytes(rng.randrange(80)) for _ in range(rng.randrange(1, 4))]
    own, frames = rng.choice(VALID_FRAMES)
    if rng.random() < 0.7:
        channel = own
    header = msgpack.unpackb(frames[0])
    frames = list(frames[1:])
    for _ in range(rng.randrange(1, 4)):
        if frames and rng.random() < 0.2:
            i = rng.randrange(len(frames))
            f = frames[i]
            frames[i] = f[:rng.randrange(len(f) + 1)] if rng.random() < 0.5 else f + rng.randbytes(rng.randrange(64))
        else:
            header = mutate(rng, header)
    if rng.random() < 0.1 and frames:
        frames.pop(rng.randrange(len(frames)))  # truncated multipart message
    raw = msgpack.packb(header, use_bin_type=True)
    if rng.random() < 0.05:
        raw = raw[:rng.randrange(len(raw) + 1)]  # truncated header
    return channel, [raw, *frames]


@pytest.mark.slow
@settings(max_examples=12_000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_typed_decoders_never_crash_or_overallocate(seed):
    channel, frames = hostile(seed)
    try:
        rec = wire.decode(frames, channel, max_bytes=LIMIT)
    except wire.WireError:
        return
    assert sum(t.numel() * t.element_size() for t in rec.tensors.values()) <= LIMIT
    # Whatever got through is fully typed: re-encoding it gives a message that decodes to the same.
    again = wire.decode(wire.encode(rec.msg, rec.tensors), channel, max_bytes=LIMIT)
    assert again.msg == rec.msg


def test_mutations_reach_both_outcomes():
    accepted = {ch.name: 0 for ch in CHANNELS}
    rejected = 0
    for seed in range(4000):
        channel, frames = hostile(seed)
        try:
            wire.decode(frames, channel, max_bytes=LIMIT)
            accepted[channel.name] += 1
        except wire.WireError:
            rejected += 1
    # The fuzzer exercises the accept path of every channel and, mostly, the reject paths.
    assert all(n > 5 for n in accepted.values()), accepted
    assert rejected > 2000


@pytest.mark.slow
def test_worker_fed_garbage_keeps_serving():
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    rng = random.Random(0)
    garbage = [hostile(rng.randrange(2**32))[1] for _ in range(500)]

    async def main():
        engine = Engine(EngineConfig(workers=1, plan="sequential"))
        await engine.start()
        try:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(engine.pool.workers["w0"].data_addr)
            for frames in garbage:
                sock.send_multipart(frames)
            sock.close(linger=2000)
            ctx.term()
            got = []
            await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                                    got.append, chunks=5, model=ServedModel(cfg),
                                    plan=make_plan("sequential", cfg.steps, cfg.blocks, 1))
            await engine.wait_stream("robot0")
            return got, (await engine.pool.request("w0", p.Stats(req=0))).stats
        finally:
            await engine.stop()

    got, stats = uvloop.run(main())
    ref = ReferenceRollout(build_model(cfg))
    assert [o.chunk for o in got] == list(range(5))
    for o in got:
        assert np.array_equal(o.output, ref.step("robot0", scene.observation("robot0", o.chunk)).output.numpy())
    # Every garbage message was dropped and counted (none was for the stream, which started afterwards); a
    # mutated Wake that still decodes is a wake-up (for no stream here: a short spin), counted as one.
    assert stats.bad_messages + stats.stale + stats.wakes == len(garbage)
