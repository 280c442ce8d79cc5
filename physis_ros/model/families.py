"""Model families as plug-ins: a package registers a family under the Python entry point group
``physis_ros.models``, and a model config names it in ``kind:``; physis_ros itself registers its built-in
tiny DiT families (``wam``, ``acwm``) through the same group (setup.py), so this registry is the only factory
of servable models.

An entry point's name is the family's name and its object a :class:`ModelFamily`::

    # a package's pyproject.toml
    [project.entry-points."physis_ros.models"]
    mydit = "my_package.family:FAMILY"

Looking a family up by name reads the installed packages' metadata only (no import, so tools that only read
model configs do not import torch): :func:`family_names`, :func:`check_family` (is it installed, and can its
module be found: what a config load checks). :func:`load_family` imports it (a worker building the model),
and a family that fails to import, or is not a ModelFamily of its own name, is refused with one line naming
its package and the ``kind`` field.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
import json
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from physis_ros.config import ConfigError, load_yaml

if TYPE_CHECKING:
    from physis_ros.model.interface import ServableModel
    from physis_ros.model.spec import ModelConfig, ModelSpec

GROUP = "physis_ros.models"
# physis_ros's own families, as setup.py registers them (tests/model/test_families.py keeps the two equal): read
# from here only where physis_ros is installed without its metadata (a colcon build installs the package
# directory without a dist-info), so that the built-in families are found either way.
BUILT_IN = {"wam": "physis_ros.model.dit_family:WAM", "acwm": "physis_ros.model.dit_family:ACWM",
            "wan": "physis_ros.model.wan_family:WAN", "wan_wam": "physis_ros.model.wan_family:WAN_WAM",
            "wan_acwm": "physis_ros.model.wan_family:WAN_ACWM"}
# A checkpoint directory's own model config (optional): a model YAML whose checkpoint is the directory.
SIDECAR = "physis_model.yaml"


@dataclass(frozen=True)
class ModelFamily:
    """A model family: ``name`` as a model config's ``kind`` names it; ``build(config, hosted_blocks=,
    device=)`` makes its servable model (:class:`~physis_ros.model.interface.ServableModel`) with only the
    blocks ``hosted_blocks`` names (None: all): the class, or ``"module:Class"`` imported when a model is first
    built, so that the module the entry point names stays light (no torch) for tools that only read configs;
    ``spec(config)``: the :class:`~physis_ros.model.spec.ModelSpec` of a model of this family, from the config
    alone (inputs and output by name and shape, tokens per chunk, K/V per slot, parameters and FLOPs per block,
    the history rule: what admission, the planner, the roofline and the front ends read; checked when a config
    is loaded, and against the model when one is built); ``doc``: one line on what it is. A family that reads
    checkpoint directories (diffusers' layout) gives ``checkpoint_class``, the ``_class_name`` of the
    ``config.json`` it reads, and ``complete(mapping, directory)``: a model config mapping with what the
    checkpoint fixes filled in (the trunk's shape, the directory), ``directory`` None when the mapping names
    it. A family whose frames can be decoded into pictures names the factory of its previewer (``preview``,
    :meth:`previewer`)."""

    name: str
    build: Callable[..., ServableModel] | str
    spec: Callable[[ModelConfig], ModelSpec]
    doc: str = ""
    checkpoint_class: str = ""
    complete: Callable[[dict[str, Any], Path | None], dict[str, Any]] | None = None
    preview: str = ""

    def previewer(self, config: ModelConfig) -> Callable[[Any], Any] | None:
        """What turns a chunk's frames into a picture a person can look at, for ``config``: a callable from the
        frames as published (``[F, C, H, W]`` float32) to an RGB image ``[H, W, 3]`` uint8; None where the
        family decodes none. ``preview`` names its factory, ``"module:function"`` (``function(config)``),
        imported only when asked for."""
        return _imported(self.preview)(config) if self.preview else None

    def model_class(self) -> Callable[..., ServableModel]:
        return _imported(self.build) if isinstance(self.build, str) else self.build

    def make(self, config: ModelConfig, *, hosted_blocks: Any = None, device: Any = "cpu") -> ServableModel:
        return self.model_class()(config, hosted_blocks=hosted_blocks, device=device)


def _imported(ref: str) -> Any:
    """The object ``"module:attr"`` names, its module imported now."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _registered() -> dict[str, list[EntryPoint]]:
    """Every entry point of the group by name (a name two packages register twice is listed twice)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        if all(ep.value != other.value for other in found.get(ep.name, [])):
            found.setdefault(ep.name, []).append(ep)
    for name, value in BUILT_IN.items():
        found.setdefault(name, [EntryPoint(name, value, GROUP)])
    return found


def _package(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else ep.module


def family_names() -> list[str]:
    """The installed model families (entry point names), sorted; nothing is imported."""
    return sorted(_registered())


def _find(name: str) -> EntryPoint:
    eps = _registered().get(name)
    if not eps:
        raise ConfigError("kind", f"no model family '{name}' is installed (installed: "
                                  f"{', '.join(family_names()) or 'none'}; a package registers one under the "
                                  f"entry point group {GROUP})")
    if len(eps) > 1:
        raise ConfigError("kind", f"model family '{name}' is registered by more than one package ("
                                  f"{', '.join(f'{_package(ep)}: {ep.value}' for ep in eps)}): uninstall one")
    return eps[0]


def check_family(name: str) -> None:
    """ConfigError naming ``kind`` unless family ``name`` is installed and its module can be found (without
    importing it)."""
    ep = _find(name)
    try:
        found = importlib.util.find_spec(ep.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError("kind", f"model family '{name}' of package '{_package(ep)}' points at module "
                                  f"'{ep.module}', which cannot be found: reinstall the package")


@functools.lru_cache(maxsize=64)
def load_family(name: str) -> ModelFamily:
    """The :class:`ModelFamily` named ``name``, imported from its package (ConfigError naming ``kind`` and the
    package when it cannot be). Remembered once loaded (a scan of the installed packages takes milliseconds
    and memory figures ask often); a failed lookup is not, so a package installed later is found."""
    ep = _find(name)
    try:
        found = ep.load()
    except Exception as exc:
        raise ConfigError("kind", f"model family '{name}' of package '{_package(ep)}' failed to import "
                                  f"({ep.value}): {type(exc).__name__}: {exc}") from None
    if not isinstance(found, ModelFamily) or found.name != name:
        raise ConfigError("kind", f"entry point '{name}' of package '{_package(ep)}' ({ep.value}) is "
                                  f"{type(found).__name__}, not a ModelFamily named '{name}'")
    return found


def _checkpoint_class(directory: Path) -> str | None:
    for candidate in (directory / "config.json", directory / "transformer" / "config.json"):
        if candidate.is_file():
            try:
                found = json.loads(candidate.read_text()).get("_class_name")
            except (OSError, ValueError, AttributeError) as exc:
                raise ConfigError("model", f"{candidate}: not readable JSON ({exc})") from None
            return str(found) if found else None
    return None


def directory_config(directory: Path) -> dict[str, Any]:
    """The model config mapping of a checkpoint directory: its ``physis_model.yaml`` (a model YAML; optional),
    completed by the family that reads the directory (its ``kind``, else the family whose
    ``checkpoint_class`` is the directory's ``config.json`` ``_class_name``). ConfigError naming ``model``
    when no installed family reads it."""
    sidecar = directory / SIDECAR
    mapping = load_yaml(sidecar) if sidecar.is_file() else {}
    kind = mapping.get("kind")
    if kind is None:
        found = _checkpoint_class(directory)
        readers = [name for name in family_names() if load_family(name).checkpoint_class == found] if found else []
        if not readers:
            raise ConfigError("model", f"{directory} is not a checkpoint directory an installed model family reads "
                                       f"(config.json _class_name {found!r}; readers: " + (", ".join(
                                           f"{n} ({load_family(n).checkpoint_class})" for n in family_names()
                                           if load_family(n).checkpoint_class) or "none") + ")")
        kind = readers[0]
    family = load_family(str(kind))
    if family.complete is None:
        raise ConfigError("kind", f"model family '{kind}' does not read checkpoint directories ({directory})")
    return family.complete({**mapping, "kind": kind}, directory)


def complete_config(mapping: dict[str, Any]) -> dict[str, Any]:
    """A model YAML's mapping, completed by its family where the family reads checkpoints (kind ``wan``: the
    trunk's shape from its directory); as given otherwise."""
    kind = mapping.get("kind") if isinstance(mapping, dict) else None
    if not isinstance(kind, str):
        return mapping
    try:
        check_family(kind)
        family = load_family(kind)
    except ConfigError:
        return mapping        # the config's own check names what is wrong with the family
    return mapping if family.complete is None else family.complete(mapping, None)
