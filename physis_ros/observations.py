"""Bundled synthetic observation source: a 7-DoF arm tracking a moving target.

Deterministic per (stream, chunk) so that runs, tests and bags are repeatable.
It stands in for real cameras and joint encoders in the demo and benchmarks;
the ROS node takes the same named tensors from real topics.
"""

from __future__ import annotations

import math

import numpy as np

from physis_ros.model.interface import derived_seed


class SyntheticScene:
    """Renders ``image`` (C, S, S floats in [0, 1]), ``state`` (joint angles) and ``actions``
    (a planned joint trajectory) for whatever names and shapes a model asks for."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], rate_hz: float = 10.0):
        self.shapes = shapes
        self.rate_hz = rate_hz

    def observation(self, stream: str, chunk: int) -> dict[str, np.ndarray]:
        phase = (derived_seed("scene", stream) % 1000) / 1000.0 * 2 * math.pi
        t = chunk / self.rate_hz
        return {name: self._render(name, shape, t, phase) for name, shape in self.shapes.items()}

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
        cx = (0.5 + 0.35 * math.sin(0.9 * t + phase)) * (w - 1)
        cy = (0.5 + 0.35 * math.sin(1.3 * t + 0.5 * phase)) * (h - 1)
        r = max(h, w) / 8.0
        disc = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))
        background = 0.15 + 0.1 * xx / max(w - 1, 1)
        channels = [np.clip(background + disc * gain, 0.0, 1.0) for gain in (0.9, 0.4, 0.1)[:c]]
        return np.stack(channels).astype(np.float32)
