"""Per-chunk telemetry records and their aggregates (DESIGN.md section 6).

The same records feed the ROS topics, the benchmark JSON and the plots. Times
are in seconds on one clock (the engine's), durations in milliseconds. Stage
compute and queue times are durations measured inside each worker, so they
are valid across hosts whose clocks differ; ``hop_ms`` compares send and
receive instants and is only filled where the processes share a clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class ChunkRecord:
    stream: str
    chunk: int
    obs_stamp: float                 # s, stamp of the observation the chunk used
    enqueue: float                   # s, chunk entered the pipeline
    emit: float                      # s, chunk left the pipeline
    interval_ms: float               # since this stream's previous emit (nan for the first chunk)
    stage_ms: list[float]            # compute per stage, pipeline order
    queue_ms: float                  # total wait in worker ready queues
    hops_ms: list[float]             # worker-to-worker (and engine) transfer times, same-host only
    batch_sizes: list[int]
    worker_compute_ms: dict[str, float] = field(default_factory=dict)
    deadline_miss: bool = False
    # On the stream's control timeline (streams with one): row i of the chunk is control step
    # first_step + i, due at step0 + i / rate; delay_steps is the inference delay the hand-off assumed.
    first_step: int = 0
    step0: float = math.nan          # s, engine clock
    delay_steps: int = 0
    shift: int = 0                   # steps since the previous chunk's first step
    # Where it reached the robot (filled by whoever delivers it: the node, the benchmarks' simulated robot):
    late_points: int = 0             # rows already due when it was delivered (not executed)
    late: bool = False               # every row was due: not executed at all
    seam_position_jump: float = math.nan   # max |new - previous| at the first executed step (nan: none)
    seam_velocity_jump: float = math.nan
    seam_blended_rows: int = 0             # rows eased from the previous chunk onto this one (the jump above)
    tracking_error: float = math.nan       # RMS vs an expert's chunk for the same observation (nan: none)

    @classmethod
    def from_trace(cls, stream: str, chunk: int, obs_stamp: float, enqueue: float, emit: float,
                   trace: list, hops_ms: list[float]) -> ChunkRecord:
        """From the per-stage trace the workers append: ``[step, block, worker, queue_ms, compute_ms, batch]``."""
        worker_ms: dict[str, float] = {}
        for entry in trace:
            worker_ms[entry[2]] = worker_ms.get(entry[2], 0.0) + entry[4]
        return cls(stream=stream, chunk=chunk, obs_stamp=obs_stamp, enqueue=enqueue, emit=emit,
                   interval_ms=math.nan, stage_ms=[e[4] for e in trace], queue_ms=sum(e[3] for e in trace),
                   hops_ms=hops_ms, batch_sizes=[e[5] for e in trace], worker_compute_ms=worker_ms)

    @property
    def latency_ms(self) -> float:
        return (self.emit - self.obs_stamp) * 1e3

    @property
    def obs_age_ms(self) -> float:
        return (self.enqueue - self.obs_stamp) * 1e3

    @property
    def pipeline_ms(self) -> float:
        return (self.emit - self.enqueue) * 1e3

    @property
    def transport_ms(self) -> float:
        """Time in flight that was neither compute nor queueing: wire, copies, engine overhead."""
        return max(0.0, self.pipeline_ms - sum(self.stage_ms) - self.queue_ms)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(latency_ms=self.latency_ms, obs_age_ms=self.obs_age_ms, transport_ms=self.transport_ms,
                 stage_ms_min=min(self.stage_ms, default=0.0), stage_ms_max=max(self.stage_ms, default=0.0),
                 stage_ms_sum=sum(self.stage_ms))
        return d


def percentile(values, q: float) -> float:
    values = [v for v in values if not math.isnan(v)]
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[ChunkRecord], skip: int = 0) -> dict:
    """Steady-state statistics over ``records[skip:]`` (skip the pipeline's fill phase)."""
    rs = records[skip:]
    intervals = [r.interval_ms for r in rs if not math.isnan(r.interval_ms)]
    span = rs[-1].emit - rs[0].emit if len(rs) > 1 else float("nan")
    return {
        "chunks": len(rs),
        "interval_ms_p50": percentile(intervals, 50),
        "interval_ms_p99": percentile(intervals, 99),
        "interval_ms_jitter": float(np.std(intervals)) if intervals else float("nan"),
        "latency_ms_p50": percentile([r.latency_ms for r in rs], 50),
        "latency_ms_p99": percentile([r.latency_ms for r in rs], 99),
        "obs_age_ms_p50": percentile([r.obs_age_ms for r in rs], 50),
        "chunks_per_s": (len(rs) - 1) / span if span and span > 0 else float("nan"),
        "hop_ms_p50": percentile([h for r in rs for h in r.hops_ms], 50),
        "deadline_misses": sum(r.deadline_miss for r in rs),
        "delay_steps_max": max((r.delay_steps for r in rs), default=0),
        "late_points": sum(r.late_points for r in rs),
        "late_chunks": sum(r.late for r in rs),
        "seam_jump_p50": percentile([r.seam_position_jump for r in rs], 50),
        "seam_jump_p99": percentile([r.seam_position_jump for r in rs], 99),
        "seam_velocity_jump_p99": percentile([r.seam_velocity_jump for r in rs], 99),
        "tracking_error_mean": _mean([r.tracking_error for r in rs]),
    }


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


class RollingStats:
    """Aggregates over the last ``window`` chunks of one stream, for live tables and /diagnostics."""

    def __init__(self, window: int = 200):
        self.records: deque[ChunkRecord] = deque(maxlen=window)
        self.total = 0
        self.deadline_misses = 0

    def add(self, record: ChunkRecord) -> None:
        self.records.append(record)
        self.total += 1
        self.deadline_misses += record.deadline_miss

    def summary(self) -> dict:
        if not self.records:
            return {"chunks": 0}
        out = summarize(list(self.records))
        out["total"] = self.total
        out["deadline_misses_total"] = self.deadline_misses
        return out


def window_stats(records: Sequence[ChunkRecord], now: float, window_s: float,
                 slo_interval_ms: float | None = None, total: int | None = None,
                 misses_total: int | None = None) -> dict[str, Any]:
    """Rate, intervals, latency and deadline-miss rate of the chunks emitted in ``(now - window_s, now]``
    (``records``: the stream's recent chunks, oldest first, ``emit`` on the clock of ``now``).

    Where the records do not reach back a whole window (a young stream, or a stats deque shorter
    than the window) the rate is measured over the span they cover, up to ``now``, so it decays too.
    """
    recs = list(records)
    recent = [r for r in recs if r.emit > now - window_s]
    if not recent:
        rate = 0.0
    elif recs[0].emit > now - window_s:
        span = now - recent[0].emit
        rate = (len(recent) - 1) / span if len(recent) > 1 and span > 0 else 0.0
    else:
        rate = len(recent) / window_s
    intervals = [r.interval_ms for r in recent if not math.isnan(r.interval_ms)]
    own = percentile([r.interval_ms for r in recs], 50)
    expected = max(slo_interval_ms or 0.0, 0.0 if math.isnan(own) else own)
    misses = sum(bool(r.deadline_miss) for r in recent)
    return {
        "total": len(recs) if total is None else total,
        "deadline_misses_total": sum(bool(r.deadline_miss) for r in recs) if misses_total is None else misses_total,
        "window_s": float(window_s),
        "chunks_window": len(recent),
        "chunks_per_s": float(rate),
        "interval_ms_p50": percentile(intervals, 50),
        "interval_ms_p99": percentile(intervals, 99),
        "latency_ms_p50": percentile([r.latency_ms for r in recent], 50),
        "latency_ms_p99": percentile([r.latency_ms for r in recent], 99),
        # how old the observation was when its chunk started: a robot publishing slower than the SLO shows here
        "observation_age_ms_p50": percentile([r.obs_age_ms for r in recent], 50),
        "observation_age_ms_p99": percentile([r.obs_age_ms for r in recent], 99),
        "deadline_misses_window": misses,
        "deadline_miss_rate": misses / len(recent) if recent else 0.0,
        "last_chunk_age_s": (now - recs[-1].emit) if recs else math.inf,
        "expected_interval_ms": expected if expected > 0 else math.nan,
        # on the control timeline (physis_ros.timeline): what reached the robot, and how it met the last chunk
        "inference_delay_steps": recent[-1].delay_steps if recent else 0,
        "late_points_window": sum(r.late_points for r in recent),
        "late_chunks_window": sum(bool(r.late) for r in recent),
        "seam_jump_p50": percentile([r.seam_position_jump for r in recent], 50),
        "seam_jump_p99": percentile([r.seam_position_jump for r in recent], 99),
        "seam_velocity_jump_p99": percentile([r.seam_velocity_jump for r in recent], 99),
        "seam_blended_chunks_window": sum(r.seam_blended_rows > 0 for r in recent),   # sent eased from a jump
        "tracking_error_p50": percentile([r.tracking_error for r in recent], 50),
    }
