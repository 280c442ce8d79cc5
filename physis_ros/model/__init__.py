"""Servable models: the interface the runtime relies on, the reference DiT and its presets."""

from physis_ros.model.interface import ServableModel
from physis_ros.model.kv import KVBatch, KVTable
from physis_ros.model.presets import build_model, load_model_config, preset_names
from physis_ros.model.spec import ModelConfig

__all__ = ["KVBatch", "KVTable", "ModelConfig", "ServableModel", "build_model", "load_model_config",
           "preset_names"]
