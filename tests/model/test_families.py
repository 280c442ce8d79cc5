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
from physis_ros.model.dit_family import dit_block_params
from physis_ros.model.families import ModelFamily
from physis_ros.model.wam import WAMModel


class ToyModel(WAMModel):
    """The package's own model class (here a WAM that says where it came from)."""

    origin = "toy_family"


FAMILY = ModelFamily("toy", ToyModel, dit_block_params, "a test family")
'''})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy" in family_names()
    config = load_model_config(model_yaml(tmp_path, "toy"))
    model = build_model(config)
    assert type(model).__name__ == "ToyModel" and model.origin == "toy_family" and model.config.kind == "toy"
    assert not hasattr(build_model("tiny-wam"), "origin")                       # the built-in one is untouched


@pytest.mark.parametrize("entry, modules, when, words", [
    ("ghost = no_such_module:FAMILY", {}, "config",
     "model family 'ghost' of package 'broken_family' points at module 'no_such_module', which cannot be found"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "raise RuntimeError('needs a GPU library')"}, "build",
     "model family 'ghost' of package 'broken_family' failed to import (ghost_mod:FAMILY): RuntimeError: needs a GPU"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "FAMILY = object()"}, "build",
     "entry point 'ghost' of package 'broken_family' (ghost_mod:FAMILY) is object, not a ModelFamily named 'ghost'"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "from physis_ros.model.families import ModelFamily\n"
                                               "from physis_ros.model.wam import WAMModel\n"
                                               "FAMILY = ModelFamily('other', WAMModel, lambda c: 0)"}, "build",
     "is ModelFamily, not a ModelFamily named 'ghost'"),
    ("ghost = ghost_mod:FAMILY", {"ghost_mod": "from physis_ros.model.families import ModelFamily\n"
                                               "from physis_ros.model.wam import WAMModel\n"
                                               "FAMILY = ModelFamily('ghost', WAMModel, lambda c: 1)"}, "build",
     "model family 'ghost' counts 1 parameters per block for model 'ghost-m' but its block has 231040"),
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
    if when == "build":     # the config loads (its module is there); building it says why not
        assert load_model_config(path).kind == kind


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
