"""physis-report's control half: the executed command rebuilt from chunks on the control timeline, its
jerk and tracking error against the expert, and the report written from a bag that holds them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rclpy.serialization import serialize_message

from physis_ros.bags.bagio import BagWriter
from physis_ros.bags.control_report import executed
from physis_ros.msg import ActionChunk, ChunkTelemetry

H, DOF, PERIOD = 16, 2, 0.02


def chunk_msg(index: int, first_step: int, rows: np.ndarray, stamp_ns: int, late_points: int = 0,
              late: bool = False, stream: str = "robot0") -> ActionChunk:
    m = ActionChunk()
    m.header.stamp.sec, m.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
    m.stream, m.chunk_index, m.control_period = stream, index, PERIOD
    m.joint_names = ["a", "b"]
    m.horizon, m.dof = rows.shape
    m.actions = rows.astype(np.float32).ravel().tolist()
    m.first_step, m.late_points, m.late = first_step, late_points, late
    return m


def rows_from(first_step: int, offset: float = 0.0) -> np.ndarray:
    steps = np.arange(first_step, first_step + H, dtype=np.float64)
    return np.stack([steps + offset, -steps], axis=1)


def test_each_chunk_runs_from_its_first_row_not_yet_due_until_the_next_takes_over():
    a = chunk_msg(0, 0, rows_from(0), 1)
    b = chunk_msg(1, 8, rows_from(8, offset=100.0), 2, late_points=3)     # takes over at step 11
    c = chunk_msg(2, 16, rows_from(16, offset=200.0), 3, late=True)        # never sent
    expert = {1: rows_from(0, 0.5), 2: rows_from(8, 0.5)}
    run = executed([(m, np.frombuffer(bytes(np.asarray(m.actions, np.float32)), np.float32).reshape(H, DOF)
                     .astype(np.float64), s) for m, s in ((c, 3), (b, 2), (a, 1))], expert)
    np.testing.assert_array_equal(run.steps, np.arange(0, 24))            # a: 0..10, b: 11..23 (its horizon)
    np.testing.assert_array_equal(run.positions[:11, 0], np.arange(0, 11))
    np.testing.assert_array_equal(run.positions[11:, 0], np.arange(11, 24) + 100.0)
    expected = np.concatenate([np.full(11, 0.5), np.full(13, 99.5)])   # column a: expert - executed
    want = math.sqrt(float(np.mean(np.concatenate([expected ** 2, np.zeros(24)]))))   # column b matches
    assert run.tracking_error() == pytest.approx(want, rel=1e-6)
    # jerk: the ramp has none except where chunk b takes over (a 100 rad step)
    third = np.diff(run.positions, n=3, axis=0) / PERIOD ** 3
    assert run.jerk_rms() == pytest.approx(math.sqrt(float(np.mean(third ** 2))))
    assert run.jerk_rms() > 0
    smooth = executed([(a, rows_from(0), 1)], None)
    assert smooth.jerk_rms() == 0.0 and math.isnan(smooth.tracking_error())


def test_no_sent_chunk_executes_nothing():
    only_late = chunk_msg(0, 0, rows_from(0), 1, late=True)
    assert executed([(only_late, rows_from(0), 1)], None) is None


@pytest.mark.slow
def test_report_of_a_bag_with_chunks_telemetry_and_expert(tmp_path, capsys):
    from physis_ros.cli import report as report_cli

    bag = tmp_path / "run"
    t0 = 1_700_000_000_000_000_000
    with BagWriter(bag) as w:
        for topic, msgtype in (("/robot0/action_chunk", "physis_ros/msg/ActionChunk"),
                               ("/robot0/expert_actions", "physis_ros/msg/ActionChunk"),
                               ("/telemetry", "physis_ros/msg/ChunkTelemetry")):
            w.add_topic(topic, msgtype)
        for c in range(12):
            stamp = t0 + c * 160_000_000
            first = 8 * c
            w.write("/robot0/expert_actions", stamp, serialize_message(chunk_msg(c, first, rows_from(first, 0.1),
                                                                                 stamp)))
            w.write("/robot0/action_chunk", stamp + 40_000_000,
                    serialize_message(chunk_msg(c, first, rows_from(first), stamp, late_points=2)))
            tel = ChunkTelemetry()
            tel.stream, tel.chunk_index = "robot0", c
            tel.emit_stamp.sec, tel.emit_stamp.nanosec = divmod(stamp + 40_000_000, 1_000_000_000)
            tel.observation_stamp = tel.emit_stamp
            tel.output_interval_ms, tel.response_latency_ms = 160.0, 40.0
            tel.first_step, tel.inference_delay_steps, tel.late_points = first, 2, 2
            tel.seam_position_jump = 0.0 if c else math.nan
            tel.seam_velocity_jump = 0.0 if c else math.nan
            tel.tracking_error = 0.1
            w.write("/telemetry", stamp + 40_000_000, serialize_message(tel))
    out = tmp_path / "report"
    assert report_cli.main([str(bag), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "seam p99 (rad)" in table and "tracking (rad)" in table
    s = json.loads((out / "summary.json").read_text())["summary"]["robot0"]
    assert s["late_points"] == 24 and s["late_chunks"] == 0 and s["delay_steps_p50"] == 2
    assert s["executed_steps"] == 2 + 8 * 11 + 14 - 2           # steps 2..(8*11+15): each chunk from row 2
    assert s["tracking_error"] == pytest.approx(0.1 / math.sqrt(2), rel=1e-5)   # joint a off by 0.1, b exact
    assert s["jerk_rms"] == pytest.approx(0.0, abs=1e-3)        # one straight ramp (float32 rounding only)
    for png in ("control", "executed"):
        data = (out / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert "![executed](executed.png)" in (out / "summary.md").read_text()
