"""A Wan action-conditioned world model (kind ``wan_acwm``, issue 57) from a pipeline directory that diffusers
writes (``transformer/`` and ``vae/``): the camera's conditioning latent is diffusers' own VAE encoding; chunks
through the sequential reference equal a whole-sequence recompute through diffusers' blocks and attention
processor within float rounding; ``run_stage`` equals the reference bit for bit; the preview is diffusers' VAE
decode of the predicted frames; configs that do not fit are refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.model.families import load_family
from physis_ros.model.kv import KVBatch
from physis_ros.model.stages import chunk_input, run_stage
from physis_ros.model.wan import head
from physis_ros.model.wan_history import chunk_mask
from physis_ros.reference import ReferenceRollout

from tiny_wan import recompute_processors, save_tiny_wan

WAN = {"frames": 2, "height": 4, "width": 6, "text_tokens": 0}
WORLD = {"image_size": 32, "image_channels": 3, "state_dim": 4, "action_horizon": 5, "action_dim": 3}
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
           latents_std=[1.5, 0.5, 2.0, 1.0])
STEPS = 3


def sidecar(**extra) -> dict:
    return {"name": "tiny-wan-acwm", "kind": "wan_acwm", "steps": STEPS, "timestep_shift": 3.0, "window": 2,
            "init_seed": 5, "wan": {**WAN, "world": dict(WORLD)}, **extra}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A pipeline directory as diffusers writes one: transformer/ and vae/ (random weights), and our
    physis_model.yaml beside them."""
    from diffusers import AutoencoderKLWan

    root = tmp_path_factory.mktemp("wanacwm") / "tiny"
    save_tiny_wan(root / "transformer")
    torch.manual_seed(1)
    AutoencoderKLWan(**VAE).eval().save_pretrained(root / "vae")
    (root / "physis_model.yaml").write_text(yaml.safe_dump(sidecar()))
    return root


def observation(c: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([7, c])
    return {"image": rng.random((3, 32, 32), dtype=np.float32), "state": rng.standard_normal(4).astype(np.float32),
            "actions": rng.standard_normal((5, 3)).astype(np.float32)}


def test_the_pipelines_vae_is_found_and_the_spec_counts_the_conditioning(pipeline):
    config = load_model_config(pipeline)
    spec = config.spec
    assert config.kind == "wan_acwm" and config.wan.vae == str(pipeline / "vae") and spec.produces == "frames"
    assert spec.inputs == {"image": (3, 32, 32), "state": (4,), "actions": (5, 3)}
    assert spec.output == (4, 2, 4, 6) and spec.frames_shape == (2, 4, 4, 6)
    camera = (32 // 8 // 2) ** 2
    assert spec.context_tokens == camera + 1 + 5 and spec.tokens_per_chunk == spec.context_tokens + 2 * 2 * 3


@torch.no_grad()
def test_the_camera_is_conditioned_through_diffusers_own_vae_encoding(pipeline):
    from diffusers import AutoencoderKLWan

    model = build_model(load_model_config(pipeline))
    vae = AutoencoderKLWan.from_pretrained(pipeline / "vae").eval()
    obs = observation(0)
    image = torch.from_numpy(obs["image"])[None]
    latent = vae.encode((image * 2 - 1)[:, :, None]).latent_dist.mode()
    mean, std = (torch.tensor(VAE[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    want = model.trunk.patch_embedding((latent - mean) / std).flatten(2).transpose(1, 2) \
        + model.adapter["camera_pos"].weight
    cond = model.encode(model.observation_tensors(obs))
    assert cond.shape == (1, 4 + 1 + 5, 24) and torch.equal(cond[:, :4], want)


@torch.no_grad()
def recompute(model, chunks: int, seed: int) -> list[torch.Tensor]:
    """The same_step rule from scratch: every chunk's video tokens in one sequence (chunk i seeing chunks
    i-window .. i, absolute RoPE frames), each chunk cross-attending to its own conditioning, through diffusers'
    blocks and processors."""
    trunk, cfg = model.trunk, model.config
    frames, height, width = WAN["frames"], WAN["height"], WAN["width"]
    video = frames * (height // 2) * (width // 2)
    mask = chunk_mask(chunks, video, cfg.window)
    contexts = [model.encode(model.observation_tensors(observation(c))) for c in range(chunks)]
    rope = trunk.rope(torch.zeros(1, 4, chunks * frames, height, width))
    blocks = [model.blocks[str(b)] for b in range(cfg.blocks)]
    with recompute_processors(blocks, mask, contexts, video):
        xs = [model.noise(seed, "w", c) for c in range(chunks)]
        ts = model.timesteps.t
        for k in range(cfg.steps, 0, -1):
            temb, proj, _, _ = trunk.condition_embedder(ts[k:k + 1] * 1000.0, torch.zeros(1, 1, 16), None)
            hidden = torch.cat([trunk.patch_embedding(x).flatten(2).transpose(1, 2) for x in xs], dim=1)
            for blk in blocks:
                hidden = blk(hidden, None, proj.unflatten(1, (6, -1)), rope)
            xs = [x + (ts[k - 1] - ts[k]) * head(trunk, part, temb, (frames, height // 2, width // 2))
                  for x, part in zip(xs, hidden.split(video, dim=1))]
    return [x[0] for x in xs]


def test_chunks_equal_a_full_recompute_and_run_stage_equals_the_reference(pipeline):
    model = build_model(load_model_config(pipeline))
    cfg = model.config
    ref = ReferenceRollout(model, seed=3)
    got = [ref.step("w", observation(c)).output for c in range(4)]
    for c, (a, b) in enumerate(zip(got, recompute(model, 4, seed=3))):
        assert torch.isfinite(a).all() and a.shape == (4, 2, 4, 6)
        assert torch.allclose(a, b, rtol=0, atol=5e-6), (c, float((a - b).abs().max()))
    tables = [model.new_kv_table(b, cfg.steps) for b in range(cfg.blocks)]
    for c in range(2):
        state = chunk_input(model.observation_tensors(observation(c)), model.noise(3, "w", c))
        for k in range(cfg.steps, 0, -1):
            for b in range(cfg.blocks):
                state = run_stage(model, b, [k], [state], KVBatch(tables[b], [k - 1]))[0]
        assert torch.equal(state["x"][0], got[c])


@torch.no_grad()
def test_the_preview_is_diffusers_decode_of_the_last_predicted_frame(pipeline):
    from diffusers import AutoencoderKLWan

    config = load_model_config(pipeline)
    model = build_model(config)
    frames = config.spec.frames_of(ReferenceRollout(model).step("w", observation(0)).output.numpy())
    picture = load_family("wan_acwm").previewer(config)(frames)
    vae = AutoencoderKLWan.from_pretrained(pipeline / "vae").eval()
    mean, std = (torch.tensor(VAE[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    latent = torch.from_numpy(np.ascontiguousarray(frames.swapaxes(0, 1)))[None] * std + mean
    video = vae.decode(latent).sample[0, :, -1].clamp(-1, 1)
    want = ((video.permute(1, 2, 0).numpy() + 1) * 127.5 + 0.5).astype(np.uint8)
    assert picture.shape == (4 * 8, 6 * 8, 3) and picture.dtype == np.uint8      # the latent 4x6, 8 pixels each
    assert np.abs(picture.astype(int) - want.astype(int)).max() <= 1 and picture.std() > 0


@pytest.mark.parametrize("change, key", [
    ({"wan": {**WAN, "world": WORLD, "vae": "/nonexistent"}}, "wan.vae"),
    ({"wan": {**WAN, "world": {**WORLD, "image_size": 24}}}, "wan.world.image_size"),
    ({"wan": {**WAN}}, "wan.world"),
    ({"kind": "wan"}, "wan.world"),
    ({"kind": "wan_wam"}, "wan.actions"),
])
def test_configs_that_do_not_fit_are_refused_naming_the_field(pipeline, tmp_path, change, key):
    root = tmp_path / "bad"
    root.mkdir()
    for name in ("transformer", "vae"):
        (root / name).symlink_to(pipeline / name)
    (root / "physis_model.yaml").write_text(yaml.safe_dump({**sidecar(), **change}))
    with pytest.raises(ConfigError) as err:
        load_model_config(root)
    assert err.value.key == key, str(err.value)


def test_a_vae_of_other_latent_channels_and_a_model_with_no_vae_are_refused(pipeline, tmp_path):
    from diffusers import AutoencoderKLWan

    other = tmp_path / "vae8"
    AutoencoderKLWan(**{**VAE, "z_dim": 8, "latents_mean": [0.0] * 8, "latents_std": [1.0] * 8}).save_pretrained(other)
    mapping = {**sidecar(), "wan": {**sidecar()["wan"], "vae": str(other)}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({**mapping, "wan": {**mapping["wan"],
                                                                          "checkpoint": str(pipeline)}}))
    with pytest.raises(ConfigError, match="z_dim 8 is not the trunk's 4 latent channels") as err:
        load_model_config(tmp_path / "m.yaml")
    assert err.value.key == "wan.vae"
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "transformer").symlink_to(pipeline / "transformer")
    (lone / "physis_model.yaml").write_text(yaml.safe_dump(sidecar()))
    with pytest.raises(ConfigError, match="encodes the camera with a VAE") as err:
        load_model_config(lone)
    assert err.value.key == "wan.vae"


def test_the_adapter_saved_beside_the_pipeline_is_served(pipeline, tmp_path):
    from physis_ros.model.wan_adapter import adapter_shapes, save_adapter

    trained = build_model(load_model_config(pipeline))
    assert {k: tuple(v.shape) for k, v in trained.adapter.state_dict().items()} == adapter_shapes(trained.config)
    root = tmp_path / "with-adapter"
    root.mkdir()
    for name in ("transformer", "vae"):
        (root / name).symlink_to(pipeline / name)
    save_adapter(trained, root)
    (root / "physis_model.yaml").write_text(yaml.safe_dump({**sidecar(), "init_seed": 11}))
    served = build_model(load_model_config(root))
    assert torch.equal(ReferenceRollout(served).step("w", observation(0)).output,
                       ReferenceRollout(trained).step("w", observation(0)).output)
    spec = (root / "adapter.json").read_text()
    (root / "adapter.json").write_text(spec.replace('"action_dim": 3', '"action_dim": 4'))
    with pytest.raises(ConfigError, match="adapter.json: world.action_dim is 4, but wan.world.action_dim is 3"):
        load_model_config(root)


def test_a_broken_vae_directory_is_refused_when_the_config_is_loaded(pipeline, tmp_path):
    """The VAE's weights are checked from their header like the trunk's: a tensor of another shape, a missing
    one, a truncated file, each refused in one line naming wan.vae, the file and the tensor."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(pipeline / "vae" / "diffusion_pytorch_model.safetensors")
    name = sorted(tensors)[0]
    root = tmp_path / "broken"
    root.mkdir()
    (root / "transformer").symlink_to(pipeline / "transformer")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_bytes((pipeline / "vae" / "config.json").read_bytes())
    (root / "physis_model.yaml").write_text(yaml.safe_dump(sidecar()))
    weights = root / "vae" / "diffusion_pytorch_model.safetensors"

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match) as err:
            load_model_config(root)
        assert err.value.key == "wan.vae" and "\n" not in str(err.value)

    save_file({**tensors, name: torch.zeros(3)}, weights)
    refused(rf"diffusion_pytorch_model.safetensors: tensor {name} has shape \(3,\), the VAE needs")
    save_file({k: v for k, v in tensors.items() if k != name}, weights)
    refused(rf"tensor {name} is missing")
    save_file(tensors, weights)
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    refused("diffusion_pytorch_model.safetensors")
    weights.write_bytes(data)
    assert load_model_config(root).wan.vae == str(root / "vae")
