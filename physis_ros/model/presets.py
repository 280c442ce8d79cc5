"""Construction of a model from its config (a preset from ``config/models/``: :func:`physis_ros.model.spec.load_model_config`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from physis_ros.model.families import load_family
from physis_ros.model.interface import ServableModel
from physis_ros.model.spec import ModelConfig, load_model_config


def build_model(config: ModelConfig | str, *, device: torch.device | str = "cpu",
                hosted_blocks: Iterable[int] | None = None) -> ServableModel:
    """Instantiate the model of ``config`` through its family (``config.kind``, a plug-in of the entry point
    group ``physis_ros.models``: :mod:`physis_ros.model.families`), random init from ``config.init_seed``, in
    eval mode."""
    if isinstance(config, str):
        config = load_model_config(config)
    model = load_family(config.kind).make(config, hosted_blocks=hosted_blocks, device=device)
    return model.eval().requires_grad_(False)
