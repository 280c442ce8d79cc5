"""A stream's schedule in the engine: pacing on its release grid, staggering streams that share a
worker, and its place on the control timeline (first step, shift, the delay the hand-off assumes)."""

import asyncio
import math
import time

import pytest

from physis_ros.runtime.streams import InFlight, StreamState, Timeline, staggered_anchor


def state(interval_s: float | None = None, timeline: Timeline | None = None) -> StreamState:
    s = StreamState("r", None, None, lambda c: None, None, None, None, asyncio.Semaphore(1), timeline=timeline)
    s.release_interval_s = interval_s
    return s


def test_staggered_anchor_puts_a_second_stream_half_an_interval_away():
    assert staggered_anchor(100.0, 0.16, []) is None            # alone: release now
    anchor = staggered_anchor(100.0, 0.16, [(100.0, 0.16)])
    assert (anchor - 100.0) % 0.16 == pytest.approx(0.08)
    # three on one worker: the third goes between the first two
    third = staggered_anchor(100.0, 0.16, [(100.0, 0.16), (100.08, 0.16)])
    assert min(abs((third - 100.0) % 0.08 - 0.04), 1.0) == pytest.approx(0.0, abs=0.006)
    # a stream of another interval: the candidate farthest from all of its releases in the lookahead
    other = staggered_anchor(100.0, 0.2, [(99.95, 0.1)])
    assert min(abs(other + k * 0.2 - (99.95 + j * 0.1)) for k in range(4) for j in range(12)) >= 0.04


def test_pacing_keeps_the_grid_and_a_late_release_keeps_its_phase():
    s = state(0.1)
    s.release_t0 = time.monotonic() - 1.0      # anchored a second ago: 10 slots behind
    s.releases = 10
    due = asyncio.run(s.pace())                 # on time (due now): no wait
    assert s.released(due) == due and s.releases == 11
    s.releases = 5                              # now 5 slots late: released now, the phase is kept ...
    t0 = s.release_t0
    now = time.monotonic()
    assert s.released(s.release_t0 + 5 * 0.1) == pytest.approx(now, abs=0.02)
    shift = s.release_t0 - t0
    assert shift / 0.1 == pytest.approx(round(shift / 0.1), abs=1e-6)   # ... a whole number of intervals
    nxt = s.release_t0 + s.releases * 0.1       # ... and the next release is 0.5 to 1.5 intervals away, not a burst
    assert 0.05 - 0.02 <= nxt - now <= 0.15 + 0.02


def test_unpaced_stream_never_waits():
    assert asyncio.run(state(None).pace()) is None


def test_place_on_timeline_counts_steps_and_assumes_a_conservative_delay():
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft", extra_delay=1)
    s = state(0.16, tl)

    def release(at: float) -> InFlight:
        f = InFlight(at, at, None, 1.0, 0.0)
        spec = s.place_on_timeline(f, at)
        assert spec is not None and (spec.mode, spec.d, spec.shift) == ("soft", f.delay_steps, f.shift)
        return f

    first = release(10.0)
    assert (first.first_step, first.shift, first.delay_steps) == (0, 0, 1)   # no delay measured yet: the extra
    s.delays += [0.030, 0.031, 0.029, 0.030, 0.090]   # a spike among 30 ms delays: the estimate keeps it
    second = release(10.16)
    assert (second.first_step, second.shift) == (8, 8)
    assert second.delay_steps == 7                # ceil(0.090 s * 50) = 5 rows due, + the switch row, + 1 extra
    s.delays = [0.5] * 20                         # far beyond what the chunk can hand off: d <= min(s, H - s)
    assert release(10.32).delay_steps == 8
    s.delays = [0.01] * 20                        # the spike is forgotten once the window moves on
    assert release(10.48).delay_steps == 3


def test_until_a_few_delays_are_known_the_handoff_assumes_the_largest_it_can_honour():
    """Was: chunk 3 assumed the largest of chunks 0-2's delays (2 steps), came 3 steps late and took over past
    its frozen rows (physis-bench handoff, seam 0.11 rad; make demo: 0.24-0.26 rad in a robot's first
    second). Until delay_warmup delays are known, d is min(s, H - s); the first chunk hands off from
    nothing."""
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    s = state(0.12, tl)
    placed = []
    for c in range(8):
        f = InFlight(10.0 + 0.12 * c, 10.0 + 0.12 * c, None, 1.0, 0.0)
        s.place_on_timeline(f, f.enqueue)
        placed.append(f.delay_steps)
        s.timeline_done(f, f.enqueue + 0.030)               # 1.5 steps after row 0
    assert placed == [0] + [8] * (tl.delay_warmup - 1) + [3, 3, 3]   # then ceil(1.5) + the switch row


def test_a_chunk_as_late_as_the_latest_in_the_window_takes_over_at_a_frozen_row():
    """Was: the delay was the window's 90th percentile. With 18 of 20 delays just under 2 steps (39 ms) and 2
    just over (41 ms), it froze 3 rows, and a chunk as late as those two (the robot switches at row
    ceil(2.05) = 3) took over at an unfrozen row: 11 of 120 chunks in physis-bench handoff, seams up to
    0.09 rad where every one could have been 0."""
    from physis_ros.timeline import first_due_row
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    s = state(0.12, tl)
    s.delays = [0.039] * 9 + [0.041] + [0.039] * 9 + [0.041]
    f = InFlight(10.0, 10.0, None, 1.0, 0.0)
    s.place_on_timeline(f, 10.0)
    k = first_due_row(10.0, 0.02, 10.0 + 0.041, 16)
    assert k == 3 and k < f.delay_steps == 4


def test_delay_is_counted_from_row_0_so_a_chunk_as_late_as_before_takes_over_at_a_frozen_row():
    """Released every 128 ms at 50 Hz, chunk 1 is released 6.4 steps in but its row 0 is step 6, due 8 ms
    before the release. It leaves 34 ms after its release: 2.1 steps after row 0, so a robot then is at row
    3. A delay taken from the release (1.7 steps) made the next chunk freeze 3 rows, and the robot switched
    to it at its unfrozen row 3 although that chunk was no later than this one."""
    from physis_ros.timeline import first_due_row
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    s = state(0.128, tl)
    s.delays = [0.030] * (tl.delay_warmup - 1)                   # past the warm-up (test above)
    chunks = [InFlight(t, t, None, 1.0, 0.0) for t in (10.0, 10.128, 10.256)]
    for f in chunks[:2]:
        s.place_on_timeline(f, f.enqueue)
    step0 = s.timeline_done(chunks[1], 10.128 + 0.034)
    assert chunks[1].first_step == 6 and step0 == pytest.approx(10.12)
    s.place_on_timeline(chunks[2], chunks[2].enqueue)            # first step 13, row 0 due at 10.26
    nxt, step0_next = chunks[2], 10.0 + 13 / 50.0
    k = first_due_row(step0_next, 0.02, step0_next + (10.162 - 10.12), 16)   # just as late as chunk 1
    assert k == 3 and k < nxt.delay_steps == 4                               # the robot switches at a frozen row


def test_the_senders_lead_counts_in_the_delay():
    """The node drops rows due within trajectory_min_lead_s of the clock read that places a chunk: that much
    later is when the robot takes it over, so the delay the next chunk freezes rows for counts it."""
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", lead_s=0.004)
    s = state(0.12, tl)
    s.delays = [0.010] * (tl.delay_warmup - 1)  # past the warm-up
    first, second = InFlight(10.0, 10.0, None, 1.0, 0.0), InFlight(10.12, 10.12, None, 1.0, 0.0)
    s.place_on_timeline(first, 10.0)
    s.timeline_done(first, 10.0 + 0.038)        # 1.9 steps after row 0; with the lead 2.1
    s.place_on_timeline(second, 10.12)
    assert second.delay_steps == 4              # ceil(2.1) + the switch row (1.9 alone: 3)


def test_no_handoff_spec_without_a_mode_but_still_on_the_timeline():
    s = state(0.1, Timeline(50.0, 16, 8))
    f = InFlight(5.0, 5.0, None, 1.0, 0.0)
    assert s.place_on_timeline(f, 5.0) is None
    f2 = InFlight(5.1, 5.1, None, 1.0, 0.0)
    assert s.place_on_timeline(f2, 5.1) is None and (f2.first_step, f2.shift) == (5, 5)


def test_edf_deadline_keeps_the_published_interval():
    """A chunk released after its predecessor left is due one SLO interval after that one left (a stream
    whose last chunk left early has less slack, so it runs first on a shared worker); while the predecessor
    is still in flight, one SLO interval from its own release; never later than that."""
    s = StreamState("r", None, None, lambda c: None, None, None, 100.0, asyncio.Semaphore(1))
    assert s.slack_s(0, 10.0) == 0.1                 # nothing has left yet
    s.last_emit, s.next_emit = 10.0, 5               # chunk 4 left at t = 10 s
    assert math.isclose(s.slack_s(5, 10.03), 0.07)   # released 30 ms later: 70 ms left of the interval
    assert math.isclose(s.slack_s(5, 10.12), -0.02)  # released late: already behind, most urgent
    assert s.slack_s(6, 10.03) == 0.1                # chunk 5 still in flight: from its own release
    s.last_emit = 9.0
    assert s.slack_s(5, 9.0 - 0.05) == 0.1           # never more than one interval
    assert StreamState("u", None, None, lambda c: None, None, None, None, asyncio.Semaphore(1)).slack_s(0, 1.0) == 1.0
