"""Previews of predicted frames (serving/preview.py): decoded off the caller's thread at most rate_hz times a
second, a chunk offered while one decodes or sooner than the rate skipped and counted, a decoder that fails
stops the previews (said once) and never the caller."""

from __future__ import annotations

import threading
import time

import numpy as np

from physis_ros.serving.preview import Previews


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_pictures_come_at_most_at_the_rate_and_a_busy_decoder_skips():
    clock, shown, gate = Clock(), [], threading.Event()
    built = []

    def factory():
        built.append(threading.current_thread().name)

        def decode(frames):
            gate.wait(10.0)
            return np.full((2, 3, 3), frames[0, 0, 0, 0], np.uint8)
        return decode

    previews = Previews("r", factory, lambda i, p, tag: shown.append((i, int(p[0, 0, 0]), tag)), 1.0, clock)
    try:
        frames = lambda v: np.full((1, 1, 2, 2), v, np.float32)   # noqa: E731
        assert previews.offer(0, frames(7), "t0")
        clock.now = 1.2
        assert not previews.offer(1, frames(8))          # the rate allows it, but chunk 0 still decodes
        gate.set()
        wait_for(lambda: len(shown) == 1)
        assert previews.offer(2, frames(9))
        wait_for(lambda: len(shown) == 2)
        clock.now = 2.0
        assert not previews.offer(3, frames(10))         # nothing decodes, but sooner than 1 s after chunk 2
        clock.now = 2.3
        assert previews.offer(4, frames(11))
        wait_for(lambda: len(shown) == 3)
        assert shown == [(0, 7, "t0"), (2, 9, None), (4, 11, None)]
        assert previews.skipped == 2 and previews.published == 3
        assert built == ["preview-r"]                    # built once, on the previews' own thread
    finally:
        previews.close()


def test_a_decoder_that_fails_stops_the_previews_and_not_the_caller(caplog):
    clock = Clock()

    def factory():
        raise RuntimeError("no VAE weights")

    previews = Previews("r", factory, lambda *a: None, 1.0, clock)
    try:
        assert previews.offer(0, np.zeros((1, 1, 1, 1), np.float32))
        wait_for(lambda: previews.error is not None)
        clock.now = 5.0
        assert not previews.offer(1, np.zeros((1, 1, 1, 1), np.float32))
        assert "no VAE weights" in previews.error and previews.published == 0
        assert sum("previews stop" in r.message for r in caplog.records) == 1
    finally:
        previews.close()
