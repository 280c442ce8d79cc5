"""Admission and placement: LDS beyond greedy Best-Fit, rejection reasons, removal, weight sharing."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from physis_ros.scheduling.admission import REASONS, StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.equal import EqualSplitScheduler
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.ranks import make_rank
from physis_ros.scheduling.settings import GB

from sched_helpers import make_config, make_device, make_profile


def lds_case(discrepancies: int):
    """Ranks: 6 ms (1 block) | 2+2+2 ms (3 blocks), each 6/7 of a device at SLO 7 ms. Greedy
    Best-Fit puts the light first rank on the big device (10 % busy: the tighter fit), after which
    the heavy second rank fits nowhere: the big device lacks time, the small one (4 GB) memory.
    One discrepancy (first rank on the small device) admits the stream."""
    model = make_profile("m", blocks=4, stage_ms=[6.0, 2.0, 2.0, 2.0], weight_gb=1.0, kv_gb=1.0)
    filler = make_profile("f", blocks=1, stage_ms=1.0, weight_gb=1.0)
    cluster = Cluster([make_device("big", 100.0), make_device("small", 4.0)], 0.0, {"m": model, "f": filler})
    fill_rank = make_rank(filler, 0, filler.order)
    cluster.add_stream(PlacedStream("filler", "f", 10.0, [fill_rank], [0]))          # big device 10 % busy
    config = make_config(discrepancies=discrepancies, split=False)
    config = dataclasses.replace(config, equal_fallback=False)
    return JointScheduler(cluster, config), StreamRequest("robot", "m", slo_ms=7.0)


def test_lds_admits_what_greedy_best_fit_rejects():
    greedy, req = lds_case(discrepancies=0)
    assert [len(r.stages) for r in greedy.ranks_for("m", 7.0)] == [1, 3]        # 6 ms | 2+2+2 ms
    assert greedy.candidates(greedy.seq("m", 7.0), 0, False)[:2] == [(0, 1), (1, 1)]  # Best-Fit: big first
    d = greedy.admit(req)
    assert not d.admitted and d.reason == "memory"
    assert "short of memory" in d.detail

    lds, req = lds_case(discrepancies=1)
    d = lds.admit(req)
    assert d.admitted and d.discrepancies == 1 and d.placed.method == "lds"
    assert d.placed.devices == [1, 0]                           # light rank on the small device
    assert d.placed.interval_alone_ms <= 7.0


def test_rejection_reasons_name_the_resource():
    prof = make_profile("m", blocks=4, stage_ms=2.0, weight_gb=1.0, kv_gb=1.0)
    huge = make_profile("huge", blocks=2, stage_ms=1.0, weight_gb=50.0)
    kvheavy = make_profile("kv", blocks=2, stage_ms=0.5, weight_gb=1.0, kv_gb=30.0)
    profiles = {"m": prof, "huge": huge, "kv": kvheavy}
    sched = JointScheduler(Cluster([make_device(memory_gb=80.0)] * 2, 0.1, profiles), make_config(0.1))

    d = sched.admit(StreamRequest("a", "m", slo_ms=2.0))           # a 2 ms stage > 2 ms x 0.9
    assert (d.admitted, d.reason) == (False, "slo-unreachable") and "stage (1, 0)" in d.detail
    d = sched.admit(StreamRequest("b", "huge", slo_ms=100.0))      # one block: 50 GB weights... fits
    assert d.admitted
    sched.remove("b")
    d = sched.admit(StreamRequest("c", "m", slo_ms=100.0, latency_slo_ms=5.0))
    assert (d.admitted, d.reason) == (False, "latency-unreachable")
    # time: 8 ms of compute per 10 ms interval = 0.8 of a device, cap 0.9; two fit, the third cannot
    assert sched.admit(StreamRequest("t1", "m", slo_ms=10.0)).admitted
    assert sched.admit(StreamRequest("t2", "m", slo_ms=10.0)).admitted
    d = sched.admit(StreamRequest("t3", "m", slo_ms=10.0))
    assert (d.admitted, d.reason) == (False, "time-capacity") and "ms left" in d.detail
    for s in ("t1", "t2"):
        sched.remove(s)
    # memory: each kv stream holds 2 x 30 GB of KV and little time; 80 GB devices hold one each
    assert sched.admit(StreamRequest("k1", "kv", slo_ms=100.0)).admitted
    assert sched.admit(StreamRequest("k2", "kv", slo_ms=100.0)).admitted
    d = sched.admit(StreamRequest("k3", "kv", slo_ms=100.0))
    assert (d.admitted, d.reason) == (False, "memory") and "GB" in d.detail

    tiny = JointScheduler(Cluster([make_device(memory_gb=40.0)], 0.1, profiles), make_config(0.1))
    d = tiny.admit(StreamRequest("h", "huge", slo_ms=100.0))      # one 50 GB block > 40 GB device
    assert (d.admitted, d.reason) == (False, "memory-unreachable")

    equal = EqualSplitScheduler(Cluster([make_device()] * 2, 0.1, profiles), make_config(0.1), group=1)
    assert equal.admit(StreamRequest("e1", "m", slo_ms=10.0)).admitted
    assert equal.admit(StreamRequest("e2", "m", slo_ms=10.0)).admitted
    d = equal.admit(StreamRequest("e3", "m", slo_ms=10.0))
    assert (d.admitted, d.reason) == (False, "no-group")
    with pytest.raises(ValueError, match="already running"):
        equal.admit(StreamRequest("e1", "m", slo_ms=10.0))
    assert {"slo-unreachable", "latency-unreachable", "time-capacity", "memory", "memory-unreachable",
            "no-group"} <= set(REASONS)                             # each reason is documented


def test_weight_sharing_and_removal_free_capacity():
    prof = make_profile("m", steps=2, blocks=4, stage_ms=1.0, weight_gb=2.0, kv_gb=0.5, hidden_bytes=1000)
    cluster = Cluster([make_device(memory_gb=100.0)] * 2, 0.1, {"m": prof})
    sched = JointScheduler(cluster, make_config(0.1))
    one = sched.admit(StreamRequest("s1", "m", slo_ms=40.0))       # 8 ms per 40 ms: 0.2 of device 0
    assert one.admitted and one.placed.devices == [0]
    mem1, util1 = cluster.mem[0], cluster.util[0]
    assert mem1 == 4 * 2 * GB + 8 * 0.5 * GB + 2 * 1000          # 4 blocks once, though 8 stages use them
    two = sched.admit(StreamRequest("s2", "m", slo_ms=40.0))
    assert two.placed.devices == [0]                                # Best-Fit: the busy device
    assert cluster.mem[0] - mem1 == 8 * 0.5 * GB + 2 * 1000       # no second copy of the weights
    assert cluster.weight_bytes()[0] == 8 * GB
    assert cluster.util[0] == pytest.approx(2 * util1)

    sched.remove("s1")                                              # weights stay: s2 still uses them
    assert cluster.mem[0] == pytest.approx(mem1) and cluster.weight_bytes()[0] == 8 * GB
    assert cluster.util[0] == pytest.approx(util1)
    sched.remove("s2")                                              # last user gone: weights leave
    assert cluster.mem[0] == 0 and cluster.util[0] == 0 and cluster.weight_bytes()[0] == 0
    with pytest.raises(KeyError):
        sched.remove("s2")


def test_removal_lets_a_rejected_stream_in_and_running_streams_never_move():
    prof = make_profile("m", blocks=4, stage_ms=3.0, weight_gb=1.0)
    cluster = Cluster([make_device()] * 3, 0.1, {"m": prof})
    sched = JointScheduler(cluster, make_config(0.1))
    placed = {}
    i = 0
    while True:
        d = sched.admit(StreamRequest(f"s{i}", "m", slo_ms=20.0))   # 12 ms per 20 ms: 0.6 of a device
        for name, devices in placed.items():                         # earlier streams stay where they are
            assert cluster.streams[name].devices == devices
        if not d.admitted:
            break
        placed[d.request.stream] = list(d.placed.devices)
        i += 1
    assert d.reason == "time-capacity" and len(placed) == 4           # 3 x 0.9 / 0.6 = 4.5
    sched.remove("s1")
    assert sched.admit(StreamRequest("again", "m", slo_ms=20.0)).admitted


def expected_state(cluster: Cluster):
    """Utilisation and memory per device recomputed from the placed streams alone."""
    util = np.zeros(cluster.n)
    mem = np.zeros(cluster.n)
    blocks = [set() for _ in range(cluster.n)]
    for p in cluster.streams.values():
        for r, d in zip(p.ranks, p.devices):
            util[d] += r.work_ms / p.slo_ms
            mem[d] += r.kv_bytes + r.buffer_bytes
            blocks[d] |= {(p.model, b) for b in r.blocks}
    for d in range(cluster.n):
        mem[d] += sum(cluster.profiles[m].block_weight_bytes for m, _ in blocks[d])
    return util, mem


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", "rm"]), st.floats(6.0, 60.0), st.integers(0, 30)),
                    min_size=1, max_size=30),
       split=st.booleans())
def test_invariants_under_arrivals_and_departures(ops, split):
    """Capacity and memory are never exceeded, and the incremental accounting (weights reference
    counted per block and device) always equals a recomputation from the placed streams."""
    profiles = {"a": make_profile("a", steps=2, blocks=3, stage_ms=[2.0, 1.0, 3.0] * 2, weight_gb=5.0, kv_gb=2.0),
                "b": make_profile("b", blocks=5, stage_ms=1.5, weight_gb=8.0, kv_gb=6.0, hop_ms=0.1)}
    cluster = Cluster([make_device(memory_gb=60.0)] * 4, 0.15, profiles)
    sched = JointScheduler(cluster, make_config(0.15, split=split))
    for n, (kind, slo, pick) in enumerate(ops):
        if kind == "rm":
            if cluster.streams:
                sched.remove(sorted(cluster.streams)[pick % len(cluster.streams)])
        else:
            d = sched.admit(StreamRequest(f"s{n}", kind, slo_ms=slo))
            if d.admitted:
                assert d.placed.interval_alone_ms <= slo * 0.85 + 1e-9
                assert len({d for d in d.placed.devices}) <= len(d.placed.ranks)
        util, mem = expected_state(cluster)
        assert np.allclose(cluster.util, util, atol=1e-9)
        assert np.allclose(cluster.mem, mem, rtol=1e-12, atol=1.0)
        assert (cluster.util <= 0.85 + 1e-9).all()
        assert (cluster.mem <= cluster.mem_cap).all()


def test_time_sharing_is_credited_at_the_measured_batch_curve():
    """A block's stages co-hosted on one device run batched: admission charges the batch-cost curve,
    not batch-1 cost, so more streams fit; removing them all leaves the device exactly idle."""
    order = [(k, b) for k in (4, 3, 2, 1) for b in (0, 1)]
    overhead_bound = {s: {1: 1.0, 2: 1.2, 4: 1.6} for s in order}  # a batch of 4 costs 1.6 singles
    prof = dataclasses.replace(make_profile("m", steps=4, blocks=2), stage_ms=overhead_bound)
    admitted = {}
    for max_batch in (1, 4):
        cluster = Cluster([make_device()], 0.0, {"m": prof}, max_batch=max_batch)
        sched = JointScheduler(cluster, make_config())
        n = 0
        while sched.admit(StreamRequest(f"s{n}", "m", slo_ms=40.0)).admitted:
            n += 1
        admitted[max_batch] = n
        if max_batch == 4:
            # 8 stages per stream: 4 steps of each block, batched 4 at a time at 1.6 / 4 = 0.4 of a single
            assert cluster.util[0] == pytest.approx(n * 8 * 0.4 / 40.0)
        for i in range(n):
            sched.remove(f"s{i}")
        assert cluster.util[0] == 0.0 and cluster.mem[0] == 0.0
    assert admitted == {1: 5, 4: 12}  # 8 ms of batch-1 work per 40 ms: 5 alone; batched: 3.2 ms each


def test_only_other_streams_batch_with_a_stream():
    """A stream's own stages of a block are its denoising steps, which run one after another: alone it is
    charged its batch-1 work (served with adaptive batching, two robots kept a worker 0.34 busy where 0.21 had been admitted). n
    streams batch as n // max_batch full batches and one of the rest (6 at max_batch 4: a 4 and a 2)."""
    order = [(k, b) for k in (4, 3, 2, 1) for b in (0, 1)]
    prof = dataclasses.replace(make_profile("m", steps=4, blocks=2),
                               stage_ms={s: {1: 1.0, 2: 1.2, 4: 1.6} for s in order})
    cluster = Cluster([make_device()], 0.0, {"m": prof}, max_batch=4)
    rank = make_rank(prof, 0, prof.order)
    per_task = {1: 1.0, 2: 0.6, 4: 0.4}          # of a single's time, in a batch of n (1.2 / 2, 1.6 / 4)
    for n, tasks in ((1, [1]), (2, [2, 2]), (4, [4] * 4), (6, [4] * 4 + [2] * 2)):
        while len(cluster.streams) < n:
            cluster.add_stream(PlacedStream(f"s{len(cluster.streams)}", "m", 100.0, [rank], [0]))
        expected = 8 * sum(per_task[m] for m in tasks) / 100.0     # 8 stages (4 steps x 2 blocks) per stream
        assert cluster.util[0] == pytest.approx(expected), n


def test_placement_decisions_are_pinned_on_a_fixed_mixed_cluster():
    """Issue 50: a change made for speed must not change what is placed. Two models with pinned synthetic
    profiles (not the presets, whose numbers change when real backbones land) on six devices of three memory
    sizes, fourteen arrivals and one departure: each decision (admitted, reason, devices, stages per rank) is
    what it was before the speed-up work."""
    profiles = {"a": make_profile("a", steps=2, blocks=4, stage_ms=10.0, weight_gb=2.0, kv_gb=1.0, hop_ms=0.5),
                "b": make_profile("b", steps=1, blocks=6, stage_ms=[4.0, 6.0, 8.0, 8.0, 6.0, 4.0], weight_gb=3.0,
                                  kv_gb=2.0, hop_ms=1.0)}
    devices = [make_device(f"d{i}", memory_gb=m) for i, m in enumerate([100, 100, 60, 60, 40, 40])]
    sched = JointScheduler(Cluster(devices, 0.1, profiles), make_config(0.1, discrepancies=2))
    arrivals = [("a", 100.0), ("b", 60.0), ("a", 50.0), ("b", 200.0), ("a", 90.0), ("b", 45.0), ("a", 300.0),
                ("b", 60.0), ("a", 40.0), ("b", 120.0), ("a", 100.0), ("b", 60.0), ("a", 25.0), ("b", 90.0)]
    got = []
    for i, (model, slo) in enumerate(arrivals):
        d = sched.admit(StreamRequest(f"s{i}", model, slo))
        got.append((d.admitted, d.reason, d.placed.devices if d.placed else None,
                    [len(r.stages) for r in d.placed.ranks] if d.placed else None))
        if i == 7:
            sched.remove("s1")
    capacity = (False, "time-capacity", None, None)
    assert got == [(True, None, [0], [8]), (True, None, [1], [6]), (True, None, [1, 2, 3], [1, 4, 3]),
                   (True, None, [3], [6]), (True, None, [4], [8]), (True, None, [5], [6]), capacity, capacity,
                   capacity, (True, None, [1], [6]), capacity, capacity, capacity, (True, None, [1, 5], [5, 1])]


def test_the_simplest_best_fit_baseline_places_nothing_and_says_where_it_would():
    """Issue 50's benchmark times each decision against this baseline on the same cluster state."""
    profiles = {"m": make_profile("m", steps=1, blocks=4, stage_ms=10.0, weight_gb=10.0)}
    sched = JointScheduler(Cluster([make_device("d0", 100), make_device("d1", 30)], 0.1, profiles), make_config(0.1))
    req = StreamRequest("a", "m", 100.0)
    before = sched.cluster.util.copy()
    assert sched.simplest_best_fit(req) == [0]          # 40 GB of weights: only d0 holds them
    assert (sched.cluster.util == before).all()
    assert sched.admit(req).admitted and sched.admit(StreamRequest("b", "m", 100.0)).admitted
    assert sched.simplest_best_fit(StreamRequest("c", "m", 50.0)) is None    # 0.8 + 0.8 of 0.9: no time left


def test_a_clean_history_stream_is_one_rank_on_one_device_never_split():
    """Under the clean rule a chunk's stages run one after another (one chunk in flight): the whole chunk,
    clean row included, is one rank; a device with a gap too small for it is not filled with a piece; an SLO
    below the chunk's work is refused naming the rule; K/V counts one slot per block."""
    prof = dataclasses.replace(make_profile(steps=2, blocks=2, stage_ms=1.0, kv_gb=1.0), clean=True)
    cluster = Cluster([make_device(), make_device()], 0.0, {"m": prof})
    sched = JointScheduler(cluster, make_config(split=True))
    (rank,) = sched.ranks_for("m", 10.0)
    assert len(rank.stages) == 6 and rank.compute_ms == 6.0 and rank.kv_bytes == 2 * GB   # 3 rows x 2 blocks
    first = sched.admit(StreamRequest("a", "m", 10.0))          # 6 of 10 ms on one device
    second = sched.admit(StreamRequest("b", "m", 10.0))         # does not fit beside it: the other device whole
    assert first.admitted and second.admitted and {first.placed.devices[0], second.placed.devices[0]} == {0, 1}
    third = sched.admit(StreamRequest("c", "m", 10.0))          # 4 ms left on each: no piece of it fits anywhere
    assert not third.admitted and third.reason == "time-capacity"
    tight = sched.admit(StreamRequest("d", "m", 5.0))
    assert not tight.admitted and tight.reason == "slo-unreachable" and "one chunk in flight" in tight.detail
