"""Per-stream observation buffer between the subscriptions (executor thread) and the engine.

Two modes:

- **latest** (default): a depth-1 slot per input; each chunk takes the latest
  image and the latest joint state (and, for a world model, the latest actions to
  imagine) at the moment it enters the pipeline. If the latest image is older than
  ``max_age_s`` (camera stopped) no chunk starts.
- **deterministic**: images queue in arrival order (bounded; overflow is
  dropped and counted) and chunk ``c`` consumes the ``c``-th complete
  observation: the image plus the joint state with the same header stamp, or,
  if stamps never match, the latest joint state at or before the image stamp
  (:func:`pick_joint`); every other paired input (a world model's actions)
  likewise, each on its own. :func:`pair_observations` applies the same rule to
  whole recorded sequences, for checking a replay against the reference.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class Sample:
    data: np.ndarray
    stamp: Any             # the front end's own stamp (a ROS header stamp), handed back with the chunk
    ns: int                # the same stamp in nanoseconds
    arrival: float = 0.0   # time.monotonic() at arrival (pairing timeout only)


@dataclass
class Taken:
    data: dict[str, np.ndarray]
    stamp: Any
    sec: float


def pick_joint(image_ns: int, joint_ns: Sequence[int], complete: bool) -> tuple[str, int]:
    """Choose the joint state for an image: ("pair", index), ("wait", -1) or ("drop", -1).

    ``joint_ns`` are the candidate stamps in arrival order. An exact stamp match wins. Otherwise,
    once no exact match can come any more (``complete``: a later joint state has arrived, the wait
    timed out, or the recording ended), the latest joint state at or before the image is used; if
    there is none the image cannot be paired and is dropped.
    """
    best = -1
    for i, ns in enumerate(joint_ns):
        if ns == image_ns:
            return "pair", i
        if ns < image_ns and (best < 0 or ns >= joint_ns[best]):
            best = i
    if not complete:
        return "wait", -1
    return ("pair", best) if best >= 0 else ("drop", -1)


def pair_observations(images: Sequence[tuple[int, T]], *paired: Sequence[tuple[int, Any]]) -> list[tuple]:
    """Offline version of the deterministic pairing over complete recordings: ``images`` and each of
    ``paired`` (joint states, actions to imagine, ...: the inputs :class:`StreamInput` pairs to the
    camera, in its ``paired`` order) are ``(stamp_ns, item)`` sequences in arrival order. Returns the
    ``(image item, paired item, ...)`` tuples chunk 0, 1, ... consume (``pair_observations(images,
    joints)``: ``(image, joint)`` pairs). Images that cannot pair are left out
    (:func:`match_observations` says which and why)."""
    return [(image, *items) for image, items, _ in match_observations(images, *paired) if items is not None]


def match_observations(images: Sequence[tuple[int, T]], *paired: Sequence[tuple[int, Any]]
                       ) -> list[tuple[T, tuple | None, int]]:
    """Every image with its verdict, as :meth:`StreamInput.take` decides in deterministic mode once nothing
    more can arrive: ``(image item, (paired item, ...), -1)`` if it pairs, else ``(image item, None, k)``
    with ``k`` the first paired input (in order) that has nothing at or before the image's stamp (the
    server counts it ``unpaired``).

    Each input is paired on its own with :func:`pick_joint`'s rule (exact stamp, else the latest at or
    before), and, as the server forgets what no later image can use, an input's entries that arrived
    before the one an image used and are older than it are not offered to later images (this matters
    only when image stamps go backwards). Exact for inputs that arrive in stamp order; the server
    decides on what has arrived so far, so an exact match that arrives after a later-stamped message
    may be passed over online."""
    start = [0] * len(paired)           # the server's history of input k is paired[k][start[k]:]
    out: list[tuple[T, tuple | None, int]] = []
    for ns, image in images:
        chosen: list[int] = []
        missing = -1
        for k, seq in enumerate(paired):
            verdict, i = pick_joint(ns, [s for s, _ in seq[start[k]:]], complete=True)
            if verdict != "pair":
                missing = k
                break
            chosen.append(start[k] + i)
        if missing >= 0:
            out.append((image, None, missing))
            continue
        for k, i in enumerate(chosen):
            seq = paired[k]
            while start[k] < len(seq) and seq[start[k]][0] < seq[i][0]:
                start[k] += 1
        out.append((image, tuple(paired[k][i][1] for k, i in enumerate(chosen)), -1))
    return out


class StreamInput:
    """Thread-safe: ``put_*`` from the executor thread, ``take`` from the engine's loop thread.

    The camera image drives the chunks; every other observation the model takes (``paired``:
    ``state`` from joint_states, ``actions`` for a world model) is paired to it by stamp with
    :func:`pick_joint`'s rule, each on its own."""

    def __init__(self, deterministic: bool = False, queue_limit: int = 10000, pair_timeout_s: float = 0.5,
                 max_age_s: float = 0.0, now: Callable[[], float] | None = None,
                 paired: Sequence[str] = ("state",)):
        self.deterministic = deterministic
        self.queue_limit = queue_limit
        self.pair_timeout_s = pair_timeout_s
        self.max_age_s = max_age_s
        self.now = now or time.time
        self.lock = threading.Lock()
        self.image: Sample | None = None
        self.images: deque[Sample] = deque()
        self.latest: dict[str, Sample | None] = {name: None for name in paired}
        self.history: dict[str, deque[Sample]] = {name: deque() for name in paired}
        self.received = Counter()   # images, joints, actions
        self.rejected = Counter()   # reason -> count
        self.refused: dict[str, Counter] = {}   # input kind (images, joints, actions) -> reason -> count
        self.used = 0
        self.last_image_ns: int | None = None
        self.waiting_since: float | None = None  # stalled: no fresh observation for a chunk

    def reject(self, reason: str, kind: str = "") -> int:
        """Count a rejected input message (of input ``kind``: images, joints, actions, if it is one of the
        stream's observations); returns the count for this reason so far."""
        with self.lock:
            self.rejected[reason] += 1
            if kind:
                self.refused.setdefault(kind, Counter())[reason] += 1
            return self.rejected[reason]

    def put_image(self, sample: Sample) -> None:
        sample.arrival = time.monotonic()
        with self.lock:
            self.received["images"] += 1
            self.last_image_ns = sample.ns
            if not self.deterministic:
                self.image = sample
            elif len(self.images) >= self.queue_limit:
                self.rejected["queue_full"] += 1
            else:
                self.images.append(sample)

    def put(self, name: str, sample: Sample) -> None:
        """A paired observation (``state``, ``actions``) arrived."""
        sample.arrival = time.monotonic()
        with self.lock:
            self.received[_COUNTER.get(name, name)] += 1
            self.latest[name] = sample
            if self.deterministic:
                history = self.history[name]
                if len(history) >= self.queue_limit:
                    history.popleft()
                history.append(sample)

    def put_joints(self, sample: Sample) -> None:
        self.put("state", sample)

    def take(self) -> Taken | None:
        """The observation for the next chunk, or None if there is none yet."""
        with self.lock:
            taken = self._take_deterministic() if self.deterministic else self._take_latest()
            if taken is None:
                if self.waiting_since is None:
                    self.waiting_since = time.monotonic()
            else:
                self.used += 1
                self.waiting_since = None
            return taken

    def _take_latest(self) -> Taken | None:
        image = self.image
        if image is None or any(s is None for s in self.latest.values()):
            return None
        sec = image.ns * 1e-9
        if self.max_age_s > 0 and self.now() - sec > self.max_age_s:
            return None  # the camera stopped: do not act on a stale view
        return Taken({"image": image.data, **{k: s.data for k, s in self.latest.items()}}, image.stamp, sec)

    def _take_deterministic(self) -> Taken | None:
        while self.images:
            image = self.images[0]
            chosen: dict[str, int] = {}
            for name, history in self.history.items():
                stamps = [x.ns for x in history]
                complete = (any(ns > image.ns for ns in stamps)
                            or time.monotonic() - image.arrival > self.pair_timeout_s)
                verdict, i = pick_joint(image.ns, stamps, complete)
                if verdict == "wait":
                    return None
                if verdict == "drop":
                    break
                chosen[name] = i
            self.images.popleft()
            if len(chosen) < len(self.history):
                self.rejected["unpaired"] += 1
                continue
            data = {"image": image.data}
            for name, i in chosen.items():
                history = self.history[name]
                picked = history[i]
                data[name] = picked.data
                while history and history[0].ns < picked.ns:
                    history.popleft()  # older than what this image used: no later image needs them
            return Taken(data, image.stamp, image.ns * 1e-9)
        return None

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"received": dict(self.received), "rejected": dict(self.rejected),
                    "refused": {kind: dict(c) for kind, c in self.refused.items()}, "used": self.used,
                    "queued": len(self.images), "waiting_since": self.waiting_since,
                    "last_image_ns": self.last_image_ns}


_COUNTER = {"state": "joints"}   # what /diagnostics has always called joint states
# A stream's subscription (its ``what``) -> the input counter its rejections are counted under.
INPUT_KINDS = {"image": "images", "joint_states": "joints", "actions": "actions"}
