"""The equal-split baseline: devices cut into fixed groups, one stream per group.

The group size is the smallest that meets the SLO (for a mixed workload, the
largest any of its models needs); a stream's stages are balanced over its
group with :func:`~physis_ros.runtime.plans.linear_partition`. No sharing, no
packing: what the joint scheduler must never do worse than.
"""

from __future__ import annotations

import time

from physis_ros.scheduling.admission import Decision, Scheduler, StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.ranks import EPS, Unplaceable, VirtualRank, equal_ranks
from physis_ros.scheduling.settings import SchedulingConfig


class EqualSplitScheduler(Scheduler):
    """The baseline: devices cut into fixed groups of ``group`` devices, one stream per group."""

    def __init__(self, cluster: Cluster, config: SchedulingConfig, group: int):
        super().__init__(cluster, config)
        if group < 1:
            raise ValueError("group size must be >= 1")
        self.group = group
        self.groups = [list(range(i * group, (i + 1) * group)) for i in range(cluster.n // group)]
        self.owner: dict[int, str] = {}           # group -> stream
        self._ranks: dict[tuple[str, float], list[VirtualRank]] = {}

    def _admit(self, req: StreamRequest) -> Decision:
        t0 = time.perf_counter()
        self._check_request(req)
        key = (req.model, req.slo_ms)
        try:
            if key not in self._ranks:
                self._ranks[key] = equal_ranks(self.cluster.profiles[req.model], req.slo_ms, self.headroom,
                                               self.device_bytes, group=self.group)
        except Unplaceable as exc:
            return self._reject(req, exc.reason, exc.detail, t0)
        ranks = self._ranks[key]
        latency = sum(r.work_ms for r in ranks)
        if req.latency_slo_ms is not None and latency > req.latency_slo_ms + EPS:
            return self._reject(req, "latency-unreachable", f"{len(ranks)} ranks: {latency:.2f} ms compute + hops "
                                                            f"> latency SLO {req.latency_slo_ms:g} ms", t0)
        free = next((g for g in range(len(self.groups)) if g not in self.owner), None)
        if free is None:
            return self._reject(req, "no-group", f"all {len(self.groups)} groups of {self.group} devices are taken", t0)
        devices = self.groups[free][:len(ranks)]
        prof = self.cluster.profiles[req.model]
        for r, d in zip(ranks, devices):
            if r.alone_bytes(prof) > self.cluster.mem_cap[d]:
                return self._reject(req, "memory", f"rank {r.describe()} needs {r.alone_bytes(prof) / 1e9:.2f} GB "
                                                   f"> {self.cluster.mem_cap[d] / 1e9:.2f} GB on device {d}", t0)
        placed = PlacedStream(req.stream, req.model, req.slo_ms, list(ranks), devices, "equal", req.latency_slo_ms)
        self.cluster.add_stream(placed)
        self.owner[free] = req.stream
        return Decision(req, True, None, f"group {free}: devices {devices}", placed, (time.perf_counter() - t0) * 1e3)

    def remove(self, stream: str) -> PlacedStream:
        placed = super().remove(stream)
        self.owner = {g: s for g, s in self.owner.items() if s != stream}
        return placed
