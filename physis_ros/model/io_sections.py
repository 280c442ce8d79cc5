"""The I/O sections of a model config (``wam:``, ``acwm:``, ``wan:`` with its ``actions:`` or ``world:``): what a
model takes and gives, in the units a robot team reads, each validated where it is read
(:class:`~physis_ros.model.spec.ModelConfig` holds one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from physis_ros.config import ConfigError, bounded


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
class WanActionsIO:
    """A Wan world-action model's robot side (kind ``wan_wam``): the camera image and the joint state in as
    cross-attention tokens beside the prompt's, an action chunk ``[horizon, dof]`` out beside the latent
    frames, its tokens joined to the video tokens in one sequence."""

    horizon: int = field(default=16, metadata=bounded(ge=1, doc="action rows one chunk plans (control steps)"))
    dof: int = field(default=7, metadata=bounded(ge=1, doc="action columns (joints commanded)"))
    state_dim: int = field(default=7, metadata=bounded(ge=1, doc="joint state entries one observation carries"))
    image_size: int = field(default=32, metadata=bounded(ge=4, doc="camera image side in pixels (square)"))
    image_channels: int = field(default=3, metadata=bounded(choices=(1, 3)))
    image_patch: int = field(default=8, metadata=bounded(ge=1, doc="pixels per side of one image token"))

    def validate(self) -> None:
        if self.image_size % self.image_patch:
            raise ConfigError("wan.actions.image_patch", f"{self.image_patch} must divide image_size "
                                                         f"{self.image_size}")


@dataclass(frozen=True)
class WanWorldIO:
    """A Wan action-conditioned world model's robot side (kind ``wan_acwm``): the camera image (encoded by the
    Wan VAE into one conditioning latent frame), the joint state and the actions to imagine in as cross-attention
    tokens; the predicted latent frames ``[C, F, H, W]`` out."""

    image_size: int = field(default=64, metadata=bounded(
        ge=8, doc="camera image side in pixels (square), a multiple of the VAE's spatial factor times the patch"))
    image_channels: int = field(default=3, metadata=bounded(choices=(3,), doc="RGB: what the VAE encodes"))
    state_dim: int = field(default=7, metadata=bounded(ge=1, doc="joint state entries one observation carries"))
    action_horizon: int = field(default=16, metadata=bounded(ge=1, doc="rows of the action chunk to imagine"))
    action_dim: int = field(default=7, metadata=bounded(ge=1, doc="columns of the action chunk to imagine"))


@dataclass(frozen=True)
class WanIO:
    """A Wan trunk read from a diffusers directory (kind ``wan``, :mod:`physis_ros.model.wan_family`): prompt
    embeddings in, latent video frames ``[C, F, H, W]`` out (the trunk's own latent layout)."""

    checkpoint: str = field(default="", metadata=bounded(
        doc="the diffusers WanTransformer3DModel directory (config.json and its safetensors, or a pipeline "
            "directory holding them in transformer/); a relative path is from the working directory. Empty: "
            "the trunk is 'trunk' with random weights (a real architecture for profiling and simulation)"))
    trunk: dict[str, Any] = field(default_factory=dict, metadata=bounded(
        doc="without a checkpoint: the trunk's diffusers config (WanTransformer3DModel's keys: "
            "num_attention_heads, attention_head_dim, num_layers, ffn_dim, text_dim, in_channels, ...), its "
            "weights random from init_seed"))
    frames: int = field(default=1, metadata=bounded(ge=1, doc="latent frames F one chunk denoises"))
    height: int = field(default=32, metadata=bounded(ge=1, doc="latent rows H of a frame (pixels / 8 for Wan2.1's VAE)"))
    width: int = field(default=32, metadata=bounded(ge=1, doc="latent columns W of a frame"))
    text_tokens: int = field(default=512, metadata=bounded(
        ge=0, doc="rows L of the prompt embeddings a chunk reads, [L, text_dim] (UMT5 pads to 512 for Wan); a "
                  "world-action model (kind wan_wam) may take none (0: no prompt input)"))
    actions: WanActionsIO | None = field(default=None, metadata=bounded(
        doc="kind wan_wam: the robot side of a world-action model (image and state in, actions out); "
            "absent for kind wan"))
    world: WanWorldIO | None = field(default=None, metadata=bounded(
        doc="kind wan_acwm: the robot side of an action-conditioned world model (image, state and the actions "
            "to imagine in, latent frames out)"))
    vae: str = field(default="", metadata=bounded(
        doc="kind wan_acwm: the diffusers AutoencoderKLWan directory (config.json and its safetensors) that "
            "encodes the camera image and decodes previews; empty: the checkpoint's vae/ (a pipeline directory), "
            "else vae_config with random weights. Kind wan_wam (optional): the VAE whose latents its predicted "
            "frames are (what physis-train encodes the scene's video with)"))
    vae_config: dict[str, Any] = field(default_factory=dict, metadata=bounded(
        doc="kinds wan_acwm and wan_wam without a VAE directory: the VAE's diffusers config (AutoencoderKLWan's "
            "keys: base_dim, z_dim, dim_mult, ...), its weights random from init_seed"))
