"""What the engine keeps per stream, and what it hands to its users (observations in, chunks out)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from physis_ros.runtime.plans import Plan
from physis_ros.telemetry import ChunkRecord


@dataclass
class Observation:
    data: dict[str, np.ndarray]
    stamp: float  # seconds, on the engine's clock


@dataclass
class ChunkOutput:
    stream: str
    chunk: int
    output: np.ndarray  # float32, model output shape
    record: ChunkRecord


@dataclass
class StreamEvent:
    """Something that happened to a stream: ``failed``, ``readmitted`` (with the chunks lost)."""

    stream: str
    kind: str
    reason: str
    lost_chunks: int = 0
    time: float = 0.0


# Returns the observation for the next chunk (its index is given), or None if none is available yet.
ObserveFn = Callable[[int], Observation | None]
OutputFn = Callable[[ChunkOutput], None]


@dataclass
class StreamState:
    name: str
    plan: Plan
    observe: ObserveFn
    on_output: OutputFn | None
    limit: int | None
    slo_interval_ms: float | None
    credits: asyncio.Semaphore
    keep_outputs: bool = False
    epoch: int = 0
    next_chunk: int = 0
    next_emit: int = 0
    last_emit: float | None = None
    pending: dict[int, ChunkOutput] = field(default_factory=dict)
    entered: dict[int, tuple[float, float]] = field(default_factory=dict)  # chunk -> (obs stamp, enqueue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    feeder: asyncio.Task | None = None
    outputs: list[ChunkOutput] = field(default_factory=list)
    failed: str | None = None
    lost_chunks: int = 0
    first_addr: str = ""
    release_interval_s: float | None = None  # pace: chunk c enters no earlier than release_t0 + c * interval
    release_t0: float = 0.0
    emit_delay_s: float | None = None  # jitter buffer: chunk c leaves no earlier than its release + this
    emit_scheduled: bool = False
