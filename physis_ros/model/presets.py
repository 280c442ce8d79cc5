"""Model presets (``config/models/*.yaml``) and construction of a model from a config."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from physis_ros.config import ConfigError, from_mapping, load_yaml, repo_config_dir
from physis_ros.model.acwm import ACWMModel
from physis_ros.model.dit import DiTModel
from physis_ros.model.spec import ModelConfig
from physis_ros.model.wam import WAMModel

MODEL_CLASSES: dict[str, type[DiTModel]] = {"wam": WAMModel, "acwm": ACWMModel}


def presets_dir() -> Path:
    return repo_config_dir() / "models"


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A preset by name (``tiny-wam``) or a path to a model YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = presets_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError("model", f"unknown model preset '{name_or_path}'; known presets: "
                                       f"{', '.join(preset_names())} (or give a path to a .yaml file)")
    data = load_yaml(path)
    try:
        return from_mapping(ModelConfig, data)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path)) from None


def build_model(config: ModelConfig | str, *, device: torch.device | str = "cpu",
                hosted_blocks: Iterable[int] | None = None) -> DiTModel:
    """Instantiate the reference model (random init from ``config.init_seed``), in eval mode."""
    if isinstance(config, str):
        config = load_model_config(config)
    model = MODEL_CLASSES[config.kind](config, hosted_blocks=hosted_blocks, device=device)
    return model.eval().requires_grad_(False)
