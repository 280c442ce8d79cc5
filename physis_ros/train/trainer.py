"""Flow-matching training of a world-action model on the scripted expert, with the noisy-KV computation.

Each batch holds sequences of ``window + 1`` consecutive chunks of one demonstration episode, each
sequence at one denoising step ``k`` (per-sample timesteps across the batch). The expert chunks are
noised to that step's level, ``x_t = t_k eps + (1 - t_k) x0``, and the model, run chunk by chunk as
the server runs it (each chunk attends to the K/V its predecessors in the window wrote at the same
step, or under the ``clean`` rule to the K/V a t = 0 pass over their expert chunks wrote:
:mod:`physis_ros.train.noisy_kv`), predicts the velocity ``v = eps - x0`` that the server's
Euler update ``x <- x + (t_{k-1} - t_k) v`` integrates. Loss: MSE of ``v`` over every chunk of every
sequence. Adam with a short warm-up and a cosine decay; gradient norm clipped to 1.

Deterministic from the seed: the model starts from its config's seeded init, and the data order,
the steps and the noise all come from one generator seeded with ``seed``; with the same torch
build and thread count two runs give bit-identical losses and weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from physis_ros.model.interface import ServableModel
from physis_ros.model.spec import ModelConfig
from physis_ros.train.dataset import Episodes, sample_batch, training_episodes
from physis_ros.train.noisy_kv import sequence_velocities, trainable_model


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    episodes: int = 128        # demonstration episodes (half free, half pushed)
    chunks: int = 32           # chunks per episode
    clip: float = 1.0


@dataclass
class TrainResult:
    model: ServableModel
    losses: list[float]
    seconds: float
    settings: TrainSettings

    def summary(self, every: int = 100) -> dict:
        """The loss curve as JSON-ready data: every loss, plus means over windows of ``every`` steps."""
        means = [sum(self.losses[i:i + every]) / len(self.losses[i:i + every])
                 for i in range(0, len(self.losses), every)]
        return {"settings": asdict(self.settings), "seconds": round(self.seconds, 2), "losses": self.losses,
                "window": every, "window_means": means}


def lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    span = max(1, settings.steps - settings.warmup)
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * (step - settings.warmup) / span))


def flow_matching_loss(model: ServableModel, batch) -> torch.Tensor:
    """MSE between the predicted and the true velocity ``eps - x0`` over every chunk of the batch; for a chunk of
    several parts (actions and frames), the mean of each part's MSE, so that each counts alike whatever its
    size."""
    t = model.timesteps.timestep(batch.k).view(-1, *[1] * (batch.x0.dim() - 1))
    x_t = t * batch.eps + (1.0 - t) * batch.x0
    v = sequence_velocities(model, batch.obs, x_t, batch.k, batch.x0)
    spec = model.config.spec
    if not spec.has_frames or spec.actions_shape is None:      # one part: the actions, or a world model's frames
        return torch.nn.functional.mse_loss(v, batch.eps - batch.x0)
    err = (v - (batch.eps - batch.x0)).square()
    n = spec.actions_shape[0] * spec.actions_shape[1]
    return 0.5 * (err[..., :n].mean() + err[..., n:].mean())


def train(config: ModelConfig, settings: TrainSettings, *, data: Episodes | None = None,
          progress: Callable[[int, float, float], None] | None = None, progress_every: int = 50) -> TrainResult:
    """Train ``config``'s model from its seeded init; ``progress(step, loss, seconds)`` every
    ``progress_every`` steps and at the last."""
    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    data = data or training_episodes(config, settings.episodes, settings.chunks)
    model = trainable_model(config)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
    gen = torch.Generator().manual_seed(settings.seed)
    length = config.window + 1
    losses = []
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        batch = sample_batch(data, settings.batch, length, config.steps, gen)
        loss = flow_matching_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the loss is {losses[-1]} at step {step}; lower the learning rate")
        if progress and ((step + 1) % progress_every == 0 or step + 1 == settings.steps):
            progress(step + 1, losses[-1], time.perf_counter() - start)
    model.eval().requires_grad_(False)
    model.clear_timestep_caches()
    return TrainResult(model, losses, time.perf_counter() - start, settings)


