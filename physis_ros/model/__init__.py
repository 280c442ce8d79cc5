"""Servable models: the interface the runtime relies on, the reference DiT and its presets.

The names below load on first use, so that a tool that only reads model configs (the scheduler, the
simulator: :mod:`physis_ros.model.spec`) does not import torch.
"""

from __future__ import annotations

import importlib

_WHERE = {"ServableModel": "interface", "KVBatch": "kv", "KVTable": "kv", "build_model": "presets",
          "ModelConfig": "spec", "load_model_config": "spec", "preset_names": "spec"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'physis_ros.model' has no attribute '{name}'")
    return getattr(importlib.import_module(f"physis_ros.model.{_WHERE[name]}"), name)
