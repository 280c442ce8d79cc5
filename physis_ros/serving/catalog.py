"""The models a server can serve, by reference: a preset name (``tiny-wam``), a model YAML, or a
safetensors checkpoint (which carries its config), each with the cost profile admission decides on.

A profile is read from ``admission.profiles`` (a directory of ``physis-profile`` JSON files named
``<model>.<device>.json``) when one is there for the model, else measured once per model by
``physis-profile`` in a child process (:func:`measure_in_child`): the workers' own stage code, a few
seconds for the tiny presets, never in the server's process. The child has an address-space limit
(``admission.profile_memory_gb``, CPU devices) and a time limit (``admission.profile_timeout_s``), runs
at the lowest CPU priority while robots are served, and is killed if the server stops; a measurement
that fails refuses its goal (``profile-failed``, or ``memory``) and is tried again by the next goal.
Goals for models already resolved are not held up by one being measured. CPU workers share the host's
cores, which a one-process measurement does not see: under the cpu-host admission policy the catalog is
given ``admission.corun_slowdown`` (what ``physis-profile --corun`` measures) to apply to a measured
profile that lacks it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import yaml

from physis_ros.config import ConfigError, repo_config_dir, to_mapping
from physis_ros.model.checkpoint import CheckpointError, read_checkpoint_config
from physis_ros.model.families import SIDECAR
from physis_ros.model.spec import load_model_config
from physis_ros.model.spec import ModelConfig
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import AdmissionConfig, ServeConfig
from physis_ros.serving.file_inputs import read_file_inputs
from physis_ros.serving.fit import check_stream_model
from physis_ros.runtime.streams import ServedModel
from physis_ros.runtime.costs import CostProfile, profile_from_json, stream_memory_bytes
from physis_ros.scheduling.settings import GB


# What a measuring child that ran out of its address-space limit says on stderr: Python's, C++'s and torch's
# allocation failures, and a thread whose stack could not be mapped (torch's thread pool, c10's thread.cpp).
OUT_OF_MEMORY = ("MemoryError", "std::bad_alloc", "DefaultCPUAllocator", "Resource temporarily unavailable (src/thread.cpp")


def bundled_checkpoint(ref: str) -> Path | None:
    """A checkpoint shipped in ``config/checkpoints/``, named by its stem (``tiny-wam-demo``: a safetensors
    file) or its directory's name (``tiny-wan-wam-demo``: a checkpoint directory with its
    ``physis_model.yaml``), so that a config can name it wherever the server runs from (source tree or
    installed share)."""
    if not ref or "/" in ref or Path(ref).suffix:
        return None
    root = repo_config_dir() / "checkpoints"
    path = root / f"{ref}.safetensors"
    if path.is_file():
        return path
    return root / ref if (root / ref / SIDECAR).is_file() else None


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


def check_default_checkpoint(model: ModelConfig, checkpoint: str | None) -> None:
    """``engine.checkpoint`` holds the weights of the default model: ConfigError naming the key (and what
    differs) if its stored config is another model's, found when the config is loaded rather than when a
    worker loads the weights and every stream fails to start."""
    if not checkpoint:
        return
    try:
        stored = read_checkpoint_config(checkpoint)
    except (ConfigError, CheckpointError, OSError) as exc:
        raise ConfigError("engine.checkpoint", f"{checkpoint}: {exc}") from None
    except Exception as exc:  # safetensors' own error types for a corrupt header
        raise ConfigError("engine.checkpoint", f"{checkpoint} is not a readable safetensors checkpoint "
                                               f"({type(exc).__name__}: {exc})") from None
    if stored == model:
        return
    differ = [f"{f.name} {getattr(stored, f.name)!r} (model: {getattr(model, f.name)!r})"
              for f in dataclasses.fields(model) if getattr(stored, f.name) != getattr(model, f.name)
              and f.name not in ("name", "description")] or ["its name"]
    raise ConfigError("engine.checkpoint", f"{checkpoint} holds model '{stored.name}', not the configured model "
                                           f"'{model.name}' ({', '.join(differ[:4])}); set model: to the "
                                           f"checkpoint itself (it carries its config) or give a checkpoint "
                                           f"of '{model.name}'")


def check_config_models(config: ServeConfig) -> ModelConfig:
    """The config's default model, and every config stream against its model (ConfigError naming the key):
    what would otherwise fail only when the workers start."""
    try:
        model = model_config_of(config.model)[0]
    except Rejected as exc:
        raise ConfigError("model", exc.detail) from None
    check_default_checkpoint(model, config.engine.checkpoint)
    for name, s in config.streams.items():
        try:
            own = model_config_of(s.model)[0] if s.model else model
        except Rejected as exc:
            raise ConfigError(f"streams.{name}.model", exc.detail) from None
        check_stream_model(f"streams.{name}", s, own)
        read_file_inputs(f"streams.{name}", s.inputs, own)
    return model


class ModelCatalog:
    """Resolves model references to :class:`~physis_ros.runtime.streams.ServedModel` with a cost profile;
    thread-safe (profiles may be measured on a helper thread while the executor runs)."""

    def __init__(self, default: str, device: str, config: AdmissionConfig, checkpoint: str | None = None,
                 corun_slowdown: float = 1.0):
        self.default = default
        self.device = device
        self.config = config
        self.corun_slowdown = corun_slowdown   # a profile measured here runs this much slower served (>= 1)
        self.default_checkpoint = checkpoint
        self._served: dict[str, ServedModel] = {}
        self._pending: dict[str, Future] = {}   # models being measured now
        self._children: list[subprocess.Popen] = []   # their physis-profile processes
        self._lock = threading.Lock()

    def config_of(self, ref: str = "") -> ModelConfig:
        """The model config of ``ref`` (empty: the server's default) without building or profiling it (a
        preset, a YAML file, or a checkpoint's header); Rejected("unknown-model") if unusable."""
        return model_config_of(ref or self.default)[0]

    def resolve(self, ref: str = "", serving: bool = True) -> ServedModel:
        """The served model of ``ref`` (empty: the server's default), with its profile (measured on first
        use: call off the executor thread; ``serving``: streams run now, so a measurement yields to them).
        Two goals for one model wait for one measurement; goals for other models do not wait for it."""
        ref = ref or self.default
        config, checkpoint = model_config_of(ref)
        if ref == self.default and checkpoint is None:
            checkpoint = self.default_checkpoint
        key = f"{config.name}@{checkpoint}"
        with self._lock:
            pending = self._pending.get(key)
            mine = pending is None and key not in self._served
            if mine:
                pending = self._pending[key] = Future()
        if mine:
            try:
                profile = self._profile(config, serving)
            except BaseException as exc:
                with self._lock:
                    del self._pending[key]      # the next goal tries again
                pending.set_exception(exc)
                raise
            with self._lock:
                self._served[key] = ServedModel(config, checkpoint, profile)
                del self._pending[key]
            pending.set_result(None)
        elif pending is not None:
            pending.result()                    # another goal measures it: its outcome is ours
        with self._lock:
            served = self._served[key]
        if served.config != config:
            # Workers share weights by the model's name: another model under a served name would run
            # with the served one's blocks (and be admitted on its profile).
            raise Rejected("unknown-model", f"model '{ref}' is named '{config.name}' like a model this "
                                            f"server already serves, with another config; give it a name "
                                            f"of its own")
        return served

    def close(self) -> None:
        """Kill a measurement under way (the server stops)."""
        with self._lock:
            children = list(self._children)
        for child in children:
            child.kill()

    def _profile(self, config: ModelConfig, serving: bool) -> CostProfile:
        directory = self.config.profiles
        if directory:
            path = Path(directory) / f"{config.name}.{self.device}.json"
            if path.is_file():
                try:
                    return profile_from_json(json.loads(path.read_text()), config, where=str(path))
                except (ConfigError, ValueError) as exc:
                    raise Rejected("unknown-model", f"profile {path}: {exc}") from None
        # (not with nothing served yet: at the lowest priority a first measurement takes what the robots'
        # and workers' own start-up leave, and read a tiny-wam chunk at 70 ms on a slow CI host)
        profile = self.measure(config, nice=19 if serving else 0)
        return dataclasses.replace(profile, corun_slowdown=max(profile.corun_slowdown, self.corun_slowdown))

    def measure(self, config: ModelConfig, nice: int) -> CostProfile:
        """``physis-profile`` of ``config`` in a child process (see the module's docstring)."""
        limit = self.config.profile_memory_gb * GB if self.device == "cpu" else None
        need = stream_memory_bytes(config)
        if limit is not None and need["weights"] + need["kv"] > limit:
            raise Rejected("memory", f"measuring model '{config.name}' here needs its whole model in one process: "
                                     f"{(need['weights'] + need['kv']) / GB:.1f} GB of weights and KV, over "
                                     f"admission.profile_memory_gb={self.config.profile_memory_gb:g} (give its "
                                     f"profile in admission.profiles, physis-profile on a larger host)")
        return measure_in_child(config, self.device, self.config.profile_repeats, nice=nice,
                                memory_bytes=None if limit is None else int(limit),
                                timeout_s=self.config.profile_timeout_s, children=self._children, lock=self._lock)


def measure_in_child(config: ModelConfig, device: str, repeats: int, *, nice: int = 0, memory_bytes: int | None = None,
                     timeout_s: float = 120.0, children: list | None = None,
                     lock: threading.Lock | None = None) -> CostProfile:
    """Run ``physis-profile`` on ``config`` (written as a model YAML) in a child process with an address-space
    limit of ``memory_bytes`` and ``nice``, killed after ``timeout_s``; its profile, or Rejected saying why not
    (``memory`` when it ran out of its limit, else ``profile-failed``). ``children``/``lock``: where the
    running child is listed while it runs (so that a stopping server can kill it)."""
    with tempfile.TemporaryDirectory(prefix="physis_profile_") as tmp:
        model, out = Path(tmp) / "model.yaml", Path(tmp) / "profile.json"
        model.write_text(yaml.safe_dump(to_mapping(config)))
        cmd = [sys.executable, "-m", "physis_ros.cli.profile", "--model", str(model), "--device", device,
               "--repeats", str(repeats), "--corun", "0", "--json", str(out)]
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        # Set from here, not by a preexec_fn (unsafe in a process with threads, as the server is): the child
        # is still starting its interpreter, long before it builds the model.
        try:
            if memory_bytes is not None:
                resource.prlimit(child.pid, resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            if nice:
                os.setpriority(os.PRIO_PROCESS, child.pid, nice)
        except (OSError, ValueError):
            child.kill()   # (ProcessLookupError: it died at once; its error is read below)
        if children is not None and lock is not None:
            with lock:
                children.append(child)
        try:
            err = child.communicate(timeout=timeout_s)[1] or ""
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise Rejected("profile-failed", f"measuring model '{config.name}' took over {timeout_s:g} s "
                                             f"(admission.profile_timeout_s); give its profile in "
                                             f"admission.profiles") from None
        finally:
            if children is not None and lock is not None:
                with lock:
                    children.remove(child)
        if child.returncode != 0 or not out.is_file():
            # (its progress line ends in a carriage return, not a newline, before the error)
            last = err.replace("\r", "\n").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            if any(word in err for word in OUT_OF_MEMORY):
                raise Rejected("memory", f"measuring model '{config.name}' ran out of admission.profile_memory_gb="
                                         f"{(memory_bytes or 0) / GB:g} GB ({last[0][:200]})")
            raise Rejected("profile-failed", f"measuring model '{config.name}' failed: {last[0][:300]}")
        try:
            return profile_from_json(json.loads(out.read_text()), config, where="physis-profile")
        except (ConfigError, ValueError) as exc:
            raise Rejected("profile-failed", f"measuring model '{config.name}': {exc}") from None
