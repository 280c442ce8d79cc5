"""The gated-MLP transformer policy of physis-gmlp (see the package's docstring for the contract)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from physis_ros.model.interface import ServableModel, derived_seed
from physis_ros.model.kv import KVBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GatedBlock(nn.Module):
    """Pre-norm attention (over this chunk's tokens and the cached K/V) and a SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, h: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        keys, values, mask = kv.attend_inputs(k, v)       # the cached K/V of earlier chunks, then this chunk's
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask)
        kv.append(k, v)                                   # what later chunks of this stage read
        h = h + self.proj(o.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class GatedPolicy(ServableModel):
    """Actions out: ``config.wam`` gives the image, state and action shapes."""

    def __init__(self, config, hosted_blocks: Iterable[int] | None = None, device: torch.device | str = "cpu"):
        super().__init__(config, hosted_blocks)
        io, d = config.wam, config.hidden
        self.grid = io.image_size // io.patch
        self.patch = self._seeded("patch", lambda: nn.Linear(io.image_channels * io.patch ** 2, d))
        self.state = self._seeded("state", lambda: nn.Linear(io.state_dim, d))
        self.actions_in = self._seeded("actions_in", lambda: nn.Linear(io.dof, d))
        self.time = self._seeded("time", lambda: nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d)))
        self.pos = self._seeded("pos", lambda: nn.Embedding(config.tokens_per_chunk, d))
        self.out_norm = RMSNorm(d)
        self.actions_out = self._seeded("actions_out", lambda: nn.Linear(d, io.dof))
        self.blocks = nn.ModuleDict({str(b): self.new_block(b) for b in sorted(self.hosted_blocks)})
        self.to(device=device, dtype=self.dtype)

    @property
    def device(self) -> torch.device:
        return self.actions_out.weight.device

    def _seeded(self, name: str, make):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed("gmlp-init", self.config.init_seed, name))
            return make()

    def new_block(self, b: int) -> GatedBlock:
        c = self.config
        return self._seeded(f"blocks.{b}", lambda: GatedBlock(c.hidden, c.heads, c.ffn_dim))

    # ---- the stage contract ----
    def action_rows(self) -> int:
        return self.config.wam.horizon

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        p = self.config.wam.patch
        patches = F.unfold(obs["image"], kernel_size=p, stride=p).transpose(1, 2)    # [B, grid^2, C*p*p]
        return torch.cat([self.patch(patches), self.state(obs["state"]).unsqueeze(1)], dim=1)

    def embed(self, cond: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.cat([cond, self.actions_in(x)], dim=1) + self.pos.weight
        return h + self.time(t.to(h.dtype)[:, None]).unsqueeze(1)                    # the timestep, once

    def block(self, b: int, h: torch.Tensor, t: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        return self.blocks[str(b)](h, kv)

    def head(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows = self.config.wam.horizon
        return self.actions_out(self.out_norm(h[:, -rows:]))

    # ---- hosting blocks one by one (ServableModel.build_blocks builds them with new_block) ----
    def attach_blocks(self, built: dict[int, nn.Module]) -> None:
        for b, blk in built.items():
            self.blocks[str(b)] = blk
        self.hosted_blocks = frozenset(self.hosted_blocks | set(built))

    def release_blocks(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if str(b) in self.blocks:
                del self.blocks[str(b)]
        self.hosted_blocks = frozenset(self.hosted_blocks - set(blocks))

