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


LAUNCHERS = ("local", "ray", "external")
PG_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """Workers as Ray actors (``launcher: ray``): Ray places and watches them; data stays on ZeroMQ."""

    address: str = F(default="", metadata=bounded(
        doc="Ray cluster to join: auto (the one 'ray start' runs on this host), HOST:6379 or ray://HOST:10001 "
            "(Ray Client); empty: start a local one for this engine"))
    strategy: str = F(default="PACK", metadata=bounded(
        choices=PG_STRATEGIES, doc="placement group strategy: PACK workers onto few nodes or SPREAD them over "
                                   "many (STRICT_: fail rather than bend)"))
    cpus_per_worker: float = F(default=1.0, metadata=bounded(
        gt=0, doc="CPUs each worker's bundle reserves (beside its GPU, if it has one)"))
    namespace: str = F(default="physis", metadata=bounded(doc="Ray namespace of the engine's job"))
    num_cpus: int = F(default=0, metadata=bounded(
        ge=0, doc="CPUs of a local cluster started here (0: enough for every bundle, at least this host's cores)"))
    object_store_mb: int = F(default=0, metadata=bounded(
        ge=0, doc="object store of a local cluster started here, MiB (0: Ray's default; no tensor goes "
                  "through it, at least 75)"))
    placement_timeout_s: float = F(default=60.0, metadata=bounded(
        gt=0, doc="give up if the cluster cannot reserve every worker's bundle by then"))


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
    hops: str = F(default="zmq", metadata=bounded(
        choices=("zmq", "torch", "shm"),
        doc="how hidden states go worker to worker (headers stay on zmq): zmq frames beside the header, torch "
            "(torch.distributed point-to-point: NCCL between GPUs, gloo on CPU) or shm (shared-memory rings, "
            "CPU workers on this host)"))
    hop_ring_mb: int = F(default=64, metadata=bounded(
        ge=1, le=65536, doc="hops shm: size of each ring (one per pair of workers and direction); a hop that "
                            "finds no room goes as frames"))
    hop_timeout_s: float = F(default=5.0, metadata=bounded(
        gt=0, le=3600, doc="hops torch: a transfer not done by then closes its link (its streams are reset)"))
    hop_network_trusted: bool = F(default=False, metadata=bounded(
        doc="hops torch off loopback: gloo/NCCL and their rendezvous store have no authentication (CurveZMQ "
            "covers only the zmq sockets); set true only on a private, trusted network"))
    spin_us: int = F(default=0, metadata=bounded(
        ge=0, le=100_000, doc="an idle worker polls its sockets without sleeping this long before it blocks"))
    wake_ahead_us: int = F(default=1000, metadata=bounded(
        ge=0, le=100_000, doc="wake the receiver this long before a paced chunk's release (the engine) and as a "
                              "chunk's last stage on a worker starts (that worker), so its message finds the "
                              "next worker or the engine awake (0: off)"))
    cpu_host: str = F(default="auto", metadata=bounded(
        choices=("auto", "on", "off"),
        doc="measures for CPU workers sharing one host (a server sets it from admission.policy: cpu-host): a "
            "worker rehearses a stream's last first task when its next one is announced, the engine polls for "
            "an announced output; auto: on when every worker is a CPU; never on a GPU worker"))
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
        choices=("oldest", "edf"), doc="which ready task a worker runs first: the oldest chunk's, or the one "
                                       "that must leave first to keep its stream's interval within the SLO"))
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
    launcher: str | None = F(default=None, metadata=bounded(
        choices=LAUNCHERS, doc="how workers start: local (processes spawned here, the default), ray (actors in "
                               "a Ray placement group, see ray.*), external (physis-worker --connect, by hand)"))
    spawn_workers: bool | None = F(default=None, metadata=bounded(
        doc="older spelling of launcher: true = local (or ray), false = external; must agree with launcher"))
    ray: RayConfig = F(default_factory=RayConfig, metadata=bounded(doc="Ray cluster (launcher: ray)"))
    ctrl_port: int = F(default=0, metadata=bounded(ge=0, le=65535, doc="engine control port (0: any free port)"))
    curve_keys: str | None = F(default=None, metadata=bounded(
        doc="physis-keys directory: CurveZMQ on every socket; required to bind anything but loopback"))
    max_message_mb: int = F(default=256, metadata=bounded(ge=1, le=4096, doc="largest message accepted (MiB)"))
    faults: FaultConfig = F(default_factory=FaultConfig, metadata=bounded(doc="fault injection for tests"))

    def __post_init__(self) -> None:
        # launcher replaced spawn_workers; both are resolved here, so every reader sees concrete values and a
        # round trip through to_mapping (ROS parameters) stays consistent.
        launcher, spawn = self.launcher, self.spawn_workers
        if launcher is None:
            launcher = "external" if spawn is False else "local"
        elif launcher not in LAUNCHERS:
            raise ConfigError("launcher", f"{launcher!r} is not allowed; allowed values: "
                                          f"{', '.join(map(repr, LAUNCHERS))}")
        elif spawn is not None and spawn != (launcher != "external"):
            raise ConfigError("spawn_workers", f"spawn_workers: {str(spawn).lower()} contradicts launcher: "
                                               f"{launcher}; drop spawn_workers (launcher replaces it: false is "
                                               f"launcher: external)")
        object.__setattr__(self, "launcher", launcher)
        object.__setattr__(self, "spawn_workers", launcher != "external")

    def validate(self) -> None:
        if self.launcher == "ray":
            self._validate_ray()
        if len(self.devices) not in (1, self.workers):
            raise ConfigError("devices", f"give one device for all workers or one per worker "
                                         f"({self.workers}), got {len(self.devices)}")
        for d in self.devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise ConfigError("devices", f"{d!r} is not a device; use 'cpu' or 'cuda:N'")
        if self.hops == "torch" and (self.launcher == "ray" or not is_loopback(self.bind_host)) \
                and not self.hop_network_trusted:
            raise ConfigError("hop_network_trusted", "hops torch sends tensors over gloo/NCCL sockets and a rendezvous "
                                                     "store that nothing authenticates, and these workers are off "
                                                     "loopback: set hop_network_trusted: true if the network is "
                                                     "private, or use hops zmq (CurveZMQ)")
        if self.cpu_host == "on" and any(self.device_of(i) != "cpu" for i in range(self.workers)):
            raise ConfigError("cpu_host", "the CPU-host measures are for CPU workers sharing one host; these run on "
                                          "a GPU: drop cpu_host (or set it off)")
        if self.hops == "shm" and (self.launcher != "local" or any(self.device_of(i) != "cpu"
                                                                    for i in range(self.workers))):
            raise ConfigError("hops", "hops shm shares memory between CPU worker processes on this host: it needs "
                                      "launcher local and cpu devices; use torch (NCCL) for GPUs, zmq across hosts")
        gpus = [self.device_of(i) for i in range(self.workers) if self.device_of(i).startswith("cuda")]
        if self.hops == "torch" and len(set(gpus)) < len(gpus) and self.launcher != "ray":
            raise ConfigError("hops", "hops torch pairs GPU workers over NCCL, which cannot pair two ranks on one "
                                      "GPU: give each worker its own (devices: [cuda:0, cuda:1, ...]) or use hops zmq")
        if self.transport == "tcp" and not is_loopback(self.bind_host) and not self.curve_keys \
                and self.launcher != "ray":  # ray: fresh keys per worker, always (security.ephemeral_keys)
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

    def _validate_ray(self) -> None:
        if self.transport != "tcp":
            raise ConfigError("transport", "launcher ray puts workers on other hosts: ipc is local only; use tcp")
        if self.curve_keys:
            raise ConfigError("curve_keys", "launcher ray makes a fresh CurveZMQ key pair per worker at every "
                                            "start and hands it to the actor; remove curve_keys")
        for d in self.devices:
            if d.startswith("cuda") and d not in ("cuda", "cuda:0"):
                raise ConfigError("devices", f"{d!r}: with launcher ray each GPU worker gets the one GPU of its "
                                             "bundle, which Ray makes its cuda:0 (CUDA_VISIBLE_DEVICES); write cuda")
        if 0 < self.ray.object_store_mb < 75:
            raise ConfigError("ray.object_store_mb", f"{self.ray.object_store_mb} MiB is below Ray's least object "
                                                     "store (75 MiB); give 75 or more, or 0 for Ray's default")
        if self.ray.address and not self.ray.address.startswith("ray://") and self.ray.address != "auto" \
                and ":" not in self.ray.address:
            raise ConfigError("ray.address", f"{self.ray.address!r} is not a Ray address: give auto, HOST:PORT "
                                             "or ray://HOST:PORT, or leave it empty to start a local cluster")

    def device_of(self, worker: int) -> str:
        return self.devices[0] if len(self.devices) == 1 else self.devices[worker]

    @property
    def host_measures(self) -> bool:
        """Whether the CPU-host measures run (``cpu_host``; auto: when every worker is a CPU)."""
        if self.cpu_host != "auto":
            return self.cpu_host == "on"
        return all(self.device_of(i) == "cpu" for i in range(self.workers))
