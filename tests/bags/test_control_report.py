"""physis-report's control half: the executed command rebuilt from chunks on the control timeline, its
jerk and tracking error against the expert, and the report written from a bag that holds them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rclpy.serialization import serialize_message

from physis_ros.bags.bagio import BagWriter
from physis_ros.bags.control_report import control_figure, executed, executed_figure
from physis_ros.msg import ActionChunk, ChunkTelemetry

H, DOF, PERIOD = 16, 2, 0.02


def chunk_msg(index: int, first_step: int, rows: np.ndarray, stamp_ns: int, late_points: int = 0,
              late: bool = False, stream: str = "robot0") -> ActionChunk:
    """A chunk of the stream's, or (first_step 0, not placed) the expert's as the synthetic robots send it."""
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


def test_tracking_error_over_the_steps_whose_expert_chunk_is_in_the_bag():
    # a recording that began after the first observation holds chunk a but not the expert's chunk for it:
    # the steps a commands have no expert, those b commands still do (once this made the column "-")
    a = chunk_msg(0, 0, rows_from(0), 1)
    b = chunk_msg(1, 8, rows_from(8), 2)
    run = executed([(a, rows_from(0), 1), (b, rows_from(8), 2)], {2: rows_from(8, 0.5)})
    assert run.expert is not None
    assert np.isnan(run.expert[:8]).all() and np.isfinite(run.expert[8:]).all()
    assert run.tracking_error() == pytest.approx(0.5 / math.sqrt(2))      # joint a off by 0.5 on b's steps
    assert math.isnan(executed([(a, rows_from(0), 1)], {2: rows_from(8, 0.5)}).tracking_error())


def _lines(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_executed_figure_draws_every_joint_executed_and_expert_with_units():
    a = chunk_msg(0, 0, np.tile(rows_from(0), (1, 3))[:, :5], 1)          # 5 joints: a grid of 2 x 4 panels
    rows = np.frombuffer(bytes(np.asarray(a.actions, np.float32)), np.float32).reshape(H, 5).astype(np.float64)
    a.joint_names = [f"j{i}" for i in range(5)]
    run = executed([(a, rows, 1)], {1: rows + 0.1})
    fig = executed_figure({"robot0": run}, "test")
    panels = [ax for ax in fig.get_axes() if ax.get_title()]
    assert [ax.get_title() for ax in panels] == a.joint_names
    for ax in panels:
        assert _lines(ax) == ["executed", "expert"]
        assert ax.get_xlabel() == "control time [s]" and ax.get_ylabel() == "position [rad]"
    assert any(ax.get_legend() is not None for ax in fig.get_axes())
    assert "vs expert" in fig.get_suptitle()

    alone = executed_figure({"robot0": executed([(a, rows, 1)], None)}, "test")
    assert all(_lines(ax) == ["executed"] for ax in alone.get_axes() if ax.get_title())
    assert "expert" not in alone.get_suptitle()


def test_no_sent_chunk_executes_nothing():
    only_late = chunk_msg(0, 0, rows_from(0), 1, late=True)
    assert executed([(only_late, rows_from(0), 1)], None) is None


def write_bag(bag, streams=("robot0",), chunks: int = 12, missing_expert=(0,)) -> None:
    """A run: per stream ``chunks`` chunks 8 steps apart (2 late points each), the expert's for the same
    observation (joint a 0.1 rad above; none for the chunks in ``missing_expert``: the recording began
    after those observations) and telemetry."""
    t0 = 1_700_000_000_000_000_000
    with BagWriter(bag) as w:
        for ns in streams:
            w.add_topic(f"/{ns}/action_chunk", "physis_ros/msg/ActionChunk")
            w.add_topic(f"/{ns}/expert_actions", "physis_ros/msg/ActionChunk")
        w.add_topic("/telemetry", "physis_ros/msg/ChunkTelemetry")
        for c in range(chunks):
            stamp = t0 + c * 160_000_000
            first = 8 * c
            for ns in streams:
                if c not in missing_expert:
                    w.write(f"/{ns}/expert_actions", stamp,
                            serialize_message(chunk_msg(c, 0, rows_from(first, 0.1), stamp, stream=ns)))
                w.write(f"/{ns}/action_chunk", stamp + 40_000_000,
                        serialize_message(chunk_msg(c, first, rows_from(first), stamp, late_points=2, stream=ns)))
                tel = ChunkTelemetry()
                tel.stream, tel.chunk_index = ns, c
                tel.emit_stamp.sec, tel.emit_stamp.nanosec = divmod(stamp + 40_000_000, 1_000_000_000)
                tel.observation_stamp = tel.emit_stamp
                tel.output_interval_ms, tel.response_latency_ms = 160.0, 40.0
                tel.first_step, tel.inference_delay_steps, tel.late_points = first, 2, 2
                tel.seam_position_jump = 0.0 if c else math.nan
                tel.seam_velocity_jump = 0.0 if c else math.nan
                tel.tracking_error = 0.1
                w.write("/telemetry", stamp + 40_000_000, serialize_message(tel))


@pytest.mark.slow
def test_report_of_a_bag_with_chunks_telemetry_and_expert(tmp_path, capsys):
    from physis_ros.bags.report import _by_stream, load_telemetry
    from physis_ros.cli import report as report_cli

    bag = tmp_path / "run"
    write_bag(bag, streams=("robot0", "robot1"))
    out = tmp_path / "report"
    assert report_cli.main([str(bag), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    for head in ("seam p99 (rad)", "tracking rms (rad)", "jerk rms (rad/s^3)", "latency p50 (ms)"):
        assert head in table
    summary = json.loads((out / "summary.json").read_text())["summary"]
    for name in ("robot0", "robot1", "all"):
        s = summary[name]
        assert s["late_points"] == 24 * (2 if name == "all" else 1) and s["late_chunks"] == 0
        assert s["delay_steps_p50"] == 2
        assert s["executed_steps"] == (2 + 8 * 11 + 14 - 2) * (2 if name == "all" else 1)  # each chunk from row 2
        # joint a off by 0.1, b exact; chunk 0's steps (no expert in the bag) left out, not the whole column
        assert s["tracking_error"] == pytest.approx(0.1 / math.sqrt(2), rel=1e-4)   # float32 rows
        assert s["jerk_rms"] == pytest.approx(0.0, abs=1e-3)    # one straight ramp (float32 rounding only)
    for png in ("control", "executed"):
        data = (out / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 150_000
    assert "![executed](executed.png)" in (out / "summary.md").read_text()

    fig = control_figure(_by_stream(load_telemetry(bag)), "test")   # each quantity on its own axis
    labels = [ax.get_ylabel() for ax in fig.get_axes()]
    assert labels == ["seam position jump [rad]", "inference delay d [steps]", "late points [steps]",
                      "tracking error\nvs expert [rad]"]
    for ax in fig.get_axes():
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["robot0", "robot1"]
