"""One robot served through :class:`~physis_ros.serving.server.Server`: its observations in, its chunks
out, and what happened to it (:class:`Session`).

A session is what :meth:`Server.join` returns. Observations go in as plain arrays
(:meth:`Session.observe`: HxWx3 uint8 camera frames of any size, joint positions, a world model's actions
to imagine), checked and resampled exactly as the ROS node checks and resamples its messages
(:mod:`physis_ros.serving.tensors`); the engine takes the freshest one (or, deterministic, the next one in
order) each time the stream's chunk is due. Finished chunks come back as :class:`Chunk` through
:meth:`Session.next_chunk`, or through the ``on_chunk`` callback given to ``join``. Threads: ``observe``
and ``next_chunk`` from any thread; the engine's thread calls :meth:`take`, :meth:`deliver` and
:meth:`on_event`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.logs import Throttle
from physis_ros.model.spec import ModelConfig
from physis_ros.runtime.streams import ChunkOutput, Observation, ServedModel, StreamEvent
from physis_ros.serving.config import StreamConfig
from physis_ros.serving.intake import Sample, StreamInput
from physis_ros.serving.tensors import InputRejected, check_stamp_s, checked_rows, preprocess
from physis_ros.telemetry import ChunkRecord, RollingStats, window_stats
from physis_ros.timeline import ControlTimeline

QUEUED_CHUNKS = 64   # chunks a session keeps for next_chunk; past that the oldest is dropped (and counted)
# A stream that renders its observation when its chunk is due (a simulator): called with the chunk's index on
# the engine's thread, returns the model's observation tensors and their stamp (server clock, s), or None.
Source = Callable[[int], "tuple[Mapping[str, np.ndarray], float] | None"]


@dataclass(frozen=True)
class Chunk:
    """One finished chunk of a stream."""

    stream: str
    index: int                    # chunk index in the stream (a reset skips the lost ones)
    epoch: int                    # resets before it: 0 until the stream's first reset
    output: np.ndarray            # the model's output, float32 in its output shape
    stamp_s: float                # stamp of the observation it used (the ``stamp_s`` given to observe), s
    telemetry: ChunkRecord        # timings, on the server clock (s) and in ms
    actions: np.ndarray | None    # a world-action model's actions, float32 [horizon, dof]; None for a world model
    frames: np.ndarray | None     # predicted latent frames [F, C, h, w] (a world model's, or those a world-action
                                  # model predicts beside its actions); None where the model predicts none
    tag: Any = None               # the front end's own stamp of that observation (a ROS header stamp), as given


@dataclass
class SessionHealth:
    """What happened to a stream in the engine (written on the engine's thread, read anywhere)."""

    failed: str | None = None      # a reset under way (or for good); None once re-admitted
    recovering: str | None = None  # reset, and no chunk delivered since
    failures: int = 0
    lost_chunks: int = 0           # chunks in flight at a reset, plus chunks computed but not delivered
    resets: Counter = field(default_factory=Counter)       # cause -> resets
    undelivered: Counter = field(default_factory=Counter)  # why a computed chunk did not reach its reader -> count
    epoch: int = 0
    gone: bool = False

    def on_event(self, event: StreamEvent) -> None:
        if event.kind == "failed":
            self.failed = event.reason
            self.recovering = f"reset ({event.cause or 'unknown'}): {event.reason}"
            self.failures += 1
            self.lost_chunks += event.lost_chunks
            self.resets[event.cause or "unknown"] += 1
            self.epoch += 1
        elif event.kind == "readmitted":
            self.failed = None

    def delivered(self) -> None:
        """A chunk reached its reader: a stream recovering from a reset is healthy again."""
        if self.recovering is not None and self.failed is None:
            self.recovering = None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _kind(images: Any, state: Any) -> str:
    """The input counter an observation's rejection is counted under."""
    return "images" if images is not None else ("joints" if state is not None else "actions")


class Session:
    """A stream admitted by the server (see the module's docstring). ``name``, ``config`` (its
    StreamConfig), ``model`` (its ModelConfig), ``workers`` and ``slo_interval_ms`` say what it is."""

    def __init__(self, name: str, config: StreamConfig, served: ServedModel, origin: str, workers: list[str],
                 slo_interval_ms: float, input: StreamInput, clock: Callable[[], float],
                 on_chunk: Callable[[Chunk], None] | None = None, stats_window: int = 200,
                 source: Source | None = None, timeline: ControlTimeline | None = None,
                 wake: Callable[[], None] | None = None, fixed: Mapping[str, np.ndarray] | None = None,
                 log: logging.Logger | None = None, warn_period_s: float = 5.0):
        self.name = name
        self.config = config
        self.served = served
        self.model: ModelConfig = served.config
        self.origin = origin
        self.workers = workers
        self.slo_interval_ms = slo_interval_ms
        self.input = input
        self.clock = clock
        self.on_chunk = on_chunk
        self.source = source
        self.fixed = dict(fixed or {})   # inputs read from files (config ``inputs``), part of every observation
        self._wake = wake   # tells the engine an observation is ready (EngineThread.observed)
        # where its chunks land on the robot's clock, and the chunk the robot executes (the engine places
        # each released chunk on it, the front end each published one)
        self.timeline = timeline
        self.admitted_mono = time.monotonic()
        self.health = SessionHealth()
        self.log = log or logging.getLogger("physis.serving")
        self.throttle = Throttle(warn_period_s)   # its warnings and re-admissions: one line per cause per period
        self.stats = RollingStats(stats_window)
        self.stats_lock = threading.Lock()
        self.delivered = 0
        self.dropped_unread = 0
        self._chunks: deque[Chunk] = deque()
        self._ready = threading.Condition()
        self._ended: str | None = None

    # ---- observations in (any thread) -----------------------------------------------------------
    def observe(self, images: Mapping[str, np.ndarray] | None = None, state: Any = None, actions: Any = None,
                stamp_s: float | None = None) -> None:
        """One observation of the robot: ``images`` maps its camera's name to an HxWx3 (or HxW, HxWx1,
        HxWx4) uint8 frame of any size, resampled to the model's input as the stream's ``image`` settings
        say; ``state`` its joint positions in ``joint_names`` order; ``actions`` ([horizon, dof]) the actions
        a world model imagines; ``stamp_s`` when it was taken, ``time.time()`` seconds (default: now).
        Each part may come alone (the latest of each is used); a bad one raises
        :class:`~physis_ros.serving.tensors.InputRejected` naming the field, and is counted."""
        if self._ended is not None:
            raise RuntimeError(f"stream '{self.name}' has ended ({self._ended})")
        if self.source is not None:
            raise RuntimeError(f"stream '{self.name}' takes its observations from its source")
        now = self.clock()
        stamp = now if stamp_s is None else stamp_s
        try:
            if not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
                raise InputRejected("malformed", f"stamp_s: {stamp!r}; give time.time() seconds")
            check_stamp_s(float(stamp), now, self.config.max_future_s, self.config.max_age_s)
        except InputRejected as exc:
            self.input.reject(exc.reason, _kind(images, state))
            raise
        parts = self.tensors(images, state, actions)
        ns = int(round(float(stamp) * 1e9))
        for name, data in parts.items():
            sample = Sample(data, float(stamp), ns)
            if name == "image":
                self.input.put_image(sample)
            else:
                self.input.put(name, sample)
        self.announce()

    def announce(self) -> None:
        """An observation is ready (:meth:`observe` says so itself; a front end with a ``source`` says so once
        it has one): if the engine waits for one for this stream, it takes it now rather than at its next
        look."""
        if self._wake is not None:
            self._wake()

    def tensors(self, images: Mapping[str, np.ndarray] | None = None, state: Any = None,
                actions: Any = None) -> dict[str, np.ndarray]:
        """One observation's parts (as :meth:`observe` takes them) as the model's input tensors, checked and
        resampled: what :meth:`observe` queues, and what a front end with a ``source`` hands the engine.
        A bad part raises :class:`~physis_ros.serving.tensors.InputRejected` naming the field, and is
        counted."""
        try:
            return self._tensors(images, state, actions)
        except InputRejected as exc:
            self.input.reject(exc.reason, _kind(images, state))
            raise

    def _tensors(self, images, state, actions) -> dict[str, np.ndarray]:
        shapes, s, dtype = self.model.observation_shapes, self.config, self.model.dtype
        out: dict[str, np.ndarray] = {}
        if images is not None:
            if not isinstance(images, Mapping) or len(images) != 1:
                raise InputRejected("malformed", "images: give one camera frame, {'camera': HxWx3 uint8 array}; "
                                                 "the model takes one image")
            (frame,) = images.values()
            out["image"] = self._image(np.asarray(frame))
        if state is not None:
            width = shapes["state"][0] if "state" in shapes else None
            if width is None:
                raise InputRejected("malformed", f"state: model '{self.model.name}' takes no joint state")
            row = np.asarray(state)
            if row.shape != (width,) or not np.issubdtype(row.dtype, np.number):
                raise InputRejected("size", f"state: shape {row.shape} of {row.dtype}; give {width} numbers, in "
                                            f"joint_names order")
            out["state"] = checked_rows(row, "state", s.max_abs_position, dtype)
        if actions is not None:
            if "actions" not in shapes:
                raise InputRejected("malformed", f"actions: model '{self.model.name}' imagines no actions")
            want = tuple(shapes["actions"])
            rows = np.asarray(actions)
            if rows.ndim != 2 or rows.shape[1] != want[1] or rows.shape[0] < want[0] \
                    or not np.issubdtype(rows.dtype, np.number):
                raise InputRejected("size", f"actions: shape {rows.shape}; give at least {want[0]} rows of "
                                            f"{want[1]} numbers")
            out["actions"] = checked_rows(rows[:want[0]], "actions", s.max_abs_position, dtype)
        if not out:
            raise InputRejected("malformed", "observe: give images, state or actions")
        return out

    def _image(self, frame: np.ndarray) -> np.ndarray:
        if frame.dtype != np.uint8 or frame.ndim not in (2, 3) or (frame.ndim == 3 and frame.shape[2] not in (1, 3, 4)):
            raise InputRejected("encoding", f"images: {frame.dtype} array of shape {frame.shape}; give uint8 "
                                            f"HxWx3 (RGB), HxWx4 (RGBA) or HxW (mono)")
        if frame.size == 0:
            raise InputRejected("size", f"images: an empty frame {frame.shape}")
        if frame.nbytes > self.config.image.max_bytes:
            raise InputRejected("too_large", f"images: {frame.nbytes} bytes exceeds image.max_bytes "
                                             f"{self.config.image.max_bytes}")
        pixels = frame[:, :, None] if frame.ndim == 2 else frame
        encoding = {1: "mono8", 3: "rgb8", 4: "rgba8"}[pixels.shape[2]]
        channels, size, _ = self.model.observation_shapes["image"]
        return preprocess(np.ascontiguousarray(pixels), encoding, size, channels, self.config.image.preprocess,
                          self.config.image.pad_value)

    # ---- chunks out ---------------------------------------------------------------------------------
    def next_chunk(self, timeout_s: float | None = 5.0) -> Chunk:
        """The oldest chunk not read yet, waiting up to ``timeout_s`` (None: for ever); the built-in
        ``TimeoutError`` if none came, RuntimeError once the stream has ended and every chunk was read."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._ready:
            while not self._chunks:
                if self._ended is not None:
                    raise RuntimeError(f"stream '{self.name}' has ended ({self._ended})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no chunk of stream '{self.name}' within {timeout_s:g} s")
                self._ready.wait(left)
            return self._chunks.popleft()

    @property
    def ended(self) -> str | None:
        """Why the stream ended (``left``, ``failed: ...``, ``shutdown``), or None while it is served."""
        return self._ended

    # ---- engine side (the engine's thread) ----------------------------------------------------------
    def take(self, chunk: int) -> Observation | None:
        """The observation for chunk ``chunk`` (the engine's ``observe`` callback), or None if none yet."""
        if self.source is not None:
            return self._pull(chunk)
        taken = self.input.take()
        if taken is None:
            return None
        return Observation({**taken.data, **self.fixed}, taken.sec, tag=taken.stamp)

    def _pull(self, chunk: int) -> Observation | None:
        """The source's observation for ``chunk``: tensors of the model's observation shapes (float32), or
        counted as rejected (``source_error``, ``size``) and none."""
        try:
            got = self.source(chunk)
        except Exception:   # the source's own error: this chunk waits, the engine carries on
            self.input.reject("source_error")
            return None
        if got is None:
            return None
        data, stamp = got
        data = {**data, **self.fixed}
        shapes = self.model.observation_shapes
        if set(data) != set(shapes) or any(np.shape(data[k]) != tuple(v) for k, v in shapes.items()):
            self.input.reject("size")
            return None
        return Observation({k: np.asarray(data[k], dtype=np.float32) for k in shapes}, float(stamp),
                           tag=float(stamp))

    def deliver(self, out: ChunkOutput) -> None:
        """A finished chunk (the engine's ``on_output`` callback): to ``on_chunk``, else to the queue."""
        output = np.asarray(out.output)
        spec = self.model.spec
        actions = np.ascontiguousarray(spec.actions_of(output)) if spec.produces == "actions" else None
        frames = np.ascontiguousarray(spec.frames_of(output)) if spec.has_frames else None
        chunk = Chunk(self.name, out.chunk, self.health.epoch, output, out.record.obs_stamp, out.record,
                      actions, frames, out.tag)
        self.health.delivered()
        with self.stats_lock:
            self.stats.add(out.record)
        self.delivered += 1
        if self.on_chunk is not None:
            try:
                self.on_chunk(chunk)
            except Exception as exc:   # the reader's own error: counted as lost, never the engine's problem
                reason = type(exc).__name__
                self.health.lost_chunks += 1
                self.health.undelivered[reason] += 1
                self.note(logging.ERROR, f"undelivered:{reason}", f"stream {self.name}: chunk {out.chunk} not "
                          f"delivered ({reason}: {str(exc)[:200]}); counted as lost")
            return
        with self._ready:
            if len(self._chunks) >= QUEUED_CHUNKS:
                self._chunks.popleft()
                self.dropped_unread += 1
            self._chunks.append(chunk)
            self._ready.notify_all()

    def on_event(self, event: StreamEvent) -> None:
        """A reset or re-admission of the stream in the engine: its health, and for a re-admission a line (at
        most one per period; the engine says each reset itself, :mod:`physis_ros.runtime.recovery`)."""
        self.health.on_event(event)
        if event.kind == "readmitted":
            self.note(logging.WARNING, "readmitted", f"stream {self.name} re-admitted: {event.reason} (chunk indices "
                      f"skip the lost ones; its health is ERROR until its first chunk)")

    def note(self, level: int, key: str, text: str) -> None:
        """A line about the stream (a warning, a re-admission), written at most once per ``key`` per period (then saying
        how many were held back), so that a flood costs a counter increment each, not a line each."""
        self.throttle.log(self.log, level, key, text)

    def end(self, reason: str) -> None:
        """The stream is no longer served: readers waiting in next_chunk hear so."""
        self.health.gone = True
        with self._ready:
            if self._ended is None:
                self._ended = reason
            self._ready.notify_all()

    # ---- reports ------------------------------------------------------------------------------------
    def records(self) -> tuple[list[ChunkRecord], int, int]:
        with self.stats_lock:
            return list(self.stats.records), self.stats.total, self.stats.deadline_misses

    def resets(self, engine_counts: Mapping[str, int] | None = None) -> dict[str, int]:
        """Resets by cause: what the session heard, or the engine's own count (``engine_counts``, from
        :meth:`~physis_ros.serving.engine_thread.EngineThread.snapshot`) where higher: it also counts a fault
        that hits a stream already resetting."""
        counts = Counter(self.health.resets)
        for cause, n in (engine_counts or {}).items():
            counts[cause] = max(counts[cause], n)
        return dict(sorted(counts.items()))

    def totals(self, engine_resets: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The stream's totals for an exit summary: ``chunks`` its reader took (delivered, less those it could
        not take), inputs received and rejected, failures, chunks lost and why they were not delivered, resets
        by cause, the interval and latency p50 (ms) over its last chunks (None before two chunks: JSON's null, never
        NaN), and how it ended (None: served)."""
        snap = self.input.snapshot()
        with self.stats_lock:
            summary = self.stats.summary() if self.stats.records else {}
        h = self.health
        return {"chunks": self.delivered - sum(h.undelivered.values()), "model": self.model.name,
                "origin": self.origin, "workers": list(self.workers), "received": snap["received"],
                "rejected": snap["rejected"], "failures": h.failures, "lost_chunks": h.lost_chunks,
                "unpublished": dict(h.undelivered), "resets": self.resets(engine_resets),
                **{k: _finite(summary.get(k)) for k in ("interval_ms_p50", "latency_ms_p50")}, "ended": self.ended}

    def figures(self, now: float, window_s: float, engine_resets: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The stream's figures at ``now`` (server clock): rate, intervals, latency and deadline misses over
        the last ``window_s`` (:func:`~physis_ros.telemetry.window_stats`), its ``inputs`` (received, rejected,
        waiting), and its health (epoch, resets by cause, chunks lost or not delivered)."""
        records, total, misses = self.records()
        out = window_stats(records, now, window_s, self.slo_interval_ms, total=total, misses_total=misses)
        h = self.health
        out.update(inputs=self.input.snapshot(), epoch=h.epoch, failed=h.failed, recovering=h.recovering,
                   failures=h.failures, lost_chunks=h.lost_chunks, undelivered=dict(h.undelivered),
                   resets=self.resets(engine_resets), delivered=self.delivered, dropped_unread=self.dropped_unread,
                   workers=list(self.workers))
        return out
