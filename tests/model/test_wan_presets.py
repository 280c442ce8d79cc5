"""The Wan presets are the real architectures (issue 56 item 4): kind wan with the trunk's diffusers config
and random weights; their block is diffusers' own WanTransformerBlock (parameters counted on the meta device
against the spec); a random-init trunk built block by block on two "workers" has the weights the whole model
has; a wan.trunk that lacks a key or has a bad one is refused naming it."""

from __future__ import annotations

import time

import pytest
import torch
import yaml
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config

REAL = {"wan2.1-1.3b": (1536, 8960, 30, 16), "wan2.2-5b": (3072, 14336, 30, 48), "wan2.1-14b": (5120, 13824, 40, 16)}


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_preset_is_the_real_architecture(name):
    config = load_model_config(name)
    hidden, ffn, blocks, channels = REAL[name]
    assert (config.kind, config.hidden, config.ffn_dim, config.blocks, config.head_dim) == ("wan", hidden, ffn, blocks,
                                                                                             128)
    with torch.device("meta"):
        block = WanTransformerBlock(hidden, ffn, hidden // 128, cross_attn_norm=True)
    assert config.block_params() == sum(p.numel() for p in block.parameters())
    assert config.spec.output == (channels, 3, config.wan.height, config.wan.width)
    assert config.spec.inputs == {"prompt_embeds": (512, 4096)}


def test_the_13b_preset_builds_one_block_in_bf16_with_fp32_where_diffusers_keeps_it():
    start = time.perf_counter()
    model = build_model("wan2.1-1.3b", hosted_blocks=[0])
    block = model.blocks["0"]
    assert sum(p.numel() for p in block.parameters()) == 46_440_704
    assert block.attn1.to_q.weight.dtype == torch.bfloat16 and block.scale_shift_table.dtype == torch.float32
    assert time.perf_counter() - start < 120      # a sanity bound (random init of one block), not a speed claim


def tiny_random(tmp_path, **trunk) -> str:
    base = {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 3, "ffn_dim": 24, "text_dim": 12,
            "in_channels": 4, "rope_max_seq_len": 16}
    path = tmp_path / "tiny-random.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny-random", "kind": "wan", "steps": 2, "init_seed": 3,
                                    "wan": {"frames": 1, "height": 4, "width": 4, "text_tokens": 3,
                                            "trunk": {**base, **trunk}}}))
    return str(path)


def test_a_random_init_trunk_built_block_by_block_has_the_whole_models_weights(tmp_path):
    config = load_model_config(tiny_random(tmp_path))
    assert (config.hidden, config.heads, config.blocks, config.ffn_dim) == (16, 2, 3, 24)
    whole = build_model(config)
    part = build_model(config, hosted_blocks=[])
    part.attach_blocks(part.build_blocks([2]))
    for name, value in whole.blocks["2"].state_dict().items():
        assert torch.equal(part.blocks["2"].state_dict()[name], value), name
    for name, value in whole.trunk.state_dict().items():
        assert torch.equal(part.trunk.state_dict()[name], value), name
    assert not torch.equal(whole.blocks["1"].attn1.to_q.weight, whole.blocks["2"].attn1.to_q.weight)


@pytest.mark.parametrize("trunk, key", [({"num_layers": 0}, "wan.trunk.num_layers"),
                                        ({"colour": 3}, "wan.trunk.colour")])
def test_a_bad_trunk_is_refused_naming_its_key(tmp_path, trunk, key):
    with pytest.raises(ConfigError) as err:
        load_model_config(tiny_random(tmp_path, **trunk))
    assert err.value.key == key, err.value
