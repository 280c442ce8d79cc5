"""Throttled logging: a line triggered by an incoming message is written at most once per period
per key, with the count of lines held back since, so a flood of bad messages costs a counter
increment each, never a log line each."""

from __future__ import annotations

import logging
import time


class Throttle:
    def __init__(self, period_s: float = 5.0, clock=time.monotonic):
        self.period_s = period_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def ready(self, key: str) -> int | None:
        """None if a line for ``key`` is held back now; else how many were held back before it."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)

    def line(self, key: str, text: str) -> str | None:
        """``text`` (with the count held back since the last one) if a line for ``key`` may be written now, else
        None: for loggers that are not :class:`logging.Logger` (rclpy's)."""
        held = self.ready(key)
        if held is None:
            return None
        return text + (f" ({held} similar line(s) held back)" if held else "")

    def log(self, logger: logging.Logger, level: int, key: str, text: str, exc_info: bool = False) -> bool:
        """Log ``text`` unless throttled (``exc_info``: with the current exception's traceback); True if written."""
        line = self.line(key, text)
        if line is None:
            return False
        logger.log(level, line, exc_info=exc_info)
        return True
