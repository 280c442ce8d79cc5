"""Training a Wan world model's VAE (diffusers' ``AutoencoderKLWan``) on the scene's video, before its trunk.

A world model's frames are its VAE's latents, and its pictures are their decode: a random-init VAE's latents
are a fixed function of the video, but its decode is noise. :func:`train_vae` trains the VAE as an
autoencoder on the videos :class:`~physis_ros.train.frames.FrameTargets` renders (each chunk's span, the
frames the trunk learns to predict): the reconstruction's MSE (pixels in [-1, 1]) plus ``kl_weight`` times the
KL term per pixel, Adam, a sampled latent per step. It then sets ``latents_mean``/``latents_std`` in the VAE's
config to the per-channel statistics of the modes over the data (Wan pipelines normalise latents by them), so
that the trunk's targets have unit scale. Deterministic from ``seed``; the weights are written by diffusers'
``save_pretrained`` and the model's config then names that directory (``wan.vae``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VAESettings:
    steps: int = 300          # optimiser steps
    batch: int = 8            # videos per step
    lr: float = 2e-3          # Adam's learning rate
    kl_weight: float = 1e-3   # of the KL term, per pixel
    seed: int = 0


def train_vae(vae: torch.nn.Module, videos: torch.Tensor, settings: VAESettings,
              progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``vae`` in place on ``videos`` ``[N, 3, T, S, S]`` in [0, 1]; the reconstruction MSE of every step.
    ``progress(step, mse)`` after each."""
    vae.train().requires_grad_(True)
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.Adam(vae.parameters(), lr=settings.lr)
    losses = []
    for step in range(settings.steps):
        x = videos[torch.randint(0, len(videos), (settings.batch,), generator=gen)] * 2.0 - 1.0
        posterior = vae.encode(x).latent_dist
        rebuilt = vae.decode(posterior.sample(generator=gen)).sample
        mse = (rebuilt - x).square().mean()
        loss = mse + settings.kl_weight * posterior.kl().mean() / x[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(mse.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the VAE's loss is {losses[-1]} at step {step}; lower --vae-lr")
        if progress:
            progress(step + 1, losses[-1])
    vae.eval().requires_grad_(False)
    set_latent_statistics(vae, videos)
    return losses


@torch.no_grad()
def set_latent_statistics(vae: torch.nn.Module, videos: torch.Tensor, batch: int = 32) -> None:
    """``latents_mean``/``latents_std`` of ``vae``'s config: the per-channel mean and standard deviation of the
    modes of ``videos`` ``[N, 3, T, S, S]`` in [0, 1]."""
    modes = torch.cat([vae.encode(videos[i:i + batch] * 2.0 - 1.0).latent_dist.mode()
                       for i in range(0, len(videos), batch)])
    channels = modes.transpose(0, 1).flatten(1)
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in channels.mean(1)],
                           latents_std=[round(max(float(v), 1e-6), 6) for v in channels.std(1)])

