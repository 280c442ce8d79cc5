"""Latency-jitter admission: a stream released every ``pace`` ms keeps an interval SLO of ``slo`` ms only
if the chunks sharing its devices cannot delay its chunk by more than ``slo - pace``
(:meth:`JitterBound.bound_ms`), with the workers' dispatch order (``oldest`` or ``edf``) deciding which do."""

import dataclasses

import pytest

from physis_ros.scheduling.admission import REASONS, StreamRequest
from physis_ros.scheduling.cluster import Cluster
from physis_ros.scheduling.placement import JointScheduler

from sched_helpers import make_config, make_device, make_profile

# policy "p": one chunk of 4 stages of 2.5 ms = 10 ms; world model "w": 4 stages of 4 ms = 16 ms
POLICY = make_profile("p", blocks=4, stage_ms=2.5)
WORLD = make_profile("w", blocks=4, stage_ms=4.0)


def scheduler(devices: int = 2, deadline_order: bool = False, max_batch: int = 1, profiles=None,
              equal_fallback: bool = False) -> JointScheduler:
    cluster = Cluster([make_device()] * devices, 0.1, profiles or {"p": POLICY, "w": WORLD}, max_batch=max_batch,
                      deadline_order=deadline_order)
    return JointScheduler(cluster, dataclasses.replace(make_config(0.1), equal_fallback=equal_fallback))


def robot(name: str, budget: float | None = 12.0) -> StreamRequest:
    return StreamRequest(name, "p", slo_ms=80.0, jitter_budget_ms=budget)      # released every 80 ms, SLO 92


def world(name: str = "wm", budget: float | None = 60.0) -> StreamRequest:
    return StreamRequest(name, "w", slo_ms=200.0, jitter_budget_ms=budget)


def test_without_budgets_best_fit_packs_a_world_model_beside_a_policy():
    sched = scheduler()
    assert sched.admit(robot("r0", None)).placed.devices == [0]
    assert sched.admit(world(budget=None)).placed.devices == [0]    # the busy device first: Best-Fit


def test_oldest_first_a_world_models_chunk_would_delay_the_policys_so_it_goes_elsewhere():
    sched = scheduler()
    sched.admit(robot("r0"))
    d = sched.admit(world())
    assert d.admitted and d.placed.devices == [1]       # on device 0 it could delay r0's chunk 16 ms > 12
    c = sched.cluster
    assert c.jitter.bound_ms(c.streams["r0"]) == 0.0 and c.jitter.bound_ms(c.streams["wm"]) == 0.0
    # a second robot beside r0 delays it by one chunk (10 ms <= 12): Best-Fit packs it there
    assert sched.admit(robot("r1")).placed.devices == [0]
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(10.0) and c.jitter.bound_ms(c.streams["r1"]) == pytest.approx(10.0)


def test_a_rejection_for_jitter_names_the_stream_and_disturbs_nothing():
    sched = scheduler(devices=1)
    sched.admit(robot("r0"))
    before = (sched.cluster.util.copy(), sched.cluster.mem.copy(), dict(sched.cluster.streams))
    d = sched.admit(world())
    assert (d.admitted, d.reason) == (False, "latency-jitter") and "latency-jitter" in REASONS
    assert "'r0'" in d.detail and "16.0 ms" in d.detail and "12.0 ms" in d.detail
    assert (sched.cluster.util == before[0]).all() and (sched.cluster.mem == before[1]).all()
    assert sched.cluster.streams == before[2]
    # a newcomer's own budget counts too: a robot that tolerates no jitter cannot join r0's device
    d = sched.admit(robot("strict", budget=5.0))
    assert (d.admitted, d.reason) == (False, "latency-jitter") and "'strict'" in d.detail


def test_earliest_deadline_first_a_looser_stream_delays_a_tighter_one_by_one_stage_only():
    sched = scheduler(devices=1, deadline_order=True)
    sched.admit(robot("r0"))
    d = sched.admit(world())                 # edf: r0's chunks run ahead of wm's; wm's task in hand: 4 ms
    assert d.admitted and d.placed.devices == [0]
    c = sched.cluster
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(4.0)
    assert c.jitter.bound_ms(c.streams["wm"]) == pytest.approx(10.0)   # r0's chunks (tighter) all run ahead of it
    # a looser world model that tolerates less than a robot chunk and a task of wm is refused, for itself
    d = sched.admit(world("wm-strict", budget=13.0))
    assert d.reason == "latency-jitter" and "'wm-strict'" in d.detail and "14.0 ms" in d.detail
    # one tighter than r0 would run ahead of it: r0 then waits for its whole chunk and one task of wm
    d = sched.admit(world("wm-urgent", budget=11.0))
    assert d.reason == "latency-jitter" and "'r0'" in d.detail and "20.0 ms" in d.detail
    # two looser streams block r0 by one task at most, not one each
    sched.admit(world("wm2"))
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(4.0)


def test_the_measured_load_factor_scales_the_delay():
    sched = scheduler(devices=1)
    sched.admit(robot("r0"))
    sched.cluster.set_load_factors([1.3])            # device measured 30 % busier than booked: 13 ms > 12
    d = sched.admit(robot("r1"))
    assert d.reason == "latency-jitter" and "13.0 ms" in d.detail
    sched.cluster.set_load_factors([1.1])            # 11 ms <= 12
    assert sched.admit(robot("r1")).admitted


def test_batched_streams_delay_each_other_by_the_batch_curve():
    # a forward of n tasks costs 2.5, 3.5, 4.5 ms at n = 1, 2, 3: three batched robots' chunk takes 18 ms
    curve = make_profile("p", blocks=4, stage_ms=2.5)
    curve = dataclasses.replace(curve, stage_ms={s: {1: 2.5, 2: 3.5, 3: 4.5} for s in curve.stage_ms})
    sched = scheduler(devices=1, max_batch=3, profiles={"p": curve})
    for name in ("r0", "r1"):
        sched.admit(robot(name))
    c = sched.cluster
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(14.0 - 10.0)   # alone 10 ms, batched with r1 14 ms
    assert sched.admit(robot("r2")).admitted                            # 18 - 10 = 8 <= 12
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(8.0)
    assert sched.admit(robot("tight", budget=7.0)).reason == "latency-jitter"


def test_streams_without_budgets_are_not_checked():
    sched = scheduler(devices=1)
    for i in range(3):
        assert sched.admit(robot(f"r{i}", None)).admitted   # 20 ms of other chunks: no budget, no check
    assert not sched.cluster.jitter.applies(None)


def test_devices_sharing_too_few_cores_slow_each_other_down():
    # 2 CPU workers on 1.25 free cores: while both are busy each gets 0.625 of a core, so a busy period
    # stretches by 0.6 of the time another device's busy period overlaps it
    sched = scheduler()
    sched.cluster.jitter.shared_cores = 1.25
    c = sched.cluster
    sched.admit(robot("r0"))                                     # 10 ms chunks on device 0
    assert sched.admit(world()).placed.devices == [1]            # 16 ms chunks: not beside r0
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(0.6 * 10.0)   # its 10 ms overlapped by wm's 16
    assert c.jitter.bound_ms(c.streams["wm"]) == pytest.approx(0.6 * 10.0)
    # beside r0, r1 adds its 10 ms chunk and stretches a 20 ms busy period by 0.6 x 16: 19.6 > 12 ms;
    # beside wm it would wait for wm's chunk: the two workers' time is there, their jitter budget is not
    d = sched.admit(robot("r1"))
    assert d.reason == "latency-jitter" and "19.6 ms" in d.detail and ("'r0'" in d.detail or "'r1'" in d.detail)
    # with a core per device nothing slows down: r1 fits beside r0 (10 <= 12 ms)
    c.jitter.shared_cores = 2.0
    assert c.jitter.bound_ms(c.streams["r0"]) == 0.0
    assert sched.admit(robot("r1")).placed.devices == [0]


def test_a_server_with_cpu_workers_shares_the_cores_its_host_budget_leaves():
    from physis_ros.serving.capacity import HostBudget, ServerAdmission

    host = HostBudget(cores=2, reserve=0.75, per_stream=0.08, headroom=0.1)
    assert ServerAdmission(2, make_device(), make_config(0.1), host=host).cluster.jitter.shared_cores == pytest.approx(1.25)
    assert ServerAdmission(2, make_device(), make_config(0.1)).cluster.jitter.shared_cores is None   # GPU workers


def test_the_equal_splits_fallback_onto_an_empty_device_is_checked_where_devices_share_cores():
    """Bug found by physis-bench admission: with the workers sharing 1.25 cores, tiny-acwm was refused by
    every LDS placement and then put on the empty worker by the equal split's fallback, unchecked: an empty
    device is free of other chunks, not of the cores the robots' worker needs (their p99 went to 1.04 of SLO)."""
    sched = scheduler(equal_fallback=True)
    sched.cluster.jitter.shared_cores = 1.25
    sched.admit(robot("r0"))
    sched.admit(robot("r1"))                          # beside r0 (10 <= 12 ms), device 1 stays empty
    assert sched.cluster.streams["r1"].devices == [0]
    d = sched.admit(world("wm", budget=60.0))         # on device 1, r0's 20 ms period would stretch by 0.6 x 16
    assert d.reason == "latency-jitter", d
    assert set(sched.cluster.streams) == {"r0", "r1"} and sched.cluster.util[1] == 0.0 and sched.cluster.mem[1] == 0.0


def paced(name: str, budget: float = 5.0, model: str = "p", slo_ms: float = 80.0) -> StreamRequest:
    return StreamRequest(name, model, slo_ms=slo_ms, jitter_budget_ms=budget, paced=True)


def test_paced_robots_on_one_device_are_released_apart_and_do_not_delay_each_other():
    """Bug found by physis-bench admission (batching off): two robots staggered on one worker held p99 88-89 ms
    (one alone: 89), yet the bound counted each one's whole chunk against the other, and with the host's
    cores shared a third robot was refused latency-jitter. Released at phases 40 ms apart, a 10 ms chunk
    is done long before the other's release: neither waits."""
    sched = scheduler(devices=1)
    c = sched.cluster
    assert sched.admit(paced("r0")).placed.phase_ms == 0.0
    d = sched.admit(paced("r1"))              # unphased, r0's 10 ms chunk would break r1's 5 ms budget
    assert d.admitted and d.placed.phase_ms == 40.0 and d.placed.devices == [0]
    assert c.jitter.bound_ms(c.streams["r0"]) == 0.0 and c.jitter.bound_ms(c.streams["r1"]) == 0.0
    d = sched.admit(paced("r2"))
    assert d.admitted and d.placed.phase_ms in (20.0, 60.0)
    assert "phase_ms" in d.as_dict()
    # unpaced, the same robot may meet any of their chunks: 20 ms > 5
    assert sched.admit(robot("free", budget=5.0)).reason == "latency-jitter"


def test_phased_chunks_longer_than_the_gap_wait_for_the_backlog_before_them():
    # 25 ms chunks at phases 0 and 40 (pace 80): the second is free, a third at 20 waits 5 ms for the first
    long = make_profile("l", blocks=4, stage_ms=6.25)
    sched = scheduler(devices=1, profiles={"l": long})
    c = sched.cluster
    c.util_cap[:] = 2.0      # time capacity is not what this test is about
    sched.admit(paced("r0", budget=12.0, model="l"))
    sched.admit(paced("r1", budget=12.0, model="l"))
    assert c.jitter.bound_ms(c.streams["r1"]) == 0.0
    d = sched.admit(paced("r2", budget=12.0, model="l"))
    assert d.admitted and d.placed.phase_ms == 20.0
    # r2 waits for r0's last 5 ms; r1 (at 40) for r2's last 10 ms; r0 is free again by 80
    assert c.jitter.bound_ms(c.streams["r2"]) == pytest.approx(5.0)
    assert c.jitter.bound_ms(c.streams["r1"]) == pytest.approx(10.0)
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(0.0)
    assert sched.admit(paced("r3", budget=12.0, model="l")).reason == "latency-jitter"   # 4 x 25 ms > 80


def test_streams_at_another_pace_meet_a_paced_one_at_every_phase():
    sched = scheduler(devices=1)
    c = sched.cluster
    sched.admit(paced("r0", budget=20.0))
    d = sched.admit(StreamRequest("wm", "w", slo_ms=200.0, jitter_budget_ms=60.0, paced=True))
    assert d.admitted
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(16.0) and c.jitter.bound_ms(c.streams["wm"]) == pytest.approx(10.0)


def test_batching_mates_share_a_phase_and_delay_each_other_by_the_batch_curve():
    curve = make_profile("p", blocks=4, stage_ms=2.5)
    curve = dataclasses.replace(curve, stage_ms={s: {1: 2.5, 2: 3.5, 3: 4.5} for s in curve.stage_ms})
    sched = scheduler(devices=1, max_batch=3, profiles={"p": curve, "w": WORLD})
    c = sched.cluster
    for name in ("r0", "r1"):
        assert sched.admit(paced(name, budget=12.0)).placed.phase_ms == 0.0
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(4.0)             # as unphased: they run together
    d = sched.admit(StreamRequest("wm", "w", slo_ms=80.0, jitter_budget_ms=60.0, paced=True))
    assert d.admitted and d.placed.phase_ms == 40.0                       # another model: spread apart
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(4.0)


def test_a_measured_spread_is_charged_to_its_stream_and_lengthens_its_chunk_for_those_phased_after_it():
    """What a stream's intervals showed beyond its bound (set_spreads) counts against its own budget, and a
    chunk of it may occupy the device that much longer: one released 15 ms after it waits for the rest. A
    newcomer, not measured yet, is charged the largest spread measured among the placed streams."""
    sched = scheduler(devices=1)
    c = sched.cluster
    sched.admit(paced("r0", budget=20.0))                    # 10 ms chunks, phase 0
    c.jitter.set_spreads({"r0": 8.0})
    assert c.jitter.spread_ms("r0") == 8.0 and c.jitter.spread_ms("newcomer") == 8.0
    assert c.jitter.spread_ms("gone") == 8.0 and sched.admit(paced("r1", budget=20.0)).placed.phase_ms == 40.0
    assert c.jitter.bound_ms(c.streams["r1"]) == 0.0               # 10 + 8 ms are done long before 40
    c.jitter.set_spreads({"r0": 8.0, "r1": 8.0})
    d = sched.admit(paced("r2", budget=20.0))                # at 20: r0's chunk may run to 18 ms, no wait
    assert d.admitted and d.placed.phase_ms == 20.0 and c.jitter.bound_ms(c.streams["r2"]) == 0.0
    c.jitter.set_spreads({"r0": 15.0, "r1": 8.0, "r2": 0.0})        # r0's chunk may now run to 25 ms: r2 waits 5
    assert c.jitter.bound_ms(c.streams["r2"]) == pytest.approx(5.0)
    c.jitter.set_spreads({"r0": 15.0, "r1": 0.0, "r2": 0.0})
    c.load[:] = 2.0                                          # at twice its profile, r0's chunk runs to 35 ms
    assert c.jitter.bound_ms(c.streams["r2"]) == pytest.approx(15.0)   # r2 waits 15 ms as run (7.5 profiled, x2)
    c.load[:] = 1.0
    c.jitter.set_spreads({"r0": 15.0, "r1": 8.0, "r2": 16.0})       # r2's own 16 ms + its 5 ms wait > 20
    r2 = c.remove_stream("r2")
    assert c.jitter.breaches(r2) == [("r2", pytest.approx(21.0), 20.0)]


def test_a_newcomer_is_refused_where_a_running_streams_measured_spread_leaves_no_room():
    """r0 is measured at 14 ms beyond its bound: a world model whose 16 ms chunk the bound alone would let
    delay it by 16 ms (of 20) is refused, naming r0; with no spread measured it is admitted."""
    for spread, admitted in ((0.0, True), (14.0, False)):
        sched = scheduler(devices=1)
        sched.admit(robot("r0", budget=20.0))
        sched.cluster.jitter.set_spreads({"r0": spread})
        d = sched.admit(world())
        assert d.admitted is admitted
        if not admitted:   # the rejection says how much of it was measured
            assert d.reason == "latency-jitter" and "'r0'" in d.detail and "30.0 ms" in d.detail
            assert "plus the 14.0 ms its intervals were measured to vary" in d.detail
        else:
            sched.remove("wm")
            assert "measured to vary" not in sched.admit(world("wm2", budget=1.0)).detail


def test_a_batching_mates_spread_is_not_charged_twice():
    """Mates at one phase run in the same forwards: a slow forward delays both, which each one's own spread
    holds; only a stream released at another phase may find the device still busy with the other's chunk."""
    curve = make_profile("p", blocks=4, stage_ms=2.5)
    curve = dataclasses.replace(curve, stage_ms={s: {1: 2.5, 2: 3.5, 3: 4.5} for s in curve.stage_ms})
    sched = scheduler(devices=1, max_batch=3, profiles={"p": curve, "w": WORLD})
    c = sched.cluster
    for name in ("r0", "r1"):
        sched.admit(paced(name, budget=20.0))
    c.jitter.set_spreads({"r0": 6.0, "r1": 9.0})
    assert c.jitter.bound_ms(c.streams["r0"]) == pytest.approx(4.0)          # the batch curve only, as without spreads
    assert c.jitter.bound_ms(c.streams["r1"]) + c.jitter.spread_ms("r1") == pytest.approx(13.0)   # its own 9 on top
    d = sched.admit(StreamRequest("wm", "w", slo_ms=80.0, jitter_budget_ms=60.0, paced=True))
    assert d.placed.phase_ms == 40.0                                     # another model, released apart:
    assert c.jitter.bound_ms(c.streams["wm"]) == pytest.approx(0.0)            # the mates' 14 ms + 9 end before 40
    c.jitter.set_spreads({"r0": 6.0, "r1": 30.0})
    assert c.jitter.bound_ms(c.streams["wm"]) == pytest.approx(4.0)            # ... unless one may run 30 ms longer
