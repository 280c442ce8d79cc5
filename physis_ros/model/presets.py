"""Construction of a model from its config (a preset from ``config/models/``: :func:`physis_ros.model.spec.load_model_config`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from physis_ros.model.acwm import ACWMModel
from physis_ros.model.dit import DiTModel
from physis_ros.model.spec import ModelConfig, load_model_config
from physis_ros.model.wam import WAMModel

MODEL_CLASSES: dict[str, type[DiTModel]] = {"wam": WAMModel, "acwm": ACWMModel}


def build_model(config: ModelConfig | str, *, device: torch.device | str = "cpu",
                hosted_blocks: Iterable[int] | None = None) -> DiTModel:
    """Instantiate the reference model (random init from ``config.init_seed``), in eval mode."""
    if isinstance(config, str):
        config = load_model_config(config)
    model = MODEL_CLASSES[config.kind](config, hosted_blocks=hosted_blocks, device=device)
    return model.eval().requires_grad_(False)
