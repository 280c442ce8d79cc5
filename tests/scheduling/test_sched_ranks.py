"""Virtual ranks fit the SLO with headroom and one device's memory; the equal split's group sizing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from physis_ros.runtime.plans import linear_partition
from physis_ros.scheduling.ranks import Unplaceable, equal_ranks, group_size, pack_ranks
from physis_ros.scheduling.settings import GB


def min_pieces(costs, budget):
    """Fewest contiguous pieces with sums <= budget, by exhaustive DP (the reference)."""
    n = len(costs)
    best = [0] + [None] * n
    for i in range(1, n + 1):
        for j in range(i):
            if best[j] is not None and sum(costs[j:i]) <= budget + 1e-9:
                cand = best[j] + 1
                if best[i] is None or cand < best[i]:
                    best[i] = cand
    return best[n]


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0.1, 5.0), min_size=2, max_size=16),
       slo=st.floats(5.0, 40.0), headroom=st.sampled_from([0.0, 0.1, 0.25]))
def test_ranks_fit_slo_with_headroom_and_are_fewest(profile_factory, costs, slo, headroom):
    prof = profile_factory(blocks=len(costs), stage_ms=costs, hop_ms=0.05)
    budget = slo * (1 - headroom)
    if max(costs) + 0.05 > budget:
        with pytest.raises(Unplaceable) as info:
            pack_ranks(prof, slo, headroom, 100 * GB)
        assert info.value.reason == "slo-unreachable"
        return
    ranks = pack_ranks(prof, slo, headroom, 100 * GB)
    assert [s for r in ranks for s in r.stages] == prof.order          # contiguous, in pipeline order
    assert all(r.work_ms <= budget + 1e-9 for r in ranks)              # compute + hop within SLO x (1 - h)
    assert len(ranks) == min_pieces(costs, budget - 0.05)              # fewest


def test_rank_must_fit_device_memory(profile_factory):
    # 8 stages of 1 ms, SLO allows all on one device, but a device holds only 3 blocks of weights
    prof = profile_factory(blocks=8, stage_ms=1.0, weight_gb=1.0)
    ranks = pack_ranks(prof, 100.0, 0.0, 3.5 * GB)
    assert [len(r.stages) for r in ranks] == [3, 3, 2]
    assert all(r.alone_bytes(prof) <= 3.5 * GB for r in ranks)
    with pytest.raises(Unplaceable) as info:
        pack_ranks(prof, 100.0, 0.0, 0.5 * GB)
    assert info.value.reason == "memory-unreachable"


def test_same_block_stages_share_weights_inside_a_rank(profile_factory):
    prof = profile_factory(steps=2, blocks=2, stage_ms=1.0, weight_gb=1.0, kv_gb=0.25)
    (rank,) = pack_ranks(prof, 100.0, 0.0, 100 * GB)
    assert rank.blocks == {0, 1} and rank.weight_bytes(prof) == 2 * GB   # 4 stages, 2 distinct blocks
    assert rank.kv_bytes == 4 * int(0.25 * GB)                           # a KV slot per stage


@pytest.mark.parametrize("model", ["wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b"])
@pytest.mark.parametrize("x", [0.5, 1.05, 1.9, 2.3, 3.7])
def test_equal_group_is_smallest_that_meets_slo(h200_profiles, model, x):
    dev, profiles = h200_profiles
    prof = profiles[model]
    headroom = 0.1
    slo = prof.chunk_ms() / ((1 - headroom) * x)
    budget = slo * (1 - headroom)
    g = group_size(prof, slo, headroom, dev.usable_bytes)

    def bottleneck(parts):
        sizes = linear_partition(prof.costs(), parts)
        i, worst = 0, 0.0
        for size in sizes:
            worst = max(worst, sum(prof.costs()[i:i + size]) + prof.hop_ms)
            i += size
        return worst

    assert bottleneck(g) <= budget + 1e-9
    assert g == 1 or bottleneck(g - 1) > budget
    ranks = equal_ranks(prof, slo, headroom, dev.usable_bytes)
    assert len(ranks) == g and max(r.work_ms for r in ranks) == pytest.approx(bottleneck(g))
