"""What the robot executed, from a recorded run: the control half of ``physis-report``.

From each stream's ``action_chunk`` (rows on the control timeline: ``first_step``, ``late_points``,
``late``) it rebuilds the command a controller executes: a chunk takes over at its first row that was
not yet due when it was published and runs until the next chunk takes over (a late chunk is never
sent). Where the bag also holds the stream's ``expert_actions`` (the synthetic robots publish what the
scene's scripted expert does for each observation), the expert's chunk for the same observation is
cut by the same rule, so the executed command and the expert's are compared step by step.

Per stream it adds to the report's summary: the executed steps, their jerk (RMS of the third difference
of position, rad/s^3), the executed tracking error against the expert (RMS, rad), and from telemetry the
seam jumps (p50/p99), the inference delay ``d`` and the late points and chunks. Plots: ``control.png``
(seam jump, ``d`` and late points, tracking error over time) and ``executed.png`` (executed vs expert,
first joints, per stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.bags.analysis import pct
from physis_ros.bags.bagio import bag_info, read_all
from physis_ros.timeline import jerk, rms

CHUNK_TYPE = "physis_ros/msg/ActionChunk"
EXPERT_SUFFIX = "/expert_actions"

COLUMNS = [  # key, header, format: appended to the report's table
    ("delay_steps_p50", "d p50 (steps)", "{:.0f}"), ("late_points", "late points", "{:.0f}"),
    ("late_chunks", "late chunks", "{:.0f}"), ("seam_jump_p50", "seam p50 (rad)", "{:.4f}"),
    ("seam_jump_p99", "seam p99 (rad)", "{:.4f}"), ("seam_velocity_jump_p99", "seam vel p99", "{:.3f}"),
    ("seam_blended_chunks", "eased seams", "{:.0f}"),
    ("jerk_rms", "jerk rms", "{:.0f}"), ("tracking_error", "tracking (rad)", "{:.4f}"),
]


@dataclass
class Executed:
    """One stream's executed command: ``positions[k]`` at control step ``steps[k]``."""

    period: float
    steps: np.ndarray                                   # int64 [n], increasing
    positions: np.ndarray                               # float64 [n, dof]
    expert: np.ndarray | None = None                    # float64 [n, dof] where every step has the expert's
    joint_names: list[str] = field(default_factory=list)

    def jerk_rms(self) -> float:
        """RMS jerk over runs of consecutive steps (rad/s^3)."""
        runs = np.split(np.arange(len(self.steps)), np.flatnonzero(np.diff(self.steps) != 1) + 1)
        return rms(np.concatenate([jerk(self.positions[run], self.period) for run in runs]))

    def tracking_error(self) -> float:
        return math.nan if self.expert is None else rms(self.positions, self.expert)


def _chunks(bag) -> tuple[dict[str, list], dict[str, dict[int, np.ndarray]]]:
    """(namespace -> ActionChunk messages, namespace -> {observation stamp ns: expert rows})."""
    from rclpy.serialization import deserialize_message

    from physis_ros.msg import ActionChunk

    topics = [t.topic for t in bag_info(bag).topics if t.msgtype == CHUNK_TYPE]
    chunks: dict[str, list] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for topic, _, _, raw in read_all(bag, topics):
        msg = deserialize_message(raw, ActionChunk)
        rows = np.frombuffer(bytes(msg.actions), dtype=np.float32).reshape(msg.horizon, msg.dof).astype(np.float64)
        stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        if topic.endswith(EXPERT_SUFFIX):
            experts.setdefault(topic[: -len(EXPERT_SUFFIX)], {})[stamp] = rows
        else:
            chunks.setdefault(topic.rsplit("/", 1)[0], []).append((msg, rows, stamp))
    return chunks, experts


def executed(chunks: list, experts: dict[int, np.ndarray] | None) -> Executed | None:
    """The executed command of one stream's chunks ((msg, rows, stamp) tuples)."""
    sent = sorted(((m.first_step + m.late_points, m, rows, stamp) for m, rows, stamp in chunks if not m.late),
                  key=lambda c: (c[0], c[1].chunk_index))
    if not sent:
        return None
    steps, positions, expert = [], [], []
    for i, (start, m, rows, stamp) in enumerate(sent):
        end = sent[i + 1][0] if i + 1 < len(sent) else m.first_step + m.horizon
        end = min(end, m.first_step + m.horizon)            # beyond its horizon a chunk prescribes nothing
        picked = range(start - m.first_step, end - m.first_step)
        ex = (experts or {}).get(stamp)
        for r in picked:
            steps.append(m.first_step + r)
            positions.append(rows[r])
            expert.append(ex[r] if ex is not None and r < len(ex) else None)
    have_expert = all(e is not None for e in expert)
    m0 = sent[0][1]
    return Executed(float(m0.control_period), np.asarray(steps, dtype=np.int64), np.asarray(positions),
                    np.asarray(expert) if have_expert else None, list(m0.joint_names))


def control_summary(rows: list[dict], run: Executed | None) -> dict[str, float]:
    """The control columns of one stream (or ``all``): from its telemetry rows and its executed command."""
    seams = [r["seam_position_jump"] for r in rows]
    out = {"delay_steps_p50": pct([r["inference_delay_steps"] for r in rows], 50),
           "late_points": sum(r["late_points"] for r in rows), "late_chunks": sum(r["late"] for r in rows),
           "seam_jump_p50": pct(seams, 50), "seam_jump_p99": pct(seams, 99),
           "seam_velocity_jump_p99": pct([r["seam_velocity_jump"] for r in rows], 99),
           "seam_blended_chunks": sum(r["seam_blended_rows"] > 0 for r in rows),
           "tracking_error_chunks_p50": pct([r["tracking_error"] for r in rows], 50)}
    if run is not None:
        out.update({"executed_steps": len(run.steps), "jerk_rms": run.jerk_rms(), "tracking_error": run.tracking_error()})
    return out


def control_report(bag, streams: dict[str, list[dict]], out: Path, title: str) -> dict[str, dict]:
    """Per stream control summary (keyed like the telemetry's streams) and the two PNGs."""
    chunks, experts = _chunks(bag)
    runs: dict[str, Executed] = {}
    for ns, items in chunks.items():
        run = executed(items, experts.get(ns))
        if run is not None:
            runs[items[0][0].stream] = run
    summary = {name: control_summary(rs, runs.get(name)) for name, rs in streams.items()}
    _plots(streams, runs, out, title)
    return summary


def _plots(streams: dict[str, list[dict]], runs: dict[str, Executed], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["emit_ns"] for rs in streams.values() for r in rs)
    colors = dict(zip(streams, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    fig, (seam, delay, track) = plt.subplots(3, 1, figsize=(10, 9), sharex=True, layout="constrained")
    for name, rs in streams.items():
        t = np.array([(r["emit_ns"] - t0) / 1e9 for r in rs])
        seam.plot(t, [r["seam_position_jump"] for r in rs], ".-", lw=0.8, ms=3, color=colors[name], label=name)
        delay.plot(t, [r["inference_delay_steps"] for r in rs], "-", lw=1, color=colors[name], label=f"{name} d")
        delay.plot(t, [r["late_points"] for r in rs], ".", ms=3, color=colors[name], alpha=0.5)
        late = [(ti, r["late_points"]) for ti, r in zip(t, rs) if r["late"]]
        if late:
            delay.plot(*zip(*late), "x", color="red", ms=6)
        track.plot(t, [r["tracking_error"] for r in rs], ".-", lw=0.8, ms=3, color=colors[name], label=name)
    seam.set(title=f"Hand-off seams - {title}", ylabel="seam position jump [rad]")
    delay.set(ylabel="d (line), late points (dots) [steps]")
    delay.plot([], [], "x", color="red", label="late chunk (not sent)")
    track.set(ylabel="tracking error vs expert [rad]", xlabel="time since first chunk [s]")
    for ax in (seam, delay, track):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.savefig(out / "control.png", dpi=110)
    plt.close(fig)

    joints = 3
    fig, axes = plt.subplots(max(1, len(runs)), joints, figsize=(12, 3.2 * max(1, len(runs))), squeeze=False,
                             layout="constrained")
    for row, (name, run) in enumerate(sorted(runs.items())):
        t = run.steps * run.period
        for j in range(min(joints, run.positions.shape[1])):
            ax = axes[row][j]
            ax.plot(t, run.positions[:, j], "-", lw=1.2, color=colors.get(name, "C0"), label="executed")
            if run.expert is not None:
                ax.plot(t, run.expert[:, j], "--", lw=1, color="black", alpha=0.7, label="expert")
            name_j = run.joint_names[j] if j < len(run.joint_names) else f"joint {j}"
            ax.set(title=f"{name}: {name_j}", xlabel="control time [s]", ylabel="position [rad]")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    if not runs:
        axes[0][0].text(0.5, 0.5, "no action_chunk topic in the bag", ha="center", transform=axes[0][0].transAxes)
    fig.suptitle(f"Executed command vs expert - {title}")
    fig.savefig(out / "executed.png", dpi=110)
    plt.close(fig)
