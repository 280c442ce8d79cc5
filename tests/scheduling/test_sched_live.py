"""The glue between joint admission and the engine (no worker processes are started here)."""

from physis_ros.runtime.plans import pipeline_order
from physis_ros.scheduling.live import admit_until_rejected, plan_of

import pytest


@pytest.mark.slow
def test_admission_on_cpu_workers_and_its_runtime_plans():
    cfg, profile, cluster, placed, rejection = admit_until_rejected("tiny-wam", 2, 90.0, 0.3)
    assert profile.source.startswith("measured:")
    assert placed and rejection is not None and rejection.reason == "time-capacity"
    assert (cluster.util <= 0.7 + 1e-9).all()
    for p in placed:
        plan = plan_of(p, cfg.steps, cfg.blocks)
        assert set(plan.assignment) == set(pipeline_order(cfg.steps, cfg.blocks))
        assert plan.workers_used == sorted(set(p.devices))
        for r, d in zip(p.ranks, p.devices):
            assert all(plan.assignment[s] == d for s in r.stages)
        assert plan.hops() <= len(p.ranks) - 1
