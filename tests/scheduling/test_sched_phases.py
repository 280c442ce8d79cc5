"""Release phases: the phase a paced stream gets, and the wait of its chunk behind the chunks released
before it on a shared device, checked against a plain first-come-first-served simulation."""

import math
import random

import pytest

from physis_ros.scheduling.phases import choose_phase, circular_distance, wait_ms


def test_choose_phase_is_as_far_as_it_can_be_from_the_phases_taken():
    assert choose_phase(80.0, []) == 0.0
    assert choose_phase(80.0, [0.0]) == 40.0
    assert choose_phase(80.0, [0.0, 40.0]) == 20.0            # 20 and 60 are as good: the earliest
    assert choose_phase(80.0, [10.0]) == 50.0
    assert circular_distance(75.0, 5.0, 80.0) == pytest.approx(10.0)


def simulated_wait(period: float, own: tuple[float, float], others: list[tuple[float, float]], laps: int = 50) -> float:
    """FCFS on one server over many periods: the wait of ``own``'s last release (ties: others first)."""
    jobs = sorted((lap * period + p, j == 0, w) for lap in range(laps)
                  for j, (p, w) in enumerate([own, *others]))
    free, wait = 0.0, None
    for t, is_own, w in jobs:
        start = max(free, t)
        if is_own:
            wait = start - t
        free = start + w
    return wait


def test_wait_is_the_backlog_of_earlier_releases():
    assert wait_ms(80.0, 40.0, 10.0, [(0.0, 10.0)]) == 0.0
    assert wait_ms(80.0, 20.0, 25.0, [(0.0, 25.0), (40.0, 25.0)]) == pytest.approx(5.0)
    assert wait_ms(80.0, 40.0, 25.0, [(0.0, 25.0), (20.0, 25.0)]) == pytest.approx(10.0)
    assert wait_ms(80.0, 20.0, 30.0, [(0.0, 30.0), (40.0, 30.0)]) == math.inf     # 90 ms of work in 80
    assert wait_ms(80.0, 0.0, 10.0, [(0.0, 10.0)]) == pytest.approx(10.0)      # a tie goes first
    assert wait_ms(80.0, 0.0, 40.0, [(40.0, 40.0)]) == math.inf                 # the period is full


def test_wait_matches_a_first_come_first_served_simulation():
    rng = random.Random(7)
    for _ in range(300):
        period = rng.choice([60.0, 80.0, 120.0])
        n = rng.randint(1, 5)
        phases = [rng.choice([0.0, rng.uniform(0, period)]) for _ in range(n + 1)]
        budget = rng.uniform(0.2, 0.95) * period
        works = [rng.uniform(0.1, 1.0) for _ in range(n + 1)]
        works = [w * budget / sum(works) for w in works]
        own, others = (phases[0], works[0]), list(zip(phases[1:], works[1:]))
        assert wait_ms(period, *own, others) == pytest.approx(simulated_wait(period, own, others), abs=1e-6)
