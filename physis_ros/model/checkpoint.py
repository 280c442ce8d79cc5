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
from physis_ros.model.dit import DiTModel, block_param_shapes
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
    blocks = range(config.blocks) if hosted_blocks is None else hosted_blocks
    model = build_model(config, device=device, hosted_blocks=[])
    load_trunk(path, model)
    model.attach_blocks(model.build_blocks(blocks, read_block_weights(path, config, blocks)))
    return model


def _read(f, path, name: str, shape, config: ModelConfig) -> torch.Tensor:
    got = f.get_slice(name).get_shape()
    if tuple(got) != tuple(shape):
        raise CheckpointError(f"tensor '{name}' in {path} has shape {tuple(got)} but the config of "
                              f"model '{config.name}' needs {tuple(shape)}")
    return f.get_tensor(name)


def load_trunk(path: str | Path, model: DiTModel) -> None:
    """Load everything but the blocks (timestep embedding, final modulation, the I/O head) into ``model``."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        available = set(f.keys())
        missing = sorted(set(expected) - available)
        if missing:
            raise CheckpointError(f"{path} lacks tensor '{missing[0]}' (and {len(missing) - 1} more) "
                                  f"needed by model '{model.config.name}'")
        loaded = {name: _read(f, path, name, want.shape, model.config) for name, want in expected.items()}
    with torch.no_grad():
        model.load_state_dict(loaded, strict=False)


def read_block_weights(path: str | Path, config: ModelConfig, blocks: Iterable[int]) -> dict[str, torch.Tensor]:
    """The tensors of ``blocks`` (``blocks.{b}.*``) from a checkpoint, shapes checked against ``config``."""
    shapes = block_param_shapes(config)
    want = {f"blocks.{b}.{k}": shape for b in blocks for k, shape in shapes.items()}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        available = set(f.keys())
        missing = sorted(set(want) - available)
        if missing:
            raise CheckpointError(f"{path} lacks tensor '{missing[0]}' (and {len(missing) - 1} more) "
                                  f"needed by model '{config.name}'")
        return {name: _read(f, path, name, shape, config) for name, shape in want.items()}
