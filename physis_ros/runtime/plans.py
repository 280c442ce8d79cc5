"""Placement plans: which worker runs each stage ``(k, b)``.

``sequential``  one worker runs every stage (the baseline of baselines)
``step``        Wave-Forcing style: each worker runs whole-model forwards for a
                contiguous group of denoising steps
``block``       StreamDiffusionV2 style: each worker owns a contiguous block range
                for every step
``stage``       PhysisServe: the K*L stages, in pipeline order, cut into contiguous
                segments that minimise the bottleneck worker's per-chunk compute
                (one stage per worker when there are enough workers)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Stage = tuple[int, int]  # (step k in K..1, or 0: the clean pass; block b in 0..L-1)
PLAN_NAMES = ("sequential", "step", "block", "stage")


def next_stage(stage: Stage, steps: int, blocks: int, clean: bool = False) -> Stage | None:
    """The stage a chunk visits after ``stage``; None after the last one: ``(1, L-1)``, or with ``clean`` (the
    clean history rule: a pass at t = 0 over the finished chunk writes the K/V later chunks read) ``(0, L-1)``."""
    k, b = stage
    if b + 1 < blocks:
        return (k, b + 1)
    return (k - 1, 0) if k > 1 or (k == 1 and clean) else None


def pipeline_order(steps: int, blocks: int, clean: bool = False) -> list[Stage]:
    """All stages in the order one chunk visits them (with ``clean``, the clean pass's row 0 last)."""
    return [(k, b) for k in range(steps, -1 if clean else 0, -1) for b in range(blocks)]


@dataclass(frozen=True)
class Plan:
    name: str
    steps: int
    blocks: int
    assignment: dict[Stage, int]  # stage -> worker index
    clean: bool = False           # the clean history rule: a row 0 of clean-pass stages, one chunk in flight

    @property
    def order(self) -> list[Stage]:
        return pipeline_order(self.steps, self.blocks, self.clean)

    @property
    def workers_used(self) -> list[int]:
        return sorted(set(self.assignment.values()))

    def stages_of(self, worker: int) -> list[Stage]:
        return [s for s in self.order if self.assignment[s] == worker]

    def next_stage(self, stage: Stage) -> Stage | None:
        return next_stage(stage, self.steps, self.blocks, self.clean)

    @property
    def first_stage(self) -> Stage:
        return (self.steps, 0)

    def segments(self) -> list[tuple[int, list[Stage]]]:
        """Maximal runs of consecutive stages on one worker, in pipeline order."""
        runs: list[tuple[int, list[Stage]]] = []
        for s in self.order:
            w = self.assignment[s]
            if runs and runs[-1][0] == w:
                runs[-1][1].append(s)
            else:
                runs.append((w, [s]))
        return runs

    def peers_of(self, worker: int) -> set[int]:
        """The workers ``worker`` hands hidden states to or takes them from (adjacent segments)."""
        runs = [w for w, _ in self.segments()]
        return {b if a == worker else a for a, b in zip(runs, runs[1:]) if worker in (a, b)}

    def hops(self) -> int:
        """Worker-to-worker transfers per chunk (excluding engine in/out)."""
        return len(self.segments()) - 1

    def worker_cost(self, costs: dict[Stage, float]) -> dict[int, float]:
        out: dict[int, float] = {}
        for s, w in self.assignment.items():
            out[w] = out.get(w, 0.0) + costs[s]
        return out

    def in_flight(self, batching: bool, max_batch: int) -> int:
        """Chunks one stream needs in flight to keep every worker busy: one each, or, with batching,
        as many as the steps a worker hosts of one block (those chunks then move through its blocks
        in lockstep), plus one so the first worker never waits for the engine's round trip. Under the clean
        history rule one: chunk c reads what chunk c-1's clean pass writes, and that pass comes last."""
        if self.clean:
            return 1
        if not batching:
            return len(self.workers_used) + 1
        total = 0
        for w in self.workers_used:
            per_block: dict[int, int] = {}
            for _, b in self.stages_of(w):
                per_block[b] = per_block.get(b, 0) + 1
            total += min(max(per_block.values()), max_batch)
        return total + 1

    def describe(self) -> str:
        parts = []
        for w, stages in self.segments():
            (k0, b0), (k1, b1) = stages[0], stages[-1]
            parts.append(f"w{w}[{k0},{b0}..{k1},{b1}]")
        return f"{self.name}: " + " -> ".join(parts)


def _split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous groups covering n items as evenly as possible."""
    parts = min(parts, n)
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Sizes of at most ``parts`` contiguous groups minimising the largest group sum (exact DP)."""
    n = len(costs)
    parts = min(parts, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[p][i]: minimal bottleneck splitting the first i items into p groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i] - 1e-12:
                    best[p][i], cut[p][i] = v, j
    sizes, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def segment_assignment(order: list[Stage], sizes: list[int]) -> dict[Stage, int]:
    out, i = {}, 0
    for w, size in enumerate(sizes):
        for s in order[i:i + size]:
            out[s] = w
        i += size
    return out


def check_clean(plan: Plan) -> None:
    """ValueError unless every stage of a block runs on one worker under the clean rule: its steps read the K/V
    its clean pass writes, which stays where it is written."""
    if not plan.clean:
        return
    for b in range(plan.blocks):
        owners = {plan.assignment[(k, b)] for k in range(plan.steps + 1)}
        if len(owners) > 1:
            raise ValueError(f"plan '{plan.name}' puts block {b} on workers {sorted(owners)}; under the clean history "
                             f"rule every step of a block reads the K/V its clean pass writes, so a block's "
                             f"stages stay on one worker (use a sequential or block plan)")


def make_plan(name: str, steps: int, blocks: int, workers: int,
              stage_costs: dict[Stage, float] | None = None, clean: bool = False) -> Plan:
    """Build a named plan for ``workers`` workers (a plan may leave workers unused); ``clean``: the model reads
    history by the clean rule (a row 0 of clean-pass stages; a block's stages on one worker: ValueError for a
    plan that splits one, as the step and stage plans do on two workers or more)."""
    if name not in PLAN_NAMES:
        raise ValueError(f"unknown plan '{name}'; choose one of: {', '.join(PLAN_NAMES)}")
    if workers < 1:
        raise ValueError("a plan needs at least one worker")
    order = pipeline_order(steps, blocks, clean)
    if name == "sequential":
        assignment = {s: 0 for s in order}
    elif name == "step":
        sizes = _split_evenly(steps, workers)
        step_worker = {}
        k = steps
        for w, size in enumerate(sizes):
            for _ in range(size):
                step_worker[k] = w
                k -= 1
        step_worker[0] = step_worker[1]         # the clean pass (clean rule) follows the last step
        assignment = {(k, b): step_worker[k] for k, b in order}
    elif name == "block":
        sizes = _split_evenly(blocks, workers)
        block_worker = {}
        b = 0
        for w, size in enumerate(sizes):
            for _ in range(size):
                block_worker[b] = w
                b += 1
        assignment = {(k, b): block_worker[b] for k, b in order}
    else:
        costs = [1.0 if stage_costs is None else stage_costs[s] for s in order]
        assignment = segment_assignment(order, linear_partition(costs, workers))
    plan = Plan(name, steps, blocks, assignment, clean)
    check_clean(plan)       # the step and stage plans split a block's steps over two workers or more
    return plan
