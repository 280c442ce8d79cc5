"""The engine's pure chunk scheduler (physis_ros.runtime.chunk_scheduler) under a fake clock, against schedules
computed by hand: releases on a stream's pace (its observation taken the timeline's capture lead ahead, a late
release keeping its phase), credits per plan with time-sharing on and off, streams staggered or batched on a
shared worker, outputs handed out in order (through the jitter buffer), bounds, resets, a worker fault and a
leave mid-chunk. No sockets, threads or sleeps: every time is given. The timeline's own arithmetic is tested
in tests/test_timeline.py; the engine that drives this with real workers in tests/runtime/test_engine.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from physis_ros.model import load_model_config
from physis_ros.runtime.chunk_scheduler import ChunkScheduler
from physis_ros.runtime.plans import make_plan
from physis_ros.runtime.settings import EngineConfig
from physis_ros.runtime.streams import ChunkOutput, InFlight, ServedModel, StreamState, staggered_anchor
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ControlTimeline

WAM = load_model_config("tiny-wam")        # 4 steps x 8 blocks
MODEL = ServedModel(WAM)


def plan(name: str = "sequential", workers: int = 1):
    return make_plan(name, WAM.steps, WAM.blocks, workers)


def scheduler(**engine) -> ChunkScheduler:
    return ChunkScheduler(EngineConfig(**{"workers": 2, "warmup_grace_s": 0.0, "chunk_timeout_floor_s": 1.0,
                                          "chunk_timeout_factor": 3.0, **engine}))


def stream(sched: ChunkScheduler, name: str = "r", *, now: float = 100.0, interval_ms: float | None = None,
           phase_ms: float | None = None, workers: int = 1, plan_name: str = "sequential", chunks=None,
           slo_ms: float | None = None, timeline: ControlTimeline | None = None, emit_delay_ms=None,
           model: ServedModel = MODEL) -> StreamState:
    s = StreamState(name, model, plan(plan_name, workers), chunks, slo_ms, timeline=timeline)
    return sched.add(s, now, interval_ms, emit_delay_ms, phase_ms, phase_epoch=0.0)


def output(s: StreamState, chunk: int, emit: float) -> ChunkOutput:
    f = s.inflight[chunk]
    record = ChunkRecord.from_trace(s.name, chunk, f.obs_stamp, f.enqueue, emit, [], [])
    return ChunkOutput(s.name, chunk, np.zeros(WAM.output_shape, np.float32), record, f.tag)


def test_a_paced_stream_releases_on_its_grid_at_the_phase_admission_booked():
    sched = scheduler()
    s = stream(sched, interval_ms=100.0, phase_ms=30.0, now=100.01)
    assert s.release_t0 == pytest.approx(100.03)                  # the first slot of phase 30 ms from now
    at = [sched.release_at(s, 100.01)]
    sched.release(s, 100.03, 5.0, 4.99)
    at.append(sched.release_at(s, 100.04))
    sched.release(s, 100.13, 5.1, 5.09)
    assert at == pytest.approx([100.03, 100.13])
    assert sched.release_at(s, 100.14) == pytest.approx(100.23)
    assert sorted(s.inflight) == [0, 1] and s.release_due == pytest.approx({0: 100.03, 1: 100.13})
    unpaced = stream(sched, "u")
    assert sched.release_at(unpaced, 100.0) is None               # released as soon as a credit allows


def test_a_late_release_keeps_the_phase_and_does_not_catch_up_in_a_burst():
    sched = scheduler()
    s = stream(sched, interval_ms=100.0, phase_ms=0.0, now=100.0)
    sched.release(s, 100.0, 0.0, 0.0)
    sched.take(s, output(s, 0, 0.05), 100.05)
    sched.release(s, 100.53, 0.53, 0.53)          # chunk 1 was due at 100.1: 4.3 intervals late (a silent camera)
    assert s.release_due[1] == pytest.approx(100.53)               # the slot it left the schedule at: now
    nxt = sched.release_at(s, 100.53)
    assert nxt == pytest.approx(100.6)                             # the same phase, 0.5-1.5 intervals on
    assert (s.release_t0 - 100.0) / 0.1 == pytest.approx(round((s.release_t0 - 100.0) / 0.1))


def test_the_observation_is_taken_the_capture_lead_ahead_and_the_chunk_placed_at_its_slot():
    sched = scheduler()
    tl = ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft")
    s = stream(sched, interval_ms=160.0, phase_ms=0.0, now=100.0, timeline=tl)
    sched.release(s, 100.0, 10.0, 10.0)
    tl.latencies = [0.030] * 5                                     # measured: a lead of 0.8 step, 16 ms
    assert sched.release_at(s, 100.01) == pytest.approx(100.16 - 0.016)
    r = sched.release(s, 100.144, 10.144, 10.144)                  # taken 16 ms ahead of its slot ...
    assert s.release_due[1] == pytest.approx(100.16)               # ... early is not late: the grid holds
    assert s.inflight[1].slot.first_step == 8 and r.handoff.mode == "soft" and r.handoff.shift == 8


def test_credits_follow_the_plan_with_time_sharing_on_and_off():
    """A stream keeps one chunk per worker it uses plus one in flight; with batching, as many as the steps a
    worker hosts of one block (at most max_batch) per worker, plus one: the block plan puts all 4 steps of a
    block on one worker (4 + 4 + 1), the step plan 2 (2 + 2 + 1)."""
    for batching, workers, plan_name, limit in (("off", 1, "sequential", 2), ("off", 2, "step", 3),
                                                 ("on", 1, "sequential", 5), ("on", 2, "step", 5),
                                                 ("on", 2, "block", 9)):
        sched = scheduler(batching=batching, max_batch=4)
        s = stream(sched, workers=workers, plan_name=plan_name)
        assert sched.in_flight_limit(s.plan) == limit, (batching, plan_name)
        for c in range(limit):
            assert sched.may_release(s)
            sched.release(s, 100.0 + c * 0.01, 0.0, 0.0)
        assert not sched.may_release(s)                            # no credit: the feeder waits
        sched.take(s, output(s, 0, 1.0), 101.0)
        assert sched.may_release(s)                                # a chunk out: a credit back
    sched = scheduler()
    finite = stream(sched, "f", chunks=1)
    sched.release(finite, 100.0, 0.0, 0.0)
    assert sched.finished(finite) and not sched.may_release(finite)


def test_streams_on_one_worker_are_staggered_unless_they_batch():
    for batching in ("off", "on"):
        sched = scheduler(batching=batching, workers=1)
        a = stream(sched, "a", interval_ms=200.0, now=100.0)
        b = stream(sched, "b", interval_ms=200.0, now=100.0)
        d = ((b.release_t0 - a.release_t0) / 0.2) % 1.0
        if batching == "off":
            assert min(d, 1 - d) > 0.3                             # apart: they would queue behind each other
        else:
            assert min(d, 1 - d) < 1e-9                            # together: one batched forward
    assert staggered_anchor(100.0, 0.16, []) is None
    assert (staggered_anchor(100.0, 0.16, [(100.0, 0.16)]) - 100.0) % 0.16 == pytest.approx(0.08)


def test_outputs_leave_in_chunk_order_with_their_intervals_and_misses():
    sched = scheduler()
    s = stream(sched, slo_ms=100.0, workers=2, plan_name="step")
    for c in range(3):
        sched.release(s, 100.0 + c * 0.05, c * 0.05, c * 0.05)
    sched.take(s, output(s, 1, 0.20), 100.20)
    assert sched.emit(s, 100.2, 0.2) == ([], None)                 # chunk 0 is not out yet: 1 waits
    sched.take(s, output(s, 0, 0.21), 100.21)
    out, wait = sched.emit(s, 100.21, 0.22)
    assert [o.chunk for o in out] == [0, 1] and wait is None
    assert [o.record.emit for o in out] == [0.21, 0.22]            # 1 waited for 0: it left after it
    sched.take(s, output(s, 2, 0.30), 100.30)
    (third,), _ = sched.emit(s, 100.30, 0.30)
    assert third.record.interval_ms == pytest.approx(80.0) and not third.record.deadline_miss
    sched.release(s, 100.4, 0.4, 0.4)
    sched.take(s, output(s, 3, 0.48), 100.48)
    (fourth,), _ = sched.emit(s, 100.48, 0.48)
    assert fourth.record.interval_ms == pytest.approx(180.0) and fourth.record.deadline_miss   # SLO 100 ms
    assert out[1].record.interval_ms == pytest.approx(10.0) and not out[1].record.deadline_miss


def test_the_jitter_buffer_holds_a_chunk_until_its_release_plus_the_delay():
    sched = scheduler()
    s = stream(sched, interval_ms=100.0, phase_ms=0.0, now=100.0, emit_delay_ms=50.0)
    sched.release(s, 100.0, 0.0, 0.0)
    sched.take(s, output(s, 0, 0.02), 100.02)
    out, wait = sched.emit(s, 100.02, 0.02)
    assert out == [] and wait == pytest.approx(0.03)
    (chunk,), wait = sched.emit(s, 100.05, 0.05)
    assert wait is None and chunk.record.emit == 0.05              # stamped when it left


def test_a_chunk_past_its_bound_is_overdue_and_a_reset_starts_a_new_epoch_whose_old_outputs_are_stale():
    sched = scheduler()
    s = stream(sched, slo_ms=100.0, workers=2, plan_name="step")
    assert sched.chunk_bound_s(s) == pytest.approx(max(1.0, 3.0 * 3 * 0.1))
    sched.release(s, 100.0, 0.0, 0.0)
    sched.release(s, 100.1, 0.1, 0.1)
    assert sched.overdue(100.9) == [] and sched.overdue(101.01) == [(s, 0)]
    sched.extend(s, 0, 101.01)                                     # flooded sockets: one more bound
    assert sched.overdue(101.5) == []
    assert sched.reset(s, "chunk 0 did not come out", "chunk_timeout") == 2
    assert (s.epoch, s.lost_chunks, s.next_emit, s.failed) == (1, 2, 2, "chunk 0 did not come out")
    assert sched.reset(s, "again", "worker_lost") is None and s.resets == {"chunk_timeout": 1, "worker_lost": 1}
    assert sched.owner("r", 0, 1) is None                          # the old incarnation's output: stale
    assert not sched.may_release(s)
    sched.readmitted(s)
    r = sched.release(s, 102.0, 2.0, 2.0)
    assert (r.chunk, r.epoch) == (2, 1) and sched.owner("r", 1, 2) is s


def test_a_worker_fault_resets_the_streams_on_it_and_a_lost_worker_fails_them_for_good():
    sched = scheduler()
    a = stream(sched, "a", workers=2, plan_name="step")            # w0 and w1
    b = stream(sched, "b")                                         # w0 only
    assert [x.name for x in sched.streams_on(1)] == ["a"] and [x.name for x in sched.streams_on(0)] == ["a", "b"]
    sched.release(a, 100.0, 0.0, 0.0)
    for x in sched.streams_on(1):
        sched.reset(x, "w1 died", "worker_lost")
    assert a.failed == "w1 died" and a.lost_chunks == 1 and b.failed is None
    sched.fail(a, "w1 cannot come back")
    assert sched.done(a) and not sched.done(b)


def test_a_stream_that_leaves_mid_chunk_takes_nothing_more():
    sched = scheduler()
    s = stream(sched)
    r = sched.release(s, 100.0, 0.0, 0.0)
    assert sched.remove("r") is s
    assert sched.owner("r", r.epoch, r.chunk) is None              # its output, when it comes, is stale
    stream(sched)                                                  # the name is free again
    with pytest.raises(ValueError, match="already exists"):
        stream(sched)


def test_edf_slack_keeps_the_published_interval():
    """A chunk released after its predecessor left is due one SLO interval after that one left; while the
    predecessor is in flight, one SLO interval from its own release; never later than that."""
    s = StreamState("r", MODEL, plan(), None, 100.0)
    assert s.slack_s(0, 10.0) == 0.1
    s.last_emit, s.next_emit = 10.0, 5
    assert math.isclose(s.slack_s(5, 10.03), 0.07)
    assert math.isclose(s.slack_s(5, 10.12), -0.02)
    assert s.slack_s(6, 10.03) == 0.1
    assert StreamState("u", MODEL, plan(), None, None).slack_s(0, 1.0) == 1.0


def test_a_chunk_is_handed_off_as_the_stream_asks():
    s = StreamState("r", MODEL, plan(), None, None,
                    timeline=ControlTimeline(rate_hz=50.0, horizon=16, execution=8, handoff="soft", extra_delay=1))
    first, second = InFlight(10.0, 10.0, None, 1.0, 0.0), InFlight(10.16, 10.16, None, 1.0, 0.0)
    spec = s.place_on_timeline(first, 10.0)
    assert (spec.mode, spec.d, spec.shift) == ("soft", 1, 0) and first.slot.first_step == 0
    spec = s.place_on_timeline(second, 10.16)
    assert (spec.mode, spec.d, spec.shift) == ("soft", second.slot.delay_steps, 8) and second.slot.first_step == 8
    plain = StreamState("p", MODEL, plan(), None, None, timeline=ControlTimeline(50.0, 16, 8))
    f = InFlight(5.0, 5.0, None, 1.0, 0.0)
    assert plain.place_on_timeline(f, 5.0) is None and f.slot.first_step == 0
    assert StreamState("n", MODEL, plan(), None, None).place_on_timeline(f, 5.0) is None


def test_what_cannot_be_served_is_refused_before_anything_changes():
    sched = scheduler(workers=1, max_streams=1)
    with pytest.raises(ValueError, match="only 1 exist"):
        stream(sched, workers=2, plan_name="step")
    with pytest.raises(ValueError, match="does not fit model"):
        stream(sched, model=ServedModel(dataclasses.replace(WAM, name="short", steps=2)))
    stream(sched, "a")
    with pytest.raises(ValueError, match="max_streams=1"):
        stream(sched, "b")
    assert list(sched.streams) == ["a"]
