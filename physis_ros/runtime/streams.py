"""What the engine keeps per stream, what it hands to its users (observations in, chunks out), and
the health snapshot it publishes for them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.config import to_mapping
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime import protocol as p
from physis_ros.runtime.plans import Plan, Stage
from physis_ros.scheduling.profiles import CostProfile
from physis_ros.telemetry import ChunkRecord


@dataclass(frozen=True)
class ServedModel:
    """A model as the engine serves it: its config, its weights (a checkpoint, or the seeded init) and
    the profile that seeds the workers' adaptive batching. Streams of one ``id`` share weights."""

    config: ModelConfig
    checkpoint: str | None = None
    profile: CostProfile | None = None

    @property
    def id(self) -> str:
        return self.config.name if not self.checkpoint else f"{self.config.name}@{self.checkpoint}"

    def ref(self, stages: list[Stage]) -> p.ModelRef:
        """What a worker hosting ``stages`` needs to know of the model."""
        costs = None if self.profile is None else self.profile.block_costs(stages)
        return p.ModelRef(id=self.id, config=to_mapping(self.config), checkpoint=self.checkpoint, batch_costs=costs)


@dataclass
class Observation:
    data: dict[str, np.ndarray]
    stamp: float        # seconds, on the engine's clock
    tag: Any = None     # opaque to the engine; returned on the ChunkOutput that used this observation


@dataclass
class ChunkOutput:
    stream: str
    chunk: int
    output: np.ndarray  # float32, model output shape, all finite
    record: ChunkRecord
    tag: Any = None     # the tag of the observation this chunk used


@dataclass
class StreamEvent:
    """Something that happened to a stream: ``failed`` (with the chunks lost and the reset's ``cause``),
    ``readmitted``."""

    stream: str
    kind: str
    reason: str
    lost_chunks: int = 0
    cause: str = ""
    time: float = 0.0


# Returns the observation for the next chunk (its index is given), or None if none is available yet.
ObserveFn = Callable[[int], Observation | None]
OutputFn = Callable[[ChunkOutput], None]


@dataclass
class InFlight:
    """A chunk between entering the pipeline and leaving it."""

    obs_stamp: float       # engine clock
    enqueue: float         # engine clock
    tag: Any
    bound_s: float         # how long it may take
    deadline: float        # time.monotonic() by which it must have left, else its stream is reset


@dataclass
class StreamState:
    name: str
    model: ServedModel
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
    last_output_mono: float | None = None
    epoch_started: bool = False        # the current epoch has emitted a chunk (warm-up grace is over)
    pending: dict[int, ChunkOutput] = field(default_factory=dict)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    feeder: asyncio.Task | None = None
    readmission: asyncio.Task | None = None
    outputs: list[ChunkOutput] = field(default_factory=list)
    failed: str | None = None          # why the stream is not serving now (reset under way, or for good)
    gone: bool = False                 # failed for good: a worker it needs cannot come back
    lost_chunks: int = 0
    resets: Counter = field(default_factory=Counter)   # cause -> count
    first_addr: str = ""
    release_interval_s: float | None = None  # pace: chunk c enters no earlier than release_t0 + c * interval
    release_t0: float = 0.0
    emit_delay_s: float | None = None  # jitter buffer: chunk c leaves no earlier than its release + this
    emit_scheduled: bool = False


@dataclass(frozen=True)
class WorkerHealth:
    name: str
    state: str                 # up | restarting | down | starting
    host: str
    device: str
    pid: int
    heartbeat_age_s: float
    restarts: int
    queue: int
    stats: dict[str, float]


@dataclass(frozen=True)
class StreamHealth:
    name: str
    failed: str | None
    gone: bool
    epoch: int
    lost_chunks: int
    resets: dict[str, int]
    in_flight: int
    workers: list[str]
    output_age_s: float | None  # since its last chunk left the pipeline (None: none yet)


@dataclass(frozen=True)
class EngineHealth:
    """A consistent picture of the engine, taken on its own loop; safe to read from any thread."""

    taken: float               # time.monotonic() when taken: an old snapshot means a stalled loop
    failure: str | None
    workers: list[WorkerHealth]
    streams: dict[str, StreamHealth]
    dropped: dict[str, int]    # messages the engine dropped, by reason (malformed, stale, ...)
