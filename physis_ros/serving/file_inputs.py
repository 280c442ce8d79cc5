"""Model inputs a stream reads from files (``streams.<name>.inputs``): a tensor per input, read once when the
stream joins and given to every chunk (a Wan trunk's prompt embeddings). Checked against the model's spec
before any capacity is looked at; an error names the stream's key and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from physis_ros.config import ConfigError
from physis_ros.model.spec import ModelConfig

MAX_BYTES = 256 * 1024 * 1024    # a file input larger than this is refused (an input, not a checkpoint)


def read_file_inputs(key: str, inputs: Mapping[str, str], model: ModelConfig) -> dict[str, np.ndarray]:
    """Each input of ``inputs`` (name -> safetensors file) as float32 of the model's shape for it (a leading
    batch axis of 1 is dropped). ConfigError naming ``<key>.inputs.<name>`` unless the model takes that input
    and the file holds a finite float tensor of its shape under that name."""
    from safetensors import safe_open

    shapes = model.observation_shapes
    out = {}
    for name, path in inputs.items():
        where = f"{key}.inputs.{name}"
        if name not in shapes:
            raise ConfigError(where, f"model '{model.name}' takes no input '{name}' (it takes "
                                     f"{', '.join(sorted(shapes))})")
        file = Path(path).expanduser()
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise ConfigError(where, f"{path}: {exc.strerror or exc}; give a safetensors file holding "
                                     f"'{name}' {list(shapes[name])}") from None
        if size > MAX_BYTES:
            raise ConfigError(where, f"{path}: {size} bytes, over {MAX_BYTES}; an input file holds one tensor")
        try:
            with safe_open(str(file), "np") as f:
                if name not in f.keys():
                    raise ConfigError(where, f"{path} holds no tensor '{name}' (it holds: "
                                             f"{', '.join(sorted(f.keys())) or 'none'})")
                value = f.get_tensor(name)
        except ConfigError:
            raise
        except Exception as exc:   # noqa: BLE001 (safetensors' own errors for a corrupt or non-numpy file)
            raise ConfigError(where, f"{path}: not a readable safetensors file ({type(exc).__name__}: "
                                     f"{str(exc)[:120]})") from None
        want = tuple(shapes[name])
        got = value.shape[1:] if value.ndim == len(want) + 1 and value.shape[0] == 1 else value.shape
        if tuple(got) != want or not np.issubdtype(value.dtype, np.floating):
            raise ConfigError(where, f"{path}: '{name}' is {value.dtype} {list(value.shape)}; model "
                                     f"'{model.name}' takes float {list(want)}")
        tensor = np.ascontiguousarray(value.reshape(want), dtype=np.float32)
        if not np.isfinite(tensor).all():
            raise ConfigError(where, f"{path}: '{name}' holds non-finite values")
        out[name] = tensor
    return out
