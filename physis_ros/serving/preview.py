"""Pictures of a stream's predicted frames for a person to look at (a world model's ``<ns>/predicted_image``):
the model family's previewer (``ModelFamily.previewer``: a VAE decode) run at most ``rate_hz`` times a second
on a thread of its own, so that decoding never delays a chunk on its way to the robot; a chunk offered while
the previous one is still decoding, or sooner than the rate allows, is skipped (counted)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("physis_ros.serving")

Publish = Callable[[int, np.ndarray, Any], None]     # (chunk index, RGB [H, W, 3] uint8, the chunk's tag)


class Previews:
    """Decode offered frames into pictures at most ``rate_hz`` times a second, on a daemon thread.
    ``factory()`` builds the decoder on that thread at the first offer (a VAE: seconds of imports and weights
    that must not stall the caller); if it fails, previews stop and the error is logged once."""

    def __init__(self, stream: str, factory: Callable[[], Callable[[np.ndarray], np.ndarray]], publish: Publish,
                 rate_hz: float, clock: Callable[[], float] = time.monotonic):
        self.stream, self.factory, self.publish = stream, factory, publish
        self.period_s = 1.0 / rate_hz
        self.clock = clock
        self.published = self.skipped = 0
        self.error: str | None = None
        self._next = -float("inf")
        self._pending: tuple[int, np.ndarray, Any] | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"preview-{stream}", daemon=True)
        self._thread.start()

    def offer(self, index: int, frames: np.ndarray, tag: Any = None) -> bool:
        """Take chunk ``index``'s frames (``[F, C, H, W]``) to decode if the rate allows and nothing is
        decoding; returns whether it was taken."""
        now = self.clock()
        with self._cv:
            if self._closed or self.error is not None or now < self._next or self._pending is not None:
                self.skipped += 1
                return False
            self._next = now + self.period_s
            self._pending = (index, np.array(frames, dtype=np.float32), tag)
            self._cv.notify()
        return True

    def _run(self) -> None:
        decode = None
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                index, frames, tag = self._pending
            try:
                if decode is None:
                    decode = self.factory()
                picture = decode(frames)
                self.publish(index, picture, tag)
                self.published += 1
            except Exception as exc:   # the decoder's own failure: no more previews, said once; chunks go on
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("stream %s: previews stop: %s", self.stream, self.error)
            with self._cv:
                self._pending = None

    def close(self, timeout_s: float = 2.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)
