"""Noisy-KV semantics of the sequential reference: window, receptive field, per-step caches."""

import dataclasses

import numpy as np
import pytest
import torch

from physis_ros.model import KVBatch, build_model, load_model_config
from physis_ros.model.stages import chunk_input, run_stage
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout, reference_rollout


def small_model(**changes):
    cfg = dataclasses.replace(load_model_config("tiny-wam"), sink=False, **changes)
    return build_model(cfg)


def outputs(model, chunks, perturb=None):
    """Chunk outputs; ``perturb`` is the index of a chunk whose observation is altered."""
    scene = SyntheticScene(model.config.observation_shapes)

    def source(stream, c):
        obs = scene.observation(stream, c)
        if c == perturb:
            obs = {k: v + np.float32(0.25) for k, v in obs.items()}
        return obs

    return [r.output for r in reference_rollout(model, source, ["r0"], chunks)]


def test_window_boundary_is_exact_with_one_stage():
    # K = 1 step, L = 1 block: chunk c reads exactly chunks c-W..c-1 and nothing older.
    model = small_model(blocks=1, steps=1, window=2)
    base = outputs(model, 6)
    older = outputs(model, 6, perturb=2)  # chunk 5 is W+1 = 3 chunks later
    inside = outputs(model, 6, perturb=3)  # exactly W = 2 chunks before chunk 5
    assert torch.equal(base[5], older[5])
    assert not torch.equal(base[3], older[3])  # the perturbation itself did take effect
    assert not torch.equal(base[5], inside[5])


def test_receptive_field_is_window_times_stages():
    # Information travels W chunks back per stage, so chunk c sees chunks c - W*K*L .. c.
    model = small_model(blocks=2, steps=2, window=1)
    reach = 1 * 2 * 2
    c = 7
    base = outputs(model, c + 1)
    assert torch.equal(base[c], outputs(model, c + 1, perturb=c - reach - 1)[c])
    assert not torch.equal(base[c], outputs(model, c + 1, perturb=c - reach)[c])


def test_chunk_reads_kv_written_at_its_own_step(tiny_wam):
    model, cfg = tiny_wam, tiny_wam.config
    scene = SyntheticScene(cfg.observation_shapes)
    ref = ReferenceRollout(model)
    for c in range(3):
        ref.step("r0", scene.observation("r0", c))
    tables = ref._tables["r0"]
    obs = model.observation_tensors(scene.observation("r0", 3))
    state = chunk_input(obs, model.noise(0, "r0", 3))
    k = cfg.steps  # the first stage of chunk 3: (K, 0)

    def first_stage(mutate_slot=None):
        table = model.new_kv_table(0, cfg.steps)
        for slot in range(cfg.steps):
            table.k[slot].copy_(tables[0].k[slot])
            table.v[slot].copy_(tables[0].v[slot])
        table.length = dict(tables[0].length)
        if mutate_slot is not None:
            table.k[mutate_slot].add_(1.0)
        return run_stage(model, 0, [k], [state], KVBatch(table, [k - 1]))[0]["h"]

    reference = first_stage()
    for other in range(1, cfg.steps):  # slots of steps 1..K-1
        assert torch.equal(reference, first_stage(mutate_slot=other - 1))
    assert not torch.equal(reference, first_stage(mutate_slot=k - 1))


def test_observation_with_wrong_shape_names_the_field(tiny_wam):
    obs = SyntheticScene(tiny_wam.config.observation_shapes).observation("r0", 0)
    obs["state"] = obs["state"][:3]
    with pytest.raises(ValueError, match="'state' has shape"):
        ReferenceRollout(tiny_wam).step("r0", obs)
    del obs["state"]
    with pytest.raises(ValueError, match="missing 'state'"):
        ReferenceRollout(tiny_wam).step("r0", obs)
