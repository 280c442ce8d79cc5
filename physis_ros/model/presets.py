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
    """ConfigError naming ``kind`` unless the family's spec matches the model it built: its block's parameters
    (what memory figures count) against a block built on the meta device (no memory, no init cost), its tokens
    per chunk and width (what K/V tables and hops are sized by) and its output against one zero observation
    encoded, embedded and headed (no block runs)."""
    config, spec = model.config, model.config.spec
    with torch.device("meta"):
        actual = sum(p.numel() for p in model.new_block(0).parameters())
    if spec.block_params != actual:
        raise ConfigError("kind", f"model family '{family.name}' counts {spec.block_params} parameters per block "
                                  f"for model '{config.name}' but its block has {actual}: fix its spec")
    try:
        with torch.no_grad():
            obs = {name: torch.zeros((1, *shape), dtype=model.dtype, device=model.device)
                   for name, shape in spec.inputs.items()}
            t = torch.ones(1, dtype=torch.float32, device=model.device)
            x = torch.zeros((1, *spec.output), dtype=model.dtype, device=model.device)
            h = model.embed(model.encode(obs), x, t)
            out = model.head(h, t)
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError("kind", f"model family '{family.name}' gives model '{config.name}' inputs "
                                  f"{dict(spec.inputs)}, output {spec.output} and {spec.tokens_per_chunk} tokens "
                                  f"per chunk, on which its model fails ({type(exc).__name__}: {first}): fix its "
                                  f"spec") from None
    if tuple(h.shape[1:]) != (spec.tokens_per_chunk, spec.kv_width):
        raise ConfigError("kind", f"model family '{family.name}' gives model '{config.name}' "
                                  f"{spec.tokens_per_chunk} tokens of width {spec.kv_width} per chunk but its "
                                  f"embed makes {tuple(h.shape[1:])}: fix its spec")
    if tuple(out.shape[1:]) != spec.output:
        raise ConfigError("kind", f"model family '{family.name}' gives model '{config.name}' output {spec.output} "
                                  f"but its head makes {tuple(out.shape[1:])}: fix its spec")
