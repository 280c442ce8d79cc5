"""Both heads of the reference DiT: shapes, dtypes, determinism, partial hosting."""

import torch

from physis_ros.model import build_model
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout


def rollout(model, stream="r0", chunks=3, seed=0):
    scene = SyntheticScene(model.config.observation_shapes)
    ref = ReferenceRollout(model, seed)
    return [ref.step(stream, scene.observation(stream, c)).output for c in range(chunks)]


def test_shapes_and_dtypes(tiny_wam, tiny_acwm):
    for model, shape in ((tiny_wam, (16, 7)), (tiny_acwm, (2, 4, 8, 8))):
        out = rollout(model, chunks=1)[0]
        assert tuple(out.shape) == shape == model.config.output_shape
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()


def test_same_seed_bit_identical_and_different_seed_differs(tiny_wam):
    a, b = rollout(tiny_wam, seed=0), rollout(tiny_wam, seed=0)
    c = rollout(tiny_wam, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_streams_get_different_noise(tiny_wam):
    assert not torch.equal(tiny_wam.noise(0, "a", 0), tiny_wam.noise(0, "b", 0))
    assert not torch.equal(tiny_wam.noise(0, "a", 0), tiny_wam.noise(0, "a", 1))


def test_partial_model_has_the_full_models_block_weights(tiny_wam):
    part = build_model("tiny-wam", hosted_blocks=[3, 5])
    assert sorted(part.blocks.keys()) == ["3", "5"]
    full = dict(tiny_wam.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name


def test_model_moves_to_the_named_device():
    model = build_model("tiny-wam", device="cpu")
    assert model.device.type == "cpu"
    out = rollout(model, chunks=1)[0]
    assert out.device.type == "cpu"
