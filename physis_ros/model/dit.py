"""Reference DiT trunk: per-sample adaLN timestep conditioning, bidirectional attention
within a chunk plus the stage-local noisy KV cache across chunks.

The WAM and ACWM heads (``wam.py``, ``acwm.py``) subclass :class:`DiTModel` and
only say how observations and chunks become tokens and back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from physis_ros.model.interface import ServableModel, derived_seed
from physis_ros.model.kv import KVBatch
from physis_ros.model.spec import ModelConfig

FREQ_DIM = 256


def sinusoidal(t: torch.Tensor, dim: int = FREQ_DIM) -> torch.Tensor:
    """Sinusoidal embedding of timesteps t [B] in [0, 1] (scaled to 0..1000 as in DiT)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepCache:
    """Memo of a pure function of one timestep, evaluated one sample at a time.

    A chunk visits only K distinct timesteps, and adaLN vectors depend on
    nothing else, so each is computed once (with batch size 1, which keeps
    batched and unbatched runs bit-identical) and gathered per sample after.
    The owner clears it whenever its weights change.
    """

    def __init__(self, fn):
        self.fn = fn
        self.values: dict[float, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        rows = []
        for i, value in enumerate(t.tolist()):
            if value not in self.values:
                self.values[value] = self.fn(t[i:i + 1])
            rows.append(self.values[value])
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoidal(t).to(self.mlp[0].weight.dtype))


class Block(nn.Module):
    """adaLN-modulated transformer block; attention reads the cache, then appends its own K/V."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(hidden, 6 * hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, hidden))

    def forward(self, h: torch.Tensor, modulation: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """``modulation``: this block's adaLN vectors for each sample's timestep, [B, 6 * D]."""
        b, t, d = h.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation.unsqueeze(1).chunk(6, dim=-1)
        x = F.layer_norm(h, (d,)) * (1 + scale1) + shift1
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        keys, values, mask = kv.attend_inputs(k, v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask)
        kv.append(k, v)
        h = h + gate1 * self.proj(o.transpose(1, 2).reshape(b, t, d))
        x = F.layer_norm(h, (d,)) * (1 + scale2) + shift2
        return h + gate2 * self.mlp(x)


def block_param_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Parameter names and shapes of one block (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        blk = Block(config.hidden, config.heads, config.ffn_dim)
    return {k: v.shape for k, v in blk.state_dict().items()}


class DiTModel(ServableModel):
    """Shared trunk of the reference models. Subclasses build ``self.io`` and the token maps."""

    def __init__(self, config: ModelConfig, hosted_blocks: Iterable[int] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, hosted_blocks)
        d = config.hidden
        # Each module is initialised from its own seed, so a worker that builds
        # only some blocks gets exactly the weights the full model has.
        self.time_embed = self._seeded("time_embed", lambda: TimestepEmbedder(d))
        self.blocks = nn.ModuleDict({str(b): self.new_block(b) for b in sorted(self.hosted_blocks)})
        self.out_ada = self._seeded("out_ada", lambda: nn.Linear(d, 2 * d))
        self.io = self._seeded("io", self.build_io)
        self.to(device=device, dtype=self.dtype)
        self._modulation = {int(k): self._modulation_of(blk) for k, blk in self.blocks.items()}
        self._out_modulation = TimestepCache(lambda t: self.out_ada(F.silu(self.time_embed(t))))

    @property
    def device(self) -> torch.device:
        # The trunk's own weight, not a walk over every parameter (which costs tens of microseconds, and
        # the noise of every chunk asks for the device).
        return self.out_ada.weight.device

    def new_block(self, b: int) -> Block:
        c = self.config
        return self._seeded(f"blocks.{b}", lambda: Block(c.hidden, c.heads, c.ffn_dim))

    def _modulation_of(self, blk: Block) -> TimestepCache:
        return TimestepCache(lambda t: blk.ada(F.silu(self.time_embed(t))))

    # ---- hosting blocks one by one (a worker adds what new streams need while others run) ----
    def attach_blocks(self, built: dict[int, nn.Module]) -> None:
        for b, blk in built.items():
            self.blocks[str(b)] = blk
            self._modulation[b] = self._modulation_of(blk)
        self.hosted_blocks = frozenset(self.hosted_blocks | set(built))

    def release_blocks(self, blocks) -> None:
        for b in blocks:
            if str(b) in self.blocks:
                del self.blocks[str(b)]
            self._modulation.pop(b, None)
        self.hosted_blocks = frozenset(self.hosted_blocks - set(blocks))

    def clear_timestep_caches(self) -> None:
        for cache in (*self._modulation.values(), self._out_modulation):
            cache.values.clear()

    def _apply(self, fn, recurse=True):  # .to(), .half(), ...: cached vectors are stale
        if hasattr(self, "_out_modulation"):
            self.clear_timestep_caches()
        return super()._apply(fn, recurse)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.clear_timestep_caches()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _seeded(self, name: str, make):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed("init", self.config.init_seed, name))
            return make()

    def build_io(self) -> nn.Module:
        """Modules mapping observations/chunks to tokens and back (head-specific)."""
        raise NotImplementedError

    def output_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The tokens of the noisy chunk: the last ones of the sequence."""
        n = self.config.tokens_per_chunk - self.condition_tokens
        return h[:, -n:]

    @property
    def condition_tokens(self) -> int:
        raise NotImplementedError

    def block(self, b: int, h: torch.Tensor, t: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        try:
            blk = self.blocks[str(b)]
        except KeyError:
            raise KeyError(f"block {b} is not hosted here (hosted: {sorted(self.hosted_blocks)})") from None
        return blk(h, self._modulation[b](t), kv)

    def final_norm(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shift, scale = self._out_modulation(t).unsqueeze(1).chunk(2, dim=-1)
        y = self.output_tokens(h)
        return F.layer_norm(y, (y.shape[-1],)) * (1 + scale) + shift
