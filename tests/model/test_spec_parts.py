"""A chunk of more than one tensor (a world-action model that also predicts its video): the spec's parts are
packed flat, actions first; front ends read each part as its own shape, and a spec that packs them wrongly is
refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from physis_ros.config import ConfigError
from physis_ros.model.spec import ModelSpec

ACTIONS, FRAMES = (4, 3), (2, 5, 2, 2)     # frames in the trunk's own axes (C, F, H, W)


def packed(**changes) -> ModelSpec:
    fields = dict(inputs={"state": (3,)}, output=(12 + 40,), produces="actions", tokens_per_chunk=9,
                  kv_slot_tokens=18, kv_width=8, block_params=100, block_flops=1e3, frame_axes="CFHW",
                  parts=(("actions", ACTIONS), ("frames", FRAMES)))
    return ModelSpec(**{**fields, **changes})


def test_packed_parts_read_back_as_their_own_shapes_actions_first():
    spec = packed()
    spec.check("toy", "m")
    flat = np.arange(52, dtype=np.float32)
    assert spec.actions_shape == ACTIONS and spec.has_frames
    assert np.array_equal(spec.actions_of(flat), flat[:12].reshape(ACTIONS))
    frames = spec.frames_of(flat)               # published [F, C, H, W]
    assert frames.shape == spec.frames_shape == (5, 2, 2, 2)
    assert np.array_equal(frames, flat[12:].reshape(FRAMES).swapaxes(0, 1))
    t = torch.arange(52.0)
    assert torch.equal(spec.actions_of(t), t[:12].view(ACTIONS))   # tensors too (the sampler's hand-off)


def test_a_one_part_spec_is_what_it_produces():
    actions = ModelSpec(inputs={"state": (3,)}, output=ACTIONS, produces="actions", tokens_per_chunk=9,
                        kv_slot_tokens=18, kv_width=8, block_params=100, block_flops=1e3)
    assert actions.actions_shape == ACTIONS and not actions.has_frames
    frames = ModelSpec(inputs={"state": (3,)}, output=(5, 2, 2, 2), produces="frames", tokens_per_chunk=9,
                       kv_slot_tokens=18, kv_width=8, block_params=100, block_flops=1e3)
    assert frames.actions_shape is None and frames.has_frames and frames.frames_shape == (5, 2, 2, 2)


@pytest.mark.parametrize("changes, message", [
    (dict(output=(51,)), "output is (51,); packed parts"),
    (dict(parts=(("frames", FRAMES), ("actions", ACTIONS))), "parts are ['frames', 'actions']"),
    (dict(produces="frames"), "parts are ['actions', 'frames'] for produces 'frames'"),
    (dict(parts=(("actions", (12,)), ("frames", FRAMES))), "output is (12,); an action chunk is (horizon, dof)"),
    (dict(parts=(("actions", ACTIONS), ("frames", (40,)))), "frame_axes is 'CFHW' for frames (40,)"),
    (dict(parts=(("actions", (0, 3)), ("frames", FRAMES))), "parts.actions is (0, 3); a shape is"),
])
def test_a_wrongly_packed_spec_is_refused_naming_the_field(changes, message):
    with pytest.raises(ConfigError, match="kind") as err:
        packed(**changes).check("toy", "m")
    assert message in str(err.value)
