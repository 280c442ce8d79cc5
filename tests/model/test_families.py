"""Model families as plug-ins (issue 53 item 1 and 4): the entry point group physis_ros.models is the only
factory; the built-in families come through it from physis_ros's own metadata (setup.py); a package installed
beside it adds a family a model config names in ``kind:``; a family that is missing, cannot be found, fails to
import, is no ModelFamily, or is registered twice is refused with one line naming its package and ``kind``."""

from __future__ import annotations

import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.model.families import BUILT_IN, GROUP, family_names, load_family
from physis_ros.model.wam import WAMModel

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "config" / "models" / "tiny-wam.yaml").read_text()


def install(root: Path, package: str, entry_points_txt: str, modules: dict[str, str]) -> None:
    """A package as pip leaves one: its modules and a dist-info with its entry points, on ``root``."""
    info = root / f"{package}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points_txt)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(source)


def model_yaml(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}-model.yaml"
    path.write_text(re.sub(r"(?m)^kind: .*$", f"kind: {kind}", TINY).replace("name: tiny-wam", f"name: {kind}-m"))
    return path


@pytest.fixture(autouse=True)
def fresh_modules():
    """The packages a test installs are imported afresh by the next (each test has its own)."""
    yield
    for name in ("toy_family", "ghost_mod"):
        sys.modules.pop(name, None)
    load_family.cache_clear()


def test_the_built_in_families_come_through_the_entry_point_group_from_physis_ros_metadata():
    installed = {ep.name: ep for ep in entry_points(group=GROUP)}
    assert {n: installed[n].value for n in BUILT_IN} == BUILT_IN                  # registered by setup.py
    assert {installed[n].dist.name.replace("-", "_") for n in BUILT_IN} == {"physis_ros"}
    setup = (ROOT / "setup.py").read_text()
    listed = re.search(r'MODEL_FAMILIES = """(.*?)"""', setup, re.S).group(1).split()
    assert dict(line.split("=", 1) for line in listed) == BUILT_IN
    assert {"wam", "acwm"} <= set(family_names())
    assert load_family("wam").model_class() is WAMModel
    assert type(build_model("tiny-acwm")).__name__ == "ACWMModel"


def test_a_family_a_package_installs_is_served_by_name(tmp_path, monkeypatch):
    install(tmp_path, "toy_family", "[physis_ros.models]\ntoy = toy_family:FAMILY\n", {"toy_family": '''
from physis_ros.model.dit_family import dit_spec
from physis_ros.model.families import ModelFamily
from physis_ros.model.wam import WAMModel


class ToyModel(WAMModel):
    """The package's own model class (here a WAM that says where it came from)."""

    origin = "toy_family"


FAMILY = ModelFamily("toy", ToyModel, dit_spec, "a test family")
'''})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy" in family_names()
    config = load_model_config(model_yaml(tmp_path, "toy"))
    model = build_model(config)
    assert type(model).__name__ == "ToyModel" and model.origin == "toy_family" and model.config.kind == "toy"
    assert not hasattr(build_model("tiny-wam"), "origin")                       # the built-in one is untouched


SPEC = ("from dataclasses import replace\nfrom physis_ros.model.dit_family import dit_spec\n"
        "from physis_ros.model.families import ModelFamily\nfrom physis_ros.model.wam import WAMModel\n")


@pytest.mark.parametrize("entry, modules, when, words", [
    ("ghost = no_such_module:FAMILY", {}, "config",
     "model family 'ghost' of package 'broken_family' points at module 'no_such_module', which cannot be found"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "raise RuntimeError('needs a GPU library')"}, "config",
     "model family 'ghost' of package 'broken_family' failed to import (ghost_mod:FAMILY): RuntimeError: needs a GPU"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "FAMILY = object()"}, "config",
     "entry point 'ghost' of package 'broken_family' (ghost_mod:FAMILY) is object, not a ModelFamily named 'ghost'"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('other', WAMModel, dit_spec)"}, "config",
     "is ModelFamily, not a ModelFamily named 'ghost'"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), block_params=1))"}, "build",
     "model family 'ghost' counts 1 parameters per block for model 'ghost-m' but its block has 231040"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), tokens_per_chunk=20))"}, "build",
     "20 tokens per chunk, on which its model fails (RuntimeError: The size of tensor a (33) must match"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), kv_width=32))"}, "build",
     "model family 'ghost' gives model 'ghost-m' 33 tokens of width 32 per chunk but its embed makes (33, 128)"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), output=(16, 6)))"}, "build",
     "output (16, 6) and 33 tokens per chunk, on which its model fails (RuntimeError: mat1 and mat2 shapes"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), output=(16, 7, 1)))"}, "config",
     "model family 'ghost' gives model 'ghost-m' a spec whose output is (16, 7, 1); an action chunk is (horizon, dof)"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), inputs={'image': (3, 0, 32)}))"}, "config",
     "spec whose inputs.image is (3, 0, 32); a shape is one or more positive integers"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), produces='video'))"}, "config",
     "spec whose produces is 'video', not one of actions, frames"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), history='noisy'))"}, "config",
     "spec whose history is 'noisy', not one of same_step"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": SPEC + "FAMILY = ModelFamily('ghost', WAMModel, lambda c: replace("
                                               "dit_spec(c), block_flops=0.0))"}, "config",
     "spec whose block_flops is 0.0; it must be positive"),
    ("wam = ghost_mod:FAMILY", {"ghost_mod": ""}, "config",
     "model family 'wam' is registered by more than one package"),
])
def test_a_broken_plugin_is_refused_with_one_line_naming_its_package_and_kind(tmp_path, monkeypatch, entry,
                                                                              modules, when, words):
    install(tmp_path, "broken_family", f"[physis_ros.models]\n{entry}\n", modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = entry.split(" =")[0]
    path = model_yaml(tmp_path, kind)
    with pytest.raises(ConfigError) as exc:
        build_model(load_model_config(path))
    assert exc.value.key == "kind" and words in str(exc.value) and "\n" not in str(exc.value), exc.value
    if when == "build":     # the config loads (its spec is consistent); building it shows the model disagrees
        assert load_model_config(path).kind == kind
    else:                   # refused when the config is loaded, before any model is built
        with pytest.raises(ConfigError):
            load_model_config(path)


def test_an_unknown_family_names_the_installed_ones():
    with pytest.raises(ConfigError) as exc:
        load_family("vla")
    installed = re.search(r"installed: ([^;]*);", str(exc.value)).group(1).split(", ")
    assert exc.value.key == "kind" and {"acwm", "wam"} <= set(installed) and installed == sorted(installed)


def test_no_code_outside_the_model_package_branches_on_a_model_family():
    """What a server does with a model comes from its spec (``ModelConfig.produces``, ``control_horizon``,
    ``observation_shapes``, ``output_shape``), never from its family's name (issue 53 item 2)."""
    branch = re.compile(r"""kind\s*(==|!=|in)\s*[("'\[]*(wam|acwm)|["'](wam|acwm)["']\s*(==|!=)\s*\w+\.kind""")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted((ROOT / "physis_ros").rglob("*.py")) if "model" not in path.relative_to(ROOT).parts[1:2]
             for i, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "\n".join(found)
    model = load_model_config("tiny-acwm")
    assert (model.produces, model.control_horizon) == ("frames", model.observation_shapes["actions"][0])
    assert (load_model_config("tiny-wam").produces, load_model_config("tiny-wam").control_horizon) == ("actions", 16)


def test_what_admission_and_the_roofline_count_comes_from_the_family_spec(tmp_path, monkeypatch):
    """A family whose spec says its blocks cost twice the FLOPs and hold K/V twice as wide is costed so by the
    roofline and admission's memory figures, with no change to physis_ros (issue 53 item 2)."""
    from physis_ros.runtime.costs import memory_fields
    from physis_ros.scheduling.profiles import roofline_profile
    from physis_ros.scheduling.settings import load_device
    install(tmp_path, "wide_family", "[physis_ros.models]\nwide = toy_family:FAMILY\n", {"toy_family": SPEC + '''
def wide_spec(c):
    base = dit_spec(c)
    return replace(base, block_flops=2 * base.block_flops, kv_width=2 * base.kv_width)


FAMILY = ModelFamily("wide", WAMModel, wide_spec)
'''})
    monkeypatch.syspath_prepend(str(tmp_path))
    wide, tiny = load_model_config(model_yaml(tmp_path, "wide")), load_model_config("tiny-wam")
    assert wide.spec.history == tiny.spec.history == "same_step"
    assert (wide.observation_shapes, wide.output_shape, wide.tokens_per_chunk) == (
        tiny.observation_shapes, tiny.output_shape, tiny.tokens_per_chunk)
    dev = load_device("h200")
    gflop = {c.kind: roofline_profile(c, dev).notes["block_gflop"] for c in (wide, tiny)}
    assert gflop["wide"] == pytest.approx(2 * gflop["wam"], rel=1e-3)
    assert memory_fields(wide)["kv_bytes"] == 2 * memory_fields(tiny)["kv_bytes"] > 0
