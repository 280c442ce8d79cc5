"""Config validation errors name the key and what would be accepted."""

import pytest

from physis_ros.config import ConfigError, from_mapping, load
from physis_ros.model.spec import ModelConfig

BASE = {"name": "m", "kind": "wam", "hidden": 32, "heads": 2, "blocks": 2, "steps": 2,
        "wam": {"image_size": 16, "patch": 8}}


def make(**changes):
    data = {**BASE, **changes}
    return from_mapping(ModelConfig, {k: v for k, v in data.items() if v is not None})


def test_valid_config_loads():
    cfg = make()
    assert cfg.tokens_per_chunk == 4 + 1 + 16 and cfg.ffn_dim == 128


@pytest.mark.parametrize("changes, key, text", [
    ({"hiden": 3}, "hiden", "unknown key; known keys: acwm,"),
    ({"hidden": "big"}, "hidden", "expected an integer"),
    ({"hidden": True}, "hidden", "expected an integer"),
    ({"blocks": 0}, "blocks", "out of range; must be >= 1"),
    ({"kind": "vla"}, "kind", "no model family 'vla' is installed (installed: acwm, "),
    ({"heads": 3}, "heads", "must divide hidden 32"),
    ({"steps": None}, "steps", "required key is missing"),
    ({"wam": {"image_size": 16, "patch": 5}}, "wam.patch", "must divide image_size"),
    ({"wam": {"image_size": 16, "patchh": 8}}, "wam.patchh", "unknown key"),
    ({"acwm": {}}, "acwm", "does not belong to kind 'wam'"),
    ({"timestep_shift": 0}, "timestep_shift", "must be > 0"),
    ({"dtype": "fp8"}, "dtype", "allowed values: 'float32', 'bfloat16', 'float16'"),
])
def test_errors_name_the_key(changes, key, text):
    with pytest.raises(ConfigError) as info:
        make(**changes)
    assert info.value.key == key
    assert text in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: m\nkind: wam\nhidden: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load(ModelConfig, path)
    # where it is broken, never what it holds (a server answering a goal with a model path must not read a
    # file back to whoever sent it: the reason echoed the offending line before)
    path.write_text("name: m\nsecret: TOPSECRET [1\n  - : {\n")
    with pytest.raises(ConfigError) as info:
        load(ModelConfig, path)
    assert "line 3" in str(info.value) and "TOPSECRET" not in str(info.value) and "- :" not in str(info.value)
    path.write_text("name: m\nkind: wam\nhidden: 32\nheads: 2\nblocks: 2\nsteps: -1\nwam: {}\n")
    with pytest.raises(ConfigError, match=r"'steps' in .*bad.yaml: -1 is out of range"):
        load(ModelConfig, path)
    with pytest.raises(ConfigError, match="cannot read"):
        load(ModelConfig, tmp_path / "missing.yaml")
