"""Construction of a model from its config (a preset from ``config/models/``: :func:`physis_ros.model.spec.load_model_config`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from physis_ros.config import ConfigError
from physis_ros.model.families import ModelFamily, load_family
from physis_ros.model.interface import ServableModel
from physis_ros.model.spec import ModelConfig, load_model_config


def build_model(config: ModelConfig | str, *, device: torch.device | str = "cpu",
                hosted_blocks: Iterable[int] | None = None) -> ServableModel:
    """Instantiate the model of ``config`` through its family (``config.kind``, a plug-in of the entry point
    group ``physis_ros.models``: :mod:`physis_ros.model.families`), random init from ``config.init_seed``, in
    eval mode."""
    if isinstance(config, str):
        config = load_model_config(config)
    family = load_family(config.kind)
    model = family.make(config, hosted_blocks=hosted_blocks, device=device)
    check_spec(family, model)
    return model.eval().requires_grad_(False)


def check_spec(family: ModelFamily, model: ServableModel) -> None:
    """ConfigError naming ``kind`` unless the family's spec matches the model it built: its ``block_params``
    (what memory figures count) against a block built on the meta device (no memory, no init cost)."""
    config = model.config
    with torch.device("meta"):
        actual = sum(p.numel() for p in model.new_block(0).parameters())
    declared = family.block_params(config)
    if declared != actual:
        raise ConfigError("kind", f"model family '{family.name}' counts {declared} parameters per block for "
                                  f"model '{config.name}' but its block has {actual}: fix its block_params")
