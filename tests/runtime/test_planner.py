"""The cost-model planner on synthetic profiles, and a real (small) profile measurement."""

import dataclasses

import pytest

from physis_ros.model import load_model_config
from physis_ros.runtime.planner import choose_plan, predict
from physis_ros.runtime.plans import make_plan, pipeline_order
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.costs import CostProfile, profile_from_json


def synthetic(steps, blocks, single, per_extra):
    """Batch n costs single + per_extra * (n - 1): per_extra << single is overhead-bound."""
    stage_ms = {s: {n: single + per_extra * (n - 1) for n in (1, 2, 4)} for s in pipeline_order(steps, blocks)}
    return CostProfile("m", "cpu", "measured:synthetic", steps, blocks, stage_ms, hop_ms=0.1, block_weight_bytes=0,
                       kv_bytes=0, hidden_bytes=1000)


def test_prediction_of_a_known_plan():
    prof = synthetic(4, 8, 1.0, 0.25)
    off = predict(make_plan("sequential", 4, 8, 1), prof, "off")
    on = predict(make_plan("sequential", 4, 8, 1), prof, "on")
    assert off.interval_ms == pytest.approx(32.0 + 0.1)  # plus its one hop (to the engine)
    # one batch of 4 steps per block in lockstep; simulated over a finite window, so within 1 %
    assert on.interval_ms == pytest.approx(8 * (1.0 + 0.75) + 0.1, rel=0.01)
    assert on.batch_of_block[0] == {b: 4 for b in range(8)}
    assert on.simulated.task_batch > 3.8


def test_workers_sharing_a_hosts_cores_are_bound_by_total_cpu():
    prof = dataclasses.replace(synthetic(4, 8, 1.0, 0.9), engine_ms=2.0)
    plan = make_plan("step", 4, 8, 2)
    alone = predict(plan, prof, "off")
    shared = predict(plan, prof, "off", host_cpus=1)
    assert alone.interval_ms == pytest.approx(16.1, rel=0.01) and alone.cpu_bound_ms == 0.0
    # one core for both workers (32 stages + 2 hops) and the engine's 2 ms per chunk
    assert shared.interval_ms == pytest.approx(32.2 + 2.0, rel=0.01)


@pytest.mark.slow
def test_adaptive_never_predicts_worse_than_off():
    for per_extra in (0.1, 0.5, 1.0, 1.5):
        prof = synthetic(4, 8, 1.0, per_extra)
        for workers in (1, 2, 3, 5, 40):
            off = choose_plan(4, 8, workers, prof, "off")
            adaptive = choose_plan(4, 8, workers, prof, "adaptive")
            assert adaptive.interval_ms <= off.interval_ms * (1 + 1e-9) / (1 - 0.10)


def test_compute_bound_profile_runs_unbatched():
    prof = synthetic(4, 8, 1.0, 1.2)  # a batch of 4 costs more than 4 singles
    pred = choose_plan(4, 8, 1, prof, "adaptive")
    assert set(pred.batch_of_block[0].values()) == {1}


def test_more_workers_than_stages_and_fewer():
    prof = synthetic(2, 3, 1.0, 0.9)
    many = choose_plan(2, 3, 10, prof, "off")
    assert len(many.plan.workers_used) == 6 and many.interval_ms == pytest.approx(1.0 + 0.1)
    few = choose_plan(2, 3, 2, prof, "off")
    assert few.interval_ms == pytest.approx(3.0 + 0.1)


def test_overhead_bound_two_workers_colocates_same_block_steps():
    prof = synthetic(4, 8, 1.0, 0.05)
    pred = choose_plan(4, 8, 2, prof, "on")
    for w in pred.plan.workers_used:
        assert max(pred.batch_of_block[w].values()) >= 2


def test_measured_profile_round_trips(tmp_path):
    cfg = dataclasses.replace(load_model_config("tiny-wam"), blocks=2, steps=2)
    prof = measure_profile(cfg, repeats=2)
    assert set(prof.stage_ms) == set(pipeline_order(2, 2))
    assert all(ms[1] > 0 and ms[4] > 0 for ms in prof.stage_ms.values())
    assert prof.hop_ms > 0 and prof.source.startswith("measured:")
    back = profile_from_json(prof.to_json(), cfg)
    assert back.stage_ms.keys() == prof.stage_ms.keys() and profile_from_json(back.to_json(), cfg) == back
    assert back.forward_ms((2, 0), 3) == pytest.approx((back.forward_ms((2, 0), 2) + back.forward_ms((2, 0), 4)) / 2)
    # the one cost model: what admission charges is the co-run speed plus the worker's own overhead
    assert back.time_ms((2, 0), 1) == pytest.approx(back.forward_ms((2, 0), 1) * back.corun_slowdown
                                                    + back.overhead_ms_per_call)
    assert back.kv_bytes == cfg.kv_slot_bytes() and back.block_weight_bytes == cfg.block_params() * 4
    with pytest.raises(ValueError, match="source.*missing|missing"):
        profile_from_json({"model": cfg.name}, cfg)
