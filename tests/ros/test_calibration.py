"""Admission's calibration (:mod:`physis_ros.serving.calibration`): a worker's measured busy time over what
admission booked there, a stream's measured interval p99, and admission refusing what fits the profiles
and the bound but not what was measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from physis_ros.model.spec import load_model_config
from physis_ros.serving.capacity import HostBudget, Rejected, ServerAdmission
from physis_ros.serving.calibration import CalibrationSettings, IntervalCalibration, LoadCalibration, SpreadSettings
from physis_ros.runtime.streams import ServedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduling"))
from sched_helpers import make_config, make_device, make_profile  # noqa: E402

WAM = load_model_config("tiny-wam")
ACWM = load_model_config("tiny-acwm")


def feed(cal: LoadCalibration, worker: int, t0: float, t1: float, busy: float, booked: float,
         start_ms: float = 0.0, period: float = 0.5) -> float:
    """Readings every ``period`` s from t0 to t1 of a worker ``busy`` of the time; its counter at t1."""
    t, c = t0, start_ms
    while t <= t1 + 1e-9:
        cal.observe(worker, t, c, booked)
        t += period
        c += busy * period * 1e3
    return c - busy * period * 1e3


def test_factor_is_measured_busy_over_booked_after_the_settle_and_a_full_window():
    cal = LoadCalibration(CalibrationSettings(window_s=8.0, settle_s=3.0))
    feed(cal, 0, 0.0, 10.0, busy=0.3, booked=0.2)        # settle 3 s, only 7 s measured: no verdict yet
    assert cal.factor(0) == 1.0
    feed(cal, 0, 10.5, 14.0, busy=0.3, booked=0.2, start_ms=10.5 * 300)
    assert cal.factor(0) == pytest.approx(1.5)
    assert [cal.factor(0), cal.factor(1)] == [pytest.approx(1.5), 1.0]   # an unmeasured worker: as profiled


def test_a_new_booking_measures_anew_but_keeps_the_last_factor_meanwhile():
    cal = LoadCalibration(CalibrationSettings(window_s=4.0, settle_s=1.0))
    c = feed(cal, 0, 0.0, 6.0, busy=0.4, booked=0.2)
    assert cal.factor(0) == pytest.approx(2.0)
    # a stream joins: booked 0.4; the first seconds (its warm-up) are not measured, the old factor holds
    c = feed(cal, 0, 6.5, 8.0, busy=0.1, booked=0.4, start_ms=c)
    assert cal.factor(0) == pytest.approx(2.0)
    feed(cal, 0, 8.5, 14.0, busy=0.44, booked=0.4, start_ms=c)
    assert cal.factor(0) == pytest.approx(1.1)


def test_never_looser_than_the_profile_bounded_and_a_restart_starts_over():
    cal = LoadCalibration(CalibrationSettings(window_s=4.0, settle_s=0.0))
    feed(cal, 0, 0.0, 5.0, busy=0.1, booked=0.3)          # quieter than booked: the profile stays the floor
    assert cal.factor(0) == 1.0
    feed(cal, 1, 0.0, 5.0, busy=0.9, booked=0.1)          # 9x: bounded
    assert cal.factor(1) == 3.0
    feed(cal, 2, 0.0, 1.0, busy=0.02, booked=0.01)        # a booking too small to say anything
    assert cal.factor(2) == 1.0
    feed(cal, 3, 0.0, 5.0, busy=0.3, booked=0.2)
    assert cal.factor(3) == pytest.approx(1.5)
    feed(cal, 3, 5.5, 7.0, busy=0.6, booked=0.2, start_ms=0.0)   # restarted worker: counter from 0
    assert cal.factor(3) == pytest.approx(1.5)              # ... no bogus rate from the jump, old factor kept


def served_wam(stage_ms: float = 0.5) -> ServedModel:
    return ServedModel(WAM, None, make_profile("tiny-wam", steps=WAM.steps, blocks=WAM.blocks, stage_ms=stage_ms))


def test_admission_books_a_worker_measured_busier_down_to_what_it_can_take_and_nothing_moves():
    # 16 ms a chunk at a 40 ms SLO: 0.4 of a worker by its profile
    cal = LoadCalibration()
    adm = ServerAdmission(2, make_device(), make_config(0.0), calibration=cal)
    a = adm.admit("a", served_wam(), 40.0)
    assert a.workers == ["w0"]
    cal.set_factors({0: 1.5})                 # measured: w0 runs 1.5x what it is booked (cap 1 / 1.5 = 0.67)
    names = ["a"]
    with pytest.raises(Rejected) as exc:
        for i in range(10):
            adm.admit(f"s{i}", served_wam(), 40.0)
            names.append(f"s{i}")
            util = adm.utilisation()
            assert util[0] <= 1 / 1.5 + 1e-9 and util[1] <= 1.0 + 1e-9, util   # as w0 runs now, within its time
    assert exc.value.cause == "time-capacity" and "measured busier than profiled, caps d0 0.67" in exc.value.detail
    assert set(adm.admitted) == set(names) and adm.admitted["a"].plan.assignment == a.plan.assignment  # nobody moved
    assert adm.load_factors() == [1.5, 1.0]
    # the profiles alone book w0 to 1.0: one stream more
    plain = ServerAdmission(2, make_device(), make_config(0.0))
    for name in [*names, "extra"]:
        plain.admit(name, served_wam(), 40.0)


def test_the_host_budget_counts_the_measured_load():
    host = HostBudget(cores=2, reserve=0.5, per_stream=0.0, headroom=0.0)
    cal = LoadCalibration()
    adm = ServerAdmission(2, make_device(), make_config(0.0), host=host, calibration=cal)
    adm.admit("a", served_wam(), 40.0)                    # 0.4 on w0
    cal.set_factors({0: 2.0, 1: 2.0})                     # caps 0.5: b fits only on w1 (0.4)
    with pytest.raises(Rejected) as exc:
        adm.admit("b", served_wam(), 40.0)                # host: (0.4 + 0.4) x 2 + 0.5 = 2.1 > 2 cores
    assert exc.value.cause == "host-cpu" and "2.10 of the host's 2 cores" in exc.value.detail
    assert list(adm.admitted) == ["a"] and adm.utilisation() == [pytest.approx(0.4), 0.0]


def test_without_calibration_the_profiles_alone_decide():
    adm = ServerAdmission(1, make_device(), make_config(0.0))
    assert adm.load_factors() == [1.0]
    adm.admit("a", served_wam(), 40.0)
    adm.admit("b", served_wam(), 40.0)
    assert len(adm.admitted) == 2


def paced_intervals(t0: float, t1: float, pattern: list[float], pace_s: float = 0.08) -> list[tuple[float, float]]:
    """(emit time, interval ms) every ``pace_s`` from ``t0`` to ``t1``, the intervals cycling through ``pattern``."""
    n = int(round((t1 - t0) / pace_s))
    return [(t0 + i * pace_s, pattern[i % len(pattern)]) for i in range(n + 1)]


def test_interval_p99_is_measured_over_a_whole_window_once_the_placements_settle():
    cal = IntervalCalibration(SpreadSettings(window_s=4.0, settle_s=1.0, min_samples=10))
    assert cal.observe("a", 0, 0.0, []) is None                     # placements version 0 from t = 0
    early = [(0.5, float("nan")), *paced_intervals(0.6, 4.9, [70.0, 90.0])]
    assert cal.observe("a", 0, 4.9, early) is None                  # settle 1 s + window 4 s: not yet
    both = early + paced_intervals(4.98, 5.5, [70.0, 90.0])
    assert cal.observe("a", 0, 5.5, both) == pytest.approx(90.0)
    # records seen before are not counted again; the window slides: only the last 4 s count
    later = both + paced_intervals(5.58, 10.0, [80.0])
    assert cal.observe("a", 0, 10.0, later) == pytest.approx(80.0)
    # another stream joins or leaves anywhere on the host (version 1): a whole new window is needed
    assert cal.observe("a", 1, 10.1, later + paced_intervals(10.08, 10.1, [99.0])) is None
    assert cal.observe("a", 1, 15.2, later + paced_intervals(10.08, 15.2, [99.0])) == pytest.approx(99.0)
    cal.forget("a")
    assert cal.observe("a", 1, 15.3, []) is None


def test_too_few_intervals_in_a_window_say_nothing():
    cal = IntervalCalibration(SpreadSettings(window_s=2.0, settle_s=0.0, min_samples=20))
    cal.observe("slow", 0, 0.0, [])
    assert cal.observe("slow", 0, 3.0, paced_intervals(0.0, 3.0, [400.0], pace_s=0.4)) is None


def test_a_streams_spread_is_the_largest_of_the_last_minute():
    """Bug found by physis-bench admission (admission_spread3, off): robot0 measured a 10.9 ms spread beside
    another robot, 2.6 ms beside a world model on the other worker (where the bound's worst case, not
    reached, hid the rest), and on the 2.6 a third stream was let in: robot0 went to p99 106 ms. A window's
    spread is a lower bound on the stream's: the largest of the last minute is what counts."""
    cal = IntervalCalibration(SpreadSettings(memory_s=60.0))
    assert cal.remember("r0", 10.0, 10.9) == 10.9
    assert cal.remember("r0", 40.0, 2.6) == 10.9
    assert cal.remember("r1", 40.0, 1.0) == 1.0                      # per stream
    assert cal.remember("r0", 69.0, 3.0) == 10.9
    assert cal.remember("r0", 71.0, 2.0) == 3.0                      # the 10.9 is over a minute old
    cal.forget("r0")
    assert cal.remember("r0", 72.0, 0.5) == 0.5


def robot_admission(intervals: IntervalCalibration | None) -> ServerAdmission:
    """Two CPU workers on a 2-core host, as the server sets them up (defaults: reserve 0.75 core)."""
    from physis_ros.serving.policies import worker_headroom

    host = HostBudget(cores=2, reserve=0.75, per_stream=0.08, headroom=0.1)
    return ServerAdmission(2, make_device(), make_config(worker_headroom(0.1, 0.75, cores=2)), host=host,
                           calibration=LoadCalibration(), intervals=intervals)


def test_a_robot_measured_near_its_slo_refuses_a_world_model_the_bound_alone_admits_beside_it():
    """Bug found by physis-bench admission (admission_phases2, batching off): a robot alone on w0 published at
    p99 97 ms of its 100 ms SLO (released every 80 ms). The bound charged a world model on w1 only the cores
    the two workers share (0.6 x 19 ms = 11 ms of the robot's 20) and admitted it, and the robot's p99 went
    to 106-108 ms. Now the robot's measured p99 plus what the bound adds must stay within its SLO: the world
    model is refused, naming the robot, while a second robot staggered on w0, which adds no wait, comes in."""
    robot = ServedModel(WAM, None, make_profile("tiny-wam", steps=WAM.steps, blocks=WAM.blocks, stage_ms=19 / 32))
    world = ServedModel(ACWM, None, make_profile("tiny-acwm", steps=ACWM.steps, blocks=ACWM.blocks,
                                                 stage_ms=25 / (ACWM.steps * ACWM.blocks)))
    plain = robot_admission(None)                                   # the bound alone, as before
    assert plain.admit("r0", robot, 80.0, 100.0).workers == ["w0"]
    assert plain.admit("wm", world, 240.0, 300.0).workers == ["w1"]

    adm = robot_admission(IntervalCalibration())
    adm.admit("r0", robot, 80.0, 100.0)
    adm.observe_intervals("r0", 0.0, [])
    assert adm.spread_ms("r0") is None
    adm.observe_intervals("r0", 9.0, paced_intervals(0.0, 9.0, [63.0, 97.0]))
    assert adm.spread_ms("r0") == pytest.approx(17.0)               # p99 97 - pace 80 - its bound 0
    with pytest.raises(Rejected) as exc:
        adm.admit("wm", world, 240.0, 300.0)
    assert exc.value.cause == "latency-jitter" and "'r0'" in exc.value.detail
    assert list(adm.admitted) == ["r0"]
    r1 = adm.admit("r1", robot, 80.0, 100.0)
    assert r1.workers == ["w0"] and r1.placed.phase_ms == 40.0
    # the placements changed: r0's window starts over; the newcomer is charged r0's spread until measured
    assert adm.cluster.jitter.spread_ms("r1") == pytest.approx(17.0)
    adm.observe_intervals("r0", 9.5, paced_intervals(0.0, 9.5, [63.0, 97.0]))
    adm.observe_intervals("r0", 18.0, paced_intervals(0.0, 18.0, [70.0, 90.0]))
    assert adm.spread_ms("r0") == pytest.approx(17.0)               # measured 10 now: the minute's largest
    adm.observe_intervals("r0", 75.0, paced_intervals(0.0, 75.0, [70.0, 90.0]))
    assert adm.spread_ms("r0") == pytest.approx(10.0)               # a minute on, the 17 is forgotten
    adm.remove("r0")
    assert adm.spread_ms("r0") is None and adm.cluster.jitter.spread_ms("r1") == 0.0


def test_a_replay_follows_the_spreads_a_server_published_for_its_streams_only():
    adm = robot_admission(IntervalCalibration())
    robot = served_wam()
    adm.admit("r0", robot, 80.0, 100.0)
    adm.follow({}, {"r0": 12.5, "gone": 30.0, "r9": -1.0})
    assert adm.spreads == {"r0": 12.5}
    off = robot_admission(None)                                     # without the measured-spread check: nothing kept
    off.admit("r0", robot, 80.0, 100.0)
    off.follow({}, {"r0": 12.5})
    assert off.spreads == {}
