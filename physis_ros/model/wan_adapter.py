"""The robot adapter of a Wan world-action or world model (kinds ``wan_wam``, ``wan_acwm``) as a checkpoint
directory holds it, beside the diffusers trunk (and VAE)::

    my-model/
      physis_model.yaml            # kind, steps, window, the wan: section (actions: or world:)
      transformer/                 # diffusers WanTransformer3DModel (config.json, safetensors)
      vae/                         # diffusers AutoencoderKLWan (a world model; optional for a WAM)
      adapter.safetensors          # the adapter's tensors (ADAPTER_TENSORS below)
      adapter.json                 # what they were made for: {"kind", "hidden", "actions" | "world": {...}}

Without ``adapter.safetensors`` the adapter is random (seeded by ``init_seed``). With it, both files are
checked when the config is loaded (torch-free: the JSON and the safetensors header): the kind, the trunk
width and every field of the robot side must be the config's, and every tensor there with its shape, no
other; a mismatch is refused in one line naming ``wan.checkpoint``, the file and the key or tensor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from physis_ros.config import ConfigError

ADAPTER = "adapter.safetensors"
ADAPTER_SPEC = "adapter.json"
SECTION = {"wan_wam": "actions", "wan_acwm": "world"}


def adapter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the adapter of ``config`` (kind wan_wam or wan_acwm) with its shape."""
    d, io = config.hidden, config.wan
    if config.kind == "wan_wam":
        a = io.actions
        return {"image.weight": (d, a.image_channels, a.image_patch, a.image_patch), "image.bias": (d,),
                "image_pos.weight": ((a.image_size // a.image_patch) ** 2, d),
                "state.weight": (d, a.state_dim), "state.bias": (d,),
                "action_in.weight": (d, a.dof), "action_in.bias": (d,),
                "action_pos.weight": (a.horizon, d),
                "action_out.weight": (a.dof, d), "action_out.bias": (a.dof,)}
    from physis_ros.model.wan_family import camera_tokens    # (wan_family checks adapters with this module)

    w = io.world
    return {"camera_pos.weight": (camera_tokens(config), d),
            "state.weight": (d, w.state_dim), "state.bias": (d,),
            "actions.weight": (d, w.action_dim), "actions.bias": (d,),
            "action_pos.weight": (w.action_horizon, d)}


def adapter_spec(config) -> dict[str, Any]:
    """What ``adapter.json`` says of the adapter of ``config``."""
    section = SECTION[config.kind]
    return {"kind": config.kind, "hidden": config.hidden,
            section: dataclasses.asdict(getattr(config.wan, section))}


def adapter_file(config) -> Path | None:
    """The checkpoint's ``adapter.safetensors``, or None (no checkpoint, or none there: a random adapter)."""
    if not config.wan.checkpoint:
        return None
    path = Path(config.wan.checkpoint) / ADAPTER
    return path if path.is_file() else None


def check_adapter(config) -> None:
    """The checkpoint's adapter files against ``config`` (see the module's docstring); nothing to check
    without them."""
    path = adapter_file(config)
    if path is None:
        return
    from physis_ros.model.wan import WanLoadError, check_headers, read_header

    def bad(problem: str) -> ConfigError:
        return ConfigError("wan.checkpoint", problem)

    spec_path = path.parent / ADAPTER_SPEC
    try:
        given = json.loads(spec_path.read_text())
    except (OSError, ValueError) as exc:
        raise bad(f"{spec_path}: not readable JSON ({exc}); an adapter's weights come with what they were made "
                  f"for (save_adapter writes both)") from None
    want = adapter_spec(config)
    section = SECTION[config.kind]
    for key in ("kind", "hidden"):
        if not isinstance(given, dict) or given.get(key) != want[key]:
            got = given.get(key) if isinstance(given, dict) else given
            raise bad(f"{spec_path}: {key} is {got!r}, the model's is {want[key]!r}")
    for key, value in want[section].items():
        got = (given.get(section) or {}).get(key) if isinstance(given.get(section), dict) else None
        if got != value:
            raise bad(f"{spec_path}: {section}.{key} is {got!r}, but wan.{section}.{key} is {value!r}")
    try:
        header = read_header(path)
        check_headers(adapter_shapes(config), dict.fromkeys(header, path), path, "the model",
                      f"a {config.kind} adapter", {path: header})
    except WanLoadError as exc:
        raise bad(str(exc)) from None


def adapter_weights(config):
    """The checkpoint's adapter tensors (float32 CPU tensors by name), or None for a random adapter."""
    path = adapter_file(config)
    if path is None:
        return None
    from safetensors.torch import load_file

    return load_file(path)


def build_adapter(config, make):
    """The adapter module ``make()`` builds, with the checkpoint's weights (``adapter.safetensors``) or random
    ones seeded by ``init_seed`` (the same on every worker)."""
    from physis_ros.model.wan import seeded

    module = seeded(config.init_seed, "adapter", make)
    weights = adapter_weights(config)
    if weights is not None:
        module.load_state_dict(weights, strict=True)
    return module


def save_adapter(model, directory: str | Path) -> None:
    """Write ``model``'s adapter (a Wan WAM's or world model's ``adapter`` module) into ``directory`` as
    ``adapter.safetensors`` and ``adapter.json``: what a training run leaves beside the trunk."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in model.adapter.state_dict().items()}
    save_file(tensors, directory / ADAPTER)
    (directory / ADAPTER_SPEC).write_text(json.dumps(adapter_spec(model.config), indent=2) + "\n")


def save_directory(model, directory: str | Path, name: str, description: str) -> Path:
    """Write ``model`` (a Wan WAM or world model hosting every block, e.g. after training) as a checkpoint
    directory the ``wan_wam``/``wan_acwm`` families read: ``transformer/`` and ``vae/`` (where the model has
    one) by diffusers' own ``save_pretrained``, the adapter (:func:`save_adapter`) and ``physis_model.yaml``
    (the model's config without what the directory holds: the trunk's shape, the VAE)."""
    import yaml
    from diffusers import WanTransformer3DModel

    config = model.config
    if set(model.hosted_blocks) != set(range(config.blocks)):
        raise ValueError(f"model '{config.name}' hosts blocks {sorted(model.hosted_blocks)}; saving needs all "
                         f"{config.blocks}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full = WanTransformer3DModel.from_config(model.trunk_config)
    state = dict(model.trunk.state_dict())
    for b in range(config.blocks):
        state.update({f"blocks.{b}.{k}": v for k, v in model.blocks[str(b)].state_dict().items()})
    full.load_state_dict(state, strict=True)
    full.save_pretrained(directory / "transformer")
    io = config.wan
    written = io.vae and Path(io.vae).resolve() == (directory / "vae").resolve()     # a VAE trained into it
    if (io.vae or io.vae_config) and not written:
        from physis_ros.model.wan_acwm import load_vae

        load_vae(config).save_pretrained(directory / "vae")
    save_adapter(model, directory)
    mapping = {k: v for k, v in dataclasses.asdict(config).items()
               if k not in ("hidden", "heads", "blocks", "ffn", "wam", "acwm", "wan") and v is not None}
    section = {k: v for k, v in dataclasses.asdict(io).items()
               if k not in ("checkpoint", "trunk", "vae", "vae_config") and v is not None}
    mapping.update(name=name, description=description, wan=section)
    (directory / "physis_model.yaml").write_text(yaml.safe_dump(mapping, sort_keys=False))
    return directory

