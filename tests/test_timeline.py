"""Timeline arithmetic: rows already due, kinematics a trajectory controller accepts, seams."""

import math

import numpy as np
import pytest

from physis_ros.timeline import SeamTracker, first_due_row, kinematics, rms


def test_first_due_row():
    assert first_due_row(10.0, 0.02, 9.99, 16) == 0
    assert first_due_row(10.0, 0.02, 10.0, 16) == 1      # due exactly now: past
    assert first_due_row(10.0, 0.02, 10.0399, 16) == 2
    assert first_due_row(10.0, 0.02, 10.31, 16) == 16    # all due
    assert first_due_row(10.0, 0.02, 1e6, 16) == 16


def test_kinematics_of_a_line_and_a_parabola():
    dt = 0.02
    t = np.arange(16)[:, None] * dt
    vel, acc = kinematics(3.0 * t + 1.0, dt)
    np.testing.assert_allclose(vel[:-1], 3.0)
    np.testing.assert_allclose(acc, 0.0, atol=1e-9)
    vel, acc = kinematics(0.5 * 4.0 * t * t, dt)        # a = 4: central differences are exact on a parabola
    np.testing.assert_allclose(vel[1:-1], 4.0 * t[1:-1], atol=1e-9)
    np.testing.assert_allclose(acc[:-1], 4.0, atol=1e-6)
    assert not vel[-1].any() and not acc[-1].any()         # at rest at the end


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_kinematics_of_short_chunks(rows):
    vel, acc = kinematics(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2), 0.1)
    assert vel.shape == acc.shape == (rows, 2) and vel.dtype == np.float64
    assert not vel[-1].any() and not acc[-1].any()
    assert np.isfinite(vel).all() and np.isfinite(acc).all()


def test_seam_compares_the_same_control_step():
    dt = 0.02
    seams = SeamTracker()
    first = np.arange(16, dtype=np.float64)[:, None] * np.ones((1, 2))      # position = step number
    v1, _ = kinematics(first, dt)
    assert math.isnan(seams.seam(0, 0, first, v1).position_jump)           # nothing to compare with yet
    seams.executed(100, first, v1)
    new = first + 0.25       # starts at step 108: its row 3 is step 111, where the first prescribed 11
    seam = seams.seam(108, 3, new + 8, v1)
    assert seam.position_jump == pytest.approx(0.25) and seam.velocity_jump == pytest.approx(0.0)
    assert math.isnan(seams.seam(120, 0, new, v1).position_jump)           # beyond the previous chunk
    seams.reset()
    assert math.isnan(seams.seam(108, 3, new, v1).position_jump)


def test_rms():
    assert rms(np.ones((3, 2)), np.zeros((3, 2))) == 1.0
    assert math.isnan(rms(np.zeros((0, 2)), np.zeros((0, 2))))


def test_timeline_streams_are_released_whole_control_steps_apart():
    from physis_ros.timeline import release_pace_ms
    # s = 8 steps at 50 Hz (160 ms) less a 20 % margin is 128 ms: 6 whole steps, 120 ms
    assert release_pace_ms(160.0, 0.2, 50.0) == pytest.approx(120.0)
    assert release_pace_ms(160.0, 0.0, 50.0) == pytest.approx(160.0)       # no margin: exactly s
    assert release_pace_ms(100.0, 0.2, 50.0) == pytest.approx(80.0)        # already whole: unchanged
    assert release_pace_ms(10.0, 0.2, 50.0) == pytest.approx(20.0)         # never less than one step
    assert release_pace_ms(160.0, 0.2, 50.0, timeline=False) == pytest.approx(128.0)   # cadence free
    # float noise never costs a step: 0.3 s at 30 Hz is 9 steps
    assert release_pace_ms(300.0, 0.0, 30.0) == pytest.approx(300.0)
