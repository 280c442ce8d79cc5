import itertools

import pytest

from physis_ros.runtime.plans import PLAN_NAMES, linear_partition, make_plan, pipeline_order


@pytest.mark.parametrize("name", PLAN_NAMES)
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 40])
def test_every_stage_is_placed_once(name, workers):
    plan = make_plan(name, 4, 8, workers)
    assert set(plan.assignment) == set(pipeline_order(4, 8))
    assert all(0 <= w < workers for w in plan.assignment.values())


def test_plan_shapes():
    assert make_plan("sequential", 4, 8, 3).workers_used == [0]
    step = make_plan("step", 4, 8, 2)
    assert {step.assignment[(k, 5)] for k in (4, 3)} == {0} and step.assignment[(1, 0)] == 1
    block = make_plan("block", 4, 8, 2)
    assert all(block.assignment[(k, b)] == (0 if b < 4 else 1) for k, b in block.assignment)
    assert block.hops() == 2 * 4 - 1
    stage = make_plan("stage", 4, 8, 3)
    loads = sorted(stage.worker_cost({s: 1.0 for s in stage.order}).values())
    assert loads == [10.0, 11.0, 11.0]  # 32 stages, balanced; step would give 16/8/8
    one_each = make_plan("stage", 2, 3, 6)
    assert sorted(one_each.assignment.values()) == list(range(6))


def test_stage_plan_uses_costs_to_balance():
    costs = {s: 1.0 for s in pipeline_order(2, 4)}
    costs[(2, 0)] = 5.0  # an expensive prologue
    plan = make_plan("stage", 2, 4, 2, stage_costs=costs)
    assert max(plan.worker_cost(costs).values()) == 6.0


def test_linear_partition_is_optimal():
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for parts in range(1, 5):
        sizes = linear_partition(costs, parts)
        assert sum(sizes) == len(costs)

        def bottleneck(sz):
            out, i = [], 0
            for n in sz:
                out.append(sum(costs[i:i + n]))
                i += n
            return max(out)

        best = min(bottleneck(c) for k in range(1, parts + 1)
                   for c in itertools.product(range(1, len(costs) + 1), repeat=k) if sum(c) == len(costs))
        assert bottleneck(sizes) == best


def test_unknown_plan_is_refused():
    with pytest.raises(ValueError, match="unknown plan 'ring'; choose one of: sequential, step, block, stage"):
        make_plan("ring", 4, 8, 2)


def test_peers_are_the_workers_a_plan_hands_hidden_states_between():
    block = make_plan("block", 4, 8, 3)  # each step walks w0 -> w1 -> w2, then the next step starts on w0
    assert [block.peers_of(w) for w in range(3)] == [{1, 2}, {0, 2}, {0, 1}]
    stage = make_plan("stage", 4, 8, 2)
    assert stage.peers_of(0) == {1} and stage.peers_of(1) == {0}
    assert make_plan("sequential", 4, 8, 1).peers_of(0) == set()
