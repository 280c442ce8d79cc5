"""Demonstrations of the scripted expert on the synthetic scene, and the training sequences cut from them.

An *episode* is one synthetic stream's chunks ``0..chunks-1``: each chunk's observation (camera image,
joint state) and the expert's chunk for it (:class:`~physis_ros.observations.ScriptedExpert`). Two
kinds of episode teach the policy both what the server's synthetic robots send and a closed loop:

- ``free``: :class:`~physis_ros.observations.SyntheticScene` (joint states move on their own,
  independent of the target: what ``physis-synthetic`` and the bags publish);
- ``tracking``: :class:`~physis_ros.observations.TrackingScene` (the arm follows the expert);
- ``pushed``: the same, with the arm pushed to a new pose every ``PUSH_EVERY`` chunks (so that the
  policy also sees states far from the target, not only the first chunk of each episode).

A world-action model that also predicts frames (a Wan WAM) gets each chunk's video as its VAE encodes it
beside the expert's actions (:mod:`physis_ros.train.frames`); its training target is the packed chunk.

A *sequence* is ``window + 1`` consecutive chunks of one episode, all at one denoising step ``k``
(the noisy-KV computation of DESIGN.md section 2 relates chunks only at the same step).
Sampling is a pure function of a :class:`torch.Generator`, so a seed fixes the whole data order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from physis_ros.model.spec import ModelConfig
from physis_ros.observations import ScriptedExpert, SyntheticScene, TrackingScene
from physis_ros.train.frames import FrameTargets

SCENES = ("free", "tracking", "pushed")
PUSH_EVERY = 8


def make_scene(kind: str, config: ModelConfig, expert: ScriptedExpert | None = None) -> SyntheticScene:
    """The scene of episode kind ``kind`` (one of :data:`SCENES`) for ``config``'s observations."""
    if kind not in SCENES:
        raise ValueError(f"unknown scene kind '{kind}'; known: {', '.join(SCENES)}")
    expert = expert or expert_for(config)
    if kind == "free":
        return SyntheticScene(config.observation_shapes)
    return TrackingScene(config.observation_shapes, expert=expert, push_every=PUSH_EVERY if kind == "pushed" else 0)


def expert_for(config: ModelConfig) -> ScriptedExpert:
    """The scripted expert whose chunks have ``config``'s shape: a world-action model that sees the camera and
    whose state is its joints, or an action-conditioned world model that also takes the actions to imagine
    (the expert's chunk for the same observation). ValueError saying why a model is neither."""
    shapes = config.observation_shapes
    if config.produces == "actions":
        horizon, dof = config.spec.actions_shape
        wanted = {"image", "state"}
    elif "actions" in shapes:
        horizon, dof = shapes["actions"]
        wanted = {"image", "state", "actions"}
    else:
        raise ValueError(f"model '{config.name}' produces {config.produces} from no actions; the scripted expert "
                         f"trains models that produce actions, or world models that imagine them")
    if set(shapes) != wanted:
        raise ValueError(f"model '{config.name}' takes {', '.join(sorted(shapes))}; the scripted scene gives a "
                         f"camera image and the joint state (and the expert's actions to imagine) only")
    if shapes["state"] != (dof,):
        raise ValueError(f"model '{config.name}' has state_dim {shapes['state'][0]} != dof {dof}; "
                         f"the scripted expert moves the joints it observes")
    return ScriptedExpert(horizon=horizon)


def check_trainable(config: ModelConfig) -> None:
    """ValueError unless :func:`build_episodes` can make ``config``'s training data: the expert fits it, and a
    model that predicts frames has a VAE to make their targets."""
    expert_for(config)
    if config.spec.has_frames:
        FrameTargets.check(config)


@dataclass
class Episodes:
    """Demonstrations: ``images`` [E, C, *image], ``states`` [E, C, dof], ``actions`` [E, C, H, dof] and, for a
    model that predicts frames, ``frames`` [E, C, *frames] (else None). ``world``: the model imagines the
    actions (an input) and predicts only the frames."""

    streams: list[str]
    kinds: list[str]
    images: torch.Tensor
    states: torch.Tensor
    actions: torch.Tensor
    frames: torch.Tensor | None = None
    world: bool = False

    def targets(self, e: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The training targets of chunks ``idx`` [B, S] of episodes ``e`` [B, 1]: the expert's actions
        [B, S, H, dof]; with frames the packed chunk (actions, then frames, flat) [B, S, N]; a world model's
        frames [B, S, *frames]."""
        if self.world:
            return self.frames[e, idx]
        actions = self.actions[e, idx]
        if self.frames is None:
            return actions
        return torch.cat([actions.flatten(2), self.frames[e, idx].flatten(2)], dim=2)

    @property
    def chunks(self) -> int:
        return self.images.shape[1]

    def __len__(self) -> int:
        return len(self.streams)


def build_episodes(config: ModelConfig, streams: list[str], chunks: int, kinds: list[str],
                   progress: Callable[[int], object] | None = None) -> Episodes:
    """Episodes ``streams[i]`` of kind ``kinds[i]``, chunks ``0..chunks-1`` each (deterministic);
    ``progress(1)`` after each."""
    expert = expert_for(config)
    scenes = {kind: make_scene(kind, config, expert) for kind in set(kinds)}
    video = FrameTargets(config) if config.spec.has_frames else None
    images, states, actions, frames = [], [], [], []
    for stream, kind in zip(streams, kinds, strict=True):
        scene = scenes[kind]
        obs = [scene.observation(stream, c) for c in range(chunks)]
        images.append(np.stack([o["image"] for o in obs]))
        states.append(np.stack([o["state"] for o in obs]))
        actions.append(np.stack([scene.expert(stream, c, expert) for c in range(chunks)]))
        if video is not None:
            frames.append(video.latents(scene, stream, chunks))
        if progress is not None:
            progress(1)
    return Episodes(list(streams), list(kinds), torch.from_numpy(np.stack(images)),
                    torch.from_numpy(np.stack(states)), torch.from_numpy(np.stack(actions)),
                    torch.stack(frames) if video is not None else None, config.produces == "frames")


def training_episodes(config: ModelConfig, episodes: int, chunks: int, prefix: str = "train",
                      progress: Callable[[int], object] | None = None) -> Episodes:
    """``episodes`` episodes, alternating ``free`` and ``pushed``, streams ``<prefix>-<i>``."""
    kinds = [("free", "pushed")[i % 2] for i in range(episodes)]
    return build_episodes(config, [f"{prefix}-{i}" for i in range(episodes)], chunks, kinds, progress)


@dataclass
class Batch:
    """``obs[s]``: observation tensors of sequence position ``s`` ([B, ...]); ``x0`` the target chunks
    [B, S, *output] (:meth:`Episodes.targets`); ``eps`` their noise; ``k`` the denoising step of each
    sequence [B]."""

    obs: list[dict[str, torch.Tensor]]
    x0: torch.Tensor
    eps: torch.Tensor
    k: torch.Tensor


def sample_batch(data: Episodes, batch: int, length: int, steps: int, gen: torch.Generator) -> Batch:
    """``batch`` sequences of ``length`` consecutive chunks (episode, start, step and noise drawn
    from ``gen``)."""
    if length > data.chunks:
        raise ValueError(f"sequences of {length} chunks do not fit episodes of {data.chunks}")
    e = torch.randint(0, len(data), (batch,), generator=gen)
    start = torch.randint(0, data.chunks - length + 1, (batch,), generator=gen)
    k = torch.randint(1, steps + 1, (batch,), generator=gen)
    idx = start[:, None] + torch.arange(length)[None]                      # [B, S]
    x0 = data.targets(e[:, None], idx)                                     # [B, S, *output]
    eps = torch.randn(x0.shape, generator=gen)
    images, states = data.images[e[:, None], idx], data.states[e[:, None], idx]
    obs = [{"image": images[:, s], "state": states[:, s]} for s in range(length)]
    if data.world:                                                         # the actions to imagine
        actions = data.actions[e[:, None], idx]
        for s, o in enumerate(obs):
            o["actions"] = actions[:, s]
    return Batch(obs, x0, eps, k)
