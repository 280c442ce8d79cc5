"""A stream's schedule in the engine: pacing on its release grid (its observation taken the timeline's capture
lead ahead), staggering streams that share a worker, the hand-off it sends, edf deadlines. The timeline's own
arithmetic is tested in tests/test_timeline.py."""

import asyncio
import math
import time

import pytest

from physis_ros.runtime.streams import InFlight, StreamState, staggered_anchor
from physis_ros.timeline import ControlTimeline


def state(interval_s: float | None = None, timeline: ControlTimeline | None = None) -> StreamState:
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


def test_pace_takes_the_observation_its_capture_lead_ahead_and_places_the_chunk_at_its_slot(monkeypatch):
    s = state(0.16, ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft"))
    s.timeline.latencies = [0.030] * 5                                   # lead 0.8 step: 16 ms
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


def test_a_chunk_is_placed_on_the_stream_timeline_and_handed_off_as_the_stream_asks():
    """StreamState asks the stream's ControlTimeline (tests/test_timeline.py) and sends what it decided."""
    s = state(0.16, ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft", extra_delay=1))
    first, second = InFlight(10.0, 10.0, None, 1.0, 0.0), InFlight(10.16, 10.16, None, 1.0, 0.0)
    spec = s.place_on_timeline(first, 10.0)
    assert (spec.mode, spec.d, spec.shift) == ("soft", 1, 0) and first.slot.first_step == 0
    spec = s.place_on_timeline(second, 10.16)
    assert (spec.mode, spec.d, spec.shift) == ("soft", second.slot.delay_steps, 8) and second.slot.first_step == 8
    assert s.place_on_timeline(InFlight(1.0, 1.0, None, 1.0, 0.0), 1.0) is not None
    assert state(0.16).place_on_timeline(InFlight(1.0, 1.0, None, 1.0, 0.0), 1.0) is None     # no timeline


def test_no_handoff_spec_without_a_mode_but_still_on_the_timeline():
    s = state(0.1, ControlTimeline(50.0, 16, 8))
    f = InFlight(5.0, 5.0, None, 1.0, 0.0)
    assert s.place_on_timeline(f, 5.0) is None
    f2 = InFlight(5.1, 5.1, None, 1.0, 0.0)
    assert s.place_on_timeline(f2, 5.1) is None and (f2.slot.first_step, f2.slot.shift) == (5, 5)


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
