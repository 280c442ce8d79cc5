"""Hidden states over torch.distributed links (gloo on CPU): a restarted worker rejoins, a header cannot
make a worker receive into a tensor of another shape or dtype, a failed link is rebuilt. (Bit-identity of
every plan over these links: tests/runtime/test_engine.py::test_out_of_band_hops_are_bit_identical_to_reference.)"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import uvloop
import zmq

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.engine import Engine
from physis_ros.runtime.hops import LinkBook, LinkId, empty_like_specs
from physis_ros.runtime.plans import make_plan
from physis_ros.runtime.settings import EngineConfig

from two_streams import CFG, TwoStreams


class Served(TwoStreams):
    """Streams ``a`` and ``b`` on the stage plan over 2 workers, hops over torch links."""

    def __init__(self, **engine):
        plan = make_plan("stage", CFG.steps, CFG.blocks, 2)
        # 5 s unless a test says otherwise: these tests are about links, and beside a CPU hog a worker starved
        # for a second was killed at the 1 s default, its loss resetting the streams the test watched
        engine.setdefault("heartbeat_timeout_s", 5.0)
        super().__init__(EngineConfig(workers=2, hops="torch", **engine), plans=(plan, plan))

    def forge(self, worker: str, task: p.Task, tensors: dict[str, torch.Tensor]) -> None:
        """Send ``task`` (declaring ``tensors``, none of which is sent) to ``worker``'s data socket."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(self.engine.pool.workers[worker].data_addr)
        sock.send_multipart(wire.encode(task, tensors))
        sock.close(linger=1000)
        ctx.term()


def _stage_on(engine: Engine, worker_index: int, stream: str) -> tuple[int, int]:
    """A stage of ``stream`` hosted on worker ``worker_index`` whose input comes from the other worker."""
    plan = engine.streams[stream].plan
    for st, w in plan.assignment.items():
        prev = [q for q, v in plan.assignment.items() if plan.next_stage(q) == st]
        if w == worker_index and prev and plan.assignment[prev[0]] != worker_index:
            return st
    raise AssertionError("no such stage")


def _state(block: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    state = {"cond": torch.zeros(1, 4, CFG.hidden, dtype=dtype), "x": torch.zeros(1, *CFG.output_shape, dtype=dtype)}
    if block > 0:
        state["h"] = torch.zeros(1, CFG.tokens_per_chunk, CFG.hidden, dtype=dtype)
    return state


@pytest.mark.slow
def test_hops_go_over_links_and_a_restarted_worker_rejoins():
    async def main():
        # 2 s: the test is about the rejoin; at 0.5 s a CPU hog beside the suite killed every restarted
        # worker again before it could rejoin
        async with Served(heartbeat_timeout_s=2.0) as run:
            await run.more()
            pool, links = run.engine.pool, run.engine.links
            await run.until(lambda: pool.workers["w1"].stats.link_hops > 0)  # stage plan: w0 hands on to w1
            gen0 = links.gen("w0", "w1")
            os.kill(pool.workers["w1"].proc.pid, signal.SIGKILL)
            await run.until(lambda: sum(e.kind == "readmitted" for e in run.events) >= 2)
            await run.more(5)   # over a pair built afresh: the restarted worker rejoined the transport
            await run.until(lambda: pool.workers["w1"].stats.link_hops > 0)  # the new process's count
            return gen0, links.gen("w0", "w1"), run.events, run.engine.stream_status("a")

    gen0, gen1, events, status = uvloop.run(main())
    assert gen1 > gen0
    failed = {(e.stream, e.cause) for e in events if e.kind == "failed"}
    # Both streams were reset; a chunk on its way to the dead worker may have said so first (a refused send or a
    # closed link) before the engine saw the worker gone.
    assert {s for s, _ in failed} == {"a", "b"}
    assert {c for _, c in failed} <= {"worker_lost", "send_failed", "link_failed"}
    assert status["epoch"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("declared", ["dtype", "shape", "names"])
def test_a_header_declaring_other_tensors_is_refused_before_any_byte_is_received(declared):
    """A wrong dtype (same byte count: float16 for bfloat16 would read garbage), shape or set of tensors in a
    link task's header is an error naming the tensor; nothing is received, the pair stays up."""
    async def main():
        async with Served() as run:
            await run.more()
            engine = run.engine
            s = engine.streams["a"]
            stage = _stage_on(engine, 1, "a")
            tensors = _state(stage[1], torch.float16 if declared == "dtype" else torch.float32)
            if declared == "shape":
                tensors["x"] = torch.zeros(1, *CFG.output_shape[:-1], CFG.output_shape[-1] + 1)
            elif declared == "names":
                tensors["extra"] = torch.zeros(1)
            gen = engine.links.gen("w0", "w1")
            await run.until(lambda: bool(s.inflight))
            chunk = max(s.inflight)
            run.forge("w1", p.Task(stream="a", chunk=chunk, stage=stage, epoch=s.epoch,
                                   link=p.HopLink(sender="w0", gen=gen, tag=7)), tensors)
            await run.until(lambda: engine.pool.workers["w1"].stats.bad_messages >= 1)
            await run.more()
            return gen, engine.links.gen("w0", "w1"), run.events, engine.stream_status("b"), run.chunks("b")

    gen_before, gen_after, events, status_b, b = uvloop.run(main())
    assert gen_after == gen_before                    # no receive was posted: the link was never at risk
    assert all(e.cause == "task_failed" for e in events if e.kind == "failed")
    assert status_b["resets"] == {} and b == list(range(b[0], b[0] + len(b)))  # the other robot lost nothing


@pytest.mark.slow
def test_a_transfer_that_never_comes_fails_its_link_which_is_rebuilt():
    """A well-formed header whose bytes never come (a forged tag; a sender that died) times out, closes the
    pair, resets the streams on it and the next start builds a new generation; both streams come back."""
    async def main():
        async with Served(hop_timeout_s=1.0) as run:
            await run.more()
            engine = run.engine
            s = engine.streams["a"]
            stage = _stage_on(engine, 1, "a")
            gen = engine.links.gen("w0", "w1")
            await run.until(lambda: bool(s.inflight))
            run.forge("w1", p.Task(stream="a", chunk=max(s.inflight), stage=stage, epoch=s.epoch,
                                   link=p.HopLink(sender="w0", gen=gen, tag=123_456)), _state(stage[1]))
            await run.until(lambda: engine.links.gen("w0", "w1") > gen)
            await run.more(5)
            return run.events

    causes = {e.cause for e in uvloop.run(main()) if e.kind == "failed"}
    # The streams are reset either by the closed link or, first, by their chunks' bound (a chunk queued behind
    # the stuck receive): loud either way, and the link's failure still moves its generation on.
    assert causes and causes <= {"link_failed", "chunk_timeout"}


def test_link_ids_ranks_and_generations():
    assert LinkId.of("w1", "w0", 3) == LinkId("w0", "w1", 3) and LinkId("w0", "w1", 3).rank_of("w1") == 1
    book = LinkBook("127.0.0.1", 1.0)
    assert book.gen("w0", "w1") == 0
    book.worker_lost("w1")
    book.link_failed("w1", "w0")
    assert book.gen("w0", "w1") == book.gen("w1", "w0") == 2 and book.gen("w0", "w2") == 0
    assert book.links("w1", {"w2", "w0"}) == [p.Link("w0", 2), p.Link("w2", 1)]


def test_declarations_are_bounded_before_anything_is_allocated():
    specs = [p.TensorSpec("h", "float32", [1, 1 << 20, 1 << 10])]
    with pytest.raises(wire.WireError, match="exceed the message limit"):
        empty_like_specs(specs, "meta", 1 << 20)
    with pytest.raises(wire.WireError, match="twice"):
        empty_like_specs([p.TensorSpec("x", "float32", [2])] * 2, "meta", 1 << 20)
    out = empty_like_specs([p.TensorSpec("x", "bfloat16", [1, 3])], "meta", 1 << 20)
    assert out["x"].dtype == torch.bfloat16 and out["x"].shape == (1, 3) and out["x"].device.type == "meta"


def test_a_link_task_carries_no_tensor_frames_and_frames_beside_one_are_refused():
    task = p.Task(stream="s", chunk=0, stage=(1, 1), epoch=0, link=p.HopLink(sender="w0", gen=0, tag=0))
    frames = wire.encode(task, {"x": torch.zeros(2, 3)})
    assert len(frames) == 1
    rec = wire.decode(frames, wire.DATA)
    assert rec.tensors == {} and rec.msg.tensors == [p.TensorSpec("x", "float32", [2, 3])]
    with pytest.raises(wire.WireError, match="expected none"):
        wire.decode([frames[0], b"\0" * 24], wire.DATA)


def test_torch_hops_need_one_gpu_per_worker():
    from physis_ros.config import ConfigError

    with pytest.raises(ConfigError, match="hops") as info:
        EngineConfig(workers=2, devices=["cuda:0"], hops="torch").validate()
    assert "one GPU" in str(info.value) or "own" in str(info.value)
    EngineConfig(workers=2, devices=["cuda:0", "cuda:1"], hops="torch").validate()
    EngineConfig(workers=2, devices=["cpu"], hops="torch").validate()   # gloo pairs processes on one host


def test_torch_hops_off_loopback_need_a_trusted_network():
    from physis_ros.config import ConfigError

    with pytest.raises(ConfigError, match="hop_network_trusted"):
        EngineConfig(workers=2, hops="torch", bind_host="10.0.0.5", curve_keys="keys").validate()
    EngineConfig(workers=2, hops="torch", bind_host="10.0.0.5", curve_keys="keys", hop_network_trusted=True).validate()
