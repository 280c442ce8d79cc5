"""World-action model head: RGB image patches + joint state -> action chunk [horizon, dof]."""

from __future__ import annotations

import torch
from torch import nn

from physis_ros.model.dit import DiTModel


class WAMModel(DiTModel):
    @property
    def condition_tokens(self) -> int:
        io = self.config.wam
        return (io.image_size // io.patch) ** 2 + 1

    def build_io(self) -> nn.Module:
        c, io = self.config, self.config.wam
        d = c.hidden
        return nn.ModuleDict({
            "patch": nn.Conv2d(io.image_channels, d, io.patch, stride=io.patch),
            "state": nn.Linear(io.state_dim, d),
            "action_in": nn.Linear(io.dof, d),
            "pos": nn.Embedding(c.tokens_per_chunk, d),
            "action_out": nn.Linear(d, io.dof),
        })

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        patches = self.io["patch"](obs["image"]).flatten(2).transpose(1, 2)
        state = self.io["state"](obs["state"]).unsqueeze(1)
        return torch.cat([patches, state], dim=1)

    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.cat([cond, self.io["action_in"](x)], dim=1)
        return h + self.io["pos"].weight

    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.io["action_out"](self.final_norm(h, t))
