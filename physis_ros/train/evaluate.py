"""Tracking error of a policy against the scripted expert, measured with the sequential reference.

The policy is run exactly as the server runs it (:class:`~physis_ros.reference.ReferenceRollout`:
the noisy-KV denoising loop of DESIGN.md section 2, one chunk after the other per stream), on
held-out synthetic streams; its chunk for each observation is compared with the expert's chunk for
the same observation. Tracking error = RMS over chunks, control steps and joints (rad).
"""

from __future__ import annotations

import numpy as np
import torch

from physis_ros.model.interface import ServableModel
from physis_ros.reference import ReferenceRollout
from physis_ros.train.dataset import expert_for, make_scene

EVAL_STREAMS = ("eval-0", "eval-1", "eval-2", "eval-3")


def tracking_error(model: ServableModel, *, kind: str = "tracking", streams=EVAL_STREAMS, chunks: int = 16,
                   seed: int = 0) -> dict[str, float]:
    """``rms``: the policy's tracking error on scene ``kind``'s ``streams`` (chunks ``0..chunks-1``,
    noise seed ``seed``); ``hold_rms``: that of a policy that holds the current joint state (how much
    of the expert's motion there is to get right); ``max_abs``: the largest error of any action."""
    config = model.config
    expert = expert_for(config)
    scene = make_scene(kind, config, expert)
    ref = ReferenceRollout(model, seed)
    sq, hold_sq, worst, n = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for c in range(chunks):
            for stream in streams:
                obs = scene.observation(stream, c)
                target = scene.expert(stream, c, expert).astype(np.float64)
                out = config.spec.actions_of(ref.step(stream, obs).output.numpy()).astype(np.float64)
                err = out - target
                sq += float((err ** 2).sum())
                hold_sq += float(((obs["state"][None].astype(np.float64) - target) ** 2).sum())
                worst = max(worst, float(np.abs(err).max()))
                n += err.size
    return {"rms": (sq / n) ** 0.5, "hold_rms": (hold_sq / n) ** 0.5, "max_abs": worst, "actions": n}
