"""What admission measures on the running server: how much busier each worker is than it booked, from the
worker's own compute counter (:class:`LoadCalibration`), and each stream's published interval p99
(:class:`IntervalCalibration`).

A cost profile is measured once (``physis-profile``, or when a model is first served); the host it runs
on is not always the host it was measured on, and a shared machine drifts: on the 2-core dev VM the same
tiny-wam chunk was profiled at 13-18 ms and served at 16-22 ms within one hour, and admission, trusting
the profile, filled a worker to a measured 0.87 where it had booked 0.66. So admission also checks what
it adds against the measured load: per worker, ``factor = measured busy / booked utilisation`` over the
last ``window_s`` seconds in which its booking did not change (after ``settle_s`` for a newcomer's warm-up),
and a placement must fit the worker's cap and the host's cores with each worker's booking scaled by its
factor. The factor is never below 1 (the profile is the floor: measured compute leaves out the hops and
per-call work the booking holds) and is kept across joins and leaves (it describes the machine, not
the load) until a new window replaces it. Deterministic serving does not calibrate: its decisions must
not depend on timing.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

from physis_ros.telemetry import percentile

MAX_FACTOR = 3.0


@dataclass(frozen=True)
class CalibrationSettings:
    window_s: float = 6.0      # measure over this long a stretch of unchanged booking
    settle_s: float = 2.0      # ... that starts this long after the booking changed (a newcomer's warm-up)
    min_booked: float = 0.05   # below this a worker's ratio is noise: keep the last factor


class LoadCalibration:
    """Per worker index: samples of (time, cumulative compute ms) since its booking last changed."""

    def __init__(self, settings: CalibrationSettings = CalibrationSettings()):
        self.settings = settings
        self._lock = threading.Lock()
        self._samples: dict[int, deque[tuple[float, float]]] = {}
        self._booked: dict[int, float] = {}
        self._changed: dict[int, float] = {}
        self._factor: dict[int, float] = {}

    def observe(self, worker: int, t: float, compute_ms: float, booked: float) -> None:
        """A reading of worker ``worker``'s cumulative compute counter at ``t`` (s) while admission books
        ``booked`` of its time."""
        s = self.settings
        with self._lock:
            samples = self._samples.setdefault(worker, deque())
            restarted = samples and compute_ms < samples[-1][1]         # a restarted worker counts from 0
            if restarted or abs(self._booked.get(worker, -1.0) - booked) > 1e-9:
                samples.clear()
                self._booked[worker], self._changed[worker] = booked, t
            if t - self._changed[worker] < s.settle_s:
                return
            samples.append((t, compute_ms))
            while len(samples) > 2 and t - samples[1][0] >= s.window_s:
                samples.popleft()
            (t0, c0), (t1, c1) = samples[0], samples[-1]
            if t1 - t0 >= s.window_s and booked >= s.min_booked:
                busy = (c1 - c0) / 1e3 / (t1 - t0)
                self._factor[worker] = min(MAX_FACTOR, max(1.0, busy / booked))

    def factor(self, worker: int) -> float:
        with self._lock:
            return self._factor.get(worker, 1.0)

    def set_factors(self, factors: dict[int, float]) -> None:
        """Take factors measured elsewhere (a benchmark replaying the server's decisions)."""
        with self._lock:
            self._factor.update({w: min(MAX_FACTOR, max(1.0, f)) for w, f in factors.items()})


@dataclass(frozen=True)
class SpreadSettings:
    window_s: float = 6.0      # a stream's interval p99 over this long a stretch of unchanged placements
    settle_s: float = 2.0      # ... that starts this long after any placement on the host changed
    min_samples: int = 20      # fewer intervals than this in the window: no measurement yet
    memory_s: float = 60.0     # a stream's spread is the largest measured over this long, whatever its placements


@dataclass
class _IntervalWindow:
    """One stream's intervals since the host's placements last changed."""

    samples: deque[tuple[float, float]] = field(default_factory=deque)   # (emit time, interval ms) in the window
    last_emit: float = -math.inf     # the newest record seen (older ones are skipped)
    version: int | None = None       # the host's placements' version the window belongs to
    changed: float = 0.0             # when that version was first seen


class IntervalCalibration:
    """Per stream: its published intervals since the host's placements last changed, and their p99 once a
    whole window of them is in.

    What the jitter bound leaves out (a chunk's own compute spread, a late release, transport, the node on
    the same cores) shows in the intervals a stream publishes; admission charges what its bound does not
    explain (:meth:`~physis_ros.serving.capacity.ServerAdmission.observe_intervals`). Every join or leave
    anywhere on the host restarts every stream's window (``version``): two busy workers share the cores, so
    the interference a stream's intervals hold is that of one set of placements.

    The spread a window shows is a lower bound on the stream's own: where the bound's worst case (say, two
    workers' busy periods overlapping) did not happen, its slack hides part of the spread. So a stream is
    charged the largest spread measured in the last ``memory_s`` (:meth:`remember`), not the latest: on the
    VM a robot measured at 10.9 ms beside another robot and 2.6 ms beside a world model on the other worker
    missed its SLO (106 ms) once a third stream joined on the strength of the 2.6.
    """

    def __init__(self, settings: SpreadSettings = SpreadSettings()):
        self.settings = settings
        self._lock = threading.Lock()
        self._windows: dict[str, _IntervalWindow] = {}
        self._spreads: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, stream: str, version: int, now: float, records: list[tuple[float, float]]) -> float | None:
        """``records``: the stream's recent (emit time, interval ms), oldest first, on the clock of ``now``
        (those already seen are skipped); ``version``: the host's placements' version. Returns the interval
        p99 over the last ``window_s`` once the window since the change is whole, else None."""
        s = self.settings
        with self._lock:
            w = self._windows.setdefault(stream, _IntervalWindow())
            if w.version != version:
                w.samples.clear()
                w.version, w.changed = version, now
            start = w.changed + s.settle_s
            samples = w.samples
            for emit, interval in records:
                if emit <= w.last_emit:
                    continue
                w.last_emit = emit
                if emit >= start and math.isfinite(interval):
                    samples.append((emit, interval))
            while samples and samples[0][0] <= now - s.window_s:
                samples.popleft()
            if now - start < s.window_s or len(samples) < s.min_samples:
                return None
            return percentile([iv for _, iv in samples], 99)

    def remember(self, stream: str, now: float, spread_ms: float) -> float:
        """Keep ``stream``'s spread measured at ``now``; the largest kept over the last ``memory_s``."""
        with self._lock:
            kept = self._spreads.setdefault(stream, deque())
            kept.append((now, spread_ms))
            while kept[0][0] < now - self.settings.memory_s:
                kept.popleft()
            return max(v for _, v in kept)

    def forget(self, stream: str) -> None:
        with self._lock:
            self._windows.pop(stream, None)
            self._spreads.pop(stream, None)
