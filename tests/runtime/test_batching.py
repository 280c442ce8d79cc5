"""A worker's ready-queue policy and adaptive batching decisions."""

from dataclasses import dataclass, field

import pytest

from physis_ros.runtime.batching import BatchPolicy


@dataclass
class T:
    stream: str
    chunk: int
    stage: tuple[int, int]
    ts: dict = field(default_factory=dict)
    model: str = "m"

    @property
    def weights(self):
        return (self.model, self.stage[1])

    @property
    def order(self):
        return self.ts.get("order", float(self.chunk))

    @property
    def deadline(self):
        return self.ts.get("deadline", self.order + 1.0)


def slot(t):
    return (t.stream, t.stage[0], t.stage[1])


def test_oldest_first_and_edf():
    a = T("a", 5, (4, 0), {"order": 1.0, "deadline": 9.0})
    b = T("b", 2, (4, 3), {"order": 2.0, "deadline": 3.0})
    assert BatchPolicy("oldest").pick([b, a], slot) == [a]
    assert BatchPolicy("edf").pick([a, b], slot) == [b]


def test_no_starvation_under_continuous_arrivals():
    sched = BatchPolicy("oldest")
    ready = [T("slow", 0, (4, 0), {"order": 0.5})]
    ran = []
    for i in range(20):
        ready.append(T("busy", i, (4, i % 8), {"order": 1.0 + i}))
        task = sched.pick(ready, slot)[0]
        ready.remove(task)
        ran.append(task.stream)
        if task.stream == "slow":
            break
    assert ran[0] == "slow"


def test_batches_same_block_only_and_never_two_tasks_of_one_slot():
    sched = BatchPolicy(batching="on", max_batch=4)
    ready = [T("a", 0, (3, 2)), T("a", 1, (4, 2)), T("a", 2, (4, 2)), T("b", 0, (3, 2)), T("a", 3, (4, 5))]
    batch = sched.pick(ready, slot)
    assert [(t.stream, t.chunk) for t in batch] == [("a", 0), ("b", 0), ("a", 1)]
    assert len({slot(t) for t in batch}) == len(batch)


def test_max_batch_and_off():
    ready = [T(f"s{i}", 0, (4, 0)) for i in range(6)]
    assert len(BatchPolicy(batching="on", max_batch=4).pick(ready, slot)) == 4
    assert len(BatchPolicy(batching="off").pick(ready, slot)) == 1


@pytest.mark.parametrize("batched_ms, expect", [(2.0, 4), (4.4, 1)])
def test_adaptive_uses_measured_costs(batched_ms, expect):
    # Overhead-bound: 4 tasks in 2.0 ms beat 4 x 1.0 ms; compute-bound: 4.4 ms loses.
    sched = BatchPolicy(batching="adaptive", max_batch=4, profile={("m", 0): {1: 1.0, 4: batched_ms}})
    ready = [T(f"s{i}", 0, (4, 0)) for i in range(4)]
    assert len(sched.pick(ready, slot)) == expect


def test_adaptive_explores_then_learns_online():
    sched = BatchPolicy(batching="adaptive", max_batch=2)
    ready = [T("a", 0, (4, 0)), T("b", 0, (4, 0))]
    sizes = []
    for _ in range(8):
        n = len(sched.pick(ready, slot))
        sizes.append(n)
        sched.observe(("m", 0), n, 1.0 if n == 1 else 3.0)  # batching measured slower here
    assert 2 in sizes[:7] and sizes[-1] == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        BatchPolicy("lifo")
    with pytest.raises(ValueError, match="unknown batching mode 'always'"):
        BatchPolicy(batching="always")


def test_adaptive_recovers_from_a_stale_estimate():
    # A disturbance made batching look slow; it is in fact faster. Periodic probes find out.
    sched = BatchPolicy(batching="adaptive", max_batch=2, profile={("m", 0): {1: 1.0, 2: 9.0}})
    ready = [T("a", 0, (4, 0)), T("b", 0, (4, 0))]
    sizes = []
    for _ in range(400):
        n = len(sched.pick(ready, slot))
        sizes.append(n)
        sched.observe(("m", 0), n, 1.0 if n == 1 else 1.2)  # the truth: a batch of 2 costs 1.2 ms
    assert sizes[0] == 1 and sizes[-50:].count(2) >= 48


def test_the_same_block_of_another_model_never_batches():
    sched = BatchPolicy(batching="on", max_batch=4)
    ready = [T("a", 0, (3, 2), model="wam"), T("b", 0, (3, 2), model="acwm"), T("c", 0, (4, 2), model="wam")]
    batch = sched.pick(ready, slot)
    assert [t.stream for t in batch] == ["a", "c"]
