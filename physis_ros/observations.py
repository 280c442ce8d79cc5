"""Bundled synthetic observation source: a 7-DoF arm tracking a moving target.

Deterministic per (stream, chunk) so that runs, tests and bags are repeatable.
It stands in for real cameras and joint encoders in the demo and benchmarks;
the ROS node takes the same named tensors from real topics.

- :class:`SyntheticScene`: the camera view of a target disc on a Lissajous path, and joint
  states that move on their own (free sinusoids, independent of the target).
- :class:`ScriptedExpert`: what the arm *should* do for an observation: a target pose
  ``q*`` that is a smooth function of where the disc is in the image, and a chunk that moves
  from the current joint state towards it, ``a_i = q + (q* - q) (1 - exp(-(i+1) dt / tau))``.
  It is a pure function of the observation (:meth:`ScriptedExpert.act` finds the disc in the
  image), so a policy can learn it; ``physis-train`` trains tiny-wam to imitate it.
- :class:`TrackingScene`: the same camera view, with an arm that follows the expert in closed
  loop (the state at chunk ``c+1`` is where the expert's chunk ``c`` is after the control steps
  executed in one chunk period).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from physis_ros.model.interface import derived_seed


class SyntheticScene:
    """Renders ``image`` (C, S, S floats in [0, 1]), ``state`` (joint angles) and ``actions``
    (a planned joint trajectory) for whatever names and shapes a model asks for."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], rate_hz: float = 10.0):
        self.shapes = shapes
        self.rate_hz = rate_hz

    def observation(self, stream: str, chunk: int) -> dict[str, np.ndarray]:
        phase = self.phase(stream)
        t = chunk / self.rate_hz
        return {name: self._render(name, shape, t, phase) for name, shape in self.shapes.items()}

    @staticmethod
    def phase(stream: str) -> float:
        """The stream's phase on the scene's paths (a stable function of its name)."""
        return (derived_seed("scene", stream) % 1000) / 1000.0 * 2 * math.pi

    def disc(self, stream: str, chunk: int) -> tuple[float, float]:
        """Where the target disc is in the image of ``observation(stream, chunk)``: (x, y) as fractions
        of the image's width and height (0 = left/top edge pixel, 1 = right/bottom)."""
        return self.disc_center(chunk / self.rate_hz, self.phase(stream))

    def expert(self, stream: str, chunk: int, expert: ScriptedExpert | None = None) -> np.ndarray:
        """The scripted expert's chunk [horizon, dof] for ``observation(stream, chunk)`` (its state,
        the disc of its image)."""
        expert = expert or ScriptedExpert()
        dof = self.shapes["state"][0]
        state = self.observation_state(stream, chunk, dof)
        return expert.chunk(state, expert.target(self.disc(stream, chunk), dof))

    def observation_state(self, stream: str, chunk: int, dof: int) -> np.ndarray:
        """The joint state ``observation(stream, chunk)`` holds (without rendering the image)."""
        return self.joints(dof, chunk / self.rate_hz, self.phase(stream))

    def _render(self, name: str, shape: tuple[int, ...], t: float, phase: float) -> np.ndarray:
        if name == "image":
            return self.image(shape, t, phase)
        if name == "state":
            return self.joints(shape[0], t, phase)
        if name == "actions":
            steps = np.arange(shape[0], dtype=np.float32) / (shape[0] * self.rate_hz)
            return np.stack([self.joints(shape[1], t + s, phase) for s in steps]).astype(np.float32)
        # Unknown names get smooth, bounded signals of the requested shape.
        n = int(np.prod(shape))
        return np.sin(np.linspace(0, 2 * math.pi, n, dtype=np.float32) + t + phase).reshape(shape)

    @staticmethod
    def joints(dof: int, t: float, phase: float) -> np.ndarray:
        j = np.arange(dof, dtype=np.float64)
        return (0.6 * np.sin(0.5 * t * (1 + 0.15 * j) + phase + j)).astype(np.float32)

    @staticmethod
    def image(shape: tuple[int, ...], t: float, phase: float) -> np.ndarray:
        """A soft bright disc (the target) moving on a Lissajous path over a dim gradient."""
        c, h, w = shape
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        u, v = SyntheticScene.disc_center(t, phase)
        cx = u * (w - 1)
        cy = v * (h - 1)
        r = max(h, w) / 8.0
        disc = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))
        background = 0.15 + 0.1 * xx / max(w - 1, 1)
        channels = [np.clip(background + disc * gain, 0.0, 1.0) for gain in (0.9, 0.4, 0.1)[:c]]
        return np.stack(channels).astype(np.float32)

    @staticmethod
    def disc_center(t: float, phase: float) -> tuple[float, float]:
        """The target disc's centre at time ``t``: (x, y) as fractions of width - 1 and height - 1."""
        return 0.5 + 0.35 * math.sin(0.9 * t + phase), 0.5 + 0.35 * math.sin(1.3 * t + 0.5 * phase)


DISC_GAINS = (0.9, 0.4, 0.1)   # per channel, as SyntheticScene.image draws the disc


def locate_disc(image: np.ndarray) -> tuple[float, float]:
    """The disc's centre in a camera image [C, H, W] in [0, 1] as SyntheticScene draws it: (x, y) as
    fractions of width - 1 and height - 1.

    The disc is a Gaussian of known radius over a known gradient, so its log is a quadratic whose
    linear terms are the centre: a weighted least-squares fit over the disc's unclipped pixels
    (in the last channel, which has the smallest gain) recovers it to float32 precision on the
    scene's own images, and closely on resized ones. An image without a visible disc gives the
    image centre.
    """
    image = np.asarray(image, dtype=np.float64)
    if image.ndim != 3:
        raise ValueError(f"expected an image [C, H, W], got shape {list(image.shape)}")
    c, h, w = image.shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    background = 0.15 + 0.1 * xx / max(w - 1, 1)
    channel = min(c, len(DISC_GAINS)) - 1
    disc = (image[channel] - background) / DISC_GAINS[channel]
    ok = (disc > 0.05) & (image[channel] < 0.999)
    if ok.sum() < 3:
        return 0.5, 0.5
    r = max(h, w) / 8.0
    z = np.log(disc[ok]) + (xx[ok] ** 2 + yy[ok] ** 2) / (2 * r * r)
    a = np.stack([xx[ok], yy[ok], np.ones_like(z)], axis=1)
    sw = np.sqrt(disc[ok])
    coef, *_ = np.linalg.lstsq(a * sw[:, None], z * sw, rcond=None)
    cx, cy = coef[0] * r * r, coef[1] * r * r
    return float(cx / max(w - 1, 1)), float(cy / max(h - 1, 1))


@dataclass(frozen=True)
class ScriptedExpert:
    """The demonstrator ``physis-train`` imitates: look at the target, move the arm to a pose for it.

    ``target``: a smooth map from the disc's position (x, y) in the image to joint angles ``q*``,
    joint ``j`` following the projection of the disc's offset from the image centre on its own
    direction (all within +-0.8 rad). ``chunk``: ``horizon`` control steps at ``control_rate_hz``
    moving from the joint state ``q`` towards ``q*`` with time constant ``tau_s``:
    ``a_i = q + (q* - q) (1 - exp(-(i + 1) dt / tau))``.
    """

    horizon: int = 16
    control_rate_hz: float = 50.0
    tau_s: float = 0.1

    def target(self, disc: tuple[float, float], dof: int) -> np.ndarray:
        """Joint targets q* [dof] (float64) for a disc at (x, y) (fractions of the image's extent)."""
        x, y = 2.0 * disc[0] - 1.0, 2.0 * disc[1] - 1.0
        j = np.arange(dof, dtype=np.float64)
        angle = 2.399963 * j                 # golden angle: every joint looks along its own direction
        return 0.8 * np.sin(1.6 * (np.cos(angle) * x + np.sin(angle) * y) + 0.2 * np.cos(1.7 * j))

    def progress(self) -> np.ndarray:
        """The fraction of the way to the target at each step of a chunk [horizon]."""
        steps = np.arange(1, self.horizon + 1, dtype=np.float64)
        return 1.0 - np.exp(-steps / (self.control_rate_hz * self.tau_s))

    def chunk(self, state: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The chunk [horizon, dof] (float32) from joint state ``state`` towards ``target``."""
        q = np.asarray(state, dtype=np.float64)
        return (q + (np.asarray(target, dtype=np.float64) - q) * self.progress()[:, None]).astype(np.float32)

    def act(self, image: np.ndarray, state: np.ndarray) -> np.ndarray:
        """The chunk for one observation (camera image [C, H, W], joint state [dof])."""
        state = np.asarray(state)
        return self.chunk(state, self.target(locate_disc(image), state.shape[0]))


class TrackingScene(SyntheticScene):
    """The synthetic scene with an arm that follows the scripted expert in closed loop.

    The image is :class:`SyntheticScene`'s; the joint state starts at a pose drawn from the stream's
    name (uniform in +-0.8 rad) and, from chunk to chunk, moves as the expert's chunk says for the
    ``execute_steps`` control steps of one chunk period (``control_rate_hz / rate_hz``, at least 1).
    So the state at chunk ``c + 1`` is ``expert(stream, c)[execute_steps - 1]``. With ``push_every``
    = n > 0 the arm is also pushed to a new pose (drawn like the first) at chunks n, 2n, ...: a
    disturbance it then recovers from (training data sees many states far from the target).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], rate_hz: float = 10.0,
                 expert: ScriptedExpert | None = None, push_every: int = 0):
        super().__init__(shapes, rate_hz)
        if push_every < 0:
            raise ValueError(f"push_every must be >= 0, got {push_every}")
        self.push_every = push_every
        self.expert_policy = expert or ScriptedExpert()
        steps = int(round(self.expert_policy.control_rate_hz / rate_hz))
        self.execute_steps = min(max(steps, 1), self.expert_policy.horizon)
        self._states: dict[tuple[str, int], list[np.ndarray]] = {}

    def observation(self, stream: str, chunk: int) -> dict[str, np.ndarray]:
        obs = super().observation(stream, chunk)
        if "state" in obs:
            obs["state"] = self.observation_state(stream, chunk, self.shapes["state"][0])
        return obs

    def initial_state(self, stream: str, dof: int, chunk: int = 0) -> np.ndarray:
        """The pose the arm starts from (chunk 0), or is pushed to (chunk > 0)."""
        parts = ("tracking-start", stream) if chunk == 0 else ("tracking-push", stream, chunk)
        rng = np.random.default_rng(derived_seed(*parts))
        return rng.uniform(-0.8, 0.8, dof)

    def observation_state(self, stream: str, chunk: int, dof: int) -> np.ndarray:
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        states = self._states.setdefault((stream, dof), [self.initial_state(stream, dof)])
        while len(states) <= chunk:
            c = len(states) - 1
            if self.push_every and (c + 1) % self.push_every == 0:
                states.append(self.initial_state(stream, dof, c + 1))
                continue
            target = self.expert_policy.target(self.disc(stream, c), dof)
            states.append(self._chunk64(states[c], target)[self.execute_steps - 1])
        return states[chunk].astype(np.float32)

    def expert(self, stream: str, chunk: int, expert: ScriptedExpert | None = None) -> np.ndarray:
        return super().expert(stream, chunk, expert or self.expert_policy)

    def _chunk64(self, state: np.ndarray, target: np.ndarray) -> np.ndarray:
        return state + (target - state) * self.expert_policy.progress()[:, None]
