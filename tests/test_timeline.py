"""The control timeline, all of it (physis_ros/timeline.py): where a released chunk starts and what its
hand-off assumes (ControlTimeline.place / emitted / capture_lead_s), where a published chunk lands and which
rows are late (land), what is kept from the previous chunk (keep_from), rows already due, kinematics a
trajectory controller accepts, seams."""

import math

import numpy as np
import pytest

from physis_ros.timeline import ControlTimeline, SeamTracker, first_due_row, kinematics, rms


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


# ---- where a published chunk lands ---------------------------------------------------------------------------
def landing(now: float, start: str = "timeline", offset_s: float = 0.0, step0: float = 100.2, min_lead_s=0.002):
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8)           # 20 ms per step
    return tl.land(10, step0, 2, 100.0, now, start, offset_s, min_lead_s)


def test_land_drops_rows_already_due():
    p = landing(100.19)
    assert (p.first_row, p.late, p.first_step, p.delay_steps) == (0, False, 10, 2) and p.start == pytest.approx(100.2)
    assert landing(100.19, min_lead_s=0.0).first_row == 0
    p = landing(100.2, min_lead_s=0.0)           # row 0 due exactly now: it is past
    assert p.first_row == 1 and p.start == pytest.approx(100.22)
    p = landing(100.199)                         # row 0 due before the message can be out (min lead 2 ms): dropped
    assert p.first_row == 1 and p.start - 100.199 >= 0.002
    p = landing(100.255)                         # rows 0..2 due (100.2, 100.22, 100.24)
    assert p.first_row == 3 and p.start == pytest.approx(100.26) and p.start > 100.255
    p = landing(100.2 + 15 * 0.02 - 0.0021)      # only the last row ahead (by more than the lead)
    assert (p.first_row, p.late) == (15, False)
    p = landing(100.2 + 15 * 0.02 - 0.0019)      # every row due, or due before the message is out: a late chunk
    assert (p.first_row, p.late) == (16, True)
    for now in np.linspace(100.1, 100.5, 401):   # whatever the moment, point 0 sent is at least the lead ahead
        p = landing(now)
        assert p.late or p.start >= now + 0.002 - 1e-12


def test_land_by_trajectory_start():
    assert landing(100.05, "observation").first_row == 3
    emit = landing(101.0, "emit", 0.1)
    assert emit.first_row == 0 and emit.start == pytest.approx(101.12)
    assert landing(100.05, step0=math.nan).row0_due == pytest.approx(100.0)   # no step on the timeline: the stamp
    offset = landing(100.2, offset_s=0.05)       # 50 ms ahead
    assert offset.first_row == 0 and offset.start == pytest.approx(100.25)
    with pytest.raises(ValueError, match="trajectory start 'later'"):
        landing(100.0, "later")


def test_keep_from_is_one_release_later_or_the_shift_when_released_when_ready():
    paced = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, release_steps=6)
    assert paced.keep_from(0) == paced.keep_from(9) == 6
    free = ControlTimeline(rate_hz=50.0, horizon=16, execution=8)
    assert free.keep_from(5) == 5 and free.keep_from(0) == 16      # the first chunk: its whole horizon


# ---- where a released chunk starts, and what its hand-off assumes --------------------------------------------
def test_place_counts_steps_and_assumes_a_conservative_delay():
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft", extra_delay=1)
    first = tl.place(10.0, 10.0)
    assert (first.first_step, first.shift, first.delay_steps) == (0, 0, 1)   # no delay measured yet: the extra
    tl.latencies += [0.030, 0.031, 0.029, 0.030, 0.090]  # a spike among 30 ms delays: the estimate keeps it
    second = tl.place(10.16, 10.16)
    assert (second.first_step, second.shift) == (8, 8)
    assert second.delay_steps == 7                # ceil(0.090 s * 50) = 5 rows due, + the switch row, + 1 extra
    tl.latencies = [0.5] * 20                        # far beyond what the chunk can hand off: d <= min(s, H - s)
    assert tl.place(10.32, 10.32).delay_steps == 8
    tl.latencies = [0.01] * 20                       # the spike is forgotten once the window moves on
    assert tl.place(10.48, 10.48).delay_steps == 3


def test_until_a_few_delays_are_known_the_handoff_assumes_the_largest_it_can_honour():
    """Was: chunk 3 assumed the largest of chunks 0-2's delays (2 steps), came 3 steps late and took over past
    its frozen rows (physis-bench handoff, seam 0.11 rad; make demo: 0.24-0.26 rad in a robot's first
    second). Until delay_warmup delays are known, d is min(s, H - s); the first chunk hands off from
    nothing."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    placed = []
    for c in range(8):
        t = 10.0 + 0.12 * c
        slot = tl.place(t, t)
        placed.append(slot.delay_steps)
        assert tl.emitted(slot, t, t + 0.030) == pytest.approx(10.0 + slot.first_step * 0.02)   # 1.5 steps late
    assert placed == [0] + [8] * (tl.delay_warmup - 1) + [3, 3, 3]   # then ceil(1.5) + the switch row


def test_a_chunk_as_late_as_the_latest_in_the_window_takes_over_at_a_frozen_row():
    """Was: the delay was the window's 90th percentile. With 18 of 20 delays just under 2 steps (39 ms) and 2
    just over (41 ms), it froze 3 rows, and a chunk as late as those two (the robot switches at row
    ceil(2.05) = 3) took over at an unfrozen row: 11 of 120 chunks in physis-bench handoff, seams up to
    0.09 rad where every one could have been 0."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    tl.latencies = [0.039] * 9 + [0.041] + [0.039] * 9 + [0.041]
    slot = tl.place(10.0, 10.0)
    k = first_due_row(10.0, 0.02, 10.0 + 0.041, 16)
    assert k == 3 and k < slot.delay_steps == 4


def test_latency_is_counted_from_the_observation_and_row_0s_offset_added_back():
    """Released every 128 ms at 50 Hz, chunk 1 is released 6.4 steps in but its row 0 is step 6, due 8 ms
    before the release; chunk 2 is released 13 steps in minus 4 ms. Both take 34 ms from their observation.
    Was (before the delay was counted from row 0): a delay taken from the release (1.7 steps) as if from
    row 0 froze 3 rows of chunk 2 and the robot switched to it at its unfrozen row 3. Counted from the
    observation, with each chunk's own offset from its row 0 added back, the robot switches at a frozen row."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    tl.latencies = [0.030] * (tl.delay_warmup - 1)                # past the warm-up (test above)
    tl.place(10.0, 10.0)
    one = tl.place(10.128, 10.128)
    step0 = tl.emitted(one, 10.128, 10.128 + 0.034)
    assert one.first_step == 6 and step0 == pytest.approx(10.12)
    assert tl.latencies[-1] == pytest.approx(0.034)
    nxt = tl.place(10.256, 10.256)                                # first step 13, row 0 due at 10.26
    k = first_due_row(10.0 + 13 / 50.0, 0.02, 10.256 + 0.034, 16)  # as long as chunk 1 took
    assert nxt.first_step == 13 and k < nxt.delay_steps          # the robot switches at a frozen row
    assert nxt.delay_steps - k == 1                               # and runs one of them, no more


def _switch_rows(margin: float | None, latencies_ms: list[float]) -> tuple[float, list[int]]:
    """A hard hand-off stream with ``latencies_ms`` in its window, its observation taken at its next slot less
    its capture lead: (the lead in steps, the frozen rows the robot runs for each of those latencies)."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", capture_margin=margin)
    tl.place(10.0, 10.0)
    tl.latencies = [x / 1e3 for x in latencies_ms]
    lead = tl.capture_lead_s()
    slot, taken = 10.16, 10.16 - lead
    placed = tl.place(slot, taken)
    assert placed.first_step == 8                                 # its rows stay on the grid
    rows = [placed.delay_steps - first_due_row(slot, 0.02, taken + x / 1e3, 16) for x in latencies_ms]
    return lead * 50.0, rows


def test_capture_lead_makes_the_robot_run_one_frozen_row_not_two():
    """Was (physis-bench handoff at d=4, 2-core host): latencies of 0.7-1.8 steps straddle a step boundary, so
    with the observation taken at the slot the estimate (their largest, say 2.05 steps) froze rows 0-3 and
    a chunk that came in 1.4 steps switched at row 2: two frozen rows run, each built on the previous chunk's
    older observation (1.5 a chunk on average, where the hand-off needs one: the switch row). Taken ahead of
    the slot by the fraction of a step that puts the estimate ``capture_margin`` before a step boundary,
    every chunk within a step of the estimate switches at the last frozen row."""
    window = [28.0, 30.0, 33.0, 36.0, 38.0, 41.0]               # 1.4 to 2.05 steps
    lead, rows = _switch_rows(0.3, window)
    assert lead == pytest.approx(0.35)                           # (2.05 + 0.3) mod 1
    assert rows == [1] * len(window)
    at_slot_lead, at_slot = _switch_rows(None, window)           # as before: taken at the slot
    assert at_slot_lead == 0.0 and at_slot == [2, 2, 2, 2, 2, 1]


def test_capture_lead_margin_keeps_a_chunk_somewhat_later_than_the_estimate_on_a_frozen_row():
    """A chunk up to ``capture_margin`` steps later than the window's largest latency still switches at a
    frozen row; one later than that takes over past them (counted as such by the benchmark)."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", capture_margin=0.3)
    tl.place(10.0, 10.0)
    tl.latencies = [0.030] * 5                                   # 1.5 steps: lead 0.8 step, d = 2
    lead, slot = tl.capture_lead_s(), 10.16
    placed = tl.place(slot, slot - lead)
    assert lead * 50 == pytest.approx(0.8) and placed.delay_steps == 2
    assert first_due_row(slot, 0.02, slot - lead + 0.0359, 16) == 1     # 1.79 steps: row 1, frozen
    assert first_due_row(slot, 0.02, slot - lead + 0.0361, 16) == 2     # 1.81 steps: past the frozen rows


@pytest.mark.parametrize("handoff, latencies", [("none", [0.03] * 5), ("hard", [0.03] * 4)])
def test_no_capture_lead_without_a_handoff_or_a_known_latency(handoff, latencies):
    """Without a hand-off nothing is frozen: the robot takes a chunk when it lands, and an observation taken
    early would only be older. Before the warm-up the latency is not known."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff=handoff)
    tl.latencies = latencies
    assert tl.capture_lead_s() == 0.0


def test_the_senders_lead_counts_in_the_delay():
    """The node drops rows due within trajectory_min_lead_s of the clock read that places a chunk: that much
    later is when the robot takes it over, so the delay the next chunk freezes rows for counts it."""
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", lead_s=0.004)
    tl.latencies = [0.010] * (tl.delay_warmup - 1)  # past the warm-up
    first = tl.place(10.0, 10.0)
    tl.emitted(first, 10.0, 10.0 + 0.038)        # 1.9 steps after row 0; with the lead 2.1
    assert tl.place(10.12, 10.12).delay_steps == 4   # ceil(2.1) + the switch row (1.9 alone: 3)


def test_the_delay_quantile_matches_numpy_without_its_first_call_cost():
    """The estimate runs on a release's path; np.percentile's first call imports numpy.ma (13 ms), which made
    the first chunk after the warm-up 9-12 ms late. Its own interpolation gives np.percentile's values."""
    from physis_ros.timeline import _quantile
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 20):
        xs = list(rng.random(n))
        for q in (0.0, 10.0, 50.0, 90.0, 95.0, 99.0, 100.0, 37.3):
            assert _quantile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)
