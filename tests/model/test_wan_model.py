"""A Wan directory as a model family through the stage contract (issue 55): ``model: DIR`` reads the trunk's
shape from the checkpoint; the spec counts diffusers' own block; chunk 0 through the sequential reference and
through ``run_stage`` (one stage at a time, and time-shared batches) equals the documented sampler over
``WanTransformer3DModel.forward`` exactly in fp32; later chunks under ``same_step`` and ``clean`` equal a full
recompute with diffusers' forward; configs that do not fit the checkpoint are refused naming the field."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import yaml

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.model.wan import sample
from physis_ros.model.wan_history import recompute
from physis_ros.reference import ReferenceRollout

from tiny_wan import StagedStreams, save_tiny_wan, tiny_wan

IO = {"frames": 2, "height": 8, "width": 6, "text_tokens": 7}
STEPS = 3


def sidecar(rule: str = "same_step", window: int = 2, **extra) -> dict:
    return {"name": "tiny-wan", "steps": STEPS, "timestep_shift": 3.0, "window": window, "history": rule,
            "wan": dict(IO), **extra}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Wan transformer with random weights, saved by diffusers, with a physis_model.yaml beside it."""
    path = tmp_path_factory.mktemp("wan") / "tiny"
    return save_tiny_wan(path), path


def write_sidecar(path, **kwargs):
    (path / "physis_model.yaml").write_text(yaml.safe_dump(sidecar(**kwargs)))


def prompt_embeds(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((IO["text_tokens"], 16)).astype(np.float32)


def grid(model) -> list[float]:
    """The model's noise levels, first to last and then 0: the sampler's ``sigmas``."""
    return [float(x) for x in reversed(model.timesteps.t.tolist())]


@torch.no_grad()
def diffusers_chunk(module, noise, prompt, sigmas):
    return sample(lambda x, t, c: module(x, t, c, return_dict=False)[0], noise, sigmas, prompt)


def test_a_directory_is_a_model_config_with_the_checkpoints_trunk(saved, tmp_path):
    _, path = saved
    write_sidecar(path)
    config = load_model_config(path)
    assert (config.kind, config.hidden, config.heads, config.blocks, config.ffn_dim) == ("wan", 24, 2, 3, 32)
    spec = config.spec
    assert spec.inputs == {"prompt_embeds": (7, 16)} and spec.output == (4, 2, 8, 6) and spec.produces == "frames"
    video = 2 * 4 * 3
    assert spec.tokens_per_chunk == 7 + video and spec.kv_slot_tokens == 2 * video
    block = tiny_wan().blocks[0]
    assert spec.block_params == sum(p.numel() for p in block.parameters())
    # a model YAML naming the directory reads the same trunk
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"kind": "wan", "steps": 2, "wan": {"checkpoint": str(path)}}))
    named = load_model_config(tmp_path / "m.yaml")
    assert (named.hidden, named.blocks, named.wan.checkpoint) == (24, 3, str(path.resolve()))


def test_the_real_wan21_13b_block_count():
    from physis_ros.model.wan_family import wan_block_params

    assert wan_block_params(1536, 8960) == 46_440_704


@pytest.mark.parametrize("change, key", [
    ({"hidden": 32}, "hidden"), ({"blocks": 2}, "blocks"),
    ({"wan": {**IO, "height": 7}}, "wan.height"),
    ({"window": 40}, "window"),
])
def test_configs_that_do_not_fit_the_checkpoint_are_refused_naming_the_field(saved, tmp_path, change, key):
    _, path = saved
    data = {**sidecar(), "kind": "wan", **change}
    data["wan"] = {**data["wan"], "checkpoint": str(path)}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_model_config(tmp_path / "m.yaml")
    assert err.value.key == key, str(err.value)


def test_a_directory_no_family_reads_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ConfigError, match="not a checkpoint directory an installed model family reads"):
        load_model_config(tmp_path)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"kind": "wan", "steps": 2, "wan": {"checkpoint": str(tmp_path)}}))
    with pytest.raises(ConfigError, match="_class_name is 'UNet2DModel'") as err:
        load_model_config(tmp_path / "m.yaml")
    assert err.value.key == "wan.checkpoint"


def test_chunk_0_through_the_reference_equals_diffusers_forward_exactly(saved):
    module, path = saved
    write_sidecar(path)
    model = build_model(load_model_config(path))
    ref = ReferenceRollout(model, seed=7)
    prompt = prompt_embeds()
    got = ref.step("s", {"prompt_embeds": prompt}).output
    noise = model.noise(7, "s", 0)
    expected = diffusers_chunk(module, noise, torch.from_numpy(prompt)[None], grid(model))
    assert got.shape == (4, 2, 8, 6) and not torch.equal(got, noise[0])
    assert torch.equal(got, expected[0]), float((got - expected[0]).abs().max())


@pytest.mark.parametrize("rule", ["same_step", "clean"])
def test_later_chunks_equal_a_full_recompute_with_diffusers_forward(saved, rule):
    """Four chunks with windows of 1 and 2: within the window at their absolute positions, past it with the
    cache keeping the offsets to the chunks it reads (equal within float rounding). Chunk 1 did read chunk 0
    (it differs from the same noise denoised alone), and the window decides what chunk 2 reads."""
    module, path = saved
    prompt = prompt_embeds(4)
    got = {}
    for window in (1, 2):
        write_sidecar(path, rule=rule, window=window)
        model = build_model(load_model_config(path))
        ref = ReferenceRollout(model, seed=1)
        got[window] = [ref.step("s", {"prompt_embeds": prompt}).output for _ in range(4)]
        noises = [model.noise(1, "s", c) for c in range(4)]
        expected = recompute(copy.deepcopy(module), noises, grid(model), torch.from_numpy(prompt)[None], rule, window)
        for c, (a, b) in enumerate(zip(got[window], expected)):
            assert torch.allclose(a, b[0], rtol=0, atol=5e-6), (rule, window, c, float((a - b[0]).abs().max()))
    alone = diffusers_chunk(module, model.noise(1, "s", 1), torch.from_numpy(prompt)[None], grid(model))[0]
    assert (got[1][1] - alone).abs().max() > 1e-2
    assert (got[1][2] - got[2][2]).abs().max() > 1e-3


@pytest.mark.parametrize("rule", ["same_step", "clean"])
def test_stages_one_at_a_time_and_time_shared_batches_equal_the_reference(saved, rule):
    """run_stage over every stage (the workers' code): one stream alone equals the reference bit for bit;
    two streams at different chunks (histories of different lengths: a padded, masked batch) batched in each
    call equal it within float rounding."""
    _, path = saved
    write_sidecar(path, rule=rule)
    model = build_model(load_model_config(path))
    ref = ReferenceRollout(model, seed=2)
    prompts = {"a": prompt_embeds(5), "b": prompt_embeds(6)}
    expected = {s: [ref.step(s, {"prompt_embeds": prompts[s]}).output for _ in range(3)] for s in prompts}
    staged = StagedStreams(model, list(prompts), lambda s, c: {"prompt_embeds": prompts[s]}, seed=2)
    staged.check_staggered(expected)


def test_a_worker_builds_only_its_blocks(saved):
    _, path = saved
    write_sidecar(path)
    config = load_model_config(path)
    model = build_model(config, hosted_blocks=[])
    assert len(model.blocks) == 0
    model.attach_blocks(model.build_blocks([1]))
    assert model.hosted_blocks == {1}
    full = build_model(config)
    for name, value in full.blocks["1"].state_dict().items():
        assert torch.equal(model.blocks["1"].state_dict()[name], value)
    assert full.weight_bytes() - model.weight_bytes() == 2 * 4 * config.block_params()


def test_the_texts_cross_attention_kv_is_computed_once_per_slot_while_the_text_is_the_same(saved, monkeypatch):
    """Counted on the cross-attention's K projection: once per (block, slot) over three chunks of one prompt,
    again for a new prompt and after a reset; every chunk equals a rollout that projects the text on every
    call (no cache); the table's bytes are what the spec counts per slot."""
    from physis_ros.model.kv import KVTable

    _, path = saved
    write_sidecar(path, rule="clean")
    model = build_model(load_model_config(path))
    calls = []
    for b in range(model.config.blocks):
        model.blocks[str(b)].attn2.to_k.register_forward_hook(lambda *_, b=b: calls.append(b))
    prompts = [prompt_embeds(1)] * 3 + [prompt_embeds(2)]

    def roll():
        ref = ReferenceRollout(model, seed=4)
        out = [ref.step("s", {"prompt_embeds": p}).output for p in prompts]
        ref.restart("s", 4)
        return out + [ref.step("s", {"prompt_embeds": prompts[-1]}).output]

    cached = roll()
    assert sorted(calls) == [0, 0, 0, 1, 1, 1, 2, 2, 2]     # one slot per block (clean): prompt 1, 2, reset
    calls.clear()
    monkeypatch.setattr(KVTable, "context", lambda self, slot, tokens, project: project(tokens))
    uncached = roll()
    assert len(calls) == 3 * len(uncached) * (STEPS + 1)   # every block call projects
    for a, b in zip(cached, uncached):
        assert torch.equal(a, b)
    table = model.new_kv_table(0, 2)
    assert table.nbytes() == 2 * model.config.kv_slot_bytes()


def _copy_dir(src, dst):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_directories_are_refused_when_the_config_is_loaded_with_one_line_naming_file_and_tensor(saved, tmp_path):
    """Issue 56 item 2: from the headers alone (no block built): a truncated file, a missing shard, a broken
    index, a tensor of another shape than the config needs, a tensor the config does not have."""
    module, path = saved
    sharded = tmp_path / "sharded"
    module.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert load_model_config(sharded).blocks == 3          # whole, it loads

    def refused(directory, *words):
        with pytest.raises(ConfigError) as err:
            load_model_config(directory)
        text = str(err.value)
        assert err.value.key == "wan.checkpoint" and "\n" not in text and all(w in text for w in words), text

    shard = sorted(set(index["weight_map"].values()))[1]
    gone = _copy_dir(sharded, tmp_path / "gone")
    (gone / shard).unlink()
    refused(gone, shard, "the file is missing")
    short = _copy_dir(sharded, tmp_path / "short")
    data = (short / shard).read_bytes()
    (short / shard).write_bytes(data[:len(data) - 100])
    refused(short, shard, "lies past the end of the file", "truncated")
    broken = _copy_dir(sharded, tmp_path / "broken")
    (broken / "diffusion_pytorch_model.safetensors.index.json").write_text("{not json")
    refused(broken, "index.json", "not a safetensors index")
    shape = _copy_dir(path, tmp_path / "shape")
    config = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**config, "ffn_dim": 40}))
    refused(shape, "diffusion_pytorch_model.safetensors", "tensor blocks.0.ffn.net.0.proj.", "the config needs")
    fewer = _copy_dir(path, tmp_path / "fewer")
    (fewer / "config.json").write_text(json.dumps({**config, "num_layers": 2}))
    refused(fewer, "tensor blocks.2.", "is not part of the model")


def test_a_worker_hosting_some_blocks_of_a_sharded_checkpoint_reads_and_holds_only_those(saved, tmp_path,
                                                                                          monkeypatch):
    """Issue 56 item 1, through the workers' own hosting code (runtime/hosting.py): the blocks a stream's stages
    need are read tensor by tensor from the shards the index names; the worker holds the trunk and those
    blocks, no other block's tensor is read; its K/V are what the spec counts."""
    from physis_ros.config import to_mapping
    from physis_ros.model import wan
    from physis_ros.runtime import protocol as p
    from physis_ros.runtime.hosting import StageHost

    module, _ = saved
    sharded = tmp_path / "sharded"
    module.save_pretrained(sharded, max_shard_size="20KB")
    (sharded / "physis_model.yaml").write_text(yaml.safe_dump(sidecar()))
    config = load_model_config(sharded)
    read = []
    real = wan.read_tensors
    monkeypatch.setattr(wan, "read_tensors", lambda files, names: read.extend(names) or real(files, names))
    host = StageHost("cpu")
    try:
        stages = [(k, 1) for k in range(1, STEPS + 1)]
        msg = p.StartStream(req=0, stream="s", epoch=0, model=p.ModelRef(id="tiny-wan", config=to_mapping(config)),
                            stages=stages, routes=[p.Route(s, "tcp://127.0.0.1:1") for s in stages])
        for future in host.prepare(msg):
            future.result(60)
        host.attach_ready()
        host.start_stream(msg)
        assert host.blocks() == {"tiny-wan": [1]}
        assert {n.split(".")[1] for n in read if n.startswith("blocks.")} == {"1"}
        block = sum(t.numel() * t.element_size() for t in module.blocks[1].parameters())
        trunk = build_model(config, hosted_blocks=[]).weight_bytes()
        assert host.weight_bytes() == trunk + block
        assert host.kv_bytes() == STEPS * config.kv_slot_bytes()
    finally:
        host.close()


def test_a_wan_trunk_rolls_out_under_latest(saved):
    """The latest rule on a Wan trunk (the sequential reference): with a window of one chunk it is same_step;
    with two, chunk 2 reads chunk 0 as its next step left it, and differs."""
    _, path = saved
    outs = {}
    for rule, window in (("latest", 1), ("same_step", 1), ("latest", 2), ("same_step", 2)):
        write_sidecar(path, rule=rule, window=window)
        ref = ReferenceRollout(build_model(load_model_config(path)), seed=6)
        outs[rule, window] = [ref.step("s", {"prompt_embeds": prompt_embeds(3)}).output for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(outs["latest", 1], outs["same_step", 1]))
    assert torch.equal(outs["latest", 2][1], outs["same_step", 2][1])
    assert not torch.allclose(outs["latest", 2][2], outs["same_step", 2][2])
