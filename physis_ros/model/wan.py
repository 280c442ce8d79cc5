"""Wan trunks from diffusers directories, cut into stages over diffusers' own modules.

A directory is what ``WanTransformer3DModel.save_pretrained`` writes (``config.json`` and
``diffusion_pytorch_model.safetensors``, or its ``.safetensors.index.json`` and shards), or a pipeline
directory holding it in ``transformer/``. :func:`load_wan` reads it as a trunk without blocks (the patch
embedding, the time and text embedders, RoPE, the output norm and projection) and builds only the blocks
asked for, each a diffusers ``WanTransformerBlock`` loaded from the tensors ``blocks.{b}.*`` alone.

:class:`WanStages` is the stage path over those modules: ``encode`` (prompt embeddings -> text tokens,
once per chunk), ``embed`` (noisy latent ``[B, C, F, H, W]`` at timesteps ``t`` -> hidden tokens and the
step's modulation), ``block`` (one diffusers block), ``head`` (velocity in the latent layout). Chained
by :func:`sample`, the sampler the docs state::

    x = noise
    for k in 0..K-1:
        v = model(x, timestep = 1000 * sigmas[k], prompt embeddings)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    output = x

it equals the same loop over ``WanTransformer3DModel.forward`` exactly in fp32 (tests/model/test_wan.py).
Served with history K/V through the model contract: :mod:`physis_ros.model.wan_model`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from physis_ros.model.wan_family import CONFIG, INDEX, WEIGHTS, WanLoadError, read_config, transformer_dir


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one file, or an index and its shards)."""
    from safetensors import safe_open

    index = directory / INDEX
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WanLoadError(f"{index}: not a safetensors index ({exc})") from None
        return {name: directory / file for name, file in entries.items()}
    single = directory / WEIGHTS
    if not single.is_file():
        raise WanLoadError(f"{directory}: neither {WEIGHTS} nor {INDEX}")
    try:
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    except Exception as exc:   # safetensors' own errors (truncated, not safetensors)
        raise WanLoadError(f"{single}: not a readable safetensors file ({exc})") from None


def read_tensors(files: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Only the tensors ``names``, each from its file."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for path, wanted in by_file.items():
        try:
            with safe_open(path, "pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name)
        except Exception as exc:   # noqa: BLE001 (a missing shard, a truncated file)
            raise WanLoadError(f"{path}: cannot read {wanted[0]} ({exc})") from None
    return out


def load_tensors(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """``tensors`` into ``module``: every parameter present and of its shape, nothing left over."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WanLoadError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing)")
    for name, value in tensors.items():
        if name not in expected:
            raise WanLoadError(f"{where}: tensor {name} is not part of the model")
        if tuple(value.shape) != tuple(expected[name].shape):
            raise WanLoadError(f"{where}: tensor {name} has shape {tuple(value.shape)}, the config needs "
                               f"{tuple(expected[name].shape)}")
    module.load_state_dict(tensors, strict=True)


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """A safetensors file's tensors, name -> (shape, end of its data), from its header alone (no tensor data
    read); WanLoadError naming the file (and tensor) if the header is broken or the data is cut short."""
    import struct

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(size - 8, 100_000_000):
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise WanLoadError(f"{path}: the file is missing (named by the checkpoint's index)") from None
    except (OSError, ValueError, struct.error) as exc:
        raise WanLoadError(f"{path}: not a readable safetensors file ({exc})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (begin, end) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WanLoadError(f"{path}: tensor {name} has a broken header entry") from None
        if not 0 <= begin <= end or 8 + n + end > size:
            raise WanLoadError(f"{path}: tensor {name} lies past the end of the file ({size} bytes): the file is "
                               f"truncated")
        out[name] = (shape, end)
    return out


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Wan transformer of diffusers config ``config`` holds, with its shape (built on the meta
    device: no memory, no init)."""
    from diffusers import WanTransformer3DModel

    init = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(init)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_headers(expected: dict[str, tuple[int, ...]], files: dict[str, Path], missing_at: Path, needs: str,
                  whole: str, headers: dict[Path, dict] | None = None) -> None:
    """The tensors ``files`` names (tensor -> the safetensors file holding it) against ``expected`` from the files'
    headers alone (``headers`` if already read): every expected tensor there with its shape, no other.
    WanLoadError naming the file (``missing_at`` for a tensor no file holds) and the tensor; ``needs`` says who
    needs a tensor, ``whole`` what an extra one is not part of."""
    if headers is None:
        headers = {file: read_header(file) for file in sorted(set(files.values()))}
    for name, shape in expected.items():
        if name not in files:
            raise WanLoadError(f"{missing_at}: tensor {name} is missing ({needs} needs it, shape {shape})")
        found = headers[files[name]].get(name)
        if found is None:
            raise WanLoadError(f"{files[name]}: tensor {name} is missing (the index names this file for it)")
        if found[0] != shape:
            raise WanLoadError(f"{files[name]}: tensor {name} has shape {found[0]}, {needs} needs {shape}")
    extra = sorted(set(files) - set(expected))
    if extra:
        raise WanLoadError(f"{files[extra[0]]}: tensor {extra[0]} is not part of {whole}")


def check_checkpoint(path: str | Path) -> None:
    """The checkpoint directory ``path`` as a worker will read it, checked from its headers alone: every file
    the index names is there and whole, every tensor the config needs is in its file with its shape, nothing
    else. WanLoadError naming the file and the tensor otherwise."""
    directory = transformer_dir(path)
    config = read_config(directory)
    try:
        expected = expected_shapes(config)
    except Exception as exc:   # noqa: BLE001 (diffusers' own checks of the config)
        raise WanLoadError(f"{directory / CONFIG}: not a config diffusers can build ({exc})") from None
    check_headers(expected, weight_map(directory), directory, "the config", "the model the config describes")


def check_vae(path: str | Path) -> None:
    """An ``AutoencoderKLWan`` directory checked from its headers as :func:`check_checkpoint` checks a
    transformer's: WanLoadError naming the file and the tensor."""
    from diffusers import AutoencoderKLWan

    directory = Path(path)
    config_path = directory / CONFIG
    try:
        init = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
        with torch.device("meta"):
            expected = {n: tuple(t.shape) for n, t in AutoencoderKLWan.from_config(init).state_dict().items()}
    except Exception as exc:   # noqa: BLE001 (unreadable JSON, diffusers' own checks of the config)
        raise WanLoadError(f"{config_path}: not a config diffusers can build ({exc})") from None
    single = directory / WEIGHTS
    check_headers(expected, weight_map(directory), directory if not single.is_file() else single, "the VAE",
                  "the VAE its config describes")


def keep_fp32() -> tuple[str, ...]:
    """The module names whose parameters diffusers keeps in fp32 whatever the model's dtype (the time
    embedder, the norms, the scale-shift tables)."""
    from diffusers import WanTransformer3DModel

    return tuple(WanTransformer3DModel._keep_in_fp32_modules or ())


def cast(module: torch.nn.Module, dtype: torch.dtype, prefix: str = "") -> torch.nn.Module:
    """``module``'s floating parameters to ``dtype``, those diffusers keeps in fp32 (a name part in
    :func:`keep_fp32`, the full name ``prefix + name``) to fp32: what ``from_pretrained(torch_dtype=)`` does."""
    kept = keep_fp32()
    for name, param in module.named_parameters():
        if param.is_floating_point():
            keep = any(part in kept for part in (prefix + name).split("."))
            param.data = param.data.to(torch.float32 if keep else dtype)
    return module


@dataclass
class WanTrunk:
    """A Wan transformer as loaded: its diffusers config, the trunk without blocks, and the blocks built."""

    config: dict[str, Any]
    trunk: torch.nn.Module                    # WanTransformer3DModel with no blocks
    blocks: dict[int, torch.nn.Module]        # block index -> WanTransformerBlock
    files: dict[str, Path]                    # tensor name -> file (to build more blocks)
    dtype: torch.dtype = torch.float32        # of the weights (fp32 where diffusers keeps fp32)
    seed: int | None = None                   # a random-init trunk (no files): each block seeded by its name

    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    def new_block(self) -> torch.nn.Module:
        """A diffusers ``WanTransformerBlock`` of this trunk's shape, its weights not loaded."""
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        c = self.config
        return WanTransformerBlock(c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"],
                                   c["num_attention_heads"], c.get("qk_norm", "rms_norm_across_heads"),
                                   c.get("cross_attn_norm", True), c.get("eps", 1e-6), c.get("added_kv_proj_dim"))

    def build_block(self, b: int) -> torch.nn.Module:
        """Block ``b`` as diffusers builds it, loaded from its tensors alone."""
        if not 0 <= b < self.num_layers:
            raise ValueError(f"block {b} does not exist; the model has blocks 0..{self.num_layers - 1}")
        if self.seed is not None:
            return cast(seeded(self.seed, f"blocks.{b}", self.new_block), self.dtype, f"blocks.{b}.").eval() \
                .requires_grad_(False)
        block = self.new_block()
        prefix = f"blocks.{b}."
        names = [n for n in self.files if n.startswith(prefix)]
        tensors = read_tensors(self.files, names)
        load_tensors(block, {n[len(prefix):]: v for n, v in tensors.items()}, f"block {b}")
        return cast(block, self.dtype, prefix).eval().requires_grad_(False)


def load_wan(path: str | Path, blocks: Iterable[int] | None = None, dtype: torch.dtype = torch.float32) -> WanTrunk:
    """The Wan transformer of directory ``path`` with only ``blocks`` built (None: all), its weights in
    ``dtype`` (fp32 where diffusers keeps fp32). WanLoadError names the file (and tensor) of a directory we
    cannot read."""
    from diffusers import WanTransformer3DModel

    directory = transformer_dir(path)
    config = read_config(directory)
    files = weight_map(directory)
    init = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        trunk = WanTransformer3DModel.from_config({**init, "num_layers": 0})
    except Exception as exc:   # noqa: BLE001 (diffusers' own checks of the config)
        raise WanLoadError(f"{directory / CONFIG}: not a config diffusers can build ({exc})") from None
    names = [n for n in files if not n.startswith("blocks.")]
    load_tensors(trunk, read_tensors(files, names), f"{directory}: the trunk")
    loaded = WanTrunk(config, cast(trunk, dtype).eval().requires_grad_(False), {}, files, dtype)
    for b in range(loaded.num_layers) if blocks is None else sorted(set(blocks)):
        loaded.blocks[b] = loaded.build_block(b)
    return loaded


def seeded(seed: int, name: str, make):
    """``make()`` under a torch seed derived from ``seed`` and the module's ``name``: the same weights on every
    worker that builds it."""
    from physis_ros.model.interface import derived_seed

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed("init", seed, name))
        return make()


def random_wan(config: dict[str, Any], blocks: Iterable[int] | None = None, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> WanTrunk:
    """A Wan transformer of diffusers config ``config`` with random weights (each module seeded by its name from
    ``seed``; diffusers' own init), only ``blocks`` built (None: all): a real architecture to profile."""
    from diffusers import WanTransformer3DModel

    init = {k: v for k, v in config.items() if not k.startswith("_")}
    trunk = seeded(seed, "trunk", lambda: WanTransformer3DModel.from_config({**init, "num_layers": 0}))
    made = WanTrunk(config, cast(trunk, dtype).eval().requires_grad_(False), {}, {}, dtype, seed)
    for b in range(made.num_layers) if blocks is None else sorted(set(blocks)):
        made.blocks[b] = made.build_block(b)
    return made


@dataclass
class StepEmbedding:
    """What every block of one denoising step reads beside the hidden tokens."""

    temb: torch.Tensor              # [B, D], the head's modulation
    timestep_proj: torch.Tensor     # [B, 6, D], each block's modulation
    rotary: tuple[torch.Tensor, torch.Tensor]   # RoPE cos, sin [1, T, 1, head_dim]
    grid: tuple[int, int, int]      # latent frames, height, width after patching


def rope_at(rope, x: torch.Tensor, frame_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``WanRotaryPosEmbed`` for latent ``x`` [B, C, F, H, W] whose first frame is at position
    ``frame_offset`` (the module itself starts at 0)."""
    _, _, frames, height, width = x.shape
    p_t, p_h, p_w = rope.patch_size
    ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
    if frame_offset + ppf > rope.max_seq_len:
        raise ValueError(f"frames {frame_offset}..{frame_offset + ppf - 1} lie past the trunk's RoPE table "
                         f"({rope.max_seq_len} positions, rope_max_seq_len): shorten the rollout or the window")
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        f, h, w = table.split(sizes, dim=1)
        parts = [f[frame_offset:frame_offset + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                 h[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                 w[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1)]
        out.append(torch.cat(parts, dim=-1).reshape(1, ppf * pph * ppw, 1, -1))
    return out[0], out[1]


def patchify(trunk, x: torch.Tensor) -> torch.Tensor:
    """Latent ``[B, C, F, H, W]`` -> video tokens ``[B, T, D]`` (the trunk's patch embedding)."""
    return trunk.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()


def time_embedding(trunk, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Timesteps ``t`` ``[B]`` (0..1000) -> the head's modulation ``temb`` ``[B, D]`` (in ``dtype``) and every
    block's ``timestep_proj`` ``[B, 6, D]``, as diffusers' condition embedder computes them."""
    ce = trunk.condition_embedder
    proj = ce.timesteps_proj(t)
    own = next(iter(ce.time_embedder.parameters())).dtype
    temb = ce.time_embedder(proj.to(own) if proj.dtype != own else proj).to(dtype)
    return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))


def head(trunk, h: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """Video tokens ``[B, T, D]`` -> velocity ``[B, C, F, H, W]`` (output norm modulated by ``temb``,
    projection, unpatchify over the patched ``grid`` (frames, rows, columns))."""
    shift, scale = (trunk.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    h = (trunk.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
    h = trunk.proj_out(h)
    p_t, p_h, p_w = trunk.config.patch_size
    f, hh, ww = grid
    h = h.reshape(h.shape[0], f, hh, ww, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)


class WanStages:
    """The stage path over a :class:`WanTrunk`'s diffusers modules (see the module's docstring)."""

    def __init__(self, wan: WanTrunk):
        self.wan = wan
        self.trunk = wan.trunk

    def encode(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings ``[B, L, text_dim]`` -> text tokens ``[B, L, D]`` (once per chunk)."""
        return self.trunk.condition_embedder.text_embedder(prompt_embeds)

    def embed(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, StepEmbedding]:
        """Noisy latent ``[B, C, F, H, W]`` at timesteps ``t`` ``[B]`` (0..1000) -> hidden ``[B, T, D]``."""
        trunk = self.trunk
        p_t, p_h, p_w = trunk.config.patch_size
        _, _, frames, height, width = x.shape
        rotary = trunk.rope(x)
        h = patchify(trunk, x)
        temb, timestep_proj = time_embedding(trunk, t, h.dtype)
        return h, StepEmbedding(temb, timestep_proj, rotary, (frames // p_t, height // p_h, width // p_w))

    def block(self, b: int, h: torch.Tensor, text: torch.Tensor, step: StepEmbedding) -> torch.Tensor:
        """Block ``b`` (diffusers' own module) on hidden ``[B, T, D]``."""
        return self.wan.blocks[b](h, text, step.timestep_proj, step.rotary)

    def head(self, h: torch.Tensor, step: StepEmbedding) -> torch.Tensor:
        """Hidden ``[B, T, D]`` -> velocity ``[B, C, F, H, W]``."""
        return head(self.trunk, h, step.temb, step.grid)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """One denoising step's model call through every block, in order."""
        h, step = self.embed(x, t)
        for b in range(self.wan.num_layers):
            h = self.block(b, h, text, step)
        return self.head(h, step)


def sample(velocity, noise: torch.Tensor, sigmas: torch.Tensor | list[float], context: torch.Tensor) -> torch.Tensor:
    """The documented sampler (the module's docstring): ``velocity(x, timesteps [B], context)`` for each of
    the K steps of ``sigmas`` (K + 1 values, decreasing); returns the chunk's output latent."""
    sigmas = [float(s) for s in sigmas]
    if len(sigmas) < 2 or any(not math.isfinite(s) for s in sigmas):
        raise ValueError(f"sigmas: give K + 1 >= 2 finite values, got {sigmas}")
    x = noise
    for k in range(len(sigmas) - 1):
        t = torch.full((x.shape[0],), 1000.0 * sigmas[k], dtype=torch.float32, device=x.device)
        x = x + (sigmas[k + 1] - sigmas[k]) * velocity(x, t, context)
    return x
