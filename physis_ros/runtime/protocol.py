"""Every message between the engine and its workers, declared once and validated at decode.

Each message is a msgspec Struct tagged by ``kind``. Decoding checks the kind
against what the receiving socket accepts, every field's type and range, and
rejects unknown fields, so a malformed header raises a ``msgspec``
error (turned into :class:`~physis_ros.runtime.wire.WireError` by the wire
layer) and never reaches a handler. Bounds are generous but finite: strings,
lists and numbers cannot grow without limit, and no float can be NaN or inf.

Planes:

- data (worker -> worker, engine -> first worker): :class:`Task`;
- output (last worker -> engine): :class:`Output`;
- control, engine -> worker: :class:`Load`, :class:`StartStream`,
  :class:`StopStream`, :class:`Stats`, :class:`Shutdown`;
- control, worker -> engine: :class:`Hello`, :class:`Heartbeat`, :class:`Ack`,
  :class:`Failed`, :class:`TaskLost`, :class:`LogRecord`.

Tensor payloads travel as raw frames after the header; the header lists them
(:class:`TensorSpec`), see :mod:`physis_ros.runtime.wire`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

VERSION = 2
MAX_RANK = 8
MAX_TENSORS = 64
MAX_TRACE = 8192          # stage visits per chunk (K * L); the largest preset has well under this
MAX_TEXT = 4096

Name = Annotated[str, Meta(max_length=128)]
StreamName = Annotated[str, Meta(min_length=1, max_length=128)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Address = Annotated[str, Meta(max_length=1024, pattern=r"^(tcp|ipc)://")]
Count = Annotated[int, Meta(ge=0, le=2**62)]
Req = Annotated[int, Meta(ge=0, le=2**62)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Clock = Annotated[float, Meta(ge=-1e12, le=1e12)]       # seconds on a process clock (perf_counter)
Ms = Annotated[float, Meta(ge=0.0, le=1e9)]
Step = Annotated[int, Meta(ge=0, le=65535)]       # a denoising step; 0: the clean pass (clean history rule)
Block = Annotated[int, Meta(ge=0, le=65535)]
Stage = tuple[Step, Block]
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8"]
BatchSize = Annotated[int, Meta(ge=1, le=4096)]
LostReason = Literal["queue_full", "send_failed", "task_failed", "epoch_ahead", "not_hosted", "link_failed"]
HopTransport = Literal["zmq", "torch", "shm"]


class TensorSpec(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One raw tensor frame: its name in the task state, dtype and shape."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    dtype: DType
    shape: Annotated[list[Annotated[int, Meta(ge=0, le=2**40)]], Meta(max_length=MAX_RANK)]


class TraceEntry(Struct, array_like=True, forbid_unknown_fields=True):
    """One stage a chunk visited: where, how long it waited and ran, in how big a batch."""

    step: Step
    block: Block
    worker: Name
    queue_ms: Ms
    compute_ms: Ms
    batch: BatchSize


class _Message(Struct, tag_field="kind", kw_only=True, forbid_unknown_fields=True):
    v: Literal[2] = VERSION
    tensors: Annotated[list[TensorSpec], Meta(max_length=MAX_TENSORS)] = []


# ---- data plane --------------------------------------------------------------------------------
class HandoffSpec(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The hand-off of a chunk to its predecessor (physis_ros.model.handoff): applied at each step's head."""

    mode: Literal["hard", "soft"]
    d: Annotated[int, Meta(ge=0, le=65535)]        # inference delay, control steps
    shift: Annotated[int, Meta(ge=0, le=65535)]    # control steps since the previous chunk's row 0


class HopLink(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The tensors of this task come over the sender's torch.distributed link (runtime/hops.py), not
    as frames: ``tensors`` declares them, tags ``tag``, ``tag + 1``, ... carry them in that order."""

    sender: Name
    gen: Count                                   # the link's generation (the engine's)
    tag: Annotated[int, Meta(ge=0, le=2**31 - 1 - MAX_TENSORS)]


class ShmRef(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The tensors of this task are in the sender's shared-memory ring (runtime/shm_hops.py): ``nbytes`` from
    byte counter ``position`` of ring file ``ring``, in declaration order, each 64-byte aligned."""

    ring: Annotated[str, Meta(max_length=256, pattern=r"^physis-hop-[0-9]+-[A-Za-z0-9_.-]+-[A-Za-z0-9_.-]+-[0-9]+$")]
    position: Count
    nbytes: Count


class Task(_Message, tag="task"):
    """A chunk on its way to ``stage``. The first stage's task carries the observation tensors
    (``obs/<name>``); later ones carry the travelling state (``cond``, ``x``, ``h``), as frames or,
    with ``link`` set, over a torch.distributed link."""

    stream: StreamName
    chunk: Count
    stage: Stage
    epoch: Count
    seed: Seed = 0
    order: Clock = 0.0          # when the chunk entered the pipeline (engine clock): oldest first
    deadline: Clock = 0.0       # when the chunk must leave to keep the stream's interval (edf policy)
    sent: Clock = 0.0           # set by the sender, turned into a hop time by the receiver
    hops: Annotated[list[Ms], Meta(max_length=MAX_TRACE)] = []
    trace: Annotated[list[TraceEntry], Meta(max_length=MAX_TRACE)] = []
    handoff: HandoffSpec | None = None
    link: HopLink | None = None
    shm: ShmRef | None = None


class Wake(_Message, tag="wake"):
    """Sent ahead of a task (by the engine, ``Load.wake_ahead_us`` before a paced release) or of a chunk that
    leaves a worker (by that worker, as it starts the chunk's last stage there): the receiver wakes and
    polls without sleeping for a while, so the message that follows finds it awake. On a host idle between
    chunks, waking a blocked process and its ZeroMQ I/O thread costs more than the hop itself. A first stage's
    worker also makes the announced chunk's noise meanwhile."""

    stream: StreamName
    chunk: Count = 0
    seed: Seed = 0


class Output(_Message, tag="output"):
    """A finished chunk (tensor ``x``), from the worker of its last stage to the engine."""

    stream: StreamName
    chunk: Count
    epoch: Count
    worker: Name
    sent: Clock = 0.0
    hops: Annotated[list[Ms], Meta(max_length=MAX_TRACE)] = []
    trace: Annotated[list[TraceEntry], Meta(max_length=MAX_TRACE)] = []


# ---- control plane: engine -> worker -------------------------------------------------------------
class FaultInjection(Struct, forbid_unknown_fields=True):
    """Test switch: drop the ``drop_task``-th accepted task silently (0: off)."""

    drop_task: Count = 0


class Load(_Message, tag="load"):
    """How the worker runs (no model yet: streams bring theirs, see :class:`StartStream`)."""

    req: Req
    threads: Annotated[int, Meta(ge=1, le=1024)] = 1
    max_ready: Annotated[int, Meta(ge=1, le=2**20)] = 1024
    batching: Literal["off", "on", "adaptive"] = "off"
    max_batch: BatchSize = 4
    policy: Literal["oldest", "edf"] = "oldest"
    faults: FaultInjection = msgspec.field(default_factory=FaultInjection)
    hops: HopTransport = "zmq"                  # how hidden states go worker to worker
    hop_store: Annotated[str, Meta(max_length=1024)] = ""   # the engine's TCPStore, host:port (hops: torch)
    hop_timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 5.0
    hop_ring_mb: Annotated[int, Meta(ge=1, le=65536)] = 64       # each shared ring's size (hops: shm)
    spin_us: Annotated[int, Meta(ge=0, le=100_000)] = 0     # poll without blocking this long before sleeping
    wake_ahead_us: Annotated[int, Meta(ge=0, le=100_000)] = 0   # send Wake before a chunk leaves (0: never)
    rehearse: bool = False      # on a Wake, rehearse the stream's last first task (EngineConfig.cpu_host)


class Route(Struct, array_like=True, forbid_unknown_fields=True):
    """Where the output of ``stage`` goes: the next stage's worker, or the engine after the last."""

    stage: Stage
    address: Address
    worker: Name = ""            # the next stage's worker id ("": the engine)


class Link(Struct, array_like=True, forbid_unknown_fields=True):
    """A worker this one exchanges a stream's hidden states with, and the link's generation (hops: torch)."""

    peer: Name
    gen: Count


class ModelRef(Struct, forbid_unknown_fields=True):
    """A model as workers host it: ``id`` names one set of weights (streams with the same id share
    blocks on a worker), ``config`` is its ModelConfig mapping (validated by the worker),
    ``checkpoint`` a safetensors file (none: the seeded init), ``batch_costs`` seeds adaptive
    batching: {"block": {"batch size": ms}}."""

    id: Name
    config: dict[str, Any]
    checkpoint: Annotated[str, Meta(max_length=4096)] | None = None
    batch_costs: dict[str, dict[str, Ms]] | None = None


class StartStream(_Message, tag="start_stream"):
    """Host a stream's stages of ``model`` with fresh KV under ``epoch``; tasks of other epochs are
    dropped. Blocks the worker lacks are loaded first (without stalling other streams)."""

    req: Req
    stream: StreamName
    epoch: Count
    model: ModelRef
    stages: Annotated[list[Stage], Meta(max_length=MAX_TRACE)]
    routes: Annotated[list[Route], Meta(max_length=MAX_TRACE)]
    links: Annotated[list[Link], Meta(max_length=1024)] = []


class StopStream(_Message, tag="stop_stream"):
    req: Req
    stream: StreamName


class Stats(_Message, tag="stats"):
    req: Req


class Shutdown(_Message, tag="shutdown"):
    req: Req


# ---- control plane: worker -> engine -------------------------------------------------------------
class WorkerStats(Struct, forbid_unknown_fields=True):
    tasks: Count = 0             # chunks that left this worker
    stages: Count = 0            # stage executions
    batches: Count = 0           # forwards (a batch counts once)
    bad_messages: Count = 0      # malformed messages received and dropped
    errors: Count = 0            # stages that raised
    stale: Count = 0             # tasks of a stopped stream or an earlier epoch
    dropped_sends: Count = 0     # outputs a peer could not take
    dropped_tasks: Count = 0     # tasks dropped because the ready queue was full
    injected_drops: Count = 0    # tasks dropped by fault injection
    link_hops: Count = 0         # tasks whose hidden state arrived over a torch.distributed link or a shared ring
    ring_full: Count = 0         # hops sent as frames because the shared ring had no room (hops: shm)
    wakes: Count = 0             # Wake messages received
    compute_ms: Ms = 0.0
    kv_bytes: Count = 0          # KV allocated for the (stream, stage)s hosted here
    weight_bytes: Count = 0      # weights held: trunks and the hosted blocks
    device_bytes: Count = 0      # the device allocator's bytes in use (CUDA; 0 on CPU)
    rss_bytes: Count = 0         # the worker process's resident memory (Linux; 0 where unknown)


class Hello(_Message, tag="hello"):
    worker: Name
    data: Address
    pid: Count
    device: Name
    host: Name = ""


class Heartbeat(_Message, tag="heartbeat"):
    worker: Name
    queue: Count
    stats: WorkerStats


class Ack(_Message, tag="ack"):
    """A request done; the fields a request kind fills are documented on the worker's handler."""

    req: Req
    worker: Name
    blocks: Annotated[list[Block], Meta(max_length=65536)] = []
    kv_bytes: Count = 0
    slot: Annotated[int, Meta(ge=-1, le=2**31)] = -1
    stats: WorkerStats | None = None


class Failed(_Message, tag="failed"):
    """A request that could not be done, and why."""

    req: Req
    worker: Name
    error: Text


class TaskLost(_Message, tag="task_lost"):
    """A chunk this worker could not pass on: the engine resets its stream at once."""

    worker: Name
    stream: StreamName
    chunk: Count
    epoch: Count
    reason: LostReason
    detail: Text = ""
    peer: Name = ""              # link_failed: the worker at the link's other end


class LogRecord(_Message, tag="log"):
    """A worker's log line, forwarded so that it reaches the engine's (and the node's) log."""

    worker: Name
    level: Literal["debug", "info", "warning", "error"]
    text: Text


ToWorker = Union[Load, StartStream, StopStream, Stats, Shutdown]
ToEngine = Union[Hello, Heartbeat, Ack, Failed, TaskLost, LogRecord]
Message = Union[Task, Wake, Output, Load, StartStream, StopStream, Stats, Shutdown, Hello, Heartbeat, Ack, Failed,
                TaskLost, LogRecord]


def clip_text(text: str) -> str:
    """Free text cut to what a message may carry."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."
