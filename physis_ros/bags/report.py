"""Latency and control report of a recorded run, from its ``/telemetry`` (one ChunkTelemetry per chunk)
and its ``action_chunk`` / ``expert_actions`` topics.

Writes ``summary.md`` and ``summary.json`` (one row per stream plus ``all``) and
six PNGs: ``interval.png`` (output interval over time, deadline misses marked),
``latency.png`` (response latency histogram and CDF), ``stages.png`` (per-stage
compute min/mean/max over time, and where the latency goes),
``observation_age.png`` (observation age over time and its histogram), and from
:mod:`physis_ros.bags.control_report` ``control.png`` (seam jumps, inference delay
and late points, tracking error over time) and ``executed.png`` (the executed
command vs the expert's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from physis_ros.bags.analysis import pct, telemetry_row
from physis_ros.bags.bagio import BagError, bag_info, read_all
from physis_ros.bags.control_report import COLUMNS as CONTROL_COLUMNS
from physis_ros.bags.control_report import control_report, pyplot, save, stream_colors

COLUMNS = [  # key, header (with its unit), format
    ("chunks", "chunks", "{:.0f}"), ("chunks_per_s", "chunks/s", "{:.2f}"),
    ("interval_ms_p50", "interval p50 (ms)", "{:.1f}"), ("interval_ms_p99", "interval p99 (ms)", "{:.1f}"),
    ("interval_ms_jitter", "jitter std (ms)", "{:.1f}"),
    ("latency_ms_p50", "latency p50 (ms)", "{:.1f}"), ("latency_ms_p99", "latency p99 (ms)", "{:.1f}"),
    ("latency_ms_max", "latency max (ms)", "{:.1f}"),
    ("obs_age_ms_p50", "obs age p50 (ms)", "{:.1f}"), ("obs_age_ms_p99", "obs age p99 (ms)", "{:.1f}"),
    ("stage_ms_max_p50", "max stage p50 (ms)", "{:.2f}"), ("stage_ms_sum_p50", "compute p50 (ms)", "{:.1f}"),
    ("queue_ms_p50", "queue p50 (ms)", "{:.1f}"), ("transport_ms_p50", "transport p50 (ms)", "{:.1f}"),
    ("deadline_misses", "deadline misses", "{:.0f}"),
] + CONTROL_COLUMNS


def load_telemetry(bag, topic: str = "/telemetry") -> list[dict]:
    from rclpy.serialization import deserialize_message

    from physis_ros.msg import ChunkTelemetry

    info = bag_info(bag)
    if topic not in {t.topic for t in info.topics}:
        raise BagError(f"{bag} has no {topic} topic (topics: {', '.join(t.topic for t in info.topics) or 'none'}); "
                       f"record the server's outputs with 'physis-bag record'")
    rows = [telemetry_row(deserialize_message(raw, ChunkTelemetry), log_ns) for _, _, log_ns, raw in read_all(bag, [topic])]
    if not rows:
        raise BagError(f"{bag}: {topic} has no messages (did the server emit any chunk?)")
    return rows


def summarize(rows: list[dict]) -> dict[str, float]:
    intervals = [r["output_interval_ms"] for r in rows if r["chunk"] > 0 and r["output_interval_ms"] > 0]
    emits = sorted(r["emit_ns"] for r in rows)
    span = (emits[-1] - emits[0]) / 1e9 if len(emits) > 1 else 0.0
    per_stream_rate = len(rows) - len({r["stream"] for r in rows})
    out = {
        "chunks": len(rows),
        "chunks_per_s": per_stream_rate / span if span > 0 else math.nan,
        "interval_ms_p50": pct(intervals, 50), "interval_ms_p99": pct(intervals, 99),
        "interval_ms_jitter": float(np.std(intervals)) if intervals else math.nan,
        "deadline_misses": sum(r["deadline_miss"] for r in rows),
    }
    for key, name in (("response_latency_ms", "latency_ms"), ("observation_age_ms", "obs_age_ms")):
        values = [r[key] for r in rows]
        out.update({f"{name}_p50": pct(values, 50), f"{name}_p99": pct(values, 99), f"{name}_max": max(values)})
    for key, name in (("stage_compute_ms_max", "stage_ms_max"), ("stage_compute_ms_sum", "stage_ms_sum"),
                      ("queue_ms", "queue_ms"), ("transport_ms", "transport_ms")):
        values = [r[key] for r in rows]
        out[f"{name}_p50"] = pct(values, 50)
        out[f"{name}_p99"] = pct(values, 99)
    return out


def summary_table(summary: dict[str, dict], markdown: bool = False) -> str:
    names = list(summary)
    if markdown:
        lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for key, head, fmt in COLUMNS:
            lines.append(f"| {head} | " + " | ".join(_fmt(fmt, summary[n].get(key)) for n in names) + " |")
        return "\n".join(lines)
    width = max(12, *(len(n) + 2 for n in names))
    label = max(len(head) for _, head, _ in COLUMNS) + 2
    lines = [f"{'metric':<{label}}" + "".join(f"{n:>{width}}" for n in names)]
    for key, head, fmt in COLUMNS:
        lines.append(f"{head:<{label}}" + "".join(f"{_fmt(fmt, summary[n].get(key)):>{width}}" for n in names))
    return "\n".join(lines)


def _fmt(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _by_stream(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["stream"], r["chunk"])):
        out.setdefault(r["stream"], []).append(r)
    return out


def write_report(bag, out_dir, topic: str = "/telemetry", slo_ms: float | None = None,
                 title: str | None = None) -> dict[str, dict]:
    """Summary (returned, and written as markdown + JSON) and the six PNGs into ``out_dir``."""
    rows = load_telemetry(bag, topic)
    streams = _by_stream(rows)
    summary = {name: summarize(rs) for name, rs in streams.items()}
    if len(streams) > 1:
        summary["all"] = summarize(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or f"{Path(bag).name}: {len(rows)} chunks, {len(streams)} stream(s)"
    for name, control in control_report(bag, streams, out, title).items():
        summary[name].update(control)
    (out / "summary.json").write_text(json.dumps({"bag": str(bag), "summary": summary}, indent=2,
                                                 default=lambda v: None) + "\n")
    (out / "summary.md").write_text(f"# Latency and control report: {title}\n\nUnits in parentheses; "
                                    f"from `{topic}` of `{bag}`.\n\n{summary_table(summary, markdown=True)}\n\n"
                                    + "".join(f"![{p}]({p}.png)\n" for p in
                                              ("interval", "latency", "stages", "observation_age", "control", "executed")))
    _plots(streams, out, title, slo_ms)
    return summary


def _plots(streams: dict[str, list[dict]], out: Path, title: str, slo_ms: float | None) -> None:
    plt = pyplot()
    t0 = min(r["emit_ns"] for rs in streams.values() for r in rs)
    colors = stream_colors(streams)

    def t(rs):
        return np.array([(r["emit_ns"] - t0) / 1e9 for r in rs])

    def col(rs, key):
        return np.array([r[key] for r in rs], dtype=np.float64)

    # 1. output interval over time
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for name, rs in streams.items():
        rs = [r for r in rs if r["chunk"] > 0]
        if not rs:
            continue
        ax.plot(t(rs), col(rs, "output_interval_ms"), ".-", lw=0.8, ms=3, color=colors[name], label=name)
        miss = [r for r in rs if r["deadline_miss"]]
        if miss:
            ax.plot(t(miss), col(miss, "output_interval_ms"), "x", color="red", ms=6)
    if miss_any := any(r["deadline_miss"] for rs in streams.values() for r in rs):
        ax.plot([], [], "x", color="red", label="deadline miss")
    if slo_ms:
        ax.axhline(slo_ms, color="gray", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax.set(title=f"Output interval over time - {title}", xlabel="time since first chunk [s]",
           ylabel="interval between chunks [ms]")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)   # headroom for the legend
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, ncol=2 if miss_any else 1)
    save(fig, out / "interval.png")

    # 2. response latency: histogram and CDF
    fig, (h, c) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    all_lat = np.concatenate([col(rs, "response_latency_ms") for rs in streams.values()])
    bins = np.linspace(max(0.0, all_lat.min() * 0.95), all_lat.max() * 1.05 + 1e-9, 40)
    for name, rs in streams.items():
        lat = np.sort(col(rs, "response_latency_ms"))
        h.hist(lat, bins=bins, histtype="step", lw=1.5, color=colors[name], label=name)
        c.plot(lat, np.arange(1, len(lat) + 1) / len(lat), color=colors[name],
               label=f"{name}: p50 {np.percentile(lat, 50):.1f}, p99 {np.percentile(lat, 99):.1f} ms")
    h.set(title="Response latency histogram", xlabel="latency: observation stamp -> chunk emitted [ms]",
          ylabel="chunks")
    c.set(title="Response latency CDF", xlabel="latency [ms]", ylabel="fraction of chunks")
    for q in (0.5, 0.99):
        c.axhline(q, color="gray", ls=":", lw=0.8)
    for a in (h, c):
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="lower right" if a is c else "upper right")
    fig.suptitle(title, fontsize=10)
    save(fig, out / "latency.png")

    # 3. per-stage compute over time + where the latency goes
    fig, (s, b) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained", width_ratios=[2, 1])
    for name, rs in streams.items():
        n_stages = np.array([max(1, len(r["batch_sizes"])) for r in rs], dtype=np.float64)
        lo, hi = col(rs, "stage_compute_ms_min"), col(rs, "stage_compute_ms_max")
        s.fill_between(t(rs), lo, hi, color=colors[name], alpha=0.2, lw=0)
        s.plot(t(rs), col(rs, "stage_compute_ms_sum") / n_stages, color=colors[name], lw=1.2,
               label=f"{name}: mean stage (band: min..max)")
    s.set(title="Per-stage compute time per chunk", xlabel="time since first chunk [s]",
          ylabel="stage compute [ms]")
    s.set_ylim(0, s.get_ylim()[1] * 1.2)
    s.grid(alpha=0.3)
    s.legend(fontsize=8, loc="upper right")
    parts = [("observation_age_ms", "observation age"), ("stage_compute_ms_sum", "compute (sum of stages)"),
             ("queue_ms", "queue"), ("transport_ms", "transport")]
    names = list(streams)
    bottom = np.zeros(len(names))
    for key, label in parts:
        vals = np.array([np.median(col(streams[n], key)) for n in names])
        b.bar(names, vals, bottom=bottom, label=label)
        bottom += vals
    b.set(title="Median latency breakdown", ylabel="median time per chunk [ms]")
    b.legend(fontsize=8, loc="upper right")
    b.set_ylim(0, max(bottom.max() * 1.35, 1e-3))
    b.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    save(fig, out / "stages.png")

    # 4. observation age
    fig, (a, hh) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained", width_ratios=[2, 1])
    for name, rs in streams.items():
        a.plot(t(rs), col(rs, "observation_age_ms"), ".-", lw=0.8, ms=3, color=colors[name], label=name)
        hh.hist(col(rs, "observation_age_ms"), bins=30, histtype="step", lw=1.5, color=colors[name], label=name)
    a.set(title="Observation age when the chunk entered the pipeline", xlabel="time since first chunk [s]",
          ylabel="observation age [ms]")
    a.set_ylim(0, a.get_ylim()[1] * 1.2)
    hh.set(title="Observation age histogram", xlabel="observation age [ms]", ylabel="chunks")
    for ax_ in (a, hh):
        ax_.grid(alpha=0.3)
        ax_.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    save(fig, out / "observation_age.png")
