"""What the robot executed, from a recorded run: the control half of ``physis-report``.

From each stream's ``action_chunk`` (rows on the control timeline: ``first_step``, ``late_points``,
``late``) it rebuilds the command a controller executes: a chunk takes over at its first row that was
not yet due when it was published and runs until the next chunk takes over (a late chunk is never
sent). Where the bag also holds the stream's ``expert_actions`` (the synthetic robots publish what the
scene's scripted expert does for each observation, with the observation's stamp), the expert's chunk for
the same observation is cut by the same rule, so the executed command and the expert's are compared step
by step, over the steps whose expert chunk the bag holds (a recording that began after the first
observations, or lost an expert message, still compares the rest).

Per stream, and pooled over the streams for ``all``, it adds to the report's summary: the executed
steps, their jerk (RMS of the third difference of position, rad/s^3), the executed tracking error
against the expert (RMS, rad), and from telemetry the seam jumps (p50/p99), the inference delay ``d``
and the late points and chunks. Plots: ``control.png`` (seam jump, ``d``, late points, tracking error
over time, each on its own axis) and ``executed.png`` (per stream, every joint: the executed command and
the expert's).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.bags.analysis import pct
from physis_ros.bags.bagio import bag_info, read_all
from physis_ros.timeline import jerk, rms

CHUNK_TYPE = "physis_ros/msg/ActionChunk"
EXPERT_SUFFIX = "/expert_actions"
DPI = 90            # the report's PNGs: readable, and well under 150 kB each
EXPERT_STYLE = dict(ls="-", lw=0.7, color="0.35", alpha=0.8, zorder=1, label="expert")

COLUMNS = [  # key, header (with its unit), format: appended to the report's table
    ("delay_steps_p50", "d p50 (steps)", "{:.0f}"), ("late_points", "late points", "{:.0f}"),
    ("late_chunks", "late chunks", "{:.0f}"), ("seam_jump_p50", "seam p50 (rad)", "{:.4f}"),
    ("seam_jump_p99", "seam p99 (rad)", "{:.4f}"), ("seam_velocity_jump_p99", "seam vel p99 (rad/s)", "{:.3f}"),
    ("seam_blended_chunks", "eased seams", "{:.0f}"), ("executed_steps", "executed steps", "{:.0f}"),
    ("jerk_rms", "jerk rms (rad/s^3)", "{:.0f}"), ("tracking_error", "tracking rms (rad)", "{:.4f}"),
]


@dataclass
class Executed:
    """One stream's executed command: ``positions[k]`` at control step ``steps[k]``."""

    period: float
    steps: np.ndarray                                   # int64 [n], increasing
    positions: np.ndarray                               # float64 [n, dof]
    expert: np.ndarray | None = None                    # float64 [n, dof], nan rows where the bag lacks it
    joint_names: list[str] = field(default_factory=list)

    def jerks(self) -> np.ndarray:
        """Jerk over runs of consecutive steps ([*, dof], rad/s^3)."""
        runs = np.split(np.arange(len(self.steps)), np.flatnonzero(np.diff(self.steps) != 1) + 1)
        return np.concatenate([jerk(self.positions[run], self.period) for run in runs])

    def errors(self) -> np.ndarray:
        """Executed minus expert at the steps whose expert chunk the bag holds ([*, dof], rad)."""
        if self.expert is None:
            return np.zeros((0, self.positions.shape[1]))
        known = np.isfinite(self.expert).all(axis=1)
        return self.positions[known] - self.expert[known]

    def jerk_rms(self) -> float:
        """RMS jerk over runs of consecutive steps (rad/s^3)."""
        return rms(self.jerks())

    def tracking_error(self) -> float:
        """RMS of executed minus expert over the steps that have the expert's (rad; nan: none has)."""
        return rms(self.errors())


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
    """The executed command of one stream's chunks ((msg, rows, stamp) tuples); ``experts``: the expert's
    rows by observation stamp (a step whose chunk has none there gets nan)."""
    sent = sorted(((m.first_step + m.late_points, m, rows, stamp) for m, rows, stamp in chunks if not m.late),
                  key=lambda c: (c[0], c[1].chunk_index))
    if not sent:
        return None
    steps, positions, expert = [], [], []
    for i, (start, m, rows, stamp) in enumerate(sent):
        end = sent[i + 1][0] if i + 1 < len(sent) else m.first_step + m.horizon
        end = min(end, m.first_step + m.horizon)            # beyond its horizon a chunk prescribes nothing
        ex = (experts or {}).get(stamp)
        if ex is not None and ex.shape[1] != rows.shape[1]:
            ex = None                                       # another arm's: nothing to compare with
        for r in range(start - m.first_step, end - m.first_step):
            steps.append(m.first_step + r)
            positions.append(rows[r])
            expert.append(ex[r] if ex is not None and r < len(ex) else np.full(rows.shape[1], np.nan))
    m0 = sent[0][1]
    expert = np.asarray(expert)
    return Executed(float(m0.control_period), np.asarray(steps, dtype=np.int64), np.asarray(positions),
                    expert if np.isfinite(expert).any() else None, list(m0.joint_names))


def control_summary(rows: list[dict], runs: list[Executed]) -> dict[str, float]:
    """The control columns of one stream (or ``all``): from its telemetry rows and its executed command(s)
    (``all``: every stream's, pooled)."""
    seams = [r["seam_position_jump"] for r in rows]
    out = {"delay_steps_p50": pct([r["inference_delay_steps"] for r in rows], 50),
           "late_points": sum(r["late_points"] for r in rows), "late_chunks": sum(r["late"] for r in rows),
           "seam_jump_p50": pct(seams, 50), "seam_jump_p99": pct(seams, 99),
           "seam_velocity_jump_p99": pct([r["seam_velocity_jump"] for r in rows], 99),
           "seam_blended_chunks": sum(r["seam_blended_rows"] > 0 for r in rows),
           "tracking_error_chunks_p50": pct([r["tracking_error"] for r in rows], 50)}
    if runs:
        out.update({"executed_steps": sum(len(run.steps) for run in runs),
                    "jerk_rms": rms(np.concatenate([run.jerks().ravel() for run in runs])),
                    "tracking_error": rms(np.concatenate([run.errors().ravel() for run in runs]))})
    return out


def control_report(bag, streams: dict[str, list[dict]], out: Path, title: str) -> dict[str, dict]:
    """Per stream control summary (keyed like the telemetry's streams, plus ``all`` over several) and the
    two PNGs."""
    chunks, experts = _chunks(bag)
    runs: dict[str, Executed] = {}
    for ns, items in chunks.items():
        run = executed(items, experts.get(ns))
        if run is not None:
            runs[items[0][0].stream] = run
    summary = {name: control_summary(rs, [runs[name]] if name in runs else []) for name, rs in streams.items()}
    if len(streams) > 1:
        summary["all"] = control_summary([r for rs in streams.values() for r in rs], list(runs.values()))
    for name, fig in (("control", control_figure(streams, title)), ("executed", executed_figure(runs, title))):
        save(fig, out / f"{name}.png")
    return summary


# ---- plots (shared with physis_ros.bags.report) ---------------------------------------------------------

def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def stream_colors(names) -> dict[str, str]:
    """One colour per stream, the same in every plot of the report."""
    cycle = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def save(fig, path: Path) -> None:
    """``fig`` as a PNG of at most 256 colours (antialiased lines in RGBA take several times the bytes)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    pyplot().close(fig)
    Image.open(buf).convert("RGB").quantize(256).save(path, optimize=True)


def control_figure(streams: dict[str, list[dict]], title: str):
    """Per chunk over time, each quantity on its own axis: seam position jump (rad), inference delay ``d``
    (steps), late points (steps, late chunks marked) and tracking error vs the expert (rad)."""
    plt = pyplot()
    t0 = min(r["emit_ns"] for rs in streams.values() for r in rs)
    colors = stream_colors(streams)
    fig, (seam, delay, late, track) = plt.subplots(4, 1, figsize=(10, 10), sharex=True, layout="constrained")
    any_late = False
    for name, rs in streams.items():
        t = np.array([(r["emit_ns"] - t0) / 1e9 for r in rs])
        style = dict(lw=0.8, ms=3, color=colors[name], label=name)
        seam.plot(t, [r["seam_position_jump"] for r in rs], ".-", **style)
        delay.step(t, [r["inference_delay_steps"] for r in rs], where="post", lw=1.2, color=colors[name], label=name)
        late.plot(t, [r["late_points"] for r in rs], ".", ms=4, color=colors[name], label=name)
        marks = [(ti, r["late_points"]) for ti, r in zip(t, rs) if r["late"]]
        if marks:
            any_late = True
            late.plot(*zip(*marks), "x", color="red", ms=7)
        track.plot(t, [r["tracking_error"] for r in rs], ".-", **style)
    if any_late:
        late.plot([], [], "x", color="red", label="late chunk (not sent)")
    seam.set(title=f"Hand-offs - {title}", ylabel="seam position jump [rad]")
    delay.set(ylabel="inference delay d [steps]")
    late.set(ylabel="late points [steps]")
    track.set(ylabel="tracking error\nvs expert [rad]", xlabel="time since first chunk [s]")
    for ax in (seam, delay, late, track):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=min(4, len(streams) + any_late))
    return fig


def executed_figure(runs: dict[str, Executed], title: str, cols: int = 4, window_s: float = 8.0):
    """Small multiples per stream, one panel per joint: the executed command and, where the bag holds it,
    the expert's for the same observations; over the run's last ``window_s`` seconds (every chunk's rows
    drawn over a whole run would be a solid band)."""
    plt = pyplot()
    colors = stream_colors(sorted(runs))
    if not runs:
        fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
        ax.text(0.5, 0.5, "no action_chunk topic in the bag", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.suptitle(f"Executed command - {title}")
        return fig
    dofs = {name: run.positions.shape[1] for name, run in runs.items()}
    cols = min(cols, max(dofs.values()))
    heights = [-(-dof // cols) for dof in dofs.values()]
    fig = plt.figure(figsize=(3.0 * cols, 2.2 * sum(heights) + 0.5 * len(runs)), layout="constrained")
    subfigs = np.atleast_1d(fig.subfigures(len(runs), 1, height_ratios=heights))
    for sub, (name, run) in zip(subfigs, sorted(runs.items())):
        dof = dofs[name]
        axes = sub.subplots(-(-dof // cols), cols, squeeze=False, sharex=True).ravel()
        t = run.steps * run.period
        shown = t >= t[-1] - window_s
        t, steps = t[shown], run.steps[shown]
        # a gap in the steps (no chunk prescribed them) is a gap in the line, not a straight segment
        gap = np.flatnonzero(np.diff(steps) != 1) + 1
        for j, ax in enumerate(axes):
            if j >= dof:
                ax.set_axis_off()
                continue
            ax.plot(np.insert(t, gap, np.nan), np.insert(run.positions[shown, j], gap, np.nan), "-", lw=1.0,
                    color=colors[name], zorder=2, label="executed")
            if run.expert is not None:
                ax.plot(np.insert(t, gap, np.nan), np.insert(run.expert[shown, j], gap, np.nan), **EXPERT_STYLE)
            ax.set_title(run.joint_names[j] if j < len(run.joint_names) else f"joint {j}", fontsize=9)
            ax.set(xlabel="control time [s]", ylabel="position [rad]")
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        spare = dof < len(axes)                             # an empty panel holds the legend
        (axes[-1] if spare else axes[0]).legend(*axes[0].get_legend_handles_labels(), fontsize=9,
                                                loc="center" if spare else "best")
        versus = (f" vs expert (tracking {run.tracking_error():.4f} rad RMS)" if run.expert is not None
                  else " (no expert_actions in the bag)")
        span = "" if shown.all() else f", last {window_s:g} s of {run.steps[-1] * run.period:.0f} s"
        sub.suptitle(f"{name}: executed command{versus}{span}", fontsize=10)
    versus = " vs expert" if any(run.expert is not None for run in runs.values()) else ""
    fig.suptitle(f"Executed command{versus} - {title}", fontsize=11)
    return fig
