"""Flow-matching timesteps of the denoising loop and its Euler update."""

from __future__ import annotations

import torch


class FlowMatchingTimesteps:
    """Timesteps ``t_K > ... > t_0 = 0`` (index ``k`` = denoising step) and ``x <- x + (t_{k-1} - t_k) v``.

    ``shift`` warps the uniform grid as in SD3 / Wan (``t' = s t / (1 + (s - 1) t)``);
    ``shift = 1`` is the plain uniform grid. ``sigmas`` gives the grid instead, ``t_K .. t_1`` (the noise level
    of each step, first to last; ``t_0 = 0`` is where the last Euler step lands). ``t_0`` is also the clean
    pass's timestep (the clean history rule).
    """

    def __init__(self, steps: int, shift: float = 1.0, sigmas: list[float] | None = None):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps = steps
        if sigmas is not None:
            if len(sigmas) != steps:
                raise ValueError(f"{len(sigmas)} sigmas for {steps} steps")
            t = torch.tensor([0.0, *reversed([float(x) for x in sigmas])], dtype=torch.float64)
        else:
            u = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
            t = shift * u / (1.0 + (shift - 1.0) * u)
        self.t = t.to(torch.float32)  # self.t[k] is t_k; t[0] == 0 (the shifted grid: t[K] == 1)

    def timestep(self, k: torch.Tensor) -> torch.Tensor:
        """Per-sample timesteps for step indices ``k`` ([B] integers in 1..K)."""
        return self.t[k.cpu()].to(k.device)

    def update(self, x: torch.Tensor, v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """One Euler step from ``t_k`` to ``t_{k-1}``, per sample."""
        kc = k.cpu()
        dt = (self.t[kc - 1] - self.t[kc]).to(device=x.device, dtype=x.dtype)
        return x + dt.view(-1, *([1] * (x.dim() - 1))) * v
