"""A Wan world-action model (family ``wan_wam``, :func:`physis_ros.model.wan_family.wan_wam_spec`): a Wan trunk
(a diffusers directory's, or a random-init real architecture) with an action adapter, served through the same
stage contract as the video trunk (:class:`~physis_ros.model.wan_model.WanModel`).

- ``encode``: the conditioning tokens every block cross-attends to, ``[B, L + P + 1, D]``: the prompt's (the
  trunk's text embedder; none when ``text_tokens`` is 0), the camera image's (a patch embedding plus each
  patch's learned position, ``P`` tokens: cross-attention has no positions of its own, so without it a block
  cannot tell where in the image a patch is) and the joint state's (one token);
- ``embed``: the packed noisy chunk (actions ``[horizon, dof]``, then the latent ``[C, F, H, W]``) -> the hidden
  state ``[conditioning; video tokens; action tokens]``. An action token is its noisy row's embedding plus its
  row's learned position plus the state token (the action embedder reads the joint state and the noisy actions);
- ``block``: diffusers' ``WanTransformerBlock`` over the video and action tokens as one sequence (one
  self-attention; cross-attention to the conditioning). Video tokens carry Wan's 3D RoPE at their frames;
  action tokens the RoPE of their chunk's last frame at row 0, column 0 (their order within the chunk is the
  learned position), so that every key is rotated and attention depends on offsets only (a chunk read at its
  shifted place in the cache past the first window sees what it did at its own). Both write history K/V: a
  later chunk reads the earlier chunks' video and actions;
- ``head``: the trunk's output norm and projection for the video tokens; for the action tokens the same
  modulated norm and the adapter's projection to ``dof``.

One denoising grid: a step ``k`` moves the actions and the video from ``t_k`` to ``t_{k-1}`` together (one
timestep per sample, as every served model). Models trained with two grids (LingBot-VA: video on 20 steps,
actions on 50) would give each token its own timestep (diffusers' Wan blocks take ``temb`` per token,
``[B, T, 6, D]``) and each part its own Euler step, a stage still being one step index of both grids; that is
not built.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from physis_ros.model.spec import ModelConfig
from physis_ros.model.wan import patchify
from physis_ros.model.wan_adapter import build_adapter
from physis_ros.model.wan_model import WanModel


def wam_adapter(config: ModelConfig) -> nn.ModuleDict:
    """The action adapter's modules: the checkpoint's ``adapter.safetensors``, or random (seeded by the model's
    ``init_seed``); names and shapes as :func:`physis_ros.model.wan_adapter.adapter_shapes` says."""
    act, d = config.wan.actions, config.hidden

    def make() -> nn.ModuleDict:
        return nn.ModuleDict({
            "image": nn.Conv2d(act.image_channels, d, act.image_patch, stride=act.image_patch),
            "image_pos": nn.Embedding((act.image_size // act.image_patch) ** 2, d),
            "state": nn.Linear(act.state_dim, d),
            "action_in": nn.Linear(act.dof, d),
            "action_pos": nn.Embedding(act.horizon, d),
            "action_out": nn.Linear(d, act.dof),
        })

    return build_adapter(config, make)


def action_positions(table: torch.Tensor, chunks: int, grid: tuple[int, int, int], horizon: int) -> torch.Tensor:
    """A video RoPE table ``[1, chunks * video tokens, 1, hd]`` (cos or sin) with each chunk's ``horizon``
    action tokens inserted after its video tokens, each at the position of the chunk's last latent frame, row 0,
    column 0. Every token is rotated, so attention depends on position offsets only, and a chunk read from the
    cache at a shifted place sees what it saw at its own."""
    video = grid[0] * grid[1] * grid[2]
    last = (grid[0] - 1) * grid[1] * grid[2]          # the first token of a chunk's last frame: row 0, column 0
    parts = []
    for c in range(chunks):
        own = table[:, c * video:(c + 1) * video]
        parts += [own, own[:, last:last + 1].expand(-1, horizon, -1, -1)]
    return torch.cat(parts, dim=1)


class WanWAMModel(WanModel):
    """The servable Wan world-action model (see the module's docstring)."""

    def __init__(self, config: ModelConfig, hosted_blocks: Iterable[int] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, hosted_blocks, device)
        act = config.wan.actions
        self._horizon, self._dof = act.horizon, act.dof
        self.adapter = wam_adapter(config).to(device=device, dtype=self.dtype).eval().requires_grad_(False)

    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos, sin chunk after chunk: each chunk's video tokens at their frames, then its action tokens
        (see :func:`action_positions`)."""
        if self._rope is None:
            chunks = self.config.window + int(self.config.sink) + 1
            cos, sin = self._video_positions()
            self._rope = (action_positions(cos, chunks, self._grid, self._horizon),
                          action_positions(sin, chunks, self._grid, self._horizon))
        return self._rope

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed chunk [B, N] -> actions [B, horizon, dof], latent [B, C, F, H, W] (views)."""
        io, n = self.config.wan, self._horizon * self._dof
        channels = self.config.spec.parts[1][1][0]
        return (x[:, :n].view(-1, self._horizon, self._dof),
                x[:, n:].view(-1, channels, io.frames, io.height, io.width))

    # ---- the stage contract ----------------------------------------------------------------------
    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        image = self.adapter["image"](obs["image"]).flatten(2).transpose(1, 2) + self.adapter["image_pos"].weight
        state = self.adapter["state"](obs["state"]).unsqueeze(1)
        tokens = [image, state]
        if self.config.wan.text_tokens:
            tokens.insert(0, self.trunk.condition_embedder.text_embedder(obs["prompt_embeds"]))
        return torch.cat(tokens, dim=1)

    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        actions, latent = self._split(x)
        rows = self.adapter["action_in"](actions) + self.adapter["action_pos"].weight + cond[:, -1:]
        return torch.cat([cond, patchify(self.trunk, latent), rows], dim=1)

    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        video = super().head(h[:, :self._context + self._video_tokens], t)
        rows = h[:, self._context + self._video_tokens:]
        temb = self._time(t)[:, 0]
        shift, scale = (self.trunk.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        rows = (self.trunk.norm_out(rows.float()) * (1 + scale) + shift).type_as(rows)
        actions = self.adapter["action_out"](rows)
        return torch.cat([actions.flatten(1), video.flatten(1)], dim=1)

