"""A Wan action-conditioned world model (family ``wan_acwm``, :func:`physis_ros.model.wan_family.wan_acwm_spec`):
a Wan trunk and its VAE (diffusers' ``AutoencoderKLWan``), served through the stage contract of the video trunk
(:class:`~physis_ros.model.wan_model.WanModel`).

- ``encode``: the conditioning tokens every block cross-attends to: the prompt's (none when ``text_tokens`` is
  0); the camera image's, encoded by the VAE into one latent frame (its mode, normalised by the VAE's
  ``latents_mean``/``latents_std`` as Wan pipelines do), patched by the trunk's own patch embedding, plus each
  patch's learned position (cross-attention has none of its own); the joint state's (one token); the actions
  to imagine (one token per row: an embedding plus the row's learned position);
- ``embed``, ``block``, ``head``: the video trunk's: the noisy future latent frames ``[C, F, H, W]`` as video
  tokens after the conditioning, diffusers' blocks over them, the trunk's head.

:func:`previewer` decodes a chunk's frames with the same VAE into the picture ``<ns>/predicted_image`` shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from physis_ros.model.spec import ModelConfig
from physis_ros.model.wan import WanLoadError, load_tensors, seeded
from physis_ros.model.wan_adapter import build_adapter
from physis_ros.model.wan_family import WEIGHTS, camera_tokens, vae_config_of
from physis_ros.model.wan_model import WanModel


def load_vae(config: ModelConfig) -> nn.Module:
    """The model's ``AutoencoderKLWan`` in fp32 (as Wan pipelines keep it): its directory's weights (WanLoadError
    naming the file and the tensor), or random from ``init_seed``."""
    from diffusers import AutoencoderKLWan

    io = config.wan
    vae_config = {k: v for k, v in vae_config_of(io).items() if not k.startswith("_")}
    if not io.vae:
        return seeded(config.init_seed, "vae", lambda: AutoencoderKLWan.from_config(vae_config)).eval()
    from safetensors.torch import load_file

    path = Path(io.vae) / WEIGHTS
    vae = AutoencoderKLWan.from_config(vae_config)
    try:
        tensors = load_file(path)
    except (OSError, RuntimeError, ValueError) as exc:
        raise WanLoadError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]})") from None
    load_tensors(vae, tensors, str(path))
    return vae.eval()


class LatentScale:
    """The VAE's latent normalisation: ``(z - mean) / std`` per channel, and back."""

    def __init__(self, vae: nn.Module):
        c = vae.config
        self.mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(c.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.mean.to(z.device)) / self.std.to(z.device)

    def denormalise(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.std.to(z.device) + self.mean.to(z.device)


def video_latent(vae: nn.Module, scale: LatentScale, video: torch.Tensor) -> torch.Tensor:
    """Videos ``[B, 3, T, S, S]`` in [0, 1] -> their normalised latent frames ``[B, z, F, S/8, S/8]`` (the mode;
    Wan's causal VAE encodes the first frame alone and every 4 after it into one latent frame: T = 1 + 4 (F - 1))."""
    return scale.normalise(vae.encode(video.float() * 2.0 - 1.0).latent_dist.mode())


def camera_latent(vae: nn.Module, scale: LatentScale, image: torch.Tensor) -> torch.Tensor:
    """Camera images ``[B, 3, S, S]`` in [0, 1] -> their normalised latent frame ``[B, z, 1, S/8, S/8]``."""
    return video_latent(vae, scale, image.unsqueeze(2))


class WanACWMModel(WanModel):
    """The servable Wan world model (see the module's docstring)."""

    def __init__(self, config: ModelConfig, hosted_blocks: Iterable[int] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, hosted_blocks, device)
        world, d = config.wan.world, config.hidden
        camera = camera_tokens(config)
        self.vae = load_vae(config).to(device=device).requires_grad_(False)
        self._scale = LatentScale(self.vae)

        def make() -> nn.ModuleDict:
            return nn.ModuleDict({"camera_pos": nn.Embedding(camera, d),
                                  "state": nn.Linear(world.state_dim, d),
                                  "actions": nn.Linear(world.action_dim, d),
                                  "action_pos": nn.Embedding(world.action_horizon, d)})

        self.adapter = build_adapter(config, make).to(device=device, dtype=self.dtype)
        self.adapter.eval().requires_grad_(False)

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        latent = camera_latent(self.vae, self._scale, obs["image"]).to(self.dtype)
        camera = self.trunk.patch_embedding(latent).flatten(2).transpose(1, 2) + self.adapter["camera_pos"].weight
        state = self.adapter["state"](obs["state"]).unsqueeze(1)
        actions = self.adapter["actions"](obs["actions"]) + self.adapter["action_pos"].weight
        tokens = [camera, state, actions]
        if self.config.wan.text_tokens:
            tokens.insert(0, self.trunk.condition_embedder.text_embedder(obs["prompt_embeds"]))
        return torch.cat(tokens, dim=1)


def previewer(config: ModelConfig) -> Callable[[Any], np.ndarray]:
    """Frames as published (``[F, C, H, W]`` float32, normalised latents) -> the last decoded frame, RGB ``[H, W,
    3]`` uint8: the model's own VAE (the same weights its workers encode with), built once here."""
    vae = load_vae(config).requires_grad_(False)
    scale = LatentScale(vae)

    @torch.no_grad()
    def decode(frames) -> np.ndarray:
        latent = torch.as_tensor(np.asarray(frames, dtype=np.float32)).permute(1, 0, 2, 3).unsqueeze(0)
        video = vae.decode(scale.denormalise(latent)).sample            # [1, 3, F', H, W] in [-1, 1]
        last = video[0, :, -1].clamp(-1.0, 1.0)
        return ((last.permute(1, 2, 0).numpy() + 1.0) * 127.5 + 0.5).astype(np.uint8)

    return decode
