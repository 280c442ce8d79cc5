"""Model configuration (what ``config/models/*.yaml`` holds) and the spec a model's family gives for it
(:class:`ModelSpec`: what the server knows of a model)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError, bounded, from_mapping, load_yaml, repo_config_dir
from physis_ros.model.families import check_family, complete_config, directory_config, load_family
from physis_ros.model.io_sections import ACWMIO, WAMIO, WanIO

DTYPES = ("float32", "bfloat16", "float16")
OUTPUTS = ("actions", "frames")
IO_SECTIONS = ("wam", "acwm", "wan")
FRAME_AXES = ("FCHW", "CFHW")   # a model config's I/O section: one, named as its kind where built in
# How chunk c at step k reads the K/V of earlier chunks (docs/history.md).
HISTORY_RULES = {"same_step": "chunk c at step k reads the K/V chunks c-window..c-1 (and the sink) wrote at step k",
                 "clean": "every step of chunk c reads the K/V a pass at t = 0 over the finished chunks "
                          "c-window..c-1 (and the sink) wrote",
                 "latest": "chunk c at step k reads chunk c-j (j = 1..window) as it was ceil(j / history_groups) - 1 "
                           "steps after k (the clean pass's K/V past the last step): chunk c-1 at the same step, "
                           "older chunks less noisy (the sequential reference only; not served by the workers)"}


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime, the planner, admission and the front ends know of a model, as its family gives it for
    one config (``ModelFamily.spec``); nothing outside ``physis_ros.model`` asks which family a model is."""

    inputs: dict[str, tuple[int, ...]]
    """Named observation tensors one chunk consumes (float32, unbatched): ``image`` (C, H, W), ``state``
    (joints,), for a world model ``actions`` (rows, action dims)."""
    output: tuple[int, ...]
    """Shape of one chunk's output: ``(horizon, dof)`` actions, or latent frames ``(F, C, h, w)``."""
    produces: str
    """``actions`` (published as action chunks) or ``frames`` (published as predicted frames)."""
    tokens_per_chunk: int
    """Tokens of one chunk in the trunk (the hidden state a stage passes on is [tokens, hidden])."""
    kv_slot_tokens: int
    """Tokens of K/V one (stream, stage) slot holds: the history window's and the sink's."""
    kv_width: int
    """Width of one token's K (and of its V) in elements (heads x head_dim)."""
    block_params: int
    """Parameters of one block (its weights' bytes are this x the dtype's size)."""
    block_flops: float
    """FLOPs of one block forward for one sample at one denoising step, attention over the history included."""
    history: str = "same_step"
    """The history rule: how a chunk reads earlier chunks' K/V (HISTORY_RULES)."""
    frame_axes: str = "FCHW"
    """A frames output's axes in order: ``FCHW`` (frames, channels, rows, columns) or ``CFHW`` (a video
    trunk's latent layout); front ends publish frames as ``FCHW``."""
    context_tokens: int = 0
    """Conditioning tokens whose cross-attention K/V a slot keeps beside its history (a Wan trunk's text), with
    the tokens themselves (to check they still apply): three tensors of this many tokens."""
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """A chunk that is more than one tensor (a world-action model that also predicts its video): the parts by
    name and shape, ``actions`` ``(horizon, dof)`` first and ``frames`` (in ``frame_axes``) after it, packed
    flat in this order in ``output`` (one axis, their sizes summed; ``produces`` is ``actions``). Empty: the
    output is one part, what ``produces`` says."""

    def _part(self, name: str) -> tuple[int, int, tuple[int, ...]] | None:
        """(start, end, shape) of part ``name`` in the flat output, or None."""
        start = 0
        for part, shape in self.parts:
            size = _size(shape)
            if part == name:
                return start, start + size, shape
            start += size
        return None

    @property
    def actions_shape(self) -> tuple[int, ...] | None:
        """The action chunk's shape ``(horizon, dof)``; None for a model whose output has no actions."""
        if self.parts:
            found = self._part("actions")
            return found[2] if found else None
        return self.output if self.produces == "actions" else None

    def actions_of(self, output):
        """The action rows of an output (numpy array or tensor, the model's own layout) as ``[horizon, dof]``:
        the output itself, or a view of its part."""
        if not self.parts:
            return output
        start, end, shape = self._part("actions")
        return output[start:end].reshape(shape)

    @property
    def has_frames(self) -> bool:
        """Whether a chunk's output holds predicted frames (a world model's, or a world-action model's part)."""
        return self.produces == "frames" or self._part("frames") is not None

    @property
    def frames_shape(self) -> tuple[int, ...]:
        """A frames output's shape as front ends publish it: ``(F, C, H, W)``."""
        out = self._part("frames")[2] if self.parts else self.output
        return out if self.frame_axes == "FCHW" else (out[1], out[0], *out[2:])

    def frames_of(self, output):
        """The frames of an output (a numpy array or tensor in the model's own layout) as ``[F, C, H, W]`` (a
        view)."""
        if self.parts:
            start, end, shape = self._part("frames")
            output = output[start:end].reshape(shape)
        return output if self.frame_axes == "FCHW" else output.swapaxes(0, 1)

    def check(self, family: str, model: str) -> None:
        """ConfigError naming ``kind`` and the field unless the spec is consistent."""
        def bad(field_name: str, problem: str) -> ConfigError:
            return ConfigError("kind", f"model family '{family}' gives model '{model}' a spec whose "
                                       f"{field_name} {problem}: fix the family's spec")

        if self.produces not in OUTPUTS:
            raise bad("produces", f"is '{self.produces}', not one of {', '.join(OUTPUTS)}")
        if not self.inputs:
            raise bad("inputs", "is empty; a chunk reads at least one observation")
        shapes = {"output": self.output, **{f"inputs.{k}": v for k, v in self.inputs.items()},
                  **{f"parts.{k}": v for k, v in self.parts}}
        for name, shape in shapes.items():
            if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
                raise bad(name, f"is {shape}; a shape is one or more positive integers")
        if self.parts:
            names = [name for name, _ in self.parts]
            if names not in (["actions"], ["actions", "frames"]) or self.produces != "actions":
                raise bad("parts", f"are {names} for produces '{self.produces}'; a packed output is 'actions' "
                                   f"then optionally 'frames', and produces 'actions'")
            if self.output != (sum(_size(shape) for _, shape in self.parts),):
                raise bad("output", f"is {self.output}; packed parts {dict(self.parts)} are one axis of their "
                                    f"sizes summed")
        if self.produces == "actions" and len(self.actions_shape) != 2:
            raise bad("output", f"is {self.actions_shape}; an action chunk is (horizon, dof)")
        for name in ("tokens_per_chunk", "kv_width", "block_params"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, f"is {getattr(self, name)!r}; it must be a positive integer")
        if not isinstance(self.context_tokens, int) or self.context_tokens < 0:
            raise bad("context_tokens", f"is {self.context_tokens!r}; it must be a non-negative integer")
        if not isinstance(self.kv_slot_tokens, int) or self.kv_slot_tokens < 0:
            raise bad("kv_slot_tokens", f"is {self.kv_slot_tokens!r}; it must be a non-negative integer")
        if not self.block_flops > 0:
            raise bad("block_flops", f"is {self.block_flops!r}; it must be positive")
        if self.history not in HISTORY_RULES:
            raise bad("history", f"is '{self.history}', not one of {', '.join(HISTORY_RULES)}")
        frames = self._part("frames")[2] if self._part("frames") else self.output
        if self.frame_axes not in FRAME_AXES or (self.has_frames and len(frames) != 4):
            raise bad("frame_axes", f"is '{self.frame_axes}' for frames {frames}; frames are 4 axes, "
                                    f"{' or '.join(FRAME_AXES)}")


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for side in shape:
        n *= side
    return n


@dataclass(frozen=True)
class ModelConfig:
    """A servable DiT: trunk shape, denoising schedule, KV window and the I/O head."""

    name: str
    kind: str = field(metadata=bounded(doc="the model family (physis_ros.model.families): wam, acwm, or a "
                                           "family a package registers under the entry point group "
                                           "physis_ros.models"))
    hidden: int = field(metadata=bounded(ge=8))
    heads: int = field(metadata=bounded(ge=1))
    blocks: int = field(metadata=bounded(ge=1))
    steps: int = field(metadata=bounded(ge=1))
    ffn: int = field(default=0, metadata=bounded(ge=0))  # 0 means 4 * hidden
    window: int = field(default=2, metadata=bounded(ge=1))
    sink: bool = False
    timestep_shift: float = field(default=1.0, metadata=bounded(
        gt=0.0, doc="shift of the uniform noise-level grid, t' = s t / (1 + (s - 1) t) as in SD3 / Wan (1: uniform)"))
    sigmas: list[float] | None = field(default=None, metadata=bounded(
        doc="the noise levels of the denoising steps, from the first (noisiest, at most 1) down to the last, one "
            "per step, strictly decreasing and above 0 (the Euler steps then end at 0); unset: the shifted "
            "uniform grid"))
    history: str = field(default="same_step", metadata=bounded(
        choices=tuple(HISTORY_RULES), doc="how a chunk reads earlier chunks' K/V (docs/history.md): same_step "
                                          "(at its own denoising step), clean (what a pass at t = 0 over "
                                          "each finished chunk wrote) or latest (older chunks at later, less noisy "
                                          "steps; the sequential reference only)"))
    history_groups: int = field(default=1, metadata=bounded(
        ge=1, doc="latest history: G, the chunks that read a version at the same step offset (chunk c-j is read "
                  "ceil(j / G) - 1 steps after the reader's step)"))
    dtype: str = field(default="float32", metadata=bounded(choices=DTYPES))
    init_seed: int = 0
    description: str = ""
    wam: WAMIO | None = None
    acwm: ACWMIO | None = None
    wan: WanIO | None = None

    def validate(self) -> None:
        if self.hidden % self.heads:
            raise ConfigError("heads", f"{self.heads} must divide hidden {self.hidden}")
        if self.sigmas is not None:
            grid = [float(x) for x in self.sigmas]
            if len(grid) != self.steps:
                raise ConfigError("sigmas", f"{len(grid)} noise levels for {self.steps} steps: give one per step")
            if not all(0.0 < x <= 1.0 for x in grid) or any(a <= b for a, b in zip(grid, grid[1:])):
                raise ConfigError("sigmas", f"{grid} must decrease strictly, within (0, 1]")
            if self.timestep_shift != 1.0:
                raise ConfigError("timestep_shift", "a model with explicit sigmas takes no shift: shift the list")
        if self.history == "latest" and self.sink:
            raise ConfigError("sink", "the latest history rule reads each window chunk at its own version; it takes "
                                      "no sink")
        check_family(self.kind)
        if self.kind in IO_SECTIONS and getattr(self, self.kind) is None:
            raise ConfigError(self.kind, f"kind '{self.kind}' needs a '{self.kind}:' section")
        given = [name for name in IO_SECTIONS if getattr(self, name) is not None]
        if not given:
            raise ConfigError("kind", f"kind '{self.kind}' needs an I/O section: 'wam:' (actions out), 'acwm:' "
                                      f"(predicted frames out) or 'wan:' (a Wan trunk's latent frames out)")
        if len(given) > 1:
            other = next(name for name in given if name != self.kind)
            raise ConfigError(other, f"a model has one I/O section; '{other}:' does not belong to kind "
                                     f"'{self.kind}'")
        self.spec  # the family's spec, checked (a broken family is refused when its config is loaded)

    @functools.cached_property
    def spec(self) -> ModelSpec:
        """What the server knows of this model: its family's :class:`ModelSpec` for this config
        (``ModelFamily.spec``), checked once."""
        spec = load_family(self.kind).spec(self)
        spec.check(self.kind, self.name)
        return spec

    @property
    def produces(self) -> str:
        """What a chunk's output is (its spec, not its family): ``actions`` (rows of control actions
        ``[horizon, dof]``, published as an action chunk and a trajectory) or ``frames`` (predicted latent
        frames, published as PredictedFrames)."""
        return self.spec.produces

    @property
    def control_horizon(self) -> int:
        """Control steps one chunk plans: the action rows it outputs, or the actions it is given to imagine; one
        for a model that takes no actions (a video trunk: one chunk per control step)."""
        if self.produces == "actions":
            return self.spec.actions_shape[0]
        return self.observation_shapes["actions"][0] if "actions" in self.observation_shapes else 1

    @property
    def clean_pass(self) -> bool:
        """After a chunk's last step a pass at t = 0 writes K/V later chunks read (the clean and latest rules):
        a row 0 of stages, a block's stages on one worker, one chunk in flight per stream."""
        return self.history in ("clean", "latest")

    @property
    def history_slots(self) -> int:
        """K/V slots one stream holds per block: one (clean: every step reads what the clean pass wrote), one
        per step (same_step), one per step and the clean pass's (latest)."""
        return {"clean": 1, "latest": self.steps + 1}.get(self.history, self.steps)

    def latest_version(self, step: int, back: int) -> int:
        """The latest rule: the step whose K/V chunk ``c - back`` wrote that chunk ``c`` reads at ``step``
        (steps K..1 noisiest first; 0: the clean pass after the last step)."""
        return max(0, step - (-(-back // self.history_groups)) + 1)

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens_per_chunk(self) -> int:
        return self.spec.tokens_per_chunk

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.spec.output

    @property
    def observation_shapes(self) -> dict[str, tuple[int, ...]]:
        """Named observation tensors one chunk consumes (float32, unbatched)."""
        return dict(self.spec.inputs)

    def block_params(self) -> int:
        """Parameters of one block, as the model's family counts them (its spec)."""
        return self.spec.block_params

    def kv_slot_bytes(self) -> int:
        """Bytes of one (stream, stage) K/V slot: one block's K and V at one step of one stream (and the
        conditioning K/V it keeps: ``spec.context_tokens``)."""
        itemsize = 4 if self.dtype == "float32" else 2
        return (2 * self.spec.kv_slot_tokens + 3 * self.spec.context_tokens) * self.spec.kv_width * itemsize


def section_tokens(config: ModelConfig) -> int:
    """Tokens per chunk of the ``wam:``/``acwm:`` layout: the image's patches, the state (and for a world model
    the actions to imagine) as tokens, one token per action row or per latent patch of each frame."""
    if config.wam is not None:
        io = config.wam
        return (io.image_size // io.patch) ** 2 + 1 + io.horizon
    io = config.acwm
    assert io is not None
    per_frame = (io.latent_height // io.patch) * (io.latent_width // io.patch)
    return (io.image_size // io.image_patch) ** 2 + io.action_horizon + 1 + io.frames * per_frame


def attention_block_flops(config: ModelConfig, params: int, tokens: int) -> float:
    """FLOPs of one transformer block forward for one sample at one step: its dense matmuls over ``tokens``
    (2 per parameter and token) and attention (scores and weighted sum) over its own and the cached tokens."""
    cached = (config.window + int(config.sink)) * tokens
    return 2.0 * params * tokens + 4.0 * tokens * (tokens + cached) * config.hidden


def section_spec(config: ModelConfig, *, block_params: int, tokens_per_chunk: int | None = None,
                 block_flops: float | None = None) -> ModelSpec:
    """The spec of a model whose I/O is its config's ``wam:`` or ``acwm:`` section: image and state in (and
    for a world model the actions to imagine), an action chunk ``[horizon, dof]`` or latent frames out. A
    family gives its block's parameters and, where its layout differs, its tokens per chunk and FLOPs."""
    tokens = section_tokens(config) if tokens_per_chunk is None else tokens_per_chunk
    if config.wam is not None:
        io = config.wam
        inputs = {"image": (io.image_channels, io.image_size, io.image_size), "state": (io.state_dim,)}
        output, produces = (io.horizon, io.dof), "actions"
    else:
        io = config.acwm
        assert io is not None
        inputs = {"image": (io.image_channels, io.image_size, io.image_size), "state": (io.state_dim,),
                  "actions": (io.action_horizon, io.action_dim)}
        output = (io.frames, io.latent_channels, io.latent_height, io.latent_width)
        produces = "frames"
    flops = attention_block_flops(config, block_params, tokens) if block_flops is None else block_flops
    return ModelSpec(inputs=inputs, output=output, produces=produces, tokens_per_chunk=tokens,
                     kv_slot_tokens=(config.window + int(config.sink)) * tokens, kv_width=config.hidden,
                     block_params=block_params, block_flops=flops, history=config.history)


def presets_dir() -> Path:
    return repo_config_dir() / "models"


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A preset by name (``tiny-wam``), a path to a model YAML file, or a checkpoint directory a model family
    reads (a diffusers directory: :func:`physis_ros.model.families.directory_config`)."""
    path = Path(name_or_path)
    if path.is_dir():
        try:
            return from_mapping(ModelConfig, directory_config(path))
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.problem, source=str(path)) from None
    if path.suffix not in (".yaml", ".yml"):
        path = presets_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError("model", f"unknown model preset '{name_or_path}'; known presets: "
                                       f"{', '.join(preset_names())} (or give a path to a .yaml file)")
    data = complete_config(load_yaml(path))
    try:
        return from_mapping(ModelConfig, data)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path)) from None
