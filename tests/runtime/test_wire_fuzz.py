"""Hostile wire input: 10,000 generated messages never crash the decoder nor allocate past the limit,
and a live worker fed garbage keeps serving correct chunks."""

import random

import msgpack
import numpy as np
import torch
import uvloop
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from physis_ros.config import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout
from physis_ros.runtime import wire
from physis_ros.runtime.engine import Engine, Observation

LIMIT = 64 * 1024
VALID = [bytes(f) for f in wire.encode(wire.Message(
    "task", "robot0", 3, (4, 0), {"x": torch.randn(1, 16, 7), "obs/state": torch.randn(1, 7)},
    {"epoch": 0, "trace": [[4, 0, "w0", 0.1, 0.2, 1]]}))]
JUNK = [None, True, -1, 2**63, 1.5, "", "x" * 9, b"\x00", [], [1, [2]], {}, {"a": 1}]


def hostile(seed: int) -> list[bytes]:
    """One hostile message: a valid one with its header fields, specs or frames mutated, or noise."""
    rng = random.Random(seed)
    if rng.randrange(5) == 0:  # pure noise frames
        return [rng.randbytes(rng.randrange(80)) for _ in range(rng.randrange(1, 4))]
    header = msgpack.unpackb(VALID[0])
    frames = list(VALID[1:])
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(["v", "kind", "stream", "chunk", "stage", "t", "ts", "body", "spec", "frame", "drop"])
        specs = header.get("t")
        if field == "spec" and isinstance(specs, list) and specs and all(
                isinstance(x, list) and len(x) == 3 for x in specs):
            spec = rng.choice(specs)
            spec[rng.randrange(3)] = rng.choice([*JUNK, "object", "float32", "bfloat16",
                                                 [rng.randrange(-2, 2**20) for _ in range(rng.randrange(10))]])
        elif field == "frame" and frames:
            i = rng.randrange(len(frames))
            f = frames[i]
            frames[i] = f[:rng.randrange(len(f) + 1)] if rng.random() < 0.5 else f + rng.randbytes(rng.randrange(64))
        elif field == "drop" and header:
            header.pop(rng.choice(list(header)), None)
        else:
            header[field] = rng.choice(JUNK + [wire.VERSION, "task", "output", [4, 0], [["x", "float32", [1]]]])
    if rng.random() < 0.2 and frames:
        frames.pop(rng.randrange(len(frames)))  # truncated multipart message
    raw = msgpack.packb(header, use_bin_type=True)
    if rng.random() < 0.1:
        raw = raw[:rng.randrange(len(raw) + 1)]  # truncated header
    return [raw, *frames]


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_decoder_never_crashes_or_overallocates(seed):
    try:
        msg = wire.decode(hostile(seed), max_bytes=LIMIT)
    except wire.WireError:
        return
    assert sum(t.numel() * t.element_size() for t in msg.tensors.values()) <= LIMIT


def test_mutations_reach_both_outcomes():
    accepted = 0
    for seed in range(2000):
        try:
            wire.decode(hostile(seed), max_bytes=LIMIT)
            accepted += 1
        except wire.WireError:
            pass
    assert 10 < accepted < 1000  # the fuzzer exercises the accept path and, mostly, the reject paths


def test_worker_fed_garbage_keeps_serving():
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    rng = random.Random(0)
    garbage = []
    for i in range(500):
        header = {"v": rng.choice([1, 1, 2]), "kind": rng.choice(["task", "output", "load", "nope"]),
                  "stream": rng.choice(["robot0", "x"]), "chunk": rng.randint(-1, 9),
                  "stage": rng.choice([[4, 0], [9, 9], None]),
                  "t": [["x", rng.choice(["float32", "object"]), [rng.randint(0, 9), 128]]], "ts": {}, "body": {}}
        frames = [msgpack.packb(header), rng.randbytes(rng.randint(0, 4096))]
        garbage.append(frames if i % 3 else [rng.randbytes(rng.randint(0, 100))])

    async def main():
        engine = Engine(cfg, EngineConfig(workers=1, plan="sequential"))
        await engine.start()
        try:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(engine.workers["w0"].data_addr)
            for frames in garbage:
                sock.send_multipart(frames)
            sock.close(linger=2000)
            ctx.term()
            got = []
            await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                                    got.append, chunks=5)
            await engine.wait_stream("robot0")
            return got, await engine.request("w0", "stats", {})
        finally:
            await engine.stop()

    got, stats = uvloop.run(main())
    ref = ReferenceRollout(build_model(cfg))
    assert [o.chunk for o in got] == list(range(5))
    for o in got:
        assert np.array_equal(o.output, ref.step("robot0", scene.observation("robot0", o.chunk)).output.numpy())
    assert stats["bad_messages"] + stats["stale"] == len(garbage)
