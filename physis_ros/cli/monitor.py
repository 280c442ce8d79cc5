"""Live per-stream aggregates from the server's ``telemetry`` topic: the table physis-demo prints."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from physis_ros.telemetry import percentile

SEAM_EVENT_RAD = 0.01     # a seam jump above this is listed (chunk by chunk) in the run's summary
SEAM_EVENTS_KEPT = 50


@dataclass
class StreamWindow:
    total: int = 0
    misses: int = 0
    first_chunk: int | None = None
    last_chunk: int | None = None
    gaps: int = 0
    late_chunks: int = 0
    # (emit_s, interval_ms, latency_ms, delay_steps, seam_jump, tracking_error)
    rows: deque = field(default_factory=lambda: deque(maxlen=400))
    # the chunks whose seam jumped: where a hand-off normally makes it 0, which ones did not, and why
    seam_events: int = 0
    seam_event_rows: list = field(default_factory=list)
    blended_chunks: int = 0   # sent eased from the previous chunk's position (their seam, as computed, jumped)
    past_frozen: int = 0      # taken over at or past row d (with a hand-off: later than the rows frozen for it)

    def add(self, chunk: int, emit: float, interval_ms: float, latency_ms: float, miss: bool, delay_steps: int = 0,
            late: bool = False, seam_jump: float = math.nan, tracking_error: float = math.nan,
            late_points: int = 0, blended_rows: int = 0) -> None:
        if self.last_chunk is not None and chunk != self.last_chunk + 1:
            self.gaps += 1
        if self.first_chunk is None:
            self.first_chunk = chunk
        self.last_chunk = chunk
        self.total += 1
        self.misses += bool(miss)
        self.late_chunks += bool(late)
        self.blended_chunks += blended_rows > 0
        self.past_frozen += not late and delay_steps > 0 and late_points >= delay_steps
        self.rows.append((emit, interval_ms if interval_ms > 0 else math.nan, latency_ms, delay_steps, seam_jump,
                          tracking_error))
        if seam_jump > SEAM_EVENT_RAD:
            self.seam_events += 1
            if len(self.seam_event_rows) < SEAM_EVENTS_KEPT:
                # late_points: the row the robot switched at; past the frozen rows when >= delay_steps
                self.seam_event_rows.append({"chunk": chunk, "seam_jump": round(float(seam_jump), 4),
                                             "delay_steps": delay_steps, "late_points": late_points,
                                             "latency_ms": round(float(latency_ms), 2),
                                             "blended_rows": blended_rows})

    def summary(self, window_s: float = 5.0) -> dict:
        rows = list(self.rows)
        if not rows:
            return {"chunks": self.total, "chunks_per_s": math.nan, "interval_p50": math.nan,
                    "interval_p99": math.nan, "latency_p50": math.nan, "latency_p99": math.nan,
                    "misses": self.misses, "delay_steps": 0, "late_chunks": self.late_chunks,
                    "seam_jump_p99": math.nan, "tracking_error": math.nan}
        t_end = rows[-1][0]
        recent = [r for r in rows if r[0] >= t_end - window_s]
        span = recent[-1][0] - recent[0][0]
        return {
            "chunks": self.total,
            "chunks_per_s": (len(recent) - 1) / span if span > 0 else math.nan,
            "interval_p50": percentile([r[1] for r in recent], 50),
            "interval_p99": percentile([r[1] for r in recent], 99),
            "latency_p50": percentile([r[2] for r in recent], 50),
            "latency_p99": percentile([r[2] for r in recent], 99),
            "misses": self.misses,
            "delay_steps": recent[-1][3],
            "late_chunks": self.late_chunks,
            "seam_jump_p99": percentile([r[4] for r in recent], 99),
            "tracking_error": percentile([r[5] for r in recent], 50),
        }


class TelemetryMonitor:
    """Subscribe to ChunkTelemetry on ``node``; ``table()`` renders the live rows."""

    HEADER = (f"{'t(s)':>6}  {'stream':<10} {'chunks':>7} {'chunks/s':>9} {'interval p50/p99 ms':>20} "
              f"{'latency p50/p99 ms':>20} {'misses':>7} {'d':>3} {'late':>5} {'seam p99':>9} {'track err':>9}")

    def __init__(self, node, topic: str = "/telemetry"):
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        from physis_ros.msg import ChunkTelemetry

        self.streams: dict[str, StreamWindow] = {}
        self.sub = node.create_subscription(ChunkTelemetry, topic, self._on_msg,
                                            QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE,
                                                       durability=DurabilityPolicy.TRANSIENT_LOCAL))

    def _on_msg(self, msg) -> None:
        w = self.streams.setdefault(msg.stream, StreamWindow())
        emit = msg.emit_stamp.sec + msg.emit_stamp.nanosec * 1e-9
        w.add(int(msg.chunk_index), emit, msg.output_interval_ms, msg.response_latency_ms, msg.deadline_miss,
              int(msg.inference_delay_steps), msg.late, msg.seam_position_jump, msg.tracking_error,
              int(msg.late_points), int(msg.seam_blended_rows))

    @property
    def total(self) -> int:
        return sum(w.total for w in self.streams.values())

    def table(self, elapsed: float) -> list[str]:
        lines = []
        for name in sorted(self.streams):
            s = self.streams[name].summary()
            lines.append(f"{elapsed:>6.1f}  {name:<10} {s['chunks']:>7} {s['chunks_per_s']:>9.1f} "
                         f"{s['interval_p50']:>9.1f} / {s['interval_p99']:>6.1f}   "
                         f"{s['latency_p50']:>9.1f} / {s['latency_p99']:>6.1f}   {s['misses']:>7} "
                         f"{s['delay_steps']:>3} {s['late_chunks']:>5} {s['seam_jump_p99']:>9.4f} "
                         f"{s['tracking_error']:>9.4f}")
        return lines

    def summaries(self) -> dict[str, dict]:
        out = {}
        for name, w in self.streams.items():
            s = w.summary(window_s=math.inf)
            s.update(first_chunk=w.first_chunk, last_chunk=w.last_chunk, gaps=w.gaps, seam_events=w.seam_events,
                     seam_event_chunks=w.seam_event_rows, seam_blended_chunks=w.blended_chunks,
                     past_frozen_chunks=w.past_frozen)
            out[name] = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in s.items()}
        return out
