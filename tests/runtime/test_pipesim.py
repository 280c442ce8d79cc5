"""The pipeline simulation behind the planner's predictions."""

import pytest

from physis_ros.runtime.pipesim import simulate
from physis_ros.runtime.plans import Plan, make_plan, pipeline_order
from physis_ros.runtime.costs import CostProfile


def profile(steps, blocks, single=1.0, per_extra=0.25, hop=0.1, engine=0.0):
    stage_ms = {s: {n: single + per_extra * (n - 1) for n in (1, 2, 4)} for s in pipeline_order(steps, blocks)}
    return CostProfile("m", "cpu", "measured:synthetic", steps, blocks, stage_ms, hop_ms=hop, block_weight_bytes=0,
                       kv_bytes=0, hidden_bytes=1000, engine_ms=engine)


def test_unbatched_pipeline_runs_at_its_busiest_worker():
    prof = profile(4, 8)
    r = simulate(make_plan("step", 4, 8, 2), prof, "off")
    assert r.interval_ms == pytest.approx(16.0 + 0.1)  # 16 stages and one hop each
    assert r.mean_batch == r.task_batch == 1.0
    assert all(0.98 <= u <= 1.0 + 1e-9 for u in r.utilisation.values())
    assert r.busy_ms_per_chunk[1] == pytest.approx(16.1, rel=0.01)


def test_a_slow_engine_round_trip_splits_batches():
    # Every block on one worker with all its steps: chunks could move in lockstep, four to a batch.
    plan = make_plan("sequential", 4, 8, 1)
    quick = simulate(plan, profile(4, 8, engine=0.0), "on")
    slow = simulate(plan, profile(4, 8, engine=20.0), "on", in_flight=4)
    assert quick.task_batch > 3.8
    # With only as many chunks in flight as steps, the re-entering chunk arrives after its group left.
    assert slow.task_batch < quick.task_batch
    assert slow.interval_ms > quick.interval_ms * 1.1
    # the worker never waits (work-conserving): it runs what it has, in smaller batches
    assert slow.utilisation[0] == pytest.approx(1.0)


def test_ping_pong_between_two_workers_shows_in_the_interval():
    # Blocks alternate between workers: every chunk crosses 8 times per step, and a lone chunk in
    # flight leaves one worker idle while the other computes.
    steps, blocks = 2, 4
    assignment = {(k, b): b % 2 for k, b in pipeline_order(steps, blocks)}
    plan = Plan("block", steps, blocks, assignment)
    one = simulate(plan, profile(steps, blocks, hop=0.5), "off", in_flight=1)
    assert one.interval_ms == pytest.approx(8 * 1.0 + 8 * 0.5)  # fully serial: compute plus every hop
    three = simulate(plan, profile(steps, blocks, hop=0.5), "off", in_flight=3)
    assert three.interval_ms == pytest.approx(4 * 1.0 + 4 * 0.5, rel=0.01)  # both busy: each its half


def test_rejects_a_window_without_steady_state():
    with pytest.raises(ValueError, match="must exceed warmup"):
        simulate(make_plan("step", 2, 2, 1), profile(2, 2), chunks=10, warmup=10)
