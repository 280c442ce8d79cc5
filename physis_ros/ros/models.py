"""The models a server can serve, by reference: a preset name (``tiny-wam``), a model YAML, or a
safetensors checkpoint (which carries its config), each with the cost profile admission decides on.

A profile is read from ``admission.profiles`` (a directory of ``physis-profile`` JSON files named
``<model>.<device>.json``) when one is there for the model, else measured here with the workers'
own stage code (:func:`physis_ros.runtime.profiler.measure_profile`, a second or two for the tiny
presets), once per model. CPU workers share the host's cores, which a one-process measurement does
not see: ``admission.corun_slowdown`` (what ``physis-profile --corun`` measures) is applied to a
measured profile that lacks it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

from physis_ros.config import ConfigError, repo_config_dir
from physis_ros.model.checkpoint import CheckpointError, read_checkpoint_config
from physis_ros.model.presets import load_model_config
from physis_ros.model.spec import ModelConfig
from physis_ros.ros.admission import Rejected
from physis_ros.ros.config import AdmissionConfig
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.streams import ServedModel
from physis_ros.scheduling.profiles import CostProfile, profile_from_json


def bundled_checkpoint(ref: str) -> Path | None:
    """A checkpoint shipped in ``config/checkpoints/``, named by its stem (``tiny-wam-demo``), so that a
    config can name it wherever the server runs from (source tree or installed share)."""
    if not ref or "/" in ref or Path(ref).suffix:
        return None
    path = repo_config_dir() / "checkpoints" / f"{ref}.safetensors"
    return path if path.is_file() else None


def model_config_of(ref: str) -> tuple[ModelConfig, str | None]:
    """(config, checkpoint path or None) of a model reference: a preset, a model YAML, a checkpoint file,
    or a bundled checkpoint's name; Rejected("unknown-model") if unusable."""
    bundled = bundled_checkpoint(ref)
    if bundled is not None:
        ref = str(bundled)
    try:
        if ref.endswith(".safetensors"):
            if not Path(ref).is_file():
                raise Rejected("unknown-model", f"checkpoint {ref} does not exist")
            try:
                config = read_checkpoint_config(ref)
            except (ConfigError, CheckpointError, OSError):
                raise
            except Exception as exc:  # safetensors raises its own error types for a corrupt or truncated header
                raise Rejected("unknown-model", f"checkpoint {ref} is not a readable safetensors file "
                                                f"({type(exc).__name__}: {exc})") from None
            return config, str(Path(ref).resolve())
        return load_model_config(ref), None
    except (ConfigError, CheckpointError, OSError) as exc:
        raise Rejected("unknown-model", f"model '{ref}': {exc}") from None


class ModelCatalog:
    """Resolves model references to :class:`~physis_ros.runtime.streams.ServedModel` with a cost profile;
    thread-safe (profiles may be measured on a helper thread while the executor runs)."""

    def __init__(self, default: str, device: str, config: AdmissionConfig, checkpoint: str | None = None):
        self.default = default
        self.device = device
        self.config = config
        self.default_checkpoint = checkpoint
        self._served: dict[str, ServedModel] = {}
        self._lock = threading.Lock()

    def config_of(self, ref: str = "") -> ModelConfig:
        """The model config of ``ref`` (empty: the server's default) without building or profiling it (a
        preset, a YAML file, or a checkpoint's header); Rejected("unknown-model") if unusable."""
        return model_config_of(ref or self.default)[0]

    def resolve(self, ref: str = "", serving: bool = True) -> ServedModel:
        """The served model of ``ref`` (empty: the server's default), with its profile (measured on first
        use: call off the executor thread; ``serving``: streams run now, so a measurement yields to them)."""
        ref = ref or self.default
        config, checkpoint = model_config_of(ref)
        if ref == self.default and checkpoint is None:
            checkpoint = self.default_checkpoint
        key = f"{config.name}@{checkpoint}"
        with self._lock:
            if key not in self._served:
                self._served[key] = ServedModel(config, checkpoint, self._profile(config, serving))
            served = self._served[key]
            if served.config != config:
                # Workers share weights by the model's name: another model under a served name would run
                # with the served one's blocks (and be admitted on its profile).
                raise Rejected("unknown-model", f"model '{ref}' is named '{config.name}' like a model this "
                                                f"server already serves, with another config; give it a name "
                                                f"of its own")
            return served

    def _profile(self, config: ModelConfig, serving: bool) -> CostProfile:
        directory = self.config.profiles
        if directory:
            path = Path(directory) / f"{config.name}.{self.device}.json"
            if path.is_file():
                try:
                    return profile_from_json(json.loads(path.read_text()), config, where=str(path))
                except (ConfigError, ValueError) as exc:
                    raise Rejected("unknown-model", f"profile {path}: {exc}") from None
        if serving:
            # (not with nothing served yet: at the lowest priority a first measurement takes what the robots'
            # and workers' own start-up leave, and read a tiny-wam chunk at 70 ms on a slow CI host)
            yield_to_streams()
        profile = measure_profile(config, self.device, repeats=self.config.profile_repeats)
        slowdown = self.config.corun_slowdown if self.device == "cpu" else 1.0
        return dataclasses.replace(profile, corun_slowdown=max(profile.corun_slowdown, slowdown))


def yield_to_streams() -> None:
    """Lower this thread's CPU priority for good (Linux: nice is per thread; the catalog's own thread
    calls this). A model's first profile is measured while other streams are served: on a host whose
    cores the workers use, a measurement at normal priority takes their time, and their chunks miss
    their bounds (seen as chunk timeouts, lost chunks and a reset of every stream on the busiest worker
    while tiny-acwm was first measured on a loaded 2-core host). At the lowest priority it takes what
    the workers leave; its numbers are then, if anything, pessimistic."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):   # not Linux, or not allowed: measure at the thread's priority
        pass
