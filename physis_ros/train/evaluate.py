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


def world_error(model: ServableModel, *, streams=EVAL_STREAMS, chunks: int = 8, seed: int = 0) -> dict:
    """An action-conditioned world model's frames against the scene's video on held-out ``streams`` (chunks
    ``0..chunks-1``, each imagining the expert's chunk for its observation, run as the server runs it):

    - ``latent_mse``: its predicted latents against the VAE's encoding of the true video
      (:class:`~physis_ros.train.frames.FrameTargets`), and ``copy_latent_mse``: the encoding of the chunk's camera
      held for the whole span (copying the last frame) against the same;
    - ``pixel_mse``: its latents decoded by the VAE against the true video (pixels in [0, 1]), and
      ``copy_pixel_mse``: the chunk's camera held, against the same (no VAE in the way);
    - ``samples``: (stream, chunk, true video, decoded prediction) of the first stream, for pictures.
    """
    from physis_ros.train.frames import FrameTargets

    config = model.config
    expert = expert_for(config)
    scene = make_scene("free", config, expert)
    video = FrameTargets(config)
    ref = ReferenceRollout(model, seed)
    sums = {"latent_mse": 0.0, "copy_latent_mse": 0.0, "pixel_mse": 0.0, "copy_pixel_mse": 0.0}
    samples = []
    with torch.no_grad():
        for stream in streams:
            clips = torch.from_numpy(np.stack([video.video(scene, stream, c) for c in range(chunks)]))
            held = clips[:, :, :1].expand_as(clips)                     # [chunks, 3, T, S, S]: the camera held
            truth, copied = video.encode(clips), video.encode(held)
            for c in range(chunks):
                obs = {**scene.observation(stream, c), "actions": scene.expert(stream, c, expert)}
                predicted = ref.step(stream, obs).output[None].float()
                decoded = video.decode(predicted)
                sums["latent_mse"] += float((predicted - truth[c:c + 1]).square().mean())
                sums["copy_latent_mse"] += float((copied[c:c + 1] - truth[c:c + 1]).square().mean())
                sums["pixel_mse"] += float((decoded - clips[c:c + 1]).square().mean())
                sums["copy_pixel_mse"] += float((held[c:c + 1] - clips[c:c + 1]).square().mean())
                if stream == streams[0]:
                    samples.append((stream, c, clips[c].numpy(), decoded[0].numpy()))
    n = len(streams) * chunks
    return {**{k: v / n for k, v in sums.items()}, "chunks": n, "samples": samples}


def world_figure(samples: list, path, title: str) -> None:
    """A picture of :func:`world_error`'s ``samples``: per chunk (a row), the camera at the chunk's start (what
    copying the last frame predicts), the true camera at the chunk's end, and the model's predicted end frame
    decoded by its VAE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = samples[:4]
    fig, axes = plt.subplots(len(rows), 3, figsize=(7.5, 2.5 * len(rows)), squeeze=False)
    for r, (stream, chunk, clip, decoded) in enumerate(rows):
        for ax, image, label in zip(axes[r], (clip[:, 0], clip[:, -1], decoded[:, -1]),
                                    ("camera now (copied)", "true, end of chunk", "predicted, end of chunk")):
            ax.imshow(np.clip(image.transpose(1, 2, 0), 0.0, 1.0), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{label}\n{stream}, chunk {chunk}" if r == 0 else f"{stream}, chunk {chunk}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
