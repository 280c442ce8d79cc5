"""Admission: what a stream asks for, what the scheduler answers, and why it may say no.

A stream asks for an output-interval SLO (and optionally a response-latency
SLO). The answer is a :class:`Decision`: admitted with its placement, or
rejected with the resource that ran out (:data:`REASONS`). Running streams never
move; removing a stream frees its time, its KV and, with the last stage that
used them, a device's copy of a block's weights.

Policies: :class:`~physis_ros.scheduling.placement.JointScheduler` (virtual
ranks, Best-Fit + LDS) and :class:`~physis_ros.scheduling.equal.EqualSplitScheduler`
(the baseline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.settings import SchedulingConfig


@dataclass(frozen=True)
class StreamRequest:
    stream: str
    model: str
    slo_ms: float                        # output interval
    latency_slo_ms: float | None = None  # response latency (optional)
    jitter_budget_ms: float | None = None  # how much its chunk latency may vary (interval SLO - release pace)
    paced: bool = False                  # released once per slo_ms, at a phase of it the scheduler picks


@dataclass
class Decision:
    request: StreamRequest
    admitted: bool
    reason: str | None                   # which resource ran out (None when admitted)
    detail: str
    placed: PlacedStream | None
    decision_ms: float                   # wall time of the decision
    nodes: int = 0                       # search nodes expanded
    discrepancies: int = 0               # of the placement taken
    cpu_ms: float = 0.0                  # CPU time of the deciding thread (immune to other processes)

    def as_dict(self) -> dict:
        out = {"stream": self.request.stream, "model": self.request.model, "slo_ms": self.request.slo_ms,
               "admitted": self.admitted, "reason": self.reason, "detail": self.detail,
               "decision_ms": round(self.decision_ms, 4), "cpu_ms": round(self.cpu_ms, 4), "nodes": self.nodes,
               "discrepancies": self.discrepancies}
        if self.placed is not None:
            out.update(self.placed.as_dict())
        return out


REASONS = {
    "slo-unreachable": "a single stage (with its hop) is slower than the SLO budget, even alone",
    "memory-unreachable": "a single stage does not fit one device's memory",
    "latency-unreachable": "compute plus hops exceed the response-latency SLO, even alone",
    "time-capacity": "no device has enough time capacity left for a rank",
    "memory": "the devices with time capacity left lack memory for a rank (or all the workers together, empty, "
              "lack it for one stream of the model: checked from its shape before it is built or profiled)",
    "latency-jitter": "the chunks that would share a device could delay some stream's chunk by more than its "
                      "interval SLO leaves over the interval it is released at",
    "no-group": "every equal-split group is taken",
}


class Scheduler:
    def __init__(self, cluster: Cluster, config: SchedulingConfig):
        self.cluster = cluster
        self.config = config
        self.headroom = cluster.headroom
        self.device_bytes = float(cluster.mem_cap.max())

    def _reject(self, req: StreamRequest, reason: str, detail: str, t0: float, nodes: int = 0) -> Decision:
        return Decision(req, False, reason, detail, None, (time.perf_counter() - t0) * 1e3, nodes)

    def admit(self, req: StreamRequest) -> Decision:
        """Admit ``req`` (placing it) or reject it with the reason; running streams never move."""
        c0 = time.thread_time()
        decision = self._admit(req)
        decision.cpu_ms = (time.thread_time() - c0) * 1e3
        return decision

    def _admit(self, req: StreamRequest) -> Decision:
        raise NotImplementedError

    def _check_request(self, req: StreamRequest) -> None:
        if req.stream in self.cluster.streams:
            raise ValueError(f"stream '{req.stream}' is already running")
        if req.model not in self.cluster.profiles:
            raise KeyError(f"no cost profile for model '{req.model}' "
                           f"(have: {', '.join(sorted(self.cluster.profiles))})")
        if req.slo_ms <= 0:
            raise ValueError(f"SLO of stream '{req.stream}' must be > 0 ms, got {req.slo_ms}")
        if req.jitter_budget_ms is not None and req.jitter_budget_ms < 0:
            raise ValueError(f"jitter budget of stream '{req.stream}' must be >= 0 ms, got {req.jitter_budget_ms}")

    def remove(self, stream: str) -> PlacedStream:
        return self.cluster.remove_stream(stream)
