"""The ``wan`` model family: a Wan trunk read from a diffusers directory (``model: /path/to/dir``), served
through the stage contract by :class:`physis_ros.model.wan_model.WanModel`. Torch-free: what a config load,
the scheduler and the simulator read (the directory's ``config.json``, the spec), with the model built on a
worker.

A model config of this family is the directory's own trunk (its ``config.json`` fixes ``hidden``, ``heads``,
``blocks`` and ``ffn``: they are filled in, and a YAML that gives other values is refused) and a ``wan:``
section: the latent chunk (``frames``, ``height``, ``width``) and the prompt embeddings' rows
(``text_tokens``). A directory may hold a ``physis_model.yaml`` with the rest (steps, grid, window, history,
dtype, the ``wan:`` section); without one the defaults below apply, and a pipeline directory's
``scheduler/scheduler_config.json`` ``flow_shift`` sets the grid's shift.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from physis_ros.config import ConfigError
from physis_ros.model.families import ModelFamily
from physis_ros.model.wan_adapter import check_adapter
from physis_ros.model.spec import ModelConfig, ModelSpec

CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
CLASS = "WanTransformer3DModel"
VAE_CLASS = "AutoencoderKLWan"
VAE_DIR = "vae"
DEFAULT_STEPS = 4       # denoising steps of a directory without physis_model.yaml (a few-step robot model)


class WanLoadError(ValueError):
    """A directory that is not a Wan transformer we can read; the message names the file (and tensor)."""


def transformer_dir(path: str | Path) -> Path:
    """The directory holding the transformer's ``config.json``: ``path``, or its ``transformer/``."""
    root = Path(path)
    for candidate in (root, root / "transformer"):
        if (candidate / CONFIG).is_file():
            return candidate
    raise WanLoadError(f"{root}: no {CONFIG} (nor transformer/{CONFIG}); give a directory written by "
                       f"WanTransformer3DModel.save_pretrained, or a pipeline directory holding one")


def read_config(directory: Path) -> dict[str, Any]:
    """The trunk's diffusers ``config.json`` (WanLoadError naming the file unless it is a Wan transformer's)."""
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WanLoadError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("_class_name") != CLASS:
        got = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
        raise WanLoadError(f"{path}: _class_name is {got!r}; a {CLASS} is needed")
    return config


# What a random-init trunk's ``wan.trunk`` must give (the rest takes diffusers' defaults).
TRUNK_KEYS = ("num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim", "text_dim", "in_channels")
TRUNK_DEFAULTS = {"patch_size": [1, 2, 2], "freq_dim": 256, "cross_attn_norm": True,
                  "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024, "out_channels": None}


def trunk_config(checkpoint: str | Path) -> dict[str, Any]:
    """``read_config`` of a checkpoint directory, as a ConfigError naming ``wan.checkpoint``."""
    try:
        return read_config(transformer_dir(checkpoint))
    except WanLoadError as exc:
        raise ConfigError("wan.checkpoint", str(exc)) from None


def check_trunk(trunk: dict[str, Any]) -> None:
    """ConfigError naming the ``wan.trunk`` key unless it is a random-init trunk's config we can build."""
    missing = [k for k in TRUNK_KEYS if k not in trunk]
    if missing:
        raise ConfigError(f"wan.trunk.{missing[0]}", "required by a random-init trunk (no wan.checkpoint): give "
                                                    f"{', '.join(missing)}")
    unknown = sorted(set(trunk) - set(TRUNK_KEYS) - set(TRUNK_DEFAULTS) - {"image_dim", "added_kv_proj_dim"})
    if unknown:
        raise ConfigError(f"wan.trunk.{unknown[0]}", f"not a key of a Wan trunk's config (known: "
                                                     f"{', '.join([*TRUNK_KEYS, *TRUNK_DEFAULTS])})")
    for key in TRUNK_KEYS:
        if not isinstance(trunk[key], int) or isinstance(trunk[key], bool) or trunk[key] < 1:
            raise ConfigError(f"wan.trunk.{key}", f"{trunk[key]!r}: a positive integer")


def trunk_of(io) -> dict[str, Any]:
    """The trunk's diffusers config: its checkpoint's ``config.json``, or the random-init ``wan.trunk`` with
    diffusers' defaults for what it leaves out (ConfigError naming the key)."""
    if io.checkpoint:
        if io.trunk:
            raise ConfigError("wan.trunk", "a model with a checkpoint takes its trunk from the checkpoint's "
                                           "config.json: leave wan.trunk out")
        return trunk_config(io.checkpoint)
    check_trunk(io.trunk)
    trunk = {"_class_name": CLASS, **TRUNK_DEFAULTS, **io.trunk}
    trunk["out_channels"] = trunk["out_channels"] or trunk["in_channels"]
    return trunk


def check_weights(checkpoint: Path, key: str = "wan.checkpoint", what: str = "transformer") -> None:
    """A directory's weights checked from their headers (every file there and whole, every tensor of its
    shape: :func:`physis_ros.model.wan.check_checkpoint` for the ``transformer``, ``check_vae`` for a ``vae``),
    once per version of its files: ConfigError naming ``key``, the file and the tensor, when the config is loaded
    rather than when a worker builds the model."""
    directory = transformer_dir(checkpoint) if what == "transformer" else Path(checkpoint)
    stats = [(f.name, f.stat()) for f in directory.iterdir() if f.is_file()]
    stamp = tuple(sorted((name, st.st_mtime_ns, st.st_size) for name, st in stats))
    try:
        _checked(str(directory), what, stamp)
    except WanLoadError as exc:
        raise ConfigError(key, str(exc)) from None


@functools.lru_cache(maxsize=32)
def _checked(directory: str, what: str, stamp: tuple) -> None:
    from physis_ros.model.wan import check_checkpoint, check_vae

    (check_checkpoint if what == "transformer" else check_vae)(directory)


def _trunk_shape(trunk: dict[str, Any]) -> dict[str, int]:
    heads, head_dim = int(trunk["num_attention_heads"]), int(trunk["attention_head_dim"])
    return {"hidden": heads * head_dim, "heads": heads, "blocks": int(trunk["num_layers"]),
            "ffn": int(trunk["ffn_dim"])}


def _flow_shift(root: Path) -> float | None:
    path = root / "scheduler" / "scheduler_config.json"
    try:
        shift = json.loads(path.read_text()).get("flow_shift") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return float(shift) if isinstance(shift, (int, float)) and shift > 0 else None


def complete(mapping: dict[str, Any], directory: Path | None) -> dict[str, Any]:
    """A ``wan`` model mapping with the checkpoint's trunk shape filled in (``directory``: the checkpoint the
    mapping is read from; None: the one its ``wan.checkpoint`` names). Values the mapping gives are kept, and
    checked against the checkpoint by the spec."""
    section = dict(mapping.get("wan") or {})
    if directory is not None:
        section["checkpoint"] = str(directory)
    if not isinstance(section.get("checkpoint"), str) or not section["checkpoint"]:
        trunk = section.get("trunk")     # a random-init trunk: its wan.trunk gives the shape
        if not isinstance(trunk, dict):
            return mapping               # from_mapping names what is wrong with wan.trunk
        check_trunk(trunk)
        return {**_trunk_shape(trunk), **mapping}
    root = Path(section["checkpoint"]).expanduser().resolve()
    section["checkpoint"] = str(root)
    if (mapping.get("kind") in ("wan_acwm", "wan_wam") and not section.get("vae") and not section.get("vae_config")
            and (root / VAE_DIR / CONFIG).is_file()):
        section["vae"] = str(root / VAE_DIR)      # a pipeline directory's own VAE
    trunk = trunk_config(root)
    check_weights(root)
    out = {**mapping, "wan": section}
    for key, value in _trunk_shape(trunk).items():
        out.setdefault(key, value)
    out.setdefault("name", root.parent.name if root.name == "transformer" else root.name)
    out.setdefault("steps", DEFAULT_STEPS)
    if "sigmas" not in out and "timestep_shift" not in out and _flow_shift(root) is not None:
        out["timestep_shift"] = _flow_shift(root)
    return out


def wan_block_params(hidden: int, ffn: int, cross_attn_norm: bool = True, added_kv_proj_dim: int | None = None
                     ) -> int:
    """Parameters of one diffusers ``WanTransformerBlock``: self- and cross-attention (q, k, v, out with
    biases, RMS norms of q and k across heads), the cross-attention norm, the GELU feed-forward and the
    block's scale-shift table (6 vectors); an image-to-video block's added K/V projections."""
    d = hidden
    attention = 4 * (d * d + d) + 2 * d
    added = 0 if added_kv_proj_dim is None else 2 * (added_kv_proj_dim * d + d) + d
    return 2 * attention + added + (2 * d if cross_attn_norm else 0) + (2 * d * ffn + ffn + d) + 6 * d


def wan_block_flops(config: ModelConfig, video_tokens: int, text_tokens: int) -> float:
    """FLOPs of one block forward for one chunk at one step: the dense matmuls over the video tokens (2 per
    parameter and token; the cross-attention's K and V over the text tokens), self-attention over the chunk
    and its cached history, cross-attention to the text."""
    d, t, n = config.hidden, video_tokens, text_tokens
    kv_text = 2 * (d * d + d)
    dense = wan_block_params(d, config.ffn_dim) - kv_text
    cached = (config.window + int(config.sink)) * t
    return 2.0 * dense * t + 2.0 * kv_text * n + 4.0 * t * (t + cached) * d + 4.0 * t * n * d


def _layout(config: ModelConfig) -> tuple[dict[str, Any], int, int]:
    """The trunk's config, its latent channels and the video tokens of one chunk, checked against the config
    (ConfigError naming the field when the config does not fit the checkpoint)."""
    io = config.wan
    if io is None:
        raise ConfigError("wan", f"kind '{config.kind}' needs a 'wan:' section with the checkpoint directory")
    trunk = trunk_of(io)
    source = f"checkpoint {io.checkpoint}" if io.checkpoint else "wan.trunk"
    for key, value in _trunk_shape(trunk).items():
        if getattr(config, key if key != "ffn" else "ffn_dim") != value:
            raise ConfigError(key, f"{getattr(config, key)} but {source} has {value}: "
                                   + ("leave it out (it is read from the checkpoint)" if io.checkpoint else
                                      "give the trunk's own shape"))
    if trunk.get("image_dim") or trunk.get("added_kv_proj_dim"):
        raise ConfigError("wan.checkpoint", f"{io.checkpoint or 'wan.trunk'} is an image-to-video trunk (image_dim "
                                            f"{trunk.get('image_dim')}); it needs image embeddings, which the wan "
                                            f"family does not take: serve a text-to-video trunk")
    channels = int(trunk["in_channels"])
    if int(trunk.get("out_channels") or channels) != channels:
        raise ConfigError("wan.checkpoint", f"{io.checkpoint or 'wan.trunk'}: in_channels {channels} != out_channels "
                                            f"{trunk['out_channels']}; the sampler needs a velocity of the "
                                            f"latent's shape")
    p_t, p_h, p_w = (int(n) for n in trunk["patch_size"])
    for key, size, patch in (("frames", io.frames, p_t), ("height", io.height, p_h), ("width", io.width, p_w)):
        if size % patch:
            raise ConfigError(f"wan.{key}", f"{size} is not a multiple of the trunk's patch {patch}")
    frames = io.frames // p_t
    positions = (config.window + int(config.sink) + 1) * frames
    if positions > int(trunk.get("rope_max_seq_len", 1024)):
        raise ConfigError("window", f"{config.window} chunks of history (+ sink + the chunk) are {positions} "
                                    f"latent frames, past the trunk's RoPE table of {trunk.get('rope_max_seq_len')}")
    return trunk, channels, frames * (io.height // p_h) * (io.width // p_w)


def _spec(config: ModelConfig, trunk: dict[str, Any], inputs: dict[str, tuple[int, ...]], output: tuple[int, ...],
          produces: str, chunk_tokens: int, context: int, parts=()) -> ModelSpec:
    """A Wan trunk's spec: ``chunk_tokens`` of a chunk write history K/V and cross-attend to ``context``
    conditioning tokens (whose K/V a slot keeps)."""
    return ModelSpec(inputs=inputs, output=output, produces=produces, tokens_per_chunk=context + chunk_tokens,
                     kv_slot_tokens=(config.window + int(config.sink)) * chunk_tokens, kv_width=config.hidden,
                     context_tokens=context,
                     block_params=wan_block_params(config.hidden, config.ffn_dim,
                                                   bool(trunk.get("cross_attn_norm", True))),
                     block_flops=wan_block_flops(config, chunk_tokens, context), history=config.history,
                     frame_axes="CFHW", parts=parts)


def wan_spec(config: ModelConfig) -> ModelSpec:
    """The spec of a Wan trunk: prompt embeddings ``[L, text_dim]`` in, latent frames ``[C, F, H, W]`` out;
    a chunk's hidden state is its text tokens followed by its video tokens, of which only the video tokens
    write history K/V. ConfigError naming the field when the config does not fit the checkpoint."""
    trunk, channels, video = _layout(config)
    io = config.wan
    if io.actions is not None:
        raise ConfigError("wan.actions", "belongs to a world-action model: give kind wan_wam, or leave it out")
    if io.world is not None or io.vae or io.vae_config:
        raise ConfigError("wan.world" if io.world is not None else "wan.vae",
                          "belongs to a world model: give kind wan_acwm, or leave it out")
    if io.text_tokens < 1:
        raise ConfigError("wan.text_tokens", "a video trunk reads a prompt: give its rows (>= 1)")
    return _spec(config, trunk, {"prompt_embeds": (io.text_tokens, int(trunk["text_dim"]))},
                 (channels, io.frames, io.height, io.width), "frames", video, io.text_tokens)


def image_tokens(actions) -> int:
    """Cross-attention tokens of a world-action model's camera image (one per patch)."""
    return (actions.image_size // actions.image_patch) ** 2


def wan_wam_spec(config: ModelConfig) -> ModelSpec:
    """The spec of a Wan world-action model (:mod:`physis_ros.model.wan_wam`): the camera image and the joint
    state (and the prompt's embeddings, if it reads ``text_tokens``) in; out, packed, the action chunk
    ``[horizon, dof]`` and the latent frames ``[C, F, H, W]`` one chunk predicts. Its conditioning tokens are the
    prompt's, the image's and the state's; its video and action tokens write history K/V."""
    trunk, channels, video = _layout(config)
    io, act = config.wan, config.wan.actions
    if act is None:
        raise ConfigError("wan.actions", "kind wan_wam needs the robot side: horizon, dof, state_dim, image_size")
    if io.world is not None:
        raise ConfigError("wan.world", "belongs to a world model (kind wan_acwm): leave it out")
    if io.vae or io.vae_config:          # optional: the VAE whose latents the predicted frames are
        check_vae(vae_config_of(io), channels)
    inputs = {"image": (act.image_channels, act.image_size, act.image_size), "state": (act.state_dim,)}
    if io.text_tokens:
        inputs["prompt_embeds"] = (io.text_tokens, int(trunk["text_dim"]))
    check_adapter(config)
    frames = (channels, io.frames, io.height, io.width)
    size = act.horizon * act.dof + channels * io.frames * io.height * io.width
    return _spec(config, trunk, inputs, (size,), "actions", video + act.horizon,
                 io.text_tokens + image_tokens(act) + 1, parts=(("actions", (act.horizon, act.dof)),
                                                               ("frames", frames)))


# What a random-init VAE's ``wan.vae_config`` may give (the rest takes diffusers' defaults); latents_mean/std
# default to 0/1 per latent channel (Wan2.1's own have 16 entries).
VAE_KEYS = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample",
            "latents_mean", "latents_std", "decoder_base_dim", "dropout")


def vae_config_of(io) -> dict[str, Any]:
    """The VAE's diffusers config: its directory's ``config.json`` (``wan.vae``), or ``wan.vae_config`` with
    diffusers' defaults and latents normalised by 0/1 (ConfigError naming the key)."""
    if io.vae:
        path = Path(io.vae) / CONFIG
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError("wan.vae", f"{path}: not readable JSON ({exc}); give an AutoencoderKLWan directory "
                                         f"(save_pretrained), or leave wan.vae out for a pipeline's vae/") from None
        if not isinstance(config, dict) or config.get("_class_name") != VAE_CLASS:
            got = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
            raise ConfigError("wan.vae", f"{path}: _class_name is {got!r}; an {VAE_CLASS} is needed")
        if io.vae_config:
            raise ConfigError("wan.vae_config", "a model with a VAE directory takes its config from it: leave "
                                                "wan.vae_config out")
        check_weights(Path(io.vae), "wan.vae", "vae")
        return config
    if not io.vae_config:
        raise ConfigError("wan.vae", "a Wan world model encodes the camera with a VAE: give its AutoencoderKLWan "
                                     "directory (wan.vae; a pipeline checkpoint's vae/ is found), or wan.vae_config "
                                     "for random weights")
    unknown = sorted(set(io.vae_config) - set(VAE_KEYS))
    if unknown:
        raise ConfigError(f"wan.vae_config.{unknown[0]}", f"not a key of an AutoencoderKLWan config (known: "
                                                          f"{', '.join(VAE_KEYS)})")
    z_dim = io.vae_config.get("z_dim", 16)
    if not isinstance(z_dim, int) or z_dim < 1:
        raise ConfigError("wan.vae_config.z_dim", f"{z_dim!r}: a positive integer")
    return {"_class_name": VAE_CLASS, "latents_mean": [0.0] * z_dim, "latents_std": [1.0] * z_dim,
            **io.vae_config}


def check_vae(vae: dict[str, Any], channels: int) -> None:
    """The VAE's latents must be the trunk's video (ConfigError naming ``wan.vae``)."""
    if int(vae.get("z_dim", 16)) != channels:
        raise ConfigError("wan.vae", f"the VAE's z_dim {vae.get('z_dim', 16)} is not the trunk's {channels} latent "
                                     f"channels: give the trunk's own VAE")


def vae_frames(vae: dict[str, Any], latent_frames: int) -> int:
    """Video frames the VAE encodes into ``latent_frames`` (its causal first frame alone, then 2 per temporal
    downsampling level each)."""
    return 1 + 2 ** sum(bool(d) for d in vae.get("temperal_downsample", [False, True, True])) * (latent_frames - 1)


def vae_scale(vae: dict[str, Any]) -> int:
    """Pixels per latent row (and column) of the VAE: 2 per downsampling level."""
    return 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1)


def camera_tokens(config: ModelConfig, trunk: dict[str, Any] | None = None,
                  vae: dict[str, Any] | None = None) -> int:
    """A world model's camera tokens: its VAE latent frame of the image, patched as the trunk patches video
    (``trunk``, ``vae``: their configs where the caller has read them already)."""
    trunk, vae, size = trunk or trunk_of(config.wan), vae or vae_config_of(config.wan), config.wan.world.image_size
    _, p_h, p_w = (int(n) for n in trunk["patch_size"])
    return (size // vae_scale(vae) // p_h) * (size // vae_scale(vae) // p_w)


def wan_acwm_spec(config: ModelConfig) -> ModelSpec:
    """The spec of a Wan action-conditioned world model (:mod:`physis_ros.model.wan_acwm`): the camera image, the
    joint state and the actions to imagine (and the prompt's embeddings, if it reads ``text_tokens``) in; the
    latent frames ``[C, F, H, W]`` out. Its conditioning tokens are the prompt's, the camera's latent frame's
    (the VAE's encoding, patched as the trunk patches video), the state's and the actions'."""
    trunk, channels, video = _layout(config)
    io, world = config.wan, config.wan.world
    if world is None:
        raise ConfigError("wan.world", "kind wan_acwm needs the robot side: image_size, state_dim, action_horizon, "
                                       "action_dim")
    if io.actions is not None:
        raise ConfigError("wan.actions", "belongs to a world-action model (kind wan_wam): leave it out")
    vae = vae_config_of(io)
    check_vae(vae, channels)
    _, p_h, p_w = (int(n) for n in trunk["patch_size"])
    scale = vae_scale(vae)
    if world.image_size % (scale * p_h) or world.image_size % (scale * p_w):
        raise ConfigError("wan.world.image_size", f"{world.image_size} is not a multiple of the VAE's {scale} "
                                                   f"pixels per latent times the trunk's patch {p_h}x{p_w}")
    check_adapter(config)
    camera = camera_tokens(config, trunk, vae)
    inputs = {"image": (world.image_channels, world.image_size, world.image_size), "state": (world.state_dim,),
              "actions": (world.action_horizon, world.action_dim)}
    if io.text_tokens:
        inputs["prompt_embeds"] = (io.text_tokens, int(trunk["text_dim"]))
    return _spec(config, trunk, inputs, (channels, io.frames, io.height, io.width), "frames", video,
                 io.text_tokens + camera + 1 + world.action_horizon)


WAN = ModelFamily("wan", "physis_ros.model.wan_model:WanModel", wan_spec,
                  "Wan trunk from a diffusers WanTransformer3DModel directory: prompt embeddings in, latent video "
                  "frames [C, F, H, W] out", checkpoint_class=CLASS, complete=complete)
WAN_WAM = ModelFamily("wan_wam", "physis_ros.model.wan_wam:WanWAMModel", wan_wam_spec,
                      "Wan world-action model: a Wan trunk (a diffusers directory's, or random) with action tokens "
                      "joined to its video tokens; camera image, joint state (and a prompt) in, the action chunk "
                      "and the predicted latent frames out", complete=complete)
WAN_ACWM = ModelFamily("wan_acwm", "physis_ros.model.wan_acwm:WanACWMModel", wan_acwm_spec,
                       "Wan action-conditioned world model: a Wan trunk and its VAE; camera image (VAE-encoded), joint "
                       "state and the actions to imagine in, latent frames [C, F, H, W] out (decoded previews)",
                       complete=complete, preview="physis_ros.model.wan_acwm:previewer")
