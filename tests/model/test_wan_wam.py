"""A Wan world-action model (kind ``wan_wam``, issue 57): a Wan trunk saved by diffusers with an action adapter.
Its chunks through the sequential reference equal a full recompute (every chunk's video and action tokens in
one sequence under the history's block-causal mask, through diffusers' own blocks and attention processor, no
cache) within float rounding; through ``run_stage`` one stage at a time they equal the reference bit for bit
and in time-shared batches within rounding; the hand-off freezes the action rows and leaves the frames to the
sampler; configs that do not fit are refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.model.handoff import Handoff
from physis_ros.model.wan import head
from physis_ros.model.wan_history import chunk_mask
from physis_ros.reference import ReferenceRollout

from tiny_wan import StagedStreams, recompute_processors, save_tiny_wan

WAN = {"frames": 2, "height": 4, "width": 6, "text_tokens": 0}
ACTIONS = {"horizon": 5, "dof": 3, "state_dim": 4, "image_size": 16, "image_channels": 3, "image_patch": 8}
STEPS, WINDOW = 3, 2


def sidecar(text_tokens: int = 0, **extra) -> dict:
    return {"name": "tiny-wan-wam", "kind": "wan_wam", "steps": STEPS, "timestep_shift": 3.0, "window": WINDOW,
            "init_seed": 4, "wan": {**WAN, "text_tokens": text_tokens, "actions": dict(ACTIONS)}, **extra}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Wan transformer saved by diffusers, with a physis_model.yaml making it a world-action model."""
    path = tmp_path_factory.mktemp("wanwam") / "tiny"
    save_tiny_wan(path)
    (path / "physis_model.yaml").write_text(yaml.safe_dump(sidecar()))
    return path


def observation(stream: str, c: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([hash(stream) % 1000, c])
    return {"image": rng.random((3, 16, 16), dtype=np.float32), "state": rng.standard_normal(4).astype(np.float32)}


def test_the_spec_packs_actions_then_frames_and_counts_every_token(saved):
    config = load_model_config(saved)
    spec = config.spec
    assert config.kind == "wan_wam" and config.produces == "actions" and config.control_horizon == 5
    assert spec.inputs == {"image": (3, 16, 16), "state": (4,)}
    assert spec.parts == (("actions", (5, 3)), ("frames", (4, 2, 4, 6))) and spec.output == (15 + 192,)
    video = 2 * 2 * 3
    assert spec.context_tokens == 4 + 1 and spec.tokens_per_chunk == 5 + video + 5
    assert spec.kv_slot_tokens == WINDOW * (video + 5) and spec.frames_shape == (2, 4, 4, 6)


@torch.no_grad()
def recompute(model, stream: str, chunks: int, seed: int) -> list[torch.Tensor]:
    """The same_step rule from scratch: every chunk denoised together as one sequence of [video; actions]
    tokens per chunk, chunk i seeing chunks i-window .. i, absolute RoPE frames (actions at their chunk's last frame), each chunk
    cross-attending to its own image and state; diffusers' blocks, condition embedder and processors."""
    trunk, adapter, cfg = model.trunk, model.adapter, model.config
    h_rows, dof = ACTIONS["horizon"], ACTIONS["dof"]
    frames, height, width = WAN["frames"], WAN["height"], WAN["width"]
    video = (frames // 1) * (height // 2) * (width // 2)
    per_chunk = video + h_rows
    mask = chunk_mask(chunks, per_chunk, cfg.window)
    contexts = []
    for c in range(chunks):
        obs = {k: torch.from_numpy(v)[None] for k, v in observation(stream, c).items()}
        contexts.append(torch.cat([adapter["image"](obs["image"]).flatten(2).transpose(1, 2)
                                   + adapter["image_pos"].weight, adapter["state"](obs["state"])[:, None]], dim=1))
    cos, sin = trunk.rope(torch.zeros(1, 4, chunks * frames, height, width))
    last = (frames - 1) * (height // 2) * (width // 2)     # an action token sits at its chunk's last frame, (0, 0)
    rope = tuple(torch.cat([p for c in range(chunks) for p in (
        table[:, c * video:(c + 1) * video], table[:, c * video + last:c * video + last + 1].repeat(1, h_rows, 1, 1))],
        dim=1) for table in (cos, sin))
    blocks = [model.blocks[str(b)] for b in range(cfg.blocks)]
    with recompute_processors(blocks, mask, contexts, per_chunk):
        xs = [model.noise(seed, stream, c)[0] for c in range(chunks)]
        ts = model.timesteps.t
        for k in range(cfg.steps, 0, -1):
            t = ts[k:k + 1]
            temb, proj, _, _ = trunk.condition_embedder(t * 1000.0, torch.zeros(1, 1, 16), None)
            proj = proj.unflatten(1, (6, -1))
            tokens = []
            for c, x in enumerate(xs):
                actions, latent = x[:h_rows * dof].view(1, h_rows, dof), x[h_rows * dof:].view(1, 4, frames, height,
                                                                                               width)
                rows = adapter["action_in"](actions) + adapter["action_pos"].weight + contexts[c][:, -1:]
                tokens += [trunk.patch_embedding(latent).flatten(2).transpose(1, 2), rows]
            hidden = torch.cat(tokens, dim=1)
            for blk in blocks:
                hidden = blk(hidden, None, proj, rope)
            out = []
            for c, part in enumerate(hidden.split(per_chunk, dim=1)):
                v_video = head(trunk, part[:, :video], temb, (frames, height // 2, width // 2))
                shift, scale = (trunk.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
                rows = (trunk.norm_out(part[:, video:].float()) * (1 + scale) + shift)
                v = torch.cat([adapter["action_out"](rows).flatten(), v_video.flatten()])
                out.append(xs[c] + (ts[k - 1] - ts[k]) * v)
            xs = out
    return xs


def test_chunks_equal_a_full_recompute_through_diffusers_blocks(saved):
    """Four chunks (past the window of two): each equals the whole-sequence recompute within float rounding;
    chunk 1 did read chunk 0 (a stream that starts at chunk 1 differs)."""
    model = build_model(load_model_config(saved))
    ref = ReferenceRollout(model, seed=2)
    got = [ref.step("r", observation("r", c)).output for c in range(4)]
    want = recompute(model, "r", 4, seed=2)
    for c, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all() and a.shape == (207,)
        assert torch.allclose(a, b, rtol=0, atol=5e-6), (c, float((a - b).abs().max()))
    fresh = ReferenceRollout(model, seed=2)
    fresh.restart("r", 1)
    alone = fresh.step("r", observation("r", 1)).output
    assert (alone - got[1]).abs().max() > 1e-3


def test_stages_one_at_a_time_and_time_shared_batches_equal_the_reference(saved):
    model = build_model(load_model_config(saved))
    ref = ReferenceRollout(model, seed=2)
    expected = {s: [ref.step(s, observation(s, c)).output for c in range(3)] for s in ("a", "b")}
    staged = StagedStreams(model, ["a", "b"], observation, seed=2)
    staged.check_staggered(expected)


def test_the_hand_off_freezes_the_action_rows_and_leaves_the_frames_to_the_sampler(saved):
    model = build_model(load_model_config(saved))
    spec = model.config.spec
    ref = ReferenceRollout(model, seed=1)
    hard = Handoff("hard", d=2, shift=2)
    first = ref.step("r", observation("r", 0), hard).output
    second = ref.step("r", observation("r", 1), hard).output
    assert torch.equal(spec.actions_of(second)[:2], spec.actions_of(first)[2:4])
    free = ReferenceRollout(model, seed=1)
    free.step("r", observation("r", 0))
    unguided = free.step("r", observation("r", 1)).output
    assert not torch.equal(spec.actions_of(unguided)[:2], spec.actions_of(first)[2:4])
    assert torch.isfinite(spec.frames_of(second)).all()


def test_a_prompt_is_read_when_the_model_takes_one(saved, tmp_path):
    directory = tmp_path / "prompted"
    save_tiny_wan(directory)
    (directory / "physis_model.yaml").write_text(yaml.safe_dump(sidecar(text_tokens=3)))
    model = build_model(load_model_config(directory))
    assert model.config.spec.inputs["prompt_embeds"] == (3, 16) and model.config.spec.context_tokens == 3 + 4 + 1
    ref = ReferenceRollout(model)
    obs = observation("r", 0)
    a = ref.step("r", {**obs, "prompt_embeds": np.ones((3, 16), np.float32)}).output
    ref.restart("r", 0)
    b = ref.step("r", {**obs, "prompt_embeds": -np.ones((3, 16), np.float32)}).output
    assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("change, key", [
    ({"kind": "wan"}, "wan.actions"),
    ({"wan": {**WAN}}, "wan.actions"),
    ({"wan": {**WAN, "actions": {**ACTIONS, "image_patch": 5}}}, "wan.actions.image_patch"),
    ({"wan": {**WAN, "actions": {**ACTIONS, "horizon": 0}}}, "wan.actions.horizon"),
    ({"wan": {**WAN, "height": 5, "actions": ACTIONS}}, "wan.height"),
    ({"kind": "wan", "wan": {**WAN, "text_tokens": 0}}, "wan.text_tokens"),
])
def test_configs_that_do_not_fit_are_refused_naming_the_field(saved, tmp_path, change, key):
    directory = tmp_path / "bad"
    directory.mkdir()
    for f in saved.iterdir():
        if f.name != "physis_model.yaml":
            (directory / f.name).symlink_to(f)
    (directory / "physis_model.yaml").write_text(yaml.safe_dump({**sidecar(), **change}))
    with pytest.raises(ConfigError) as err:
        load_model_config(directory)
    assert err.value.key == key, str(err.value)


def pipeline_with_adapter(saved, root, source_model, **sidecar_changes):
    """A pipeline directory: the saved trunk as transformer/, ``source_model``'s adapter beside it."""
    from physis_ros.model.wan_adapter import save_adapter

    root.mkdir()
    (root / "transformer").symlink_to(saved, target_is_directory=True)
    save_adapter(source_model, root)
    (root / "physis_model.yaml").write_text(yaml.safe_dump({**sidecar(), "init_seed": 9, **sidecar_changes}))
    return root


def test_a_checkpoints_adapter_is_served_in_place_of_a_random_one(saved, tmp_path):
    """A model directory with adapter.safetensors and adapter.json serves those weights (its own init_seed
    would give others); the adapter's tensors are the ones adapter_shapes lists."""
    from physis_ros.model.wan_adapter import adapter_shapes

    trained = build_model(load_model_config(saved))                # init_seed 4: stands in for a trained one
    root = pipeline_with_adapter(saved, tmp_path / "wam", trained)
    served = build_model(load_model_config(root))
    assert served.config.init_seed == 9 and served.config.wan.checkpoint == str(root)
    assert {k: tuple(v.shape) for k, v in served.adapter.state_dict().items()} == adapter_shapes(served.config)
    for name, value in trained.adapter.state_dict().items():
        assert torch.equal(served.adapter.state_dict()[name], value), name
    a = ReferenceRollout(served, seed=1).step("r", observation("r", 0)).output
    b = ReferenceRollout(trained, seed=1).step("r", observation("r", 0)).output
    assert torch.equal(a, b)
    (root / "adapter.safetensors").unlink()
    (root / "adapter.json").unlink()
    random = build_model(load_model_config(root))
    assert not torch.equal(random.adapter["action_out"].weight, trained.adapter["action_out"].weight)


def test_a_mismatching_adapter_is_refused_naming_the_file_and_the_key_or_tensor(saved, tmp_path):
    from safetensors.torch import save_file

    trained = build_model(load_model_config(saved))
    root = pipeline_with_adapter(saved, tmp_path / "wam", trained)
    spec = json.loads((root / "adapter.json").read_text())

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match) as err:
            load_model_config(root)
        assert err.value.key == "wan.checkpoint" and "\n" not in str(err.value)

    (root / "adapter.json").write_text(json.dumps({**spec, "actions": {**spec["actions"], "horizon": 6}}))
    refused(r"adapter.json: actions.horizon is 6, but wan.actions.horizon is 5")
    (root / "adapter.json").write_text(json.dumps({**spec, "hidden": 48}))
    refused(r"adapter.json: hidden is 48, the model's is 24")
    (root / "adapter.json").unlink()
    refused(r"adapter.json: not readable JSON")
    (root / "adapter.json").write_text(json.dumps(spec))
    tensors = {k: v.clone() for k, v in trained.adapter.state_dict().items()}
    save_file({**tensors, "action_out.weight": torch.zeros(3, 7)}, root / "adapter.safetensors")
    refused(r"adapter.safetensors: tensor action_out.weight has shape \(3, 7\), the model needs \(3, 24\)")
    save_file({k: v for k, v in tensors.items() if k != "state.bias"}, root / "adapter.safetensors")
    refused(r"adapter.safetensors: tensor state.bias is missing")
    save_file({**tensors, "extra.weight": torch.zeros(2)}, root / "adapter.safetensors")
    refused(r"adapter.safetensors: tensor extra.weight is not part of a wan_wam adapter")
    save_file(tensors, root / "adapter.safetensors")
    data = (root / "adapter.safetensors").read_bytes()
    (root / "adapter.safetensors").write_bytes(data[:-40])
    refused(r"adapter.safetensors: tensor .* lies past the end of the file")
    (root / "adapter.safetensors").write_bytes(data)
    assert load_model_config(root).kind == "wan_wam"
