"""Wan trunks from directories diffusers itself writes (issue 55, first step): the stage path over
diffusers' own modules, loaded block by block, equals ``WanTransformer3DModel.forward`` under the
documented sampler, exactly in fp32; only the blocks asked for are read; directories we cannot read are
refused naming the file and the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from physis_ros.model.wan import WanLoadError, WanStages, load_wan, sample

from tiny_wan import save_tiny_wan

SIGMAS = [1.0, 0.8, 0.55, 0.3, 0.0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Wan transformer with random weights (every parameter, the tables included), saved by diffusers."""
    path = tmp_path_factory.mktemp("wan") / "tiny"
    return save_tiny_wan(path), path


def inputs(seed: int = 1, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((batch, 4, 3, 8, 6), generator=g)          # [B, C, F, H, W], latent units
    prompt = torch.randn((batch, 7, 16), generator=g)                # [B, L, text_dim]
    return noise, prompt


@torch.no_grad()
def reference(model, noise, prompt):
    return sample(lambda x, t, c: model(x, t, c, return_dict=False)[0], noise, SIGMAS, prompt)


@torch.no_grad()
def staged(wan, noise, prompt):
    stages = WanStages(wan)
    return sample(stages.velocity, noise, SIGMAS, stages.encode(prompt))


@pytest.mark.parametrize("batch", [1, 2])
def test_the_stage_path_equals_diffusers_forward_exactly(saved, batch):
    model, path = saved
    noise, prompt = inputs(batch=batch)
    expected = reference(model, noise, prompt)
    got = staged(load_wan(path), noise, prompt)
    assert got.shape == noise.shape and torch.isfinite(got).all()
    assert torch.equal(got, expected)
    assert not torch.equal(expected, noise)   # the sampler did move the latent


def test_a_pipeline_directory_and_a_sharded_checkpoint_load_the_same_model(saved, tmp_path):
    model, path = saved
    model.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="20KB")
    assert (tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    noise, prompt = inputs(seed=3)
    assert torch.equal(staged(load_wan(tmp_path / "pipe"), noise, prompt), reference(model, noise, prompt))


def test_only_the_blocks_asked_for_are_built(saved):
    model, path = saved
    wan = load_wan(path, blocks=[1])
    assert set(wan.blocks) == {1} and len(wan.trunk.blocks) == 0
    for name, value in model.blocks[1].state_dict().items():
        assert torch.equal(wan.blocks[1].state_dict()[name], value)
    held = sum(p.numel() for p in wan.trunk.parameters()) + sum(p.numel() for p in wan.blocks[1].parameters())
    full = sum(p.numel() for p in model.parameters())
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    assert held == full - 2 * per_block


def _copy(path, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for f in path.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_directories_we_cannot_read_are_refused_naming_the_file_and_tensor(saved, tmp_path):
    _, path = saved
    with pytest.raises(WanLoadError, match="no config.json"):
        load_wan(tmp_path)
    bad = _copy(path, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "_class_name": "UNet2DModel"}))
    with pytest.raises(WanLoadError, match="_class_name is 'UNet2DModel'"):
        load_wan(bad)
    (bad / "config.json").write_text(json.dumps({**config, "ffn_dim": 40}))
    with pytest.raises(WanLoadError, match=r"block 0: tensor ffn\.net\.0\.proj\.(bias|weight) has shape \(32,.*\), "
                                           r"the config needs \(40,.*\)"):
        load_wan(bad)
    (bad / "config.json").write_text(json.dumps(config))
    weights = bad / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(WanLoadError, match="diffusion_pytorch_model.safetensors: not a readable safetensors"):
        load_wan(bad)
    weights.unlink()
    with pytest.raises(WanLoadError, match="neither diffusion_pytorch_model.safetensors nor"):
        load_wan(bad)
    (bad / "config.json").write_text(json.dumps({**config, "num_layers": 4}))
    weights.write_bytes((path / "diffusion_pytorch_model.safetensors").read_bytes())
    with pytest.raises(WanLoadError, match=r"block 3: tensor .* is missing"):
        load_wan(bad)


def test_positions_past_the_rope_table_are_refused(saved):
    from physis_ros.model.wan import rope_at

    _, path = saved
    rope = load_wan(path, blocks=[]).trunk.rope
    chunk = torch.zeros((1, 4, 16, 4, 4))             # 16 frames; the third chunk's positions reach 47 > 32
    assert rope_at(rope, chunk, 16)[0].shape[1] == 16 * 2 * 2
    with pytest.raises(ValueError, match="past the trunk's RoPE table .*rope_max_seq_len"):
        rope_at(rope, chunk, 32)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_half_precision_keeps_diffusers_fp32_modules_and_equals_its_forward(saved, dtype, tolerance):
    """Weights in bf16 / fp16 where diffusers' own ``from_pretrained(torch_dtype=)`` puts them there and fp32
    where it keeps fp32 (time embedder, norms, scale-shift tables), parameter by parameter; the stage path
    then equals that model's forward exactly, and stays within ``tolerance`` (relative to the output's
    largest value) of fp32."""
    model, path = saved
    theirs = WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype).eval()
    wan = load_wan(path, dtype=dtype)
    ours = {n: p.dtype for n, p in wan.trunk.named_parameters()}
    ours.update({f"blocks.{b}.{n}": p.dtype for b, blk in wan.blocks.items() for n, p in blk.named_parameters()})
    assert ours == {n: p.dtype for n, p in theirs.named_parameters()}
    assert set(ours.values()) == {torch.float32, dtype}
    noise, prompt = inputs()
    got = staged(wan, noise.to(dtype), prompt.to(dtype))
    assert got.dtype == dtype
    assert torch.equal(got, reference(theirs, noise.to(dtype), prompt.to(dtype)))
    full = reference(model, noise, prompt)
    assert (got.float() - full).abs().max() / full.abs().max() < tolerance


def test_a_missing_shard_or_a_broken_index_is_refused_naming_the_file(saved, tmp_path):
    model, _ = saved
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json"
    shards = sorted((tmp_path / "sharded").glob("*-of-*.safetensors"))
    assert len(shards) > 2
    shards[-1].unlink()
    with pytest.raises(WanLoadError, match=f"{shards[-1].name}: cannot read"):
        load_wan(tmp_path / "sharded")
    index.write_text("{not json")
    with pytest.raises(WanLoadError, match="index.json: not a safetensors index"):
        load_wan(tmp_path / "sharded")
