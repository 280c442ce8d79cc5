import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config, preset_names
from physis_ros.model.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_config, save_checkpoint


def test_round_trip_full_and_partial(tmp_path, tiny_acwm):
    path = tmp_path / "m.safetensors"
    save_checkpoint(tiny_acwm, path)
    assert read_checkpoint_config(path) == tiny_acwm.config
    loaded = load_checkpoint(path)
    for (n1, p1), (n2, p2) in zip(tiny_acwm.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    part = load_checkpoint(path, hosted_blocks=[2])
    assert list(part.blocks.keys()) == ["2"]
    assert torch.equal(part.blocks["2"].qkv.weight, tiny_acwm.blocks["2"].qkv.weight)


def test_loaded_weights_are_used(tmp_path, tiny_wam):
    path = tmp_path / "m.safetensors"
    save_checkpoint(tiny_wam, path)
    tensors = load_file(str(path))
    tensors["blocks.0.qkv.weight"] = tensors["blocks.0.qkv.weight"] * 0.5
    save_file(tensors, str(path), metadata={"physis_model_config": __import__("json").dumps(
        __import__("physis_ros.config", fromlist=["to_mapping"]).to_mapping(tiny_wam.config))})
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.blocks["0"].qkv.weight, tiny_wam.blocks["0"].qkv.weight * 0.5)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path, tiny_wam):
    path = tmp_path / "m.safetensors"
    save_checkpoint(tiny_wam, path)
    wider = dataclasses.replace(tiny_wam.config, ffn=512)
    with pytest.raises(CheckpointError, match=r"'blocks\.0\.mlp\.0\.weight'.*\(256, 128\).*\(512, 128\)"):
        load_checkpoint(path, config=wider)


def test_missing_tensor_is_named(tmp_path, tiny_wam):
    path = tmp_path / "m.safetensors"
    save_checkpoint(tiny_wam, path)
    deeper = dataclasses.replace(tiny_wam.config, blocks=9)
    with pytest.raises(CheckpointError, match="lacks tensor 'blocks.8"):
        load_checkpoint(path, config=deeper)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown model preset 'tiny-wham'.*tiny-acwm, tiny-wam"):
        load_model_config("tiny-wham")


def test_all_presets_load_and_size_presets_are_labelled():
    names = preset_names()
    for required in ("tiny-wam", "tiny-acwm", "wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b"):
        assert required in names
    for name in names:
        cfg = load_model_config(name)
        assert cfg.steps == 4
        if name != "tiny-wam" and name != "tiny-acwm":
            assert "random init" in cfg.description
    assert load_model_config("wan2.1-14b").blocks == 40
    # Parameter counts are in the right class for the named backbones (trunk only).
    billions = {n: load_model_config(n).block_params() * load_model_config(n).blocks / 1e9
                for n in ("wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b")}
    assert 1.0 < billions["wan2.1-1.3b"] < 1.8 and 4 < billions["wan2.2-5b"] < 6.5
    assert 11 < billions["wan2.1-14b"] < 17 and 18 < billions["ltx-22b"] < 26 and 28 < billions["h3-33b"] < 38


def test_tiny_model_builds_from_a_custom_yaml(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nkind: wam\nhidden: 32\nheads: 2\nblocks: 2\nsteps: 2\n"
                    "wam: {image_size: 16, patch: 8, state_dim: 3, horizon: 4, dof: 3}\n")
    model = build_model(load_model_config(path))
    assert model.config.tokens_per_chunk == 4 + 1 + 4
