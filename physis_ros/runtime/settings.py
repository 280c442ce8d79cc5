"""How the engine runs its workers: count, placement plan, transport, limits (``engine:`` in a
serve config). Validated once where it is loaded (``physis_ros.config.from_mapping``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from physis_ros.config import ConfigError, bounded
from physis_ros.runtime.security import is_loopback


F = dataclasses.field


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests (all off by default)."""

    drop_task: int = F(default=0, metadata=bounded(ge=0, doc="a worker silently drops its N-th accepted task "
                                                              "(0: off); proves that a lost chunk resets its stream"))
    worker: str = F(default="", metadata=bounded(doc="the worker that drops (e.g. w1); empty: every worker"))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: workers, placement plan, transport, limits, recovery."""

    workers: int = F(default=2, metadata=bounded(ge=1, le=64, doc="worker processes (one per device)"))
    plan: str = F(default="stage", metadata=bounded(
        choices=("sequential", "step", "block", "stage", "auto"),
        doc="placement of stages on workers; auto: the cost-model planner picks from `profile`"))
    profile: str | None = F(default=None, metadata=bounded(
        doc="physis-profile JSON: seeds adaptive batching and the planner (empty: none, or measured for auto)"))
    devices: list[str] = F(default_factory=lambda: ["cpu"], metadata=bounded(
        doc="device of each worker (one for all, or one per worker): cpu or cuda:N"))
    transport: str = F(default="tcp", metadata=bounded(
        choices=("tcp", "ipc"), doc="local data sockets: tcp on bind_host, or ipc in a private directory"))
    bind_host: str = F(default="127.0.0.1", metadata=bounded(
        doc="interface the engine and spawned workers bind (loopback unless told otherwise; needs curve_keys)"))
    threads_per_worker: int = F(default=1, metadata=bounded(ge=1, doc="torch threads of each worker"))
    max_in_flight: int = F(default=0, metadata=bounded(
        ge=0, doc="chunks a stream may have in its pipeline (0: derived from its plan)"))
    # Merging same-block tasks changes fp32 rounding (results within 1e-5 relative of the reference);
    # "off" keeps outputs bit-identical to the sequential reference.
    batching: str = F(default="off", metadata=bounded(
        choices=("off", "on", "adaptive"), doc="merge ready tasks of the same block into one forward"))
    max_batch: int = F(default=4, metadata=bounded(ge=1, le=64, doc="largest batched forward"))
    policy: str = F(default="oldest", metadata=bounded(
        choices=("oldest", "edf"), doc="which ready task a worker runs first"))
    max_streams: int = F(default=8, metadata=bounded(ge=1, le=65536, doc="streams the engine may hold at once"))
    max_ready: int = F(default=1024, metadata=bounded(
        ge=1, le=2**20, doc="tasks a worker's ready queue holds before it drops the oldest (and resets its "
                            "stream)"))
    seed: int = F(default=0, metadata=bounded(doc="noise seed: chunk c of stream s always starts from the "
                                                 "same noise"))
    checkpoint: str | None = F(default=None, metadata=bounded(doc="safetensors checkpoint (empty: the "
                                                                   "preset's random init)"))
    start_timeout_s: float = F(default=60.0, metadata=bounded(gt=0, doc="give up if a worker is not up by then"))
    heartbeat_timeout_s: float = F(default=1.0, metadata=bounded(
        gt=0, doc="a worker silent this long is killed and restarted"))
    chunk_timeout_floor_s: float = F(default=1.0, metadata=bounded(
        gt=0, doc="least time a chunk may take through its pipeline before its stream is reset"))
    chunk_timeout_factor: float = F(default=3.0, metadata=bounded(
        gt=0, doc="a chunk's bound: this many times its stream's in-flight chunks x SLO interval (at least "
                  "the floor)"))
    warmup_grace_s: float = F(default=5.0, metadata=bounded(
        ge=0, doc="extra time for the chunks of a (re)started stream before its first output (first "
                  "forwards are slow)"))
    restart_workers: bool = F(default=True, metadata=bounded(
        doc="restart a lost worker and re-admit its streams with fresh KV"))
    restart_budget_s: float = F(default=30.0, metadata=bounded(
        gt=0, doc="time to bring a lost worker back (retries with backoff) before the engine gives up"))
    spawn_workers: bool = F(default=True, metadata=bounded(
        doc="start local workers; false: wait for physis-worker --connect on other hosts"))
    ctrl_port: int = F(default=0, metadata=bounded(ge=0, le=65535, doc="engine control port (0: any free port)"))
    curve_keys: str | None = F(default=None, metadata=bounded(
        doc="physis-keys directory: CurveZMQ on every socket; required to bind anything but loopback"))
    max_message_mb: int = F(default=256, metadata=bounded(ge=1, le=4096, doc="largest message accepted (MiB)"))
    faults: FaultConfig = F(default_factory=FaultConfig, metadata=bounded(doc="fault injection for tests"))

    def validate(self) -> None:
        if len(self.devices) not in (1, self.workers):
            raise ConfigError("devices", f"give one device for all workers or one per worker "
                                         f"({self.workers}), got {len(self.devices)}")
        for d in self.devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise ConfigError("devices", f"{d!r} is not a device; use 'cpu' or 'cuda:N'")
        if self.transport == "tcp" and not is_loopback(self.bind_host) and not self.curve_keys:
            raise ConfigError("curve_keys", f"binding {self.bind_host} (not loopback) requires CurveZMQ keys: "
                                            "generate them with 'physis-keys DIR' and set curve_keys: DIR")
        if self.max_in_flight * self.max_streams > self.max_ready:
            # A worker may host every stream's chunks: more credits than its queue holds would drop tasks.
            raise ConfigError("max_in_flight", f"{self.max_in_flight} chunks in flight x max_streams "
                                               f"{self.max_streams} exceed a worker's ready queue (max_ready "
                                               f"{self.max_ready}); lower max_in_flight or raise max_ready")
        if self.faults.worker and not (self.faults.worker.startswith("w")
                                       and self.faults.worker[1:].isdigit()
                                       and int(self.faults.worker[1:]) < self.workers):
            raise ConfigError("faults.worker", f"{self.faults.worker!r} is not one of w0..w{self.workers - 1}")

    def device_of(self, worker: int) -> str:
        return self.devices[0] if len(self.devices) == 1 else self.devices[worker]
