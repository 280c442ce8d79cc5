"""Admission in the served product: every stream, from the serve config at start-up or from a
ServeStream goal later, is admitted through one joint scheduler over this server's workers.

Each worker is one device of the scheduler's cluster. A request is checked first for what no
placement can fix (a model that does not exist or does not fit the robot, a name or namespace in
use, bad joint names), then placed by Best-Fit + LDS as virtual ranks
(:class:`~physis_ros.scheduling.placement.JointScheduler`) on the model's cost profile, with
time-sharing credited at the measured batch-cost curve when the workers batch, and checked against
each worker's measured load and each running stream's measured intervals
(:mod:`physis_ros.serving.calibration`). An admitted
stream gets its own plan (its ranks' stages on their workers) and never moves; removing it frees
its time and memory for the next. Rejections name the reason (:data:`REASONS`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from physis_ros.serving.calibration import IntervalCalibration, LoadCalibration
from physis_ros.runtime.plans import Plan
from physis_ros.runtime.streams import ServedModel
from physis_ros.scheduling.admission import REASONS as PLACEMENT_REASONS
from physis_ros.scheduling.admission import StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.ranks import Unplaceable
from physis_ros.runtime.costs import stream_memory_bytes
from physis_ros.scheduling.settings import GB, DeviceSpec, SchedulingConfig

if TYPE_CHECKING:
    from physis_ros.model.spec import ModelConfig

# A rejected stream's reason says what its sender must change (README's table is kept in step with this by
# tests/ros/test_admission_unit.py); the scheduler's own cause (PLACEMENT_REASONS) follows its detail in [].
REASONS = {
    "invalid-request": "a field of the request is malformed (name, namespace, joints, rates, topics): fix the "
                       "field the detail names",
    "unknown-model": "the model is not a preset, a model YAML or a checkpoint this server can read: name one "
                     "that is",
    "model-mismatch": "the model's inputs or outputs do not fit the stream (joint count, observations): give the "
                      "joints and topics the model takes, or another model",
    "timeline": "the SLO interval or execution horizon does not fit the model's control timeline (an SLO longer "
                "than the executed rows of a chunk last, a horizon longer than the chunk): shorten "
                "slo_interval_ms or change execution_horizon",
    "slo-too-tight": "no placement meets the stream's SLO: a stage alone is slower than it, or the chunks sharing "
                     "a worker (or its cores) would delay this stream's or another's chunks past what their SLO "
                     "leaves: loosen slo_interval_ms (up to the control timeline's interval), or try again when "
                     "fewer streams are served",
    "capacity": "the workers' time, the host's cores or engine.max_streams are taken by the streams served: "
                "remove a stream, add workers, or try again later",
    "memory": "the model's weights and KV do not fit the workers' memory (or admission.profile_memory_gb for its "
              "measurement): a smaller model, or workers with more memory",
    "name-in-use": "a stream of that name is already served: pick another name",
    "namespace-in-use": "another stream already uses that namespace: pick another namespace",
    "topic-collision": "a topic the stream would publish on belongs to another stream or the server (or lies "
                       "outside the namespace of a goal): change its topics or namespace",
    "busy": "admission.max_pending_goals goals are being admitted already (a burst): ask again shortly",
    "profile-failed": "measuring the model's cost profile failed or took longer than admission.profile_timeout_s: "
                      "give one in admission.profiles (physis-profile)",
    "not-serving": "the server is not serving (not configured, or its engine failed, or could not start the "
                   "stream): see its log, start it again",
    "internal-error": "the server failed while admitting the stream (a bug): its log has the details; report it",
}
# The scheduler's causes, and the reason each is reported under.
CAUSES = {"slo-unreachable": "slo-too-tight", "latency-unreachable": "slo-too-tight",
          "latency-jitter": "slo-too-tight", "time-capacity": "capacity", "no-group": "capacity",
          "memory-unreachable": "memory", "memory": "memory", "host-cpu": "capacity", "stream-limit": "capacity"}
assert set(PLACEMENT_REASONS) <= set(CAUSES) and set(CAUSES.values()) <= set(REASONS)


@dataclass
class Admitted:
    """An admitted stream: where it runs."""

    stream: str
    model: ServedModel
    plan: Plan
    placed: PlacedStream

    @property
    def workers(self) -> list[str]:
        return [f"w{i}" for i in self.plan.workers_used]


def worker_index(worker: str) -> int:
    """The device index admission knows worker ``worker`` by (``w3`` -> 3, as :attr:`Admitted.workers` names
    them); -1 for any other name."""
    return int(worker[1:]) if worker[:1] == "w" and worker[1:].isdigit() else -1


class Rejected(Exception):
    """A stream that cannot come in: ``reason`` one of :data:`REASONS` (what to change), ``detail`` what
    exactly, ending in ``[cause]`` where a finer cause (:data:`CAUSES`) decided it."""

    def __init__(self, reason: str, detail: str, cause: str | None = None):
        if cause is not None and cause != reason:
            detail = f"{detail} [{cause}]"
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.cause = cause or reason

    @property
    def label(self) -> str:
        """The reason label (README's "Why a robot is refused"): the same as ``reason``."""
        return self.reason


def plan_of(placed: PlacedStream, steps: int, blocks: int, clean: bool = False) -> Plan:
    """The runtime plan of a placed stream: each stage on the worker (device) of its rank."""
    assignment = {s: d for r, d in zip(placed.ranks, placed.devices) for s in r.stages}
    return Plan("joint", steps, blocks, assignment, clean)


@dataclass(frozen=True)
class HostBudget:
    """CPU workers share one host with the node: the workers' load (cores) plus ``reserve`` plus
    ``per_stream`` per served stream (the node's callbacks, conversion and publishing) must stay within
    ``cores x (1 - headroom)``."""

    cores: int
    reserve: float
    per_stream: float
    headroom: float
    memory_bytes: float = float("inf")   # the host's physical memory, which its CPU workers share

    def used(self, worker_load: float, streams: int) -> float:
        return worker_load + self.reserve + self.per_stream * streams

    @property
    def capacity(self) -> float:
        return self.cores * (1.0 - self.headroom)


def host_memory_bytes() -> float:
    """The host's physical memory (bytes; inf where the platform does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return float("inf")


class ServerAdmission:
    """The joint scheduler over this server's workers (one device each)."""

    def __init__(self, workers: int, device: DeviceSpec, config: SchedulingConfig, max_batch: int = 1,
                 host: HostBudget | None = None, calibration: LoadCalibration | None = None,
                 deadline_order: bool = False, bound_jitter: bool = True,
                 intervals: IntervalCalibration | None = None, enforce: bool = True,
                 vetoes: Sequence[Callable[[ServerAdmission, str, np.ndarray], None]] = ()):
        self.cluster = Cluster([device] * workers, config.headroom, {}, max_batch=max_batch,
                               deadline_order=deadline_order)
        self.scheduler = JointScheduler(self.cluster, config)
        self.admitted: dict[str, Admitted] = {}
        self.host = host
        if host is not None:   # CPU workers: they share the host's cores, less what the node keeps
            self.cluster.jitter.shared_cores = max(1e-3, host.cores - host.reserve)
        self.calibration = calibration   # measured load per worker (None: trust the profiles alone)
        self.bound_jitter = bound_jitter  # admit streams with their latency-jitter budget (slo - pace)
        # measured intervals per stream (None: the bound alone); what each showed beyond its bound is kept in
        # the jitter bound, which charges it (JitterBound.spread)
        self.intervals = intervals
        self.version = 0   # placements on the host: every join and leave counts (restarts the interval windows)
        # False: admission off (admission.enforce), every stream placed on the least booked workers, unchecked
        self.enforce = enforce
        # refusals after a placement (each raises Rejected; the placement is undone): the host budget's, then
        # registered checks' own
        self.vetoes = [*([host_cpu_veto] if host is not None else []), *vetoes]

    def check_memory(self, config: ModelConfig) -> None:
        """Rejected("memory") when one stream of ``config`` cannot fit all the workers' memory together even
        with nothing else served: decided from the model's shape alone, before it is built or profiled, so
        the same request gets the same answer whatever the server runs."""
        need = stream_memory_bytes(config)
        total = sum(need.values())
        cap = float(self.cluster.mem_cap.sum())
        spec = self.cluster.specs[0]
        held = (f"the server's {len(self.cluster.specs)} worker(s) hold {cap / GB:.1f} GB ({spec.name}: "
                f"{spec.usable_bytes / GB:.1f} GB usable each)")
        if self.host is not None and self.host.memory_bytes < cap:   # CPU workers: the host's memory, shared
            cap = self.host.memory_bytes
            held = f"the host's CPU workers share its {cap / GB:.1f} GB"
        if total > cap:
            raise Rejected("memory", f"model '{config.name}' needs {total / GB:.1f} GB for one stream (weights "
                                     f"{need['weights'] / GB:.1f} GB, KV {need['kv'] / GB:.1f} GB, buffers "
                                     f"{need['buffers'] / GB:.2f} GB); {held}")

    def admit(self, stream: str, model: ServedModel, pace_ms: float, slo_ms: float | None = None,
              paced: bool = True, latency_bound: bool = False) -> Admitted:
        """Place ``stream``, released every ``pace_ms`` (its booked interval), or raise :class:`Rejected`
        naming why; nothing running moves. With ``slo_ms`` (its published-interval SLO) its chunks'
        latency may vary by ``slo_ms - pace_ms``, and no placement may make that or any other budgeted
        stream's worst-case jitter exceed its budget. ``paced``: the engine releases it every ``pace_ms``
        at the phase admission picks (``placed.phase_ms``); else whenever it can (booked at ``pace_ms``).
        ``latency_bound``: ``slo_ms`` bounds each chunk's latency instead (a client waiting for the chunk of
        its observation): it may vary by ``slo_ms`` less the chunk's own work (its profile's ``chunk_ms``)."""
        if stream in self.admitted:
            raise Rejected("name-in-use", f"stream '{stream}' is already served")
        if model.profile is None:
            raise Rejected("unknown-model", f"no cost profile for model '{model.id}'")
        if model.id not in self.cluster.profiles:
            # The cluster tells weight sets apart by the profile's model name: make it the model's id.
            self.cluster.profiles[model.id] = dataclasses.replace(model.profile, model=model.id)
        # A worker measured busier than its profiles say takes that much less booking (Best-Fit sees it).
        factors = self._load_into_cluster()
        own = model.profile.chunk_ms() if latency_bound else pace_ms
        budget = None if slo_ms is None or not self.bound_jitter else max(0.0, slo_ms - own)
        request = StreamRequest(stream, model.id, pace_ms, jitter_budget_ms=budget, paced=paced)
        if not self.enforce:
            return self._admit_unchecked(request, model)
        decision = self.scheduler.admit(request)
        if not decision.admitted:
            raise Rejected(CAUSES.get(decision.reason, decision.reason), decision.detail, cause=decision.reason)
        for veto in self.vetoes:
            try:
                veto(self, stream, factors)
            except Rejected:
                self.scheduler.remove(stream)   # nothing else moved: undo this placement only
                raise
        return self._book(model, decision.placed)

    def _admit_unchecked(self, request: StreamRequest, model: ServedModel) -> Admitted:
        """Admission off: the stream placed on the least booked workers whatever its SLO and their time
        (memory still checked)."""
        try:
            placed = self.scheduler.place_unchecked(request)
        except Unplaceable as exc:
            raise Rejected(CAUSES[exc.reason], exc.detail, cause=exc.reason) from None
        if placed is None:
            raise Rejected("memory", f"no worker has the memory left for a rank of model '{model.id}'",
                           cause="memory")
        return self._book(model, placed)

    def _book(self, model: ServedModel, placed: PlacedStream) -> Admitted:
        """A stream placed: its plan, kept as admitted (a new placement on the host)."""
        cfg = model.config
        admitted = Admitted(placed.stream, model, plan_of(placed, cfg.steps, cfg.blocks, cfg.clean_pass), placed)
        self.admitted[placed.stream] = admitted
        self.version += 1
        return admitted

    def remove(self, stream: str) -> None:
        if self.admitted.pop(stream, None) is not None:
            self.scheduler.remove(stream)
            self.version += 1
        self.cluster.jitter.forget(stream)
        if self.intervals is not None:
            self.intervals.forget(stream)

    def utilisation(self) -> list[float]:
        return [round(float(u), 4) for u in self.cluster.util]

    def observe_load(self, worker: int, t: float, compute_ms: float) -> None:
        """Worker ``worker``'s cumulative compute counter read at ``t`` (s), for the load calibration."""
        if self.calibration is not None and 0 <= worker < self.cluster.n:
            self.calibration.observe(worker, t, compute_ms, float(self.cluster.util[worker]))

    def load_factor(self, worker: int) -> float:
        """Worker ``worker``'s measured busy / booked (1.0: as profiled, or not measured yet)."""
        return 1.0 if self.calibration is None else self.calibration.factor(worker)

    def load_factors(self) -> list[float]:
        return [self.load_factor(w) for w in range(self.cluster.n)]

    def observe_intervals(self, stream: str, now: float, records: list[tuple[float, float]]) -> None:
        """Stream ``stream``'s recent (emit time, interval ms) at ``now`` (one clock). Once a whole window of
        them shows its interval p99 under the host's current placements, what that p99 exceeds its release
        interval by beyond its jitter bound is a spread it has; the largest of the last minute is charged
        (:meth:`IntervalCalibration.remember`): later placements must keep its bound plus that spread within
        its budget, i.e. its measured p99 plus what they add within its SLO. A newcomer is charged the largest
        spread measured (:meth:`JitterBound.spread_ms`)."""
        placed = self.cluster.streams.get(stream)
        if self.intervals is None or placed is None or placed.phase_ms is None or placed.jitter_budget_ms is None:
            return   # only paced streams publish at their booked interval plus their chunks' jitter
        p99 = self.intervals.observe(stream, self.version, now, records)
        if p99 is None:
            return
        self._load_into_cluster()
        spread = max(0.0, p99 - placed.slo_ms - self.cluster.jitter.bound_ms(placed))
        self.cluster.jitter.charge(stream, self.intervals.remember(stream, now, spread))

    def _load_into_cluster(self) -> np.ndarray:
        """Each worker's measured load factor, as the cluster's bound and caps must use it now."""
        factors = np.array(self.load_factors())
        self.cluster.set_load_factors(factors)
        return factors

    @property
    def spreads(self) -> dict[str, float]:
        """Per measured stream: what it showed beyond its bound (ms), as admission charges it."""
        return self.cluster.jitter.spread

    def spread_ms(self, stream: str) -> float | None:
        """What ``stream`` was measured to vary beyond its bound (ms); None: not measured yet."""
        return self.cluster.jitter.spread.get(stream)

    def follow(self, factors: dict[int, float], spreads: dict[str, float] | None = None) -> None:
        """Take load factors and spreads measured elsewhere (a benchmark replaying a server's decisions)."""
        if self.calibration is not None:
            self.calibration.set_factors(factors)
        if self.intervals is not None and spreads:
            for s, v in spreads.items():
                if s in self.admitted:
                    self.cluster.jitter.charge(s, v)


def host_cpu_veto(admission: ServerAdmission, stream: str, factors: np.ndarray) -> None:
    """The host budget (``host-cpu``) of a placement just made: the workers' load as they run now (each
    booking scaled by its worker's measured factor), plus what the node keeps, within the host's cores."""
    host = admission.host
    used = host.used(float((admission.cluster.util * factors).sum()), len(admission.admitted) + 1)
    if used > host.capacity + 1e-9:
        raise Rejected("capacity", f"{used:.2f} of the host's {host.cores} cores would be in use (at most "
                                   f"{host.capacity:.2f}: workers' load plus {host.reserve:g} + "
                                   f"{host.per_stream:g} per stream)", cause="host-cpu")
