"""What a world-action model's predicted frames are trained towards: the scene's video over each chunk, encoded
by the model's VAE.

A Wan world-action model (:mod:`physis_ros.model.wan_wam`) denoises an action chunk and latent video frames
``[C, F, H, W]`` together. Its frames are the normalised latents of its VAE (``wan.vae`` or ``wan.vae_config``):
the scene's camera rendered at the VAE's size (``H`` x the VAE's pixels per latent) over the span of the chunk's
actions (``horizon`` control steps at the expert's 50 Hz: 0.32 s for 16 rows), from the chunk's own observation
on (``1 + 4 (F - 1)`` video frames for Wan's causal VAE, evenly spaced), encoded as
:func:`~physis_ros.model.wan_acwm.video_latent` does (the mode). An action-conditioned world model's frames
span the actions it imagines the same way. A model whose output has no frames needs none.
"""

from __future__ import annotations

import numpy as np
import torch

from physis_ros.model.spec import ModelConfig
from physis_ros.observations import ScriptedExpert, SyntheticScene


class FrameTargets:
    """The latent frames of the scene's video for chunks of ``config``'s model (see the module's docstring)."""

    @staticmethod
    def check(config: ModelConfig) -> None:
        """ValueError unless ``config`` has a VAE to make its frames' targets."""
        io = config.wan
        if io is None or not (io.vae or io.vae_config):
            raise ValueError(f"model '{config.name}' predicts frames but has no VAE to make their targets: give "
                             f"wan.vae (an AutoencoderKLWan directory) or wan.vae_config")

    def __init__(self, config: ModelConfig):
        from physis_ros.model.wan_acwm import LatentScale, load_vae
        from physis_ros.model.wan_family import vae_config_of, vae_frames, vae_scale

        self.check(config)
        io = config.wan
        vae = vae_config_of(io)
        self.frames = vae_frames(vae, io.frames)
        self.span_s = config.control_horizon / ScriptedExpert().control_rate_hz    # the chunk's actions
        self.size = (io.height * vae_scale(vae), io.width * vae_scale(vae))
        self.vae = load_vae(config).requires_grad_(False)
        self.scale = LatentScale(self.vae)

    def video(self, scene: SyntheticScene, stream: str, chunk: int) -> np.ndarray:
        """The camera over chunk ``chunk``'s span: ``[3, T, S, S]`` in [0, 1]."""
        start = chunk / scene.rate_hz
        times = [start + self.span_s * i / max(1, self.frames - 1) for i in range(self.frames)]
        phase = scene.phase(stream)
        return np.stack([scene.image((3, *self.size), t, phase) for t in times], axis=1)

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Videos ``[B, 3, T, S, S]`` in [0, 1] -> normalised latents ``[B, C, F, H, W]`` float32."""
        from physis_ros.model.wan_acwm import video_latent

        return video_latent(self.vae, self.scale, video).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``[B, C, F, H, W]`` -> videos ``[B, 3, T, S, S]`` in [0, 1]."""
        video = self.vae.decode(self.scale.denormalise(latents.float())).sample
        return ((video + 1.0) / 2.0).clamp(0.0, 1.0)

    def latents(self, scene: SyntheticScene, stream: str, chunks: int) -> torch.Tensor:
        """Chunks ``0 .. chunks-1`` of ``stream``: ``[chunks, C, F, H, W]`` float32."""
        return self.encode(torch.from_numpy(np.stack([self.video(scene, stream, c) for c in range(chunks)])))
