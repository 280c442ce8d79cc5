"""Checkpoints: safetensors weights plus the model config.

Key layout (``state_dict`` names; ``{b}`` is the block index):

=========================  ==============================================
``time_embed.mlp.{0,2}.*``  timestep MLP (sinusoidal 256 -> hidden -> hidden)
``blocks.{b}.ada.*``        adaLN modulation, hidden -> 6 * hidden
``blocks.{b}.qkv.*``        fused Q/K/V projection, hidden -> 3 * hidden
``blocks.{b}.proj.*``       attention output projection
``blocks.{b}.mlp.{0,2}.*``  feed-forward, hidden -> ffn -> hidden
``out_ada.*``               final adaLN, hidden -> 2 * hidden
``io.*``                    head-specific token maps (WAM: patch, state,
                            action_in, pos, action_out; ACWM: action,
                            state, latent_in, pos, latent_out)
=========================  ==============================================

The config travels in the safetensors metadata under ``physis_model_config``
(JSON). A worker that hosts only some blocks reads only their tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from physis_ros.config import ConfigError, from_mapping, to_mapping
from physis_ros.model.dit import DiTModel
from physis_ros.model.presets import build_model
from physis_ros.model.spec import ModelConfig

CONFIG_KEY = "physis_model_config"


class CheckpointError(ValueError):
    """A checkpoint does not fit the model it is loaded into."""


def save_checkpoint(model: DiTModel, path: str | Path) -> None:
    if model.hosted_blocks != frozenset(range(model.config.blocks)):
        raise CheckpointError("save a checkpoint from a model that hosts all its blocks")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={CONFIG_KEY: json.dumps(to_mapping(model.config))})


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if CONFIG_KEY not in meta:
        raise CheckpointError(f"{path} has no '{CONFIG_KEY}' metadata; was it written by save_checkpoint?")
    try:
        return from_mapping(ModelConfig, json.loads(meta[CONFIG_KEY]))
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=f"{path} (embedded config)") from None


def load_checkpoint(path: str | Path, *, config: ModelConfig | None = None, device: str = "cpu",
                    hosted_blocks: Iterable[int] | None = None) -> DiTModel:
    """Build a model from a checkpoint, reading only the tensors of the hosted blocks.

    ``config`` defaults to the one stored in the file; when given, every tensor
    must have the shape that config implies.
    """
    config = config or read_checkpoint_config(path)
    model = build_model(config, device=device, hosted_blocks=hosted_blocks)
    expected = model.state_dict()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        available = set(f.keys())
        missing = sorted(set(expected) - available)
        if missing:
            raise CheckpointError(f"{path} lacks tensor '{missing[0]}' (and {len(missing) - 1} more) "
                                  f"needed by model '{config.name}'")
        loaded = {}
        for name, want in expected.items():
            got = f.get_slice(name).get_shape()
            if tuple(got) != tuple(want.shape):
                raise CheckpointError(f"tensor '{name}' in {path} has shape {tuple(got)} but the config of "
                                      f"model '{config.name}' needs {tuple(want.shape)}")
            loaded[name] = f.get_tensor(name)
    with torch.no_grad():
        model.load_state_dict(loaded, strict=True)
    return model
