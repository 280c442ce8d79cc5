"""Admission's load calibration (:mod:`physis_ros.ros.calibration`): a worker's measured busy time over
what admission booked there, and admission refusing what fits the profiles but not the measured load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from physis_ros.model.presets import load_model_config
from physis_ros.ros.admission import HostBudget, Rejected, ServerAdmission
from physis_ros.ros.calibration import CalibrationSettings, LoadCalibration
from physis_ros.runtime.streams import ServedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduling"))
from sched_helpers import make_config, make_device, make_profile  # noqa: E402

WAM = load_model_config("tiny-wam")


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
    c = feed(cal, 3, 0.0, 5.0, busy=0.3, booked=0.2)
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
    assert exc.value.reason == "time-capacity" and "measured busier than profiled, caps d0 0.67" in exc.value.detail
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
    assert exc.value.reason == "host-cpu" and "2.10 of the host's 2 cores" in exc.value.detail
    assert list(adm.admitted) == ["a"] and adm.utilisation() == [pytest.approx(0.4), 0.0]


def test_without_calibration_the_profiles_alone_decide():
    adm = ServerAdmission(1, make_device(), make_config(0.0))
    assert adm.load_factors() == [1.0]
    adm.admit("a", served_wam(), 40.0)
    adm.admit("b", served_wam(), 40.0)
    assert len(adm.admitted) == 2
