"""/diagnostics statuses from snapshots (no ROS graph needed): levels, windowed rates that decay,
hardware ids, and no STALE from the node itself. The verdicts are the serving core's
(physis_ros.serving.health); they are checked here as the node publishes them (ros.diagnostics.to_msg)."""

import math
import time

import pytest
from diagnostic_msgs.msg import DiagnosticStatus

from physis_ros.ros.diagnostics import to_msg
from physis_ros.serving import health
from physis_ros.telemetry import ChunkRecord, RollingStats, window_stats

from rosprobe import registered_session, served_stream



def published(verdict):
    """A verdict of physis_ros.serving.health as the node publishes it."""
    return lambda *args, **kw: to_msg(verdict(*args, **kw))


class diag:   # noqa: N801 (the verdicts as messages)
    stream_status = staticmethod(published(health.stream_status))
    worker_status = staticmethod(published(health.worker_status))
    engine_status = staticmethod(published(health.engine_status))
    hardware_id = staticmethod(health.hardware_id)
    stream_hardware_id = staticmethod(health.stream_hardware_id)
    inputs_summary = staticmethod(health.inputs_summary)


OK, WARN, ERROR, STALE = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR, DiagnosticStatus.STALE
INPUTS = {"received": {"images": 60, "joints": 60}, "rejected": {"encoding": 2, "queue_full": 1},
          "used": 50, "queued": 0}


def values(status):
    return {kv.key: kv.value for kv in status.values}


def records(n: int, interval_s: float, end: float, miss_every: int = 0, latency_s: float = 0.05) -> list:
    """``n`` chunks ``interval_s`` apart, the last emitted at ``end``."""
    out = []
    for c in range(n):
        emit = end - (n - 1 - c) * interval_s
        miss = bool(miss_every) and c % miss_every == 0
        out.append(ChunkRecord("r0", c, emit - latency_s, emit - latency_s / 2, emit,
                               interval_s * 1e3 if c else math.nan, [1.0], 0.0, [], [1], deadline_miss=miss))
    return out


def status(stats, inputs=INPUTS, **kw):
    args = dict(slo_interval_ms=100.0, new_rejects=0, engine_state="serving", idle_s=None, armed=True,
                hardware_id="host:cpu", miss_rate_warn=0.05, starved_s=2.0, since_s=60.0)
    args.update(kw)
    return diag.stream_status("r0", stats, inputs, **args)


def test_stalled_stream_decays_to_error_instead_of_staying_ok_forever():
    """The defect: rates over the last 200 chunks never decay, so a stream that stopped 10 s ago
    still read 'OK 22.0 chunks/s'. Over a time window the rate falls to 0 and the verdict is ERROR."""
    now = 1000.0
    recs = records(300, 1 / 22, end=now - 10.0)
    stats = window_stats(recs, now, window_s=5.0, slo_interval_ms=100.0)
    assert stats["chunks_per_s"] == 0.0 and stats["chunks_window"] == 0
    assert stats["last_chunk_age_s"] == 10.0 and stats["total"] == 300
    s = status(stats)
    assert s.level == ERROR and "no chunk for 10.0 s" in s.message, s.message
    # The same stream while it is live: OK at its real rate.
    live = window_stats(records(300, 1 / 22, end=now - 0.01), now, window_s=5.0, slo_interval_ms=100.0)
    assert abs(live["chunks_per_s"] - 22.0) < 0.5
    ok = status(live)
    assert ok.level == OK and "22.0 chunks/s" in ok.message, ok.message


def test_rate_is_honest_when_the_window_is_not_yet_full_and_when_the_deque_truncates():
    now = 50.0
    young = window_stats(records(11, 0.1, end=now), now, window_s=5.0)  # 1 s of history
    assert abs(young["chunks_per_s"] - 10.0) < 0.2
    rs = RollingStats(20)  # keeps only 20 records: less than the window at 10 chunks/s
    for r in records(100, 0.1, end=now):
        rs.add(r)
    capped = window_stats(list(rs.records), now, window_s=5.0, total=rs.total)
    assert abs(capped["chunks_per_s"] - 10.0) < 0.2 and capped["total"] == 100


def test_no_chunk_for_two_intervals_is_error_and_the_threshold_follows_the_stream():
    now = 100.0
    # SLO 100 ms, running at it: 0.15 s without a chunk is fine, 0.25 s is not.
    assert status(window_stats(records(50, 0.1, end=now - 0.15), now, 5.0, 100.0)).level == OK
    late = status(window_stats(records(50, 0.1, end=now - 0.3), now, 5.0, 100.0))
    assert late.level == ERROR and "no chunk for 0.3 s" in late.message, late.message
    # No SLO: two of its own (median) intervals.
    assert status(window_stats(records(50, 0.2, end=now - 0.3), now, 5.0), slo_interval_ms=None).level == OK
    assert status(window_stats(records(50, 0.2, end=now - 0.5), now, 5.0),
                  slo_interval_ms=None).level == ERROR
    # Never produced a chunk: ERROR once the stream has served longer than the starvation time.
    none = window_stats([], now, 5.0, 100.0)
    assert status(none, since_s=0.5).level == WARN
    nothing = status(none, since_s=3.0)
    assert nothing.level == ERROR and "no chunk" in nothing.message


def test_warn_on_p99_over_slo_and_on_miss_rate_in_the_window():
    now = 10.0
    slow = records(100, 0.1, end=now)
    slow[-2].interval_ms = 250.0  # one slow interval: p99 over the SLO, p50 fine
    s = status(window_stats(slow, now, 5.0, 100.0))
    assert s.level == WARN and "p99" in s.message, s.message
    missing = window_stats(records(100, 0.09, end=now, miss_every=10), now, 5.0, 100.0)
    assert abs(missing["deadline_miss_rate"] - 0.1) < 0.03
    s = status(missing)
    assert s.level == WARN and "deadline miss" in s.message, s.message
    assert status(missing, miss_rate_warn=0.5).level == OK
    # Misses long gone from the window no longer count.
    old = records(100, 0.09, end=now - 20, miss_every=2) + records(60, 0.09, end=now)
    assert window_stats(old, now, 5.0, 100.0)["deadline_miss_rate"] == 0.0


def test_starved_failed_rejects_and_engine_states():
    now = 10.0
    stats = window_stats(records(100, 0.1, end=now), now, 5.0, 100.0)
    s = status(stats)
    assert s.level == OK and s.name == "physis_server: r0" and s.hardware_id == "host:cpu"
    v = values(s)
    assert v["rejected.encoding"] == "2" and v["rejected_total"] == "3" and v["dropped_total"] == "1"
    assert v["slo_rate_hz"] == "10.000" and v["armed"] == "True"
    assert status(stats, new_rejects=2).level == WARN
    starved = status(stats, idle_s=3.0)
    assert starved.level == ERROR and "no fresh observation for 3.0 s" in starved.message
    assert status(stats, idle_s=0.5).level == OK
    inputs = {**INPUTS, "failed": "worker w1 lost"}
    f = diag.stream_status("r0", stats, inputs, slo_interval_ms=100.0, new_rejects=0, engine_state="serving",
                           idle_s=None)
    assert f.level == ERROR and "worker w1 lost" in f.message
    # Before the engine serves: WARN "starting", never STALE (that is the aggregator's word).
    for state in ("starting", "unconfigured", "stopping", "stopped"):
        s = status(window_stats([], now, 5.0), engine_state=state)
        assert s.level == WARN and state in s.message and s.level != STALE
    disarmed = status(stats, armed=False)
    assert values(disarmed)["armed"] == "False" and "disarmed" in disarmed.message


def test_worker_and_engine_status():
    now = time.monotonic()
    ok = diag.worker_status("w0", 12, now, {"tasks": 5}, 1.0, True, hardware_id="myhost:cpu")
    assert ok.level == OK and ok.hardware_id == "myhost:cpu"
    assert diag.worker_status("w0", 12, now - 5, {}, 1.0, True).level == ERROR
    assert diag.worker_status("w0", 12, now, {}, 1.0, False).level == ERROR
    serving = diag.engine_status("serving", "tiny-wam", "stage", 2, None, hardware_id="myhost")
    assert serving.level == OK and serving.message == "serving" and serving.hardware_id == "myhost"
    assert values(serving)["armed"] == "True"
    failed = diag.engine_status("failed", "tiny-wam", "stage", 2, "worker w1 exited")
    assert failed.level == ERROR and failed.message == "worker w1 exited"
    down = diag.engine_status("serving", "tiny-wam", "stage", 2, None, workers_down=["w1"])
    assert down.level == ERROR and "w1" in down.message and values(down)["workers_down"] == "w1"
    disarmed = diag.engine_status("serving", "tiny-wam", "stage", 2, None, armed=False)
    assert disarmed.level == WARN and "disarmed" in disarmed.message and values(disarmed)["armed"] == "False"
    for state in ("starting", "unconfigured"):
        s = diag.engine_status(state, "m", "stage", 2, None)
        assert s.level == WARN and values(s)["state"] == state
    assert not math.isnan(float(values(diag.worker_status("w0", 1, now, {}, 1.0, True))["heartbeat_age_s"]))


def test_hardware_ids():
    assert diag.hardware_id("myhost", "cpu") == "myhost:cpu"
    assert diag.hardware_id("myhost", "cuda:0") == "myhost:cuda:0"
    assert diag.stream_hardware_id("myhost", ["myhost:cuda:1", "myhost:cuda:0", "myhost:cuda:0"]) == \
        "myhost:cuda:0,myhost:cuda:1"
    assert diag.stream_hardware_id("myhost", []) == "myhost"


def test_timeline_metrics_and_late_chunks_reach_diagnostics():
    """A chunk that arrived after its last step was due was not sent to the robot: WARN, counted; the
    delay, late points, seam jumps and tracking error are reported as values."""
    now = 200.0
    recs = records(40, 0.1, end=now)
    for i, r in enumerate(recs):
        r.delay_steps, r.late_points = 3, 3
        r.seam_position_jump, r.seam_velocity_jump, r.tracking_error = 0.01 * (i % 5), 0.2, 0.05
        r.seam_blended_rows = 3 if i % 10 == 4 else 0
    stats = window_stats(recs, now, 5.0, 100.0)
    ok = status(stats, inputs={**INPUTS, "blended_chunks": 9})
    v = values(ok)
    assert ok.level == OK, ok.message
    assert v["inference_delay_steps"] == "3" and v["late_points_window"] == "120" and v["late_chunks_window"] == "0"
    assert v["seam_blended_chunks_window"] == "4" and v["seam_blended_chunks_total"] == "9"
    assert float(v["seam_jump_p99"]) > 0.039 and float(v["tracking_error_p50"]) == 0.05
    recs[-2].late = True
    late = status(window_stats(recs, now, 5.0, 100.0))
    assert late.level == WARN and "1 chunk(s)" in late.message and "not sent" in late.message, late.message
    assert values(late)["late_chunks_window"] == "1"



@pytest.mark.slow
def test_a_reset_stream_is_error_until_it_publishes_again_and_its_resets_by_cause_are_reported():
    """Bug found: the node cleared a stream's failure when the engine re-admitted it, so /diagnostics could
    say OK before the stream published again (the requirement: ERROR until it publishes again); and the
    engine's resets by cause reached neither /diagnostics nor the ``--summary-json`` totals."""
    import numpy as np

    from physis_ros.ros import diagnostics
    from physis_ros.ros.conversions import time_msg
    from physis_ros.runtime.streams import ChunkOutput, StreamEvent

    with served_stream() as (node, name, st):
        def verdict():
            s = next(s for s in map(to_msg, diagnostics.statuses(node)) if s.name == f"{node.diag_prefix}: {name}")
            return s.level, s.message, values(s)

        node.server.on_engine_event(StreamEvent(name, "failed", "chunk 3 lost (dropped_task)", 2, "task_lost"))
        level, msg, v = verdict()
        assert level == ERROR and "stream failed" in msg, msg
        assert v["resets.task_lost"] == "1" and v["failures_total"] == "1" and v["lost_chunks_total"] == "2"
        node.server.on_engine_event(StreamEvent(name, "readmitted", "placed again on w0"))
        level, msg, v = verdict()    # re-admitted, nothing published yet: still ERROR
        assert level == ERROR and "recovering" in msg and "task_lost" in msg, msg
        node.server.on_engine_event(StreamEvent(name, "failed", "chunk 9 past its bound", 1, "chunk_timeout"))
        node.server.on_engine_event(StreamEvent(name, "readmitted", "placed again on w0"))
        assert verdict()[0] == ERROR
        now = node.now()
        rec = records(1, 0.1, end=now)[0]
        rec.stream, rec.chunk = name, 12
        st.session.deliver(ChunkOutput(name, 12, np.zeros(st.model.output_shape, np.float32), rec, time_msg(now)))
        level, msg, v = verdict()    # it published again: no longer the reset's ERROR
        assert "recovering" not in msg and "failed" not in msg, msg
        assert v["resets.task_lost"] == "1" and v["resets.chunk_timeout"] == "1" and v["failures_total"] == "2"
        report = node.report()[name]  # what physis-serve --summary-json writes per stream
        assert report["resets"] == {"chunk_timeout": 1, "task_lost": 1} and report["failures"] == 2


@pytest.mark.slow
def test_a_chunk_that_cannot_be_published_is_counted_as_lost_with_the_reason():
    """Bug found: with trajectory_start_offset_s 1e308 (a parameter set without a range) every publish of the
    stream failed, 104 chunks in 13 s, while /diagnostics said lost_chunks_total 0. The range now refuses that
    value; whatever else stops a computed chunk on its way out is counted, with its reason."""
    import dataclasses

    import numpy as np

    from physis_ros.ros import diagnostics
    from physis_ros.ros.conversions import time_msg
    from physis_ros.runtime.streams import ChunkOutput

    with served_stream(armed=True) as (node, name, st):
        st.session.config = dataclasses.replace(st.config, trajectory_start_offset_s=1e308)   # (what the set let in)
        now = node.now()
        for i, rec in enumerate(records(3, 0.1, end=now)):
            rec.stream, rec.chunk = name, i
            st.session.deliver(ChunkOutput(name, i, np.zeros(st.model.output_shape, np.float32), rec, time_msg(now)))
        s = next(s for s in map(to_msg, diagnostics.statuses(node)) if s.name == f"{node.diag_prefix}: {name}")
        v = values(s)
        assert v["lost_chunks_total"] == "3" and v["unpublished_total"] == "3", v
        assert [k for k in v if k.startswith("unpublished.")], v
        assert node.report()[name]["lost_chunks"] == 3 and sum(node.report()[name]["unpublished"].values()) == 3


@pytest.mark.slow
def test_a_storm_of_resets_logs_one_line_per_cause_per_period(caplog):
    """Each reset and re-admission was logged: a fault storm (a worker dropping every task) was a log flood, and
    the node said each reset a second time beside the engine's line. The session says the re-admissions (any
    front end's), one line per ``warn_throttle_s``; the engine alone says the resets (its own throttle)."""
    import logging

    from physis_ros.runtime.streams import StreamEvent

    with served_stream() as (node, name, st), caplog.at_level(logging.INFO, logger="physis"):
        for i in range(50):
            node.server.on_engine_event(StreamEvent(name, "failed", f"chunk {i} lost", 1, "task_lost"))
            node.server.on_engine_event(StreamEvent(name, "readmitted", "placed again on w0"))
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if f"stream {name}" in r.getMessage()]
        assert lines == [("WARNING", lines[0][1])] and "re-admitted: placed again on w0" in lines[0][1], lines
        assert st.health.failures == 50 and st.health.resets == {"task_lost": 50}
        st.session.throttle.clock = lambda: 1e12   # a period later: the next line says how many were held back
        node.server.on_engine_event(StreamEvent(name, "readmitted", "placed again on w0"))
        assert "49 similar line(s) held back" in caplog.records[-1].getMessage(), caplog.records[-1].getMessage()


@pytest.mark.slow
def test_another_front_ends_stream_is_on_diagnostics_listed_and_removable_through_the_node():
    """The node serves beside other front ends on one server (an openpi client is a stream of its own): its
    /diagnostics judges that stream from the server's figures, ~/list_streams names it (no namespace: it has no
    topics) and ~/remove_stream removes it, its front end hearing it ended ``removed``."""
    from physis_ros.ros import diagnostics
    from physis_ros.srv import ListStreams, RemoveStream

    with served_stream() as (node, name, st):
        cfg = node.config.streams[name]
        registered_session(node, "client0", cfg, "openpi")
        events = []
        node.server.subscribe(events.append)
        names = [s.name for s in diagnostics.statuses(node)]
        assert f"{node.diag_prefix}: client0" in names and f"{node.diag_prefix}: {name}" in names, names
        listed = node.actions._list(ListStreams.Request(), ListStreams.Response())
        rows = dict(zip(listed.streams, zip(listed.origins, listed.namespaces)))
        assert rows == {name: ("config", st.namespace), "client0": ("openpi", "")}, rows
        done = node.actions._remove(RemoveStream.Request(stream="client0"), RemoveStream.Response())
        assert done.ok and "client0" not in node.server.streams() and name in node.server.streams(), done
        assert [(e.stream, e.kind, e.reason) for e in events] == [("client0", "ended", "removed")], events
        nobody = node.actions._remove(RemoveStream.Request(stream="client0"), RemoveStream.Response())
        assert not nobody.ok and "no stream 'client0' is served" in nobody.message


def test_a_streams_status_carries_what_admission_charges_it_beyond_its_bound():
    now = 100.0
    stats = window_stats(records(50, 0.08, end=now), now, window_s=5.0, slo_interval_ms=100.0)
    values = {kv.key: kv.value for kv in status(stats).values}
    assert values["admission_spread_ms"] == "none"                  # not measured yet
    values = {kv.key: kv.value for kv in status({**stats, "admission_spread_ms": 12.34567}).values}
    assert float(values["admission_spread_ms"]) == 12.346


def test_a_robot_publishing_slower_than_its_slo_is_warned_about_stale_inputs():
    """Issue 48 item 4: a robot publishing at 1 Hz was reported OK at 8.4 chunks/s while its chunks used
    observations about 1 s old. The age of the observation each chunk used (when the chunk started) is on
    /diagnostics, and past diagnostics_stale_intervals x the SLO interval (default one) the stream is WARN."""
    now = 100.0
    recs = records(80, 0.12, end=now)   # 8.3 chunks/s, SLO 120 ms
    fresh = window_stats(recs, now, 5.0, 120.0)
    assert fresh["observation_age_ms_p50"] == pytest.approx(25.0)
    assert status(fresh, slo_interval_ms=120.0).level == OK
    for r in recs:                      # the same chunks on a camera stamped once a second
        r.obs_stamp = math.floor(r.enqueue)
    stale = window_stats(recs, now, 5.0, 120.0)
    assert 400.0 < stale["observation_age_ms_p50"] < 600.0 and stale["observation_age_ms_p99"] > 900.0
    s = status(stale, slo_interval_ms=120.0)
    assert s.level == WARN and s.message.startswith("stale inputs:") and "chunks/s" in s.message, s.message
    assert float(values(s)["observation_age_ms_p50"]) == pytest.approx(stale["observation_age_ms_p50"], abs=1e-3)
    assert status(stale, slo_interval_ms=120.0, stale_intervals=10.0).level == OK   # a looser bound: OK again


def test_a_log_line_about_missing_inputs_says_what_arrived_and_why_it_was_rejected():
    """Issue 48 item 4: "joint states 0 received" was printed while 700 had arrived and been rejected."""
    inputs = {"received": {"images": 30}, "refused": {"joints": {"max_age": 700, "joint_names": 3}}}
    assert diag.inputs_summary(inputs) == ("images 30 accepted; joint states 0 accepted, 703 rejected "
                                           "(max_age 700, joint_names 3)")
    from physis_ros.serving.intake import StreamInput

    si = StreamInput()
    si.reject("max_age", "joints")
    si.reject("encoding", "images")
    si.reject("queue_full")
    snap = si.snapshot()
    assert snap["refused"] == {"joints": {"max_age": 1}, "images": {"encoding": 1}}
    assert snap["rejected"] == {"max_age": 1, "encoding": 1, "queue_full": 1}
    assert diag.inputs_summary(snap) == ("images 0 accepted, 1 rejected (encoding 1); joint states 0 accepted, "
                                         "1 rejected (max_age 1)")


def test_logs_name_the_model_as_configured():
    """Issue 48 item 4: the logs said tiny-wam for a stream configured with the bundled tiny-wam-demo."""
    from physis_ros.model.spec import load_model_config
    from physis_ros.serving.fit import model_label

    tiny = load_model_config("tiny-wam")
    assert model_label("tiny-wam-demo", tiny) == "tiny-wam-demo (tiny-wam)"
    assert model_label("tiny-wam", tiny) == "tiny-wam"
