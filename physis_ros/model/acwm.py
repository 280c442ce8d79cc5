"""Action-conditioned world model head: current image + state + action chunk -> latent frames [F, C, h, w]."""

from __future__ import annotations

import torch
from torch import nn

from physis_ros.model.dit import DiTModel


class ACWMModel(DiTModel):
    @property
    def condition_tokens(self) -> int:
        io = self.config.acwm
        return (io.image_size // io.image_patch) ** 2 + io.action_horizon + 1

    def build_io(self) -> nn.Module:
        c, io = self.config, self.config.acwm
        d, patch_dim = c.hidden, io.latent_channels * io.patch * io.patch
        return nn.ModuleDict({
            "patch": nn.Conv2d(io.image_channels, d, io.image_patch, stride=io.image_patch),
            "action": nn.Linear(io.action_dim, d),
            "state": nn.Linear(io.state_dim, d),
            "latent_in": nn.Linear(patch_dim, d),
            "pos": nn.Embedding(c.tokens_per_chunk, d),
            "latent_out": nn.Linear(d, patch_dim),
        })

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        io, (b, f, c, hh, ww) = self.config.acwm, x.shape
        p = io.patch
        x = x.reshape(b, f, c, hh // p, p, ww // p, p).permute(0, 1, 3, 5, 2, 4, 6)
        return x.reshape(b, f * (hh // p) * (ww // p), c * p * p)

    def _unpatchify(self, y: torch.Tensor) -> torch.Tensor:
        io, b = self.config.acwm, y.shape[0]
        p, f, c = io.patch, io.frames, io.latent_channels
        gh, gw = io.latent_height // p, io.latent_width // p
        y = y.reshape(b, f, gh, gw, c, p, p).permute(0, 1, 4, 2, 5, 3, 6)
        return y.reshape(b, f, c, gh * p, gw * p)

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        patches = self.io["patch"](obs["image"]).flatten(2).transpose(1, 2)
        actions = self.io["action"](obs["actions"])
        state = self.io["state"](obs["state"]).unsqueeze(1)
        return torch.cat([patches, actions, state], dim=1)

    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.cat([cond, self.io["latent_in"](self._patchify(x))], dim=1)
        return h + self.io["pos"].weight

    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self._unpatchify(self.io["latent_out"](self.final_norm(h, t)))
