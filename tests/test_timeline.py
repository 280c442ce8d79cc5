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


def running(first_step: int = 100, rows: int = 16, dof: int = 2) -> SeamTracker:
    """A tracker whose robot runs a chunk from ``first_step`` with position = step number."""
    seams = SeamTracker()
    pos = (first_step + np.arange(rows, dtype=np.float64))[:, None] * np.ones((1, dof))
    seams.executed(first_step, pos, kinematics(pos, 0.02)[0])
    return seams


def test_a_takeover_that_jumps_starts_where_the_robot_is_and_eases_onto_the_new_chunk():
    """Was: a chunk later than its frozen rows (a latency spike) went out as computed, a 0.2-0.3 rad step in
    the command at its first point (make demo, 2 to 4 of 10 robot-runs)."""
    seams = running()
    new = (106 + np.arange(16, dtype=np.float64))[:, None] * np.ones((1, 2)) + 0.3
    sent, changed = seams.blend(106, 2, new, rows=4, keep_from=8)
    assert changed == 4
    np.testing.assert_array_equal(sent[2], [108.0, 108.0])                 # the first row run: where the robot is
    eased = 0.3 * (1 - 0.5 * (1 + np.cos(np.pi * np.arange(4) / 4)))        # 0, 0.044, 0.15, 0.256 of the 0.3
    np.testing.assert_allclose(sent[2:6, 0] - (new[2:6, 0] - 0.3), eased, atol=1e-9)
    np.testing.assert_array_equal(sent[:2], [[106.0] * 2, [107.0] * 2])      # rows before: what the robot ran
    np.testing.assert_array_equal(sent[6:], new[6:])                       # from the window's end: as computed
    steps = np.abs(np.diff(sent[2:7, 0]))
    assert steps.max() < 1.0 + 0.3 / 4 * 2 and np.all(np.diff(sent[2:7, 0]) > 0)   # no step, still moving on


def test_the_blend_stops_before_the_next_chunks_first_step_and_leaves_agreeing_takeovers_alone():
    seams = running()
    new = (106 + np.arange(16, dtype=np.float32))[:, None] * np.ones((1, 2), np.float32) + 0.3
    sent, changed = seams.blend(106, 3, new, rows=4, keep_from=6)         # the next chunk keeps rows 6.. as computed
    assert changed == 3
    np.testing.assert_array_equal(sent[6:], new[6:])
    assert seams.blend(106, 5, new, rows=4, keep_from=6)[1] == 0           # one row: would only move the jump
    assert seams.blend(106, 2, new, rows=0, keep_from=8)[1] == 0           # off
    agreeing = (106 + np.arange(16, dtype=np.float32))[:, None] * np.ones((1, 2), np.float32)
    agreeing[3:] += 0.1      # a takeover at the last frozen row (row 2): the rows after it are the chunk's own
    sent, changed = seams.blend(106, 2, agreeing, rows=4, keep_from=8)
    assert changed == 0 and sent is agreeing                               # bit for bit as computed
    assert SeamTracker().blend(0, 0, new, rows=4, keep_from=8)[1] == 0     # nothing running yet
    assert seams.blend(130, 0, new, rows=4, keep_from=8)[1] == 0           # beyond what the robot had


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
