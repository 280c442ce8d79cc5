"""Release phases: streams released at one pace on one device, spread over the interval.

A paced stream is released once every ``pace`` ms, at a fixed phase of that interval counted from one
epoch the engine keeps (:meth:`physis_ros.runtime.engine.Engine.add_stream`). Two streams at the same
pace on one device then meet at the same relative phase every interval: a chunk of one waits for the
other only if that one's chunk, released earlier, is still running. With ``oldest`` dispatch (first
released, first run) the wait is the backlog of the chunks released before it, which :func:`wait_ms`
follows over the periodic schedule. Streams at other paces drift against each other and meet at every
relative phase, so they get no such credit (:class:`~physis_ros.scheduling.jitter.JitterBound` counts them
in full).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CANDIDATES = 32   # phases tried per interval (2.5 ms apart at an 80 ms pace)


def circular_distance(a: float, b: float, period: float) -> float:
    d = abs(a - b) % period
    return min(d, period - d)


def choose_phase(period_ms: float, taken: Sequence[float], candidates: int = CANDIDATES) -> float:
    """The phase (ms, in [0, period)) farthest from every phase in ``taken``, the earliest of equals;
    0.0 when none is taken."""
    best, best_gap = 0.0, -1.0
    if not taken:
        return best
    for j in range(candidates):
        phase = period_ms * j / candidates
        gap = min(circular_distance(phase, t, period_ms) for t in taken)
        if gap > best_gap + 1e-9:
            best, best_gap = phase, gap
    return best


def wait_ms(period_ms: float, own_phase: float, own_ms: float, others: Sequence[tuple[float, float]]) -> float:
    """How long a chunk released at ``own_phase`` (taking ``own_ms``) waits for the chunks released
    before it, first come first served, in the steady state of the periodic schedule: ``others`` are
    (phase, work ms), released every ``period_ms`` as well; one released at the same phase goes first.
    inf when their work fills the period (the backlog grows without bound)."""
    if own_ms + sum(w for _, w in others) >= period_ms:
        return math.inf
    events = sorted([(p % period_ms, 0, w) for p, w in others] + [(own_phase % period_ms, 1, own_ms)])
    # Every busy period is shorter than the period (the work released in one period is less than it), so
    # from an empty queue the second lap is the steady state.
    backlog, last, wait = 0.0, None, 0.0
    for lap in range(2):
        for phase, own, work in events:
            t = lap * period_ms + phase
            if last is not None:
                backlog = max(0.0, backlog - (t - last))
            last = t
            if own:
                wait = backlog
            backlog += work
    return wait
