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
    s.latencies += [0.030, 0.031, 0.029, 0.030, 0.090]   # a spike among 30 ms delays: the estimate keeps it
    second = release(10.16)
    assert (second.first_step, second.shift) == (8, 8)
    assert second.delay_steps == 7                # ceil(0.090 s * 50) = 5 rows due, + the switch row, + 1 extra
    s.latencies = [0.5] * 20                         # far beyond what the chunk can hand off: d <= min(s, H - s)
    assert release(10.32).delay_steps == 8
    s.latencies = [0.01] * 20                        # the spike is forgotten once the window moves on
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
    s.latencies = [0.039] * 9 + [0.041] + [0.039] * 9 + [0.041]
    f = InFlight(10.0, 10.0, None, 1.0, 0.0)
    s.place_on_timeline(f, 10.0)
    k = first_due_row(10.0, 0.02, 10.0 + 0.041, 16)
    assert k == 3 and k < f.delay_steps == 4


def test_latency_is_counted_from_the_observation_and_row_0s_offset_added_back():
    """Released every 128 ms at 50 Hz, chunk 1 is released 6.4 steps in but its row 0 is step 6, due 8 ms
    before the release; chunk 2 is released 13 steps in minus 4 ms. Both take 34 ms from their observation.
    Was (before the delay was counted from row 0): a delay taken from the release (1.7 steps) as if from
    row 0 froze 3 rows of chunk 2 and the robot switched to it at its unfrozen row 3. Counted from the
    observation, with each chunk's own offset from its row 0 added back, the robot switches at a frozen row."""
    from physis_ros.timeline import first_due_row
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard")
    s = state(0.128, tl)
    s.latencies = [0.030] * (tl.delay_warmup - 1)                # past the warm-up (test above)
    chunks = [InFlight(t, t, None, 1.0, 0.0) for t in (10.0, 10.128, 10.256)]
    for f in chunks[:2]:
        s.place_on_timeline(f, f.enqueue)
    step0 = s.timeline_done(chunks[1], 10.128 + 0.034)
    assert chunks[1].first_step == 6 and step0 == pytest.approx(10.12)
    assert s.latencies[-1] == pytest.approx(0.034)
    nxt = chunks[2]
    s.place_on_timeline(nxt, nxt.enqueue)                       # first step 13, row 0 due at 10.26
    step0_next = 10.0 + 13 / 50.0
    k = first_due_row(step0_next, 0.02, nxt.enqueue + 0.034, 16)   # as long as chunk 1 took
    assert k < nxt.delay_steps                                     # the robot switches at a frozen row
    assert nxt.delay_steps - k == 1                                # and runs one of them, no more


def _switch_rows(margin: float | None, latencies_ms: list[float]) -> tuple[float, list[int]]:
    """A hard hand-off stream with ``latencies_ms`` in its window, released at its next slot less its capture
    lead: (the lead in steps, the frozen rows the robot runs for each of those latencies)."""
    from physis_ros.timeline import first_due_row
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", capture_margin=margin)
    s = state(0.16, tl)
    first = InFlight(10.0, 10.0, None, 1.0, 0.0)
    s.place_on_timeline(first, 10.0)
    s.latencies = [x / 1e3 for x in latencies_ms]
    lead = s.capture_lead_s()
    slot = 10.16
    f = InFlight(slot - lead, slot - lead, None, 1.0, 0.0)
    s.place_on_timeline(f, slot)
    assert f.first_step == 8                                    # its rows stay on the grid
    rows = [f.delay_steps - first_due_row(slot, 0.02, f.enqueue + x / 1e3, 16) for x in latencies_ms]
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
    from physis_ros.timeline import first_due_row
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", capture_margin=0.3)
    s = state(0.16, tl)
    s.place_on_timeline(InFlight(10.0, 10.0, None, 1.0, 0.0), 10.0)
    s.latencies = [0.030] * 5                                   # 1.5 steps: lead 0.8 step, d = 2
    lead, slot = s.capture_lead_s(), 10.16
    f = InFlight(slot - lead, slot - lead, None, 1.0, 0.0)
    s.place_on_timeline(f, slot)
    assert lead * 50 == pytest.approx(0.8) and f.delay_steps == 2
    assert first_due_row(slot, 0.02, f.enqueue + 0.0359, 16) == 1     # 1.79 steps: row 1, frozen
    assert first_due_row(slot, 0.02, f.enqueue + 0.0361, 16) == 2     # 1.81 steps: past the frozen rows


@pytest.mark.parametrize("handoff, latencies", [("none", [0.03] * 5), ("hard", [0.03] * 4)])
def test_no_capture_lead_without_a_handoff_or_a_known_latency(handoff, latencies):
    """Without a hand-off nothing is frozen: the robot takes a chunk when it lands, and an observation taken
    early would only be older. Before the warm-up the latency is not known."""
    s = state(0.16, Timeline(rate_hz=50.0, horizon=16, execution=8, handoff=handoff))
    s.latencies = latencies
    assert s.capture_lead_s() == 0.0


def test_pace_takes_the_observation_its_capture_lead_ahead_and_places_the_chunk_at_its_slot(monkeypatch):
    s = state(0.16, Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft"))
    s.latencies = [0.030] * 5                                   # lead 0.8 step: 16 ms
    s.release_t0, s.releases = time.monotonic() + 0.05, 1       # the next slot is 210 ms away
    wake_at = []                                                # when pace asks to wake (how late the host
                                                                # wakes it is not the schedule's doing)

    async def sleep(delay):
        wake_at.append(time.monotonic() + delay)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    due = asyncio.run(s.pace())
    woke = time.monotonic()
    assert due == pytest.approx(s.release_t0 + 0.16)
    assert len(wake_at) == 1 and due - wake_at[0] == pytest.approx(0.016, abs=0.001)   # ahead of the slot by the lead
    s.release_due[3] = s.released(due)
    assert s.release_due[3] == due                              # early is not late: the schedule is kept
    assert s.scheduled(3, 100.0) == pytest.approx(100.0 + (due - woke), abs=0.002)   # the slot, engine clock


def test_the_senders_lead_counts_in_the_delay():
    """The node drops rows due within trajectory_min_lead_s of the clock read that places a chunk: that much
    later is when the robot takes it over, so the delay the next chunk freezes rows for counts it."""
    tl = Timeline(rate_hz=50.0, horizon=16, execution=8, handoff="hard", lead_s=0.004)
    s = state(0.12, tl)
    s.latencies = [0.010] * (tl.delay_warmup - 1)  # past the warm-up
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


def test_the_delay_quantile_matches_numpy_without_its_first_call_cost():
    """The estimate runs on a release's path; np.percentile's first call imports numpy.ma (13 ms), which made
    the first chunk after the warm-up 9-12 ms late. Its own interpolation gives np.percentile's values."""
    import numpy as np

    from physis_ros.runtime.streams import _quantile
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 20):
        xs = list(rng.random(n))
        for q in (0.0, 10.0, 50.0, 90.0, 95.0, 99.0, 100.0, 37.3):
            assert _quantile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)
