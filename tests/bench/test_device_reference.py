"""The device check's comparison across a reset: every chunk is compared with the reference of its epoch (the
uninterrupted one before the first reset, one restarted with fresh K/V at the first chunk after it), so a run
that lost a worker is judged on its arithmetic, and a chunk compared with the wrong epoch shows as a diff."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from physis_ros.bench.device import STREAM, EpochReference, epochs_of
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout, reference_rollout


@dataclass
class Record:
    enqueue: float


@dataclass
class Out:
    chunk: int
    output: np.ndarray
    record: Record


def test_chunks_after_a_reset_are_compared_with_the_restarted_reference():
    cfg = load_model_config("tiny-wam")
    scene, model = SyntheticScene(cfg.observation_shapes), build_model(cfg)
    chunks = 3 * cfg.window + 2
    unbroken = [r.output.numpy() for r in reference_rollout(model, scene.observation, [STREAM], chunks)]
    # What a server computes when its stream is reset at t=10 s: chunks 0-4 in epoch 0, 5-6 lost, 7.. afresh
    restarted = ReferenceRollout(model)
    restarted.restart(STREAM, 7)
    outputs = [Out(c, unbroken[c], Record(float(c))) for c in range(5)]
    outputs += [Out(c, restarted.step(STREAM, scene.observation(STREAM, c)).output.numpy(), Record(10.0 + c))
                for c in range(7, chunks)]
    resets = [{"time": 9.5, "cause": "worker-lost", "reason": "w1 lost", "lost": 2}]
    epochs = epochs_of(outputs, resets)
    assert epochs == [0] * 5 + [1] * (chunks - 7)
    want = EpochReference(model, scene, unbroken).expected(outputs, epochs)
    assert all(np.array_equal(o.output, w) for o, w in zip(outputs, want))
    # against the uninterrupted reference alone the same outputs differ (what the check reported before)
    assert any(not np.array_equal(o.output, unbroken[o.chunk]) for o in outputs[5:])
    # and a reset the check did not know of makes the restarted chunks differ
    blind = EpochReference(model, scene, unbroken).expected(outputs, epochs_of(outputs, []))
    assert any(not np.array_equal(o.output, w) for o, w in zip(outputs, blind))
