"""Coroutines on the rclpy executor: sleeping, and waiting for a future of another thread.

The node runs one executor thread. Work that takes long (an action goal that lasts as long as a robot
is served, admitting the config's streams at start-up) runs as coroutines on it, so that it never
blocks the subscriptions: they ``await`` a :class:`Ticker` (one node timer wakes every sleeper) or a
``concurrent.futures.Future`` finished on the engine's thread or a loader thread.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from rclpy.task import Future


class Ticker:
    """``await ticker.sleep(s)`` on the executor: one timer of ``period_s`` completes every due sleeper."""

    def __init__(self, node, period_s: float = 0.02):
        self._waiting: list[tuple[float, Future]] = []
        self._timer = node.create_timer(period_s, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        due = [f for t, f in self._waiting if t <= now]
        self._waiting = [(t, f) for t, f in self._waiting if t > now]
        for f in due:
            if not f.done():
                f.set_result(None)

    def sleep(self, seconds: float) -> Future:
        f = Future()
        self._waiting.append((time.monotonic() + seconds, f))
        return f

    async def wait(self, future: concurrent.futures.Future, poll_s: float = 0.02) -> Any:
        """The result of a future of another thread (its exception is raised here)."""
        while not future.done():
            await self.sleep(poll_s)
        return future.result()
