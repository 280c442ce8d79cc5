"""A worker's ready-queue policy and adaptive batching of same-weight tasks.

Policy: ``oldest`` runs the task whose chunk entered the pipeline first;
``edf`` the one whose deadline is earliest: the time by which its chunk must
leave to keep the stream's published interval within its SLO (one SLO interval
after the previous chunk left, or after its own release while that one is
still in flight; :meth:`~physis_ros.runtime.streams.StreamState.slack_s`).
Both are starvation-free: every waiting task eventually holds the smallest key,
because keys only grow for later chunks.

Batching merges ready tasks that use the *same weights* (the same block of the
same model; other steps, chunks or streams) into one forward, never two tasks that share a KV slot (a later chunk
must read what the earlier one appends). ``adaptive`` batches only when the
measured cost per task of a batch is lower than running the tasks one by
one, so batching can't be slower than not batching beyond a few exploratory
runs. Costs start from a profile (``physis-profile``) where one is given and
are refined online from the worker's own timings.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol

MIN_SAMPLES = 3
HISTORY = 16
PROBE_EVERY = 64  # decisions per block between re-measurements of the option not taken
POLICIES = ("oldest", "edf")
BATCHING = ("off", "on", "adaptive")


class Schedulable(Protocol):
    @property
    def weights(self) -> Hashable:
        """Which weights the task's forward uses (the block, of a model): only such tasks batch."""

    @property
    def order(self) -> float: ...

    @property
    def deadline(self) -> float: ...


class BatchPolicy:
    def __init__(self, policy: str = "oldest", batching: str = "off", max_batch: int = 4,
                 profile: dict[Hashable, dict[int, float]] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy '{policy}'; choose one of {', '.join(POLICIES)}")
        if batching not in BATCHING:
            raise ValueError(f"unknown batching mode '{batching}'; choose one of {', '.join(BATCHING)}")
        self.policy = policy
        self.batching = batching
        self.max_batch = max(1, max_batch)
        self.samples: dict[tuple[Hashable, int], deque[float]] = {}
        self.decisions: dict[Hashable, int] = {}
        for weights, by_size in (profile or {}).items():
            self.seed(weights, by_size)

    def seed(self, weights: Hashable, by_size: dict[int, float]) -> None:
        """Start the estimates of ``weights`` from a profile ({batch size: ms}), as if measured."""
        for n, ms in by_size.items():
            self.samples[(weights, int(n))] = deque([float(ms)] * MIN_SAMPLES, maxlen=HISTORY)

    def key(self, task: Schedulable) -> tuple[float, float]:
        return (task.deadline, task.order) if self.policy == "edf" else (task.order, task.deadline)

    def pick(self, ready: list, slot_key: Callable[[Schedulable], Hashable]) -> list:
        head = min(ready, key=self.key)
        if self.batching == "off" or self.max_batch == 1:
            return [head]
        block = head.weights
        used = {slot_key(head)}
        mates = []
        for t in sorted((t for t in ready if t is not head and t.weights == block), key=self.key):
            if slot_key(t) in used:
                continue
            used.add(slot_key(t))
            mates.append(t)
            if len(mates) + 1 >= self.max_batch:
                break
        n = 1 + len(mates)
        if self.batching == "adaptive" and n > 1:
            n = self.best_size(block, n)
        return [head, *mates[:n - 1]]

    def cost(self, block: Hashable, n: int) -> float | None:
        s = self.samples.get((block, n))
        return statistics.median(s) if s and len(s) >= MIN_SAMPLES else None

    def best_size(self, block: Hashable, available: int) -> int:
        """``available`` if one batched forward measured cheaper than that many single ones, else 1.

        Only the two ends are compared: per-task cost falls smoothly with batch size when a
        block is overhead-bound, and picking in-between sizes on noisy timings would break the
        lockstep in which chunks move through a worker's blocks together.
        """
        single, batched = self.cost(block, 1), self.cost(block, available)
        if single is None:
            return 1
        if batched is None:
            return available
        choice = available if batched <= available * single else 1
        # Now and then run the other option once: estimates of an option never taken would
        # otherwise stay frozen at whatever a passing disturbance made them.
        self.decisions[block] = self.decisions.get(block, 0) + 1
        if self.decisions[block] % PROBE_EVERY == 0:
            return 1 if choice == available else available
        return choice

    def observe(self, block: Hashable, n: int, ms: float) -> None:
        samples = self.samples.get((block, n))
        if samples is None:   # (not setdefault: that would build a deque for every stage run)
            samples = self.samples[(block, n)] = deque(maxlen=HISTORY)
        samples.append(ms)
