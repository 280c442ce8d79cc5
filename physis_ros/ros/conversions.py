"""ROS messages <-> model tensors: pure functions, shared by the node and the replay checker.

Input side: :func:`image_from_msg` (Image or CompressedImage -> float32 [C, S, S]
in [0, 1], preprocessed to the model's size), :func:`joints_from_msg`
(JointState -> float32 [dof] in the configured joint order) and
:func:`observation_from_msgs`, the whole observation of one chunk. Anything
wrong with a message raises :class:`InputRejected` with a short ``reason``
(the counter name on /diagnostics) and a ``detail`` that names the problem.

Output side: :func:`action_chunk_msg`, :func:`trajectory_msg`,
:func:`telemetry_msg` build the published messages from a chunk.
"""

from __future__ import annotations

import array
import functools
import io
import math

import numpy as np
from builtin_interfaces.msg import Duration, Time
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from physis_ros.model.spec import ModelConfig
from physis_ros.msg import ActionChunk, ChunkTelemetry
from physis_ros.ros.config import StreamConfig
from physis_ros.telemetry import ChunkRecord

# encoding -> (channels in the message, indices of R, G, B; None for mono)
ENCODINGS: dict[str, tuple[int, tuple[int, int, int] | None]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, None),
}
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)

# Rejection reasons (counter names on /diagnostics).
REASONS = ("encoding", "size", "decode", "nonfinite", "missing_joints", "malformed",
           "future_stamp", "stale_stamp", "no_clock", "queue_full", "unpaired")


class InputRejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---- time ---------------------------------------------------------------------------------------
def stamp_ns(t: Time) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def stamp_to_sec(t: Time) -> float:
    return int(t.sec) + int(t.nanosec) * 1e-9


def time_msg(seconds: float) -> Time:
    """Seconds (float, node clock) -> builtin_interfaces/Time."""
    ns = int(round(seconds * 1e9))
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def duration_msg(seconds: float) -> Duration:
    ns = int(round(seconds * 1e9))
    return Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def check_stamp(stamp: Time, now: float, max_future_s: float, max_age_s: float) -> float:
    """The stamp in seconds if it is plausible against the node clock ``now``; else InputRejected."""
    if now <= 0.0:
        raise InputRejected("no_clock", "the node clock is not running yet (use_sim_time without /clock)")
    sec = stamp_to_sec(stamp)
    if sec - now > max_future_s:
        raise InputRejected("future_stamp", f"stamp {sec:.3f} is {sec - now:.3f} s ahead of the node clock "
                                            f"(limit {max_future_s} s)")
    if max_age_s > 0 and now - sec > max_age_s:
        raise InputRejected("stale_stamp", f"stamp {sec:.3f} is {now - sec:.3f} s old (limit {max_age_s} s)")
    return sec


# ---- images -------------------------------------------------------------------------------------
def image_pixels(msg: Image) -> np.ndarray:
    """A raw Image as uint8 [h, w, channels] (channels as encoded); checks encoding and sizes."""
    enc = msg.encoding.lower()
    if enc not in ENCODINGS:
        raise InputRejected("encoding", f"unsupported encoding '{msg.encoding}' "
                                        f"(supported: {', '.join(ENCODINGS)})")
    ch = ENCODINGS[enc][0]
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    if h == 0 or w == 0:
        raise InputRejected("size", f"empty image {w}x{h}")
    if step < w * ch:
        raise InputRejected("size", f"step {step} < width {w} x {ch} bytes per pixel ({msg.encoding})")
    n = len(msg.data)
    if n != step * h:
        raise InputRejected("size", f"data has {n} bytes, step x height = {step} x {h} = {step * h}")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    return data.reshape(h, step)[:, : w * ch].reshape(h, w, ch)


def _pillow():
    try:
        from PIL import Image as PILImage
    except ImportError:
        return None
    return PILImage


def compressed_decoder_available() -> str | None:
    """None if CompressedImage can be decoded here, else the name of the missing dependency."""
    return None if _pillow() is not None else "Pillow (pip install pillow)"


def compressed_pixels(msg: CompressedImage) -> np.ndarray:
    """A jpeg/png CompressedImage as uint8 [h, w, 3] RGB (or [h, w, 1] for grayscale)."""
    pil = _pillow()
    if pil is None:
        raise InputRejected("decode", "CompressedImage needs Pillow to decode (pip install pillow)")
    try:
        with pil.open(io.BytesIO(bytes(msg.data))) as im:
            im.load()
            if im.mode not in ("L", "RGB"):
                im = im.convert("RGB")
            arr = np.asarray(im, dtype=np.uint8)
    except Exception as exc:  # PIL raises many kinds for corrupt data
        raise InputRejected("decode", f"cannot decode '{msg.format}' image: {exc}") from None
    return arr[:, :, None] if arr.ndim == 2 else arr


@functools.lru_cache(maxsize=64)
def _resample_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights of a triangle (bilinear) filter, widened when shrinking (antialiased);
    half-pixel centres. Deterministic: plain float64 arithmetic."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centers = (np.arange(n_out, dtype=np.float64) + 0.5) * scale - 0.5
    src = np.arange(n_in, dtype=np.float64)
    w = np.clip(1.0 - np.abs(src[None, :] - centers[:, None]) / support, 0.0, None)
    w /= w.sum(axis=1, keepdims=True)
    return w


def resize(img: np.ndarray, size: int) -> np.ndarray:
    """float32 [C, h, w] -> float32 [C, size, size] (separable antialiased bilinear)."""
    _, h, w = img.shape
    if h == size and w == size:
        return img
    wy, wx = _resample_matrix(h, size), _resample_matrix(w, size)
    out = np.einsum("yh,chw,xw->cyx", wy, img.astype(np.float64), wx, optimize=True)
    return out.astype(np.float32)


def preprocess(pixels: np.ndarray, encoding: str | None, size: int, channels: int, mode: str,
               pad_value: float = 0.0) -> np.ndarray:
    """uint8 [h, w, ch] -> float32 [channels, size, size] in [0, 1].

    ``encoding`` names the channel order (rgb8, bgr8, rgba8, bgra8, mono8; None: RGB or mono by
    channel count). ``mode``: resize (stretch), center_crop (central square, then resize) or pad
    (pad the short side to a square with ``pad_value``, then resize).
    """
    ch = pixels.shape[2]
    order = ENCODINGS[encoding][1] if encoding is not None else ((0, 1, 2) if ch >= 3 else None)
    img = pixels.astype(np.float32) * np.float32(1.0 / 255.0)      # [h, w, ch]
    if order is None:
        gray = img[:, :, 0]
        chw = np.repeat(gray[None], 3, axis=0) if channels == 3 else gray[None]
    else:
        rgb = np.stack([img[:, :, i] for i in order])               # [3, h, w]
        chw = rgb if channels == 3 else np.tensordot(LUMA, rgb, axes=1)[None].astype(np.float32)
    _, h, w = chw.shape
    if mode == "center_crop" and h != w:
        m = min(h, w)
        y0, x0 = (h - m) // 2, (w - m) // 2
        chw = chw[:, y0:y0 + m, x0:x0 + m]
    elif mode == "pad" and h != w:
        m = max(h, w)
        y0, x0 = (m - h) // 2, (m - w) // 2
        padded = np.full((chw.shape[0], m, m), np.float32(pad_value), dtype=np.float32)
        padded[:, y0:y0 + h, x0:x0 + w] = chw
        chw = padded
    elif mode not in ("resize", "center_crop", "pad"):
        raise ValueError(f"unknown preprocess mode {mode!r}")
    return np.ascontiguousarray(resize(chw, size), dtype=np.float32)


def image_from_msg(msg: Image | CompressedImage, stream: StreamConfig, model: ModelConfig) -> np.ndarray:
    """The model's ``image`` input from a camera message (InputRejected if it is unusable)."""
    assert model.wam is not None
    if isinstance(msg, CompressedImage):
        pixels, encoding = compressed_pixels(msg), None
    else:
        pixels, encoding = image_pixels(msg), msg.encoding.lower()
    return preprocess(pixels, encoding, model.wam.image_size, model.wam.image_channels,
                      stream.image.preprocess, stream.image.pad_value)


# ---- joints -------------------------------------------------------------------------------------
def joints_from_msg(msg: JointState, joint_names: list[str]) -> np.ndarray:
    """Positions of ``joint_names`` (in that order) from a JointState with any order and extra joints."""
    names = list(msg.name)
    pos = np.asarray(msg.position, dtype=np.float64)
    if len(names) != len(pos):
        raise InputRejected("malformed", f"{len(names)} names but {len(pos)} positions")
    index = {}
    for i, n in enumerate(names):
        if n in index:
            raise InputRejected("malformed", f"joint '{n}' appears twice")
        index[n] = i
    missing = [n for n in joint_names if n not in index]
    if missing:
        raise InputRejected("missing_joints", f"missing joint(s) {', '.join(missing)} "
                                              f"(got {', '.join(names) or 'none'})")
    out = pos[[index[n] for n in joint_names]]
    if not np.all(np.isfinite(out)):
        bad = [n for n, v in zip(joint_names, out) if not math.isfinite(v)]
        raise InputRejected("nonfinite", f"non-finite position of joint(s) {', '.join(bad)}")
    return out.astype(np.float32)


def observation_from_msgs(image_msg: Image | CompressedImage, joint_msg: JointState, stream: StreamConfig,
                          model: ModelConfig) -> dict[str, np.ndarray]:
    """The observation tensors (unbatched float32) one chunk consumes, exactly as the node builds them."""
    return {"image": image_from_msg(image_msg, stream, model),
            "state": joints_from_msg(joint_msg, list(stream.joint_names))}


# ---- outputs ------------------------------------------------------------------------------------
def action_chunk_msg(stream_name: str, stream: StreamConfig, chunk: int, actions: np.ndarray,
                     obs_stamp: Time) -> ActionChunk:
    horizon, dof = actions.shape
    msg = ActionChunk()
    msg.header.stamp = obs_stamp
    msg.header.frame_id = stream.frame_id
    msg.stream = stream_name
    msg.chunk_index = chunk
    msg.control_period = stream.control_period
    msg.joint_names = list(stream.joint_names)
    msg.horizon = horizon
    msg.dof = dof
    # array.array is the setter's fast path (a numpy array is checked element by element)
    msg.actions = array.array("f", np.ascontiguousarray(actions, dtype=np.float32).tobytes())
    return msg


def trajectory_velocities(positions: np.ndarray, period: float) -> np.ndarray:
    """Central differences (one-sided at the start); the last point's velocity is zero so that the
    trajectory ends at rest, as joint_trajectory_controller requires by default."""
    pos = np.asarray(positions, dtype=np.float64)
    vel = np.zeros_like(pos)
    if len(pos) > 2:
        vel[1:-1] = (pos[2:] - pos[:-2]) / (2.0 * period)
    if len(pos) > 1:
        vel[0] = (pos[1] - pos[0]) / period
    return vel


class TrajectoryBuilder:
    """Builds a stream's JointTrajectory messages, reusing one message object (rclpy message objects
    are slow to construct): the result is valid until the next :meth:`build`. Point i is at
    ``start + (i + 1) * control_period``; positions are the action rows, velocities
    :func:`trajectory_velocities`."""

    def __init__(self, stream: StreamConfig, horizon: int):
        self.period = stream.control_period
        self.msg = JointTrajectory()
        self.msg.header.frame_id = stream.frame_id
        self.msg.joint_names = list(stream.joint_names)
        self.msg.points = [JointTrajectoryPoint(time_from_start=duration_msg((i + 1) * self.period))
                           for i in range(horizon)]

    def build(self, actions: np.ndarray, start: Time) -> JointTrajectory:
        positions = np.ascontiguousarray(actions, dtype=np.float64)
        velocities = trajectory_velocities(positions, self.period)
        if len(positions) != len(self.msg.points):
            raise ValueError(f"{len(positions)} action rows, builder made for {len(self.msg.points)}")
        self.msg.header.stamp = start
        for p, pos, vel in zip(self.msg.points, positions, velocities):
            p.positions = array.array("d", pos.tobytes())
            p.velocities = array.array("d", vel.tobytes())
        return self.msg


def trajectory_msg(stream: StreamConfig, actions: np.ndarray, start: Time) -> JointTrajectory:
    """Action rows as joint positions (+ velocities), a fresh message (see :class:`TrajectoryBuilder`)."""
    return TrajectoryBuilder(stream, len(actions)).build(actions, start)


def trajectory_start(stream: StreamConfig, obs_stamp: Time, emit: float) -> Time:
    base = stamp_to_sec(obs_stamp) if stream.trajectory_start == "observation" else emit
    if stream.trajectory_start_offset_s == 0.0 and stream.trajectory_start == "observation":
        return obs_stamp
    return time_msg(base + stream.trajectory_start_offset_s)


def _finite(x: float) -> float:
    return 0.0 if math.isnan(x) else float(x)


def telemetry_msg(record: ChunkRecord, obs_stamp: Time | None = None, handover: float | None = None
                  ) -> ChunkTelemetry:
    """One ChunkTelemetry from the engine's record (times are node-clock seconds); ``handover``: when the
    node began publishing the chunk (the emit time if not given)."""
    emit = time_msg(record.emit)
    msg = ChunkTelemetry()
    msg.header.stamp = emit
    msg.stream = record.stream
    msg.chunk_index = record.chunk
    msg.observation_stamp = obs_stamp if obs_stamp is not None else time_msg(record.obs_stamp)
    msg.enqueue_stamp = time_msg(record.enqueue)
    msg.emit_stamp = emit
    msg.handover_stamp = emit if handover is None else time_msg(handover)
    msg.response_latency_ms = _finite(record.latency_ms)
    msg.output_interval_ms = _finite(record.interval_ms)
    msg.observation_age_ms = _finite(record.obs_age_ms)
    stages = record.stage_ms
    msg.stage_compute_ms_min = float(min(stages, default=0.0))
    msg.stage_compute_ms_max = float(max(stages, default=0.0))
    msg.stage_compute_ms_sum = float(sum(stages))
    msg.queue_ms = float(record.queue_ms)
    msg.transport_ms = float(record.transport_ms)
    msg.batch_sizes = [int(b) for b in record.batch_sizes]
    msg.deadline_miss = bool(record.deadline_miss)
    return msg
