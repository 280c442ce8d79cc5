"""Admission in the served product: every stream, from the serve config at start-up or from a
ServeStream goal later, is admitted through one joint scheduler over this server's workers.

Each worker is one device of the scheduler's cluster. A request is checked first for what no
placement can fix (a model that does not exist or does not fit the robot, a name or namespace in
use, bad joint names), then placed by Best-Fit + LDS as virtual ranks
(:class:`~physis_ros.scheduling.placement.JointScheduler`) on the model's cost profile, with
time-sharing credited at the measured batch-cost curve when the workers batch. An admitted
stream gets its own plan (its ranks' stages on their workers) and never moves; removing it frees
its time and memory for the next. Rejections name the reason (:data:`REASONS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from physis_ros.runtime.plans import Plan
from physis_ros.runtime.streams import ServedModel
from physis_ros.scheduling.admission import REASONS as PLACEMENT_REASONS
from physis_ros.scheduling.admission import StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.settings import DeviceSpec, SchedulingConfig

REASONS = {
    **PLACEMENT_REASONS,
    "unknown-model": "the model is not a preset, a model YAML or a checkpoint this server can read",
    "model-mismatch": "the model's inputs or outputs do not fit the stream (joint count, observations)",
    "name-in-use": "a stream of that name is already served",
    "namespace-in-use": "another stream already uses that namespace",
    "invalid-request": "a field of the request is malformed (name, namespace, joints, rates, topics)",
    "not-serving": "the server is not serving (not configured, or its engine failed)",
    "stream-limit": "the server holds engine.max_streams streams already",
    "internal-error": "the server failed while admitting the stream (a bug; its log has the details)",
}


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


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def plan_of(placed: PlacedStream, steps: int, blocks: int) -> Plan:
    """The runtime plan of a placed stream: each stage on the worker (device) of its rank."""
    assignment = {s: d for r, d in zip(placed.ranks, placed.devices) for s in r.stages}
    return Plan("joint", steps, blocks, assignment)


class ServerAdmission:
    """The joint scheduler over this server's workers (one device each)."""

    def __init__(self, workers: int, device: DeviceSpec, config: SchedulingConfig, max_batch: int = 1):
        self.cluster = Cluster([device] * workers, config.headroom, {}, max_batch=max_batch)
        self.scheduler = JointScheduler(self.cluster, config)
        self.admitted: dict[str, Admitted] = {}

    def admit(self, stream: str, model: ServedModel, slo_ms: float) -> Admitted:
        """Place ``stream`` (or raise :class:`Rejected` naming why); nothing running moves."""
        if stream in self.admitted:
            raise Rejected("name-in-use", f"stream '{stream}' is already served")
        if model.profile is None:
            raise Rejected("unknown-model", f"no cost profile for model '{model.id}'")
        if model.id not in self.cluster.profiles:
            # The cluster tells weight sets apart by the profile's model name: make it the model's id.
            self.cluster.profiles[model.id] = dataclasses.replace(model.profile, model=model.id)
        decision = self.scheduler.admit(StreamRequest(stream, model.id, slo_ms))
        if not decision.admitted:
            raise Rejected(decision.reason, decision.detail)
        cfg = model.config
        admitted = Admitted(stream, model, plan_of(decision.placed, cfg.steps, cfg.blocks), decision.placed)
        self.admitted[stream] = admitted
        return admitted

    def remove(self, stream: str) -> None:
        if self.admitted.pop(stream, None) is not None:
            self.scheduler.remove(stream)

    def utilisation(self) -> list[float]:
        return [round(float(u), 4) for u in self.cluster.util]
