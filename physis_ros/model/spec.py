"""Model configuration (what ``config/models/*.yaml`` holds) and the shape metadata a model exposes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.config import ConfigError, bounded, from_mapping, load_yaml, repo_config_dir
from physis_ros.model.families import check_family, load_family

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WAMIO:
    """World-action model I/O: RGB image + joint state in, action chunk [horizon, dof] out."""

    image_size: int = field(default=32, metadata=bounded(ge=4))
    image_channels: int = field(default=3, metadata=bounded(choices=(1, 3)))
    patch: int = field(default=8, metadata=bounded(ge=1))
    state_dim: int = field(default=7, metadata=bounded(ge=1))
    horizon: int = field(default=16, metadata=bounded(ge=1))
    dof: int = field(default=7, metadata=bounded(ge=1))

    def validate(self) -> None:
        if self.image_size % self.patch:
            raise ConfigError("wam.patch", f"{self.patch} must divide image_size {self.image_size}")


@dataclass(frozen=True)
class ACWMIO:
    """Action-conditioned world model I/O: the current camera image + state + the action chunk to imagine
    in, predicted latent frames [F, C, h, w] out."""

    image_size: int = field(default=32, metadata=bounded(ge=4))
    image_channels: int = field(default=3, metadata=bounded(choices=(1, 3)))
    image_patch: int = field(default=8, metadata=bounded(ge=1))
    action_horizon: int = field(default=16, metadata=bounded(ge=1))
    action_dim: int = field(default=7, metadata=bounded(ge=1))
    state_dim: int = field(default=7, metadata=bounded(ge=1))
    frames: int = field(default=2, metadata=bounded(ge=1))
    latent_channels: int = field(default=4, metadata=bounded(ge=1))
    latent_height: int = field(default=8, metadata=bounded(ge=1))
    latent_width: int = field(default=8, metadata=bounded(ge=1))
    patch: int = field(default=2, metadata=bounded(ge=1))

    def validate(self) -> None:
        for side in ("latent_height", "latent_width"):
            if getattr(self, side) % self.patch:
                raise ConfigError("acwm.patch", f"{self.patch} must divide {side} {getattr(self, side)}")
        if self.image_size % self.image_patch:
            raise ConfigError("acwm.image_patch", f"{self.image_patch} must divide image_size {self.image_size}")


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
    timestep_shift: float = field(default=1.0, metadata=bounded(gt=0.0))
    dtype: str = field(default="float32", metadata=bounded(choices=DTYPES))
    init_seed: int = 0
    description: str = ""
    wam: WAMIO | None = None
    acwm: ACWMIO | None = None

    def validate(self) -> None:
        if self.hidden % self.heads:
            raise ConfigError("heads", f"{self.heads} must divide hidden {self.hidden}")
        check_family(self.kind)
        if self.kind in ("wam", "acwm") and getattr(self, self.kind) is None:
            raise ConfigError(self.kind, f"kind '{self.kind}' needs a '{self.kind}:' section")
        if self.wam is None and self.acwm is None:
            raise ConfigError("kind", f"kind '{self.kind}' needs an I/O section: 'wam:' (actions out) or 'acwm:' "
                                      f"(predicted frames out)")
        if self.wam is not None and self.acwm is not None:
            other = "acwm" if self.kind == "wam" else "wam"
            raise ConfigError(other, f"a model has one I/O section; '{other}:' does not belong to kind "
                                     f"'{self.kind}'")

    @property
    def produces(self) -> str:
        """What a chunk's output is (its spec, not its family): ``actions`` (rows of control actions
        ``[horizon, dof]``, published as an action chunk and a trajectory) or ``frames`` (predicted latent
        frames, published as PredictedFrames)."""
        return "actions" if self.wam is not None else "frames"

    @property
    def control_horizon(self) -> int:
        """Control steps one chunk plans: the action rows it outputs, or the actions it is given to imagine."""
        if self.produces == "actions":
            return self.output_shape[0]
        return self.observation_shapes["actions"][0]

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens_per_chunk(self) -> int:
        if self.wam is not None:
            io = self.wam
            return (io.image_size // io.patch) ** 2 + 1 + io.horizon
        io = self.acwm
        assert io is not None
        per_frame = (io.latent_height // io.patch) * (io.latent_width // io.patch)
        return (io.image_size // io.image_patch) ** 2 + io.action_horizon + 1 + io.frames * per_frame

    @property
    def output_shape(self) -> tuple[int, ...]:
        if self.wam is not None:
            return (self.wam.horizon, self.wam.dof)
        io = self.acwm
        assert io is not None
        return (io.frames, io.latent_channels, io.latent_height, io.latent_width)

    @property
    def observation_shapes(self) -> dict[str, tuple[int, ...]]:
        """Named observation tensors one chunk consumes (float32, unbatched)."""
        if self.wam is not None:
            io = self.wam
            return {"image": (io.image_channels, io.image_size, io.image_size), "state": (io.state_dim,)}
        io = self.acwm
        assert io is not None
        return {"image": (io.image_channels, io.image_size, io.image_size), "state": (io.state_dim,),
                "actions": (io.action_horizon, io.action_dim)}

    def block_params(self) -> int:
        """Parameters of one block, as the model's family counts them (``ModelFamily.block_params``)."""
        return load_family(self.kind).block_params(self)

    def kv_slot_bytes(self) -> int:
        """Bytes of one (stream, step) KV slot of one block."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * (self.window + int(self.sink)) * self.tokens_per_chunk * self.hidden * itemsize


def presets_dir() -> Path:
    return repo_config_dir() / "models"


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A preset by name (``tiny-wam``) or a path to a model YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = presets_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError("model", f"unknown model preset '{name_or_path}'; known presets: "
                                       f"{', '.join(preset_names())} (or give a path to a .yaml file)")
    data = load_yaml(path)
    try:
        return from_mapping(ModelConfig, data)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path)) from None
