"""The engine and real worker processes: equivalence to the reference, batching, faults, shutdown."""

import asyncio
import json
import math
import os
import signal
import time

import numpy as np
import pytest
import torch
import uvloop
import zmq

from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout, reference_rollout
from physis_ros.runtime import protocol as p
from physis_ros.runtime.engine import Engine, EngineError, Observation, ServedModel
from physis_ros.runtime.offline import run_chunks
from physis_ros.runtime.planner import resolve_plan
from physis_ros.runtime.plans import Plan, pipeline_order
from physis_ros.runtime.costs import CostProfile

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

STREAMS = ["robot0", "robot1"]


def new_engine(cfg, engine_cfg: EngineConfig, **kw) -> tuple[Engine, dict]:
    """An engine, and the model and plan its streams are added with (``add_stream(..., **served)``)."""
    resolved = resolve_plan(cfg, engine_cfg)
    return Engine(engine_cfg, **kw), {"model": ServedModel(cfg, profile=resolved.profile), "plan": resolved.plan}
_reference_cache: dict = {}


def reference(model_name: str, chunks: int):
    key = (model_name, chunks)
    if key not in _reference_cache:
        cfg = load_model_config(model_name)
        scene = SyntheticScene(cfg.observation_shapes)
        _reference_cache[key] = {(r.stream, r.index): r.output.numpy()
                                 for r in reference_rollout(build_model(cfg), scene.observation, STREAMS, chunks)}
    return _reference_cache[key]


def run(model_name, chunks, **engine):
    """Every chunk of both streams. These tests check arithmetic, not liveness: a worker starved of CPU for a
    second beside a CPU hog (its heartbeat late) is not killed and its stream reset mid-check (liveness has
    tests of its own, with short timeouts)."""
    cfg = load_model_config(model_name)
    scene = SyntheticScene(cfg.observation_shapes)
    engine.setdefault("heartbeat_timeout_s", 20.0)
    return run_chunks(cfg, EngineConfig(**engine), STREAMS, chunks, scene.observation)


# Every plan on 2 and 3 workers; the large corners (4 workers, torch hops on 3) run in bench/equivalence.sh.
CASES = [("sequential", 1)] + [(p, w) for p in ("step", "block", "stage") for w in (2, 3)]


@pytest.mark.parametrize("model_name", ["tiny-wam", "tiny-acwm"])
@pytest.mark.parametrize("plan, workers", CASES)
def test_pipeline_is_bit_identical_to_reference(model_name, plan, workers):
    chunks = 3 * load_model_config(model_name).window + 1  # past the KV window
    out = run(model_name, chunks, plan=plan, workers=workers)
    ref = reference(model_name, chunks)
    for s in STREAMS:
        assert [o.chunk for o in out[s]] == list(range(chunks))
        for o in out[s]:
            assert np.array_equal(o.output, ref[(s, o.chunk)]), (s, o.chunk)
            assert len(o.record.stage_ms) == 32 and all(b == 1 for b in o.record.batch_sizes)


@pytest.mark.parametrize("hops, plan, workers", [("torch", "step", 2), ("torch", "block", 2), ("torch", "stage", 3),
                                                ("shm", "step", 2), ("shm", "block", 3), ("shm", "stage", 3)])
def test_out_of_band_hops_are_bit_identical_to_reference(hops, plan, workers):
    """Hidden states over torch.distributed (gloo here; NCCL on GPUs) or shared-memory rings, headers over
    ZeroMQ."""
    chunks = 3 * load_model_config("tiny-wam").window + 1
    out = run("tiny-wam", chunks, plan=plan, workers=workers, hops=hops)
    ref = reference("tiny-wam", chunks)
    for s in STREAMS:
        assert [o.chunk for o in out[s]] == list(range(chunks))
        assert all(np.array_equal(o.output, ref[(s, o.chunk)]) for o in out[s]), s


@pytest.mark.parametrize("batching, plan, workers", [("on", "sequential", 1), ("adaptive", "stage", 2)])
def test_batched_pipeline_matches_reference_within_tolerance(batching, plan, workers):
    chunks = 12
    out = run("tiny-wam", chunks, plan=plan, workers=workers, batching=batching)
    ref = reference("tiny-wam", chunks)
    batched = 0
    for s in STREAMS:
        for o in out[s]:
            want = ref[(s, o.chunk)]
            assert np.abs(o.output - want).max() <= 1e-5 * np.abs(want).max()
            batched += sum(b > 1 for b in o.record.batch_sizes)
    assert batched > 0  # batching did happen


def test_auto_plan_comes_from_the_planner_and_runs(tmp_path):
    cfg = load_model_config("tiny-wam")
    # Overhead-bound profile (a batch of 4 costs 1.6 singles): the planner must batch same-block stages.
    stage_ms = {s: {1: 1.0, 2: 1.2, 4: 1.6} for s in pipeline_order(cfg.steps, cfg.blocks)}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(CostProfile(cfg.name, "cpu", "measured:synthetic", cfg.steps, cfg.blocks, stage_ms,
                                              hop_ms=0.1, block_weight_bytes=0, kv_bytes=0,
                                              hidden_bytes=1000).to_json()))
    resolved = resolve_plan(cfg, EngineConfig(plan="auto", workers=2, batching="on", profile=str(profile)))
    assert resolved.prediction is not None and resolved.plan is resolved.prediction.plan
    assert resolved.prediction.simulated.task_batch > 1.5 and resolved.prediction.interval_ms > 0
    out = run("tiny-wam", 8, plan="auto", workers=2, batching="on", profile=str(profile))
    ref = reference("tiny-wam", 8)
    for s in STREAMS:
        assert [o.chunk for o in out[s]] == list(range(8))
        assert all(np.abs(o.output - ref[(s, o.chunk)]).max() <= 1e-5 * np.abs(ref[(s, o.chunk)]).max()
                   for o in out[s])


def test_telemetry_records_are_complete():
    out = run("tiny-wam", 6, plan="stage", workers=2)
    recs = [o.record for o in out["robot0"]]
    assert np.isnan(recs[0].interval_ms) and all(r.interval_ms > 0 for r in recs[1:])
    for r in recs:
        assert r.emit >= r.enqueue >= r.obs_stamp
        assert r.latency_ms >= sum(r.stage_ms) * 0.5
        assert set(r.worker_compute_ms) == {"w0", "w1"}
        assert len(r.hops_ms) == 3  # engine -> w0 -> w1 -> engine


async def _engine_with_stream(cfg, engine_cfg, chunks=None):
    scene = SyntheticScene(cfg.observation_shapes)
    engine, served = new_engine(cfg, engine_cfg)
    await engine.start()
    got = []
    await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                            got.append, chunks=chunks, **served)
    return engine, got


def test_malformed_message_is_dropped_and_worker_keeps_serving(caplog):
    cfg = load_model_config("tiny-wam")

    async def main():
        engine, got = await _engine_with_stream(cfg, EngineConfig(workers=2, plan="stage"), chunks=8)
        try:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(engine.pool.workers["w1"].data_addr)
            for frames in ([b"\x00garbage"], [b"\x81\xa1v\x01"], []):
                if frames:
                    sock.send_multipart(frames)
            sock.close(linger=1000)
            await engine.wait_stream("robot0")
            stats = (await engine.pool.request("w1", p.Stats(req=0))).stats
            return got, stats
        finally:
            await engine.stop()

    with caplog.at_level("WARNING", logger="physis.worker"):
        got, stats = uvloop.run(main())
    assert [o.chunk for o in got] == list(range(8))
    assert stats.bad_messages == 2
    # The worker's log line reached the engine's log, under the worker's name.
    assert any("[w1]" in r.getMessage() and "malformed data message" in r.getMessage() for r in caplog.records)


def test_shutdown_leaves_no_processes_or_ipc_files():
    cfg = load_model_config("tiny-wam")

    async def main():
        engine, got = await _engine_with_stream(cfg, EngineConfig(workers=2, plan="stage", transport="ipc"))
        while len(got) < 3:
            await asyncio.sleep(0.01)
        pids = [w.proc.pid for w in engine.pool.workers.values()]
        ipc_dir = engine._ipc_dir.name
        assert any(os.scandir(ipc_dir))
        await engine.stop()
        return pids, ipc_dir

    pids, ipc_dir = uvloop.run(main())
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(ipc_dir)


def test_killed_worker_is_reported_by_name_without_hanging():
    cfg = load_model_config("tiny-wam")

    async def main():
        engine, got = await _engine_with_stream(cfg, EngineConfig(workers=2, plan="stage", restart_workers=False),
                                                chunks=10_000)
        try:
            while len(got) < 2:
                await asyncio.sleep(0.01)
            victim = engine.pool.workers["w1"].proc
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(EngineError, match=rf"worker w1 \(pid {victim.pid}\) exited with code -9 .*restart"):
                await asyncio.wait_for(engine.wait_stream("robot0"), timeout=10)
            return time.monotonic() - killed
        finally:
            await engine.stop()

    assert uvloop.run(main()) < 5.0


def test_worker_that_cannot_load_is_named():
    cfg = load_model_config("tiny-wam")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA to provoke a load failure")

    async def main():
        engine, served = new_engine(cfg, EngineConfig(workers=1, plan="sequential", devices=["cuda:0"]))
        await engine.start()
        await engine.add_stream("robot0", lambda c: None, **served)

    # physis-worker refuses a device this machine lacks before it connects; the engine names the worker.
    with pytest.raises(EngineError, match="worker w0 exited with code 2 before it said hello"):
        uvloop.run(main())


def test_a_stream_whose_weights_cannot_load_is_refused_and_the_worker_stays_up(tmp_path):
    cfg = load_model_config("tiny-wam")
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a checkpoint")

    async def main():
        engine, served = new_engine(cfg, EngineConfig(workers=1, plan="sequential"))
        await engine.start()
        try:
            with pytest.raises(EngineError, match="worker w0: StartStream failed"):
                await engine.add_stream("broken", lambda c: None, model=ServedModel(cfg, str(bad)),
                                        plan=served["plan"])
            got = []
            await engine.add_stream("fine", lambda c: Observation(SyntheticScene(cfg.observation_shapes)
                                                                  .observation("fine", c), engine.clock()),
                                    got.append, chunks=3, **served)
            await engine.wait_stream("fine")
            return [o.chunk for o in got]
        finally:
            await engine.stop()

    assert uvloop.run(main()) == [0, 1, 2]


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["hung", "killed"])
def test_lost_worker_fails_only_its_streams_and_they_come_back(fault):
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    on_w0 = Plan("sequential", cfg.steps, cfg.blocks, {s: 0 for s in pipeline_order(cfg.steps, cfg.blocks)})
    on_w1 = Plan("sequential", cfg.steps, cfg.blocks, {s: 1 for s in pipeline_order(cfg.steps, cfg.blocks)})

    async def main():
        events = []
        # 1 s (the default): at 0.5 s a CPU-starved CI host once timed out a healthy worker loading its blocks.
        engine, served = new_engine(cfg, EngineConfig(workers=2, heartbeat_timeout_s=1.0), on_event=events.append)
        await engine.start()
        got = {"a": [], "b": []}
        try:
            for name, plan in (("a", on_w0), ("b", on_w1)):
                await engine.add_stream(name, lambda c, n=name: Observation(scene.observation(n, c), engine.clock()),
                                        got[name].append, model=served["model"], plan=plan)
            while len(got["b"]) < 3:
                await asyncio.sleep(0.01)
            victim = engine.pool.workers["w1"]
            os.kill(victim.proc.pid, fault)  # SIGSTOP: hung, not dead, only heartbeats can tell
            stopped = time.monotonic()
            while not any(e.kind == "failed" for e in events):
                await asyncio.sleep(0.01)
            detect_s = time.monotonic() - stopped
            a_at_failure = len(got["a"])
            while not any(e.kind == "readmitted" for e in events) or len(got["b"]) < 8:
                await asyncio.sleep(0.02)
                assert time.monotonic() - stopped < 30
            status = engine.stream_status("b")
            return detect_s, a_at_failure, got, events, status
        finally:
            await engine.stop()

    detect_s, a_at_failure, got, events, status = uvloop.run(main())
    # a bound, not a speed: the heartbeat timeout plus a monitor period or two (more beside a CPU hog)
    assert detect_s < 5.0
    assert [e.stream for e in events] == ["b", "b"] and "w1" in events[0].reason
    assert len(got["a"]) > a_at_failure  # stream a kept running through the fault
    assert [o.chunk for o in got["a"]] == list(range(len(got["a"])))  # and lost nothing
    b = [o.chunk for o in got["b"]]
    assert b == sorted(b) and status["epoch"] == 1
    gap = [y - x for x, y in zip(b, b[1:]) if y - x > 1]
    assert sum(g - 1 for g in gap) == status["lost_chunks"] == events[0].lost_chunks
    # What b computed is exact in both epochs: before the reset the uninterrupted reference, after it the
    # reference restarted (fresh K/V) at b's first chunk of the new epoch (what the device check compares with)
    model = build_model(cfg)
    before = [o for o in got["b"] if o.record.enqueue < events[0].time]
    after = [o for o in got["b"] if o.record.enqueue >= events[0].time]
    assert before and after and [o.chunk for o in before + after] == b
    ref = ReferenceRollout(model)
    def same(o) -> bool:
        return ref.next_chunk("b") == o.chunk and np.array_equal(ref.step("b", scene.observation("b", o.chunk)).output,
                                                                 o.output)
    assert all(same(o) for o in before)
    unbroken = ReferenceRollout(model)      # (which differs: the reset is visible in the outputs)
    first_after = [unbroken.step("b", scene.observation("b", c)) for c in range(after[0].chunk + 1)][-1]
    assert not np.array_equal(first_after.output, after[0].output)
    ref.restart("b", after[0].chunk)
    assert all(same(o) for o in after)


def test_slow_worker_shows_as_deadline_misses_not_silence():
    cfg = load_model_config("tiny-wam")

    async def main():
        scene = SyntheticScene(cfg.observation_shapes)
        engine, served = new_engine(cfg, EngineConfig(workers=1, plan="sequential", heartbeat_timeout_s=2.0))
        await engine.start()
        got = []
        try:
            await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                                    got.append, slo_interval_ms=300.0, **served)
            while len(got) < 3:
                await asyncio.sleep(0.01)
            pid = engine.pool.workers["w0"].proc.pid
            os.kill(pid, signal.SIGSTOP)  # a stall shorter than the heartbeat timeout: slow, not lost
            await asyncio.sleep(0.8)
            os.kill(pid, signal.SIGCONT)
            n = len(got)
            while len(got) < n + 3:
                await asyncio.sleep(0.01)
            return got, list(engine.events)
        finally:
            await engine.stop()

    got, events = uvloop.run(main())
    assert events == []  # not failed
    misses = [o for o in got if o.record.deadline_miss]
    assert misses and all(o.record.interval_ms > 300.0 for o in misses)
    assert [o.chunk for o in got] == list(range(len(got)))


ENGINE_THAT_HANGS = """
import asyncio, sys, uvloop
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import load_model_config
from physis_ros.runtime.engine import Engine

async def main():
    engine = Engine(EngineConfig(workers=2))
    await engine.start()
    print(" ".join(str(w.proc.pid) for w in engine.pool.workers.values()), flush=True)
    await asyncio.sleep(3600)

uvloop.run(main())
"""


def test_workers_do_not_outlive_a_killed_engine():
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_THAT_HANGS], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.kill()  # SIGKILL: the engine gets no chance to stop its workers
        proc.wait()
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}") and
                     open(f"/proc/{p}/stat").read().split()[2] != "Z"]
            time.sleep(0.1)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("plan, workers", [("sequential", 1), ("step", 2), ("stage", 2), ("block", 3)])
def test_handoff_freezes_the_first_d_actions_and_the_reference_agrees(plan, workers):
    """With the hand-off, every plan equals the sequential reference fed the same observations and the same
    hand-offs (the delay each chunk assumed is on its record), bit for bit; with ``hard`` chunk c's first d
    actions are exactly chunk c-1's committed actions for those steps."""
    from physis_ros.model.handoff import Handoff
    from physis_ros.reference import ReferenceRollout
    from physis_ros.timeline import ControlTimeline

    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    timeline = ControlTimeline(rate_hz=50.0, horizon=16, execution=6, handoff="hard", extra_delay=2)
    out = run_chunks(cfg, EngineConfig(plan=plan, workers=workers), ["robot0"], 8, scene.observation,
                     timeline=timeline, release_interval_ms=120.0)["robot0"]
    ref = ReferenceRollout(build_model(cfg))
    prev = None
    for o in out:
        r = o.record
        assert r.delay_steps >= 2 and r.delay_steps <= timeline.max_delay
        handoff = Handoff("hard", r.delay_steps, r.shift) if o.chunk > 0 else Handoff("hard", 0, 0)
        want = ref.step("robot0", scene.observation("robot0", o.chunk), handoff).output.numpy()
        assert np.array_equal(o.output, want), o.chunk
        if prev is not None:
            d, shift = r.delay_steps, r.shift
            # 6 steps a release; a late release keeps the grid's phase (the next slot at least half an
            # interval away), so on a busy machine the shift can be 3..6 or a multiple of 6 beyond.
            assert shift >= 3 and r.first_step == prev.record.first_step + shift
            assert r.step0 == pytest.approx(out[0].record.step0 + r.first_step / 50.0)
            n = min(d, 16 - shift)            # rows of the previous chunk that overlap this one's first d
            np.testing.assert_array_equal(o.output[:n], prev.output[shift:shift + n])  # frozen: equal exactly
            if shift + d + 2 <= 16:
                assert not np.array_equal(o.output[d:d + 2], prev.output[shift + d:shift + d + 2])
        prev = o
    # On the release grid (every 6 steps) a chunk starts at its slot, whole steps after the one before, even
    # when the loop released it a few ms late; only a release over half an interval late (the first chunks'
    # warm-up holding the credits, on a loaded machine) leaves the grid.
    on_grid = [o.record.first_step % 6 == 0 for o in out]
    assert sum(on_grid) >= len(out) - 2, [o.record.first_step for o in out]


def test_with_a_handoff_observations_are_taken_ahead_so_the_robot_switches_at_the_last_frozen_row():
    """The engine takes each observation ahead of its chunk's slot (the estimate of its latency, the largest
    of the last 20 observation-to-emit times known then, plus the 0.3-step margin, modulo a step), keeps
    the chunk's rows on the grid, and freezes the rows due until it arrives: every chunk no later than
    that estimate plus the margin reaches the robot while a frozen row is still ahead (the switch row)."""
    from physis_ros.timeline import ControlTimeline
    from physis_ros.timeline import first_due_row

    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    timeline = ControlTimeline(rate_hz=50.0, horizon=16, execution=6, handoff="hard")
    out = run_chunks(cfg, EngineConfig(plan="sequential", workers=1), ["robot0"], 14, scene.observation,
                     timeline=timeline, release_interval_ms=120.0)["robot0"]
    recs = [o.record for o in out]

    def lead(latencies: list[float]) -> float:
        latencies = latencies[-timeline.delay_window:]
        if len(latencies) < timeline.delay_warmup:
            return 0.0
        return (max(latencies) * 50.0 + timeline.capture_margin) % 1.0

    for r in recs:
        known = [x.emit - x.enqueue for x in recs if x.emit < r.enqueue]
        ahead = (r.step0 - r.enqueue) * 50.0
        # The lead was set before the release's last sleep (the latest latency may have come in during it),
        # and the loop may wake late (a release up to half an interval late keeps its slot), early only by
        # the event loop's timer resolution (uvloop: 1 ms, 0.05 step). A release later than that leaves the
        # grid: its first step is the nearest to when it was taken, up to half a step after it.
        leads = [lead(known), lead(known[:-1])]
        slack = 0.5 if r.first_step % 6 else 0.06
        assert -3.0 <= ahead <= max(leads) + slack, (r.chunk, ahead, leads)
        if len(known) < timeline.delay_warmup or r.first_step % 6:
            continue                                          # warm-up, or a release that left the grid
        est = max(known[-timeline.delay_window:]) * 50.0
        assert r.delay_steps == min(timeline.max_delay, max(1, math.floor(est - ahead) + 2)), r.chunk
        if r.delay_steps == timeline.max_delay or math.floor(est - ahead) + 2 < 1:
            continue                                          # capped (a loaded host's long latencies)
        # The estimate lands ``margin`` steps before the step boundary of the switch row: the capture margin
        # when the loop woke on time (test_streams' capture-lead tests, on the pure functions, and the pace
        # test check that), less its lateness on a loaded host, where no release is required to be on time.
        margin = r.delay_steps - 1 - (est - ahead)
        # so a chunk that much later than the largest recent one still reaches the robot at a frozen row
        if (r.emit - r.enqueue) * 50.0 <= est + margin - 0.02:
            assert first_due_row(r.step0, 0.02, r.emit, 16) < r.delay_steps, r.chunk


def test_a_stream_slow_to_place_still_starts_on_its_release_grid(monkeypatch):
    """Placing a stream can load its blocks (tens of ms on a slow host). Its release grid was anchored before
    that, so on a 2-core VM the first release came over half an interval late, re-anchored, and every chunk
    after it sat off the timeline's grid (first steps 0, 7, 13, 19 ... at 6 steps a release)."""
    from physis_ros.timeline import ControlTimeline

    place = Engine.place

    async def slow_place(self, s):
        await asyncio.sleep(0.1)
        return await place(self, s)

    monkeypatch.setattr(Engine, "place", slow_place)
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    timeline = ControlTimeline(rate_hz=50.0, horizon=16, execution=6)
    out = run_chunks(cfg, EngineConfig(plan="sequential", workers=1), ["robot0"], 4, scene.observation,
                     timeline=timeline, release_interval_ms=120.0)["robot0"]
    assert [o.record.first_step for o in out] == [0, 6, 12, 18]


@pytest.mark.parametrize("batching", ["off", "adaptive"])
def test_paced_streams_on_one_worker_are_spread_apart_unless_they_batch(batching):
    """Streams sharing a worker queue behind each other if released together, so they are spread across
    the release interval; but a batching worker runs same-model stages together only if they arrive
    together (admission credits that), so then a same-model stream joins the other's phase. A stream of
    another model cannot batch with them and is spread apart in both modes."""
    wam, acwm = load_model_config("tiny-wam"), load_model_config("tiny-acwm")
    interval = 0.2

    async def main():
        engine_cfg = EngineConfig(workers=1, plan="sequential", batching=batching)
        engine, served = new_engine(wam, engine_cfg)
        acwm_served = {"model": ServedModel(acwm, profile=resolve_plan(acwm, engine_cfg).profile),
                       "plan": resolve_plan(acwm, engine_cfg).plan}
        async with engine:
            scenes = {"wam": SyntheticScene(wam.observation_shapes), "acwm": SyntheticScene(acwm.observation_shapes)}
            for name, kind, s in (("a", "wam", served), ("b", "wam", served), ("w", "acwm", acwm_served)):
                scene = scenes[kind]
                await engine.add_stream(name, lambda c, n=name, sc=scene: Observation(sc.observation(n, c),
                                                                                       engine.clock()),
                                        chunks=2, release_interval_ms=interval * 1e3, **s)
            return {n: engine.streams[n].release_t0 for n in ("a", "b", "w")}

    t0 = uvloop.run(main())

    def phase(x: float, y: float) -> float:   # distance of two anchors on the release grid, in intervals
        d = ((x - y) / interval) % 1.0
        return min(d, 1.0 - d)

    if batching == "off":
        assert phase(t0["a"], t0["b"]) > 0.3
    else:
        assert phase(t0["a"], t0["b"]) < 1e-6
    assert phase(t0["w"], t0["a"]) > 0.2 and phase(t0["w"], t0["b"]) > 0.2


def test_a_stream_given_a_release_phase_is_released_at_that_phase_of_its_interval():
    """Admission books streams sharing a worker at phases of their common interval
    (JitterBound.release_phase); the engine must release each at the phase it was booked at, counted from its
    phase epoch, whatever else shares the worker, and not spread it on its own."""
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    interval = 0.08

    async def main():
        engine, served = new_engine(cfg, EngineConfig(workers=1, plan="sequential"))
        async with engine:
            for name, phase_ms in (("a", 0.0), ("b", 20.0), ("c", 20.0)):
                await engine.add_stream(name, lambda c, n=name: Observation(scene.observation(n, c), engine.clock()),
                                        chunks=2, release_interval_ms=interval * 1e3, release_phase_ms=phase_ms,
                                        **served)
            return engine.phase_epoch, {n: engine.streams[n].release_t0 for n in ("a", "b", "c")}

    epoch, t0 = uvloop.run(main())
    for name, phase_ms in (("a", 0.0), ("b", 20.0), ("c", 20.0)):
        slots = (t0[name] - epoch - phase_ms / 1e3) / interval
        assert slots == pytest.approx(round(slots), abs=1e-6), (name, slots)


@pytest.mark.parametrize("wake_ahead_us", [0, 1000])
def test_a_paced_chunk_is_announced_to_each_receiver_and_still_equals_the_reference(wake_ahead_us):
    """With wake-ups on, the engine wakes a paced stream's first worker before each release (which also makes
    the chunk's noise then), each worker wakes the next before the chunk's last stage there, and the last
    wakes the engine: what is computed is unchanged. Off, nobody is woken."""
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    chunks = 5

    async def main():
        engine, served = new_engine(cfg, EngineConfig(workers=2, plan="step", wake_ahead_us=wake_ahead_us))
        async with engine:
            got = []
            await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                                    got.append, chunks=chunks, release_interval_ms=60.0, **served)
            await engine.wait_stream("robot0")
            stats = {w: (await engine.pool.request(w, p.Stats(req=0))).stats for w in ("w0", "w1")}
            return got, stats, engine.wakes, served["plan"].segments()

    got, stats, engine_wakes, segments = uvloop.run(main())
    want = reference("tiny-wam", chunks)
    assert [o.chunk for o in got] == list(range(chunks))
    assert all(np.array_equal(o.output, want[("robot0", o.chunk)]) for o in got)
    assert len(segments) == 2   # plan "step" on 2 workers: w0 runs the first steps, w1 the rest
    if wake_ahead_us:
        # w0 by the engine before every release but the first (that one is not waited for), w1 by w0 as each
        # chunk starts its last stage there, the engine by w1
        assert stats["w0"].wakes == chunks - 1
        assert stats["w1"].wakes == chunks and engine_wakes == chunks
    else:
        assert stats["w0"].wakes == stats["w1"].wakes == engine_wakes == 0
    assert stats["w0"].bad_messages == stats["w1"].bad_messages == 0
