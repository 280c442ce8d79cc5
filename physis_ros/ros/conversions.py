"""ROS messages -> model tensors: pure functions, shared by the node and the replay checker.

Input side: :func:`image_from_msg` (Image or CompressedImage -> float32 [C, S, S]
in [0, 1] by :func:`~physis_ros.serving.tensors.preprocess`, preprocessed to the model's size), :func:`joints_from_msg`
(JointState -> float32 [dof] in the configured joint order) and
:func:`observation_from_msgs`, the whole observation of one chunk. Anything
wrong with a message raises :class:`InputRejected` with a short ``reason``
(the counter name on /diagnostics) and a ``detail`` that names the problem.
They run on the executor thread, which every robot shares, so they stay cheap
whatever arrives: messages over the configured caps (``image.max_bytes``,
``max_joints``) are refused before any work, images are resampled straight from
the message buffer (:func:`area_average`: ~1.5 ms and ~1.5 MB for 1080p, never a
full-size float copy), and joint positions are checked in the precision the model
uses (its ``dtype``: float32, float16 or bfloat16). (The output side is :mod:`physis_ros.ros.outputs`.)
"""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np
from builtin_interfaces.msg import Duration, Time
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from physis_ros.model.spec import ModelConfig
from physis_ros.msg import ActionChunk
from physis_ros.serving.config import StreamConfig
from physis_ros.serving.tensors import ENCODINGS, InputRejected, check_stamp_s, checked_rows, finite_in, preprocess

# Rejection reasons (counter names on /diagnostics).
REASONS = ("encoding", "size", "too_large", "decode", "nonfinite", "missing_joints", "malformed",
           "future_stamp", "stale_stamp", "no_clock", "queue_full", "unpaired")


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
    return check_stamp_s(stamp_to_sec(stamp), now, max_future_s, max_age_s)


# ---- images -------------------------------------------------------------------------------------
def _field_default(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_image_bytes(msg: Image | CompressedImage, max_bytes: int) -> None:
    """InputRejected("too_large") if the message carries more than ``max_bytes`` of image data: the
    first check on a camera message (cheap: the length only), so that an oversized frame is reported
    as such even when its transport took long enough to make it stale too. A CompressedImage's decoded
    size is checked by :func:`compressed_pixels`, from its header."""
    n = len(msg.data)
    if n > max_bytes:
        what = ("compressed image" if isinstance(msg, CompressedImage)
                else f"{msg.width}x{msg.height} {msg.encoding} image")
        raise InputRejected("too_large", f"{what} of {n} bytes exceeds image.max_bytes {max_bytes}")


def image_pixels(msg: Image, max_bytes: int | None = None) -> np.ndarray:
    """A raw Image as uint8 [h, w, channels] (channels as encoded), a view of the message's buffer (no
    copy); checks the encoding, the byte cap (``too_large``, before anything else is done) and sizes."""
    enc = msg.encoding.lower()
    if enc not in ENCODINGS:
        raise InputRejected("encoding", f"unsupported encoding '{msg.encoding}' "
                                        f"(supported: {', '.join(ENCODINGS)})")
    if max_bytes is not None:
        check_image_bytes(msg, max_bytes)
    n = len(msg.data)
    ch = ENCODINGS[enc][0]
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    if h == 0 or w == 0:
        raise InputRejected("size", f"empty image {w}x{h}")
    if step < w * ch:
        raise InputRejected("size", f"step {step} < width {w} x {ch} bytes per pixel ({msg.encoding})")
    if n != step * h:
        raise InputRejected("size", f"data has {n} bytes, step x height = {step} x {h} = {step * h}")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    return data.reshape(h, step)[:, : w * ch].reshape(h, w, ch)


def compressed_decoder_available() -> str | None:
    """None if CompressedImage can be decoded here (OpenCV is a requirement), else what is missing."""
    return None


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic): they carry the size.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def compressed_header(data) -> tuple[str, int, int, int]:
    """(format, width, height, channels after decoding: 1 gray, 3 colour) from a png or jpeg header,
    without decoding (and without copying the data); InputRejected("decode") for anything else or an
    unreadable header."""
    mv = memoryview(data).cast("B")
    n = len(mv)

    def at(i: int, k: int) -> bytes:
        return bytes(mv[i:i + k])

    if at(0, 8) == _PNG_SIGNATURE:
        if n < 33 or at(12, 4) != b"IHDR":
            raise InputRejected("decode", "png without an IHDR header")
        w, h = int.from_bytes(at(16, 4), "big"), int.from_bytes(at(20, 4), "big")
        color_type = mv[25]
        return "png", w, h, 1 if color_type in (0, 4) else 3        # 0/4: gray (+alpha)
    if at(0, 2) == b"\xff\xd8":
        i = 2                                        # walk the segments (EXIF/ICC ones can be long)
        while i + 4 <= n:
            if mv[i] != 0xFF:
                break
            marker = mv[i + 1]
            if marker == 0xFF:                       # fill byte
                i += 1
                continue
            if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
                i += 2
                continue
            if marker in (0xD9, 0xDA):               # end of image / start of scan before any frame header
                break
            length = int.from_bytes(at(i + 2, 2), "big")
            if marker in _JPEG_SOF:
                if length < 8 or i + 10 > n:
                    break
                h, w = int.from_bytes(at(i + 5, 2), "big"), int.from_bytes(at(i + 7, 2), "big")
                return "jpeg", w, h, 1 if mv[i + 9] == 1 else 3
            if length < 2:
                break
            i += 2 + length
        raise InputRejected("decode", "jpeg without a readable frame header")
    raise InputRejected("decode", f"not a jpeg or png image (first bytes {at(0, 8).hex() or 'none'})")


def compressed_pixels(msg: CompressedImage, max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """A jpeg/png CompressedImage as (uint8 [h, w, 3] BGR, "bgr8") or ([h, w, 1], "mono8"), decoded by
    OpenCV (alpha dropped, 16 bit reduced to 8, EXIF orientation ignored). The message size and the
    decoded size the header announces are checked against ``max_bytes`` before decoding."""
    data = msg.data
    n = len(data)
    if max_bytes is not None:
        check_image_bytes(msg, max_bytes)
    fmt, w, h, ch = compressed_header(data)
    if w == 0 or h == 0:
        raise InputRejected("decode", f"{fmt} header says {w}x{h}")
    if max_bytes is not None and w * h * ch > max_bytes:
        raise InputRejected("too_large", f"{fmt} image {w}x{h} decodes to {w * h * ch} bytes, over "
                                         f"image.max_bytes {max_bytes}")
    flags = (cv2.IMREAD_GRAYSCALE if ch == 1 else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    level = cv2.utils.logging.getLogLevel()
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)  # our rejection says it, throttled
    try:
        arr = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    except cv2.error as exc:
        raise InputRejected("decode", f"cannot decode {fmt} image: {str(exc).strip()[:200]}") from None
    finally:
        cv2.utils.logging.setLogLevel(level)
    if arr is None:
        raise InputRejected("decode", f"cannot decode {fmt} image ({n} bytes; corrupt or truncated)")
    if arr.shape[:2] != (h, w):
        raise InputRejected("decode", f"{fmt} header says {w}x{h}, decoded {arr.shape[1]}x{arr.shape[0]}")
    return (arr[:, :, None], "mono8") if arr.ndim == 2 else (arr, "bgr8")


def image_from_msg(msg: Image | CompressedImage, stream: StreamConfig, model: ModelConfig) -> np.ndarray:
    """The model's ``image`` input from a camera message (InputRejected if it is unusable). Messages
    over ``stream.image.max_bytes`` (raw bytes, or a compressed image's decoded size) are refused before
    any work; the full-size image is never copied or converted to float."""
    channels, size, _ = model.observation_shapes["image"]
    max_bytes = stream.image.max_bytes
    if isinstance(msg, CompressedImage):
        pixels, encoding = compressed_pixels(msg, max_bytes)
    else:
        pixels, encoding = image_pixels(msg, max_bytes), msg.encoding.lower()
    return preprocess(pixels, encoding, size, channels, stream.image.preprocess, stream.image.pad_value)


# ---- joints -------------------------------------------------------------------------------------
def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def joints_from_msg(msg: JointState, joint_names: list[str], max_joints: int | None = None,
                    max_abs: float | None = None, dtype: str = "float32") -> np.ndarray:
    """Positions of ``joint_names`` (in that order) from a JointState with any order and extra joints.

    A message listing more than ``max_joints`` names or positions is refused (``too_large``) before it
    is looked at. Positions are checked in the model's precision (``dtype``; float32 by default) and
    rejected as ``nonfinite`` if it cannot represent them (float32: |x| > 3.4e38, float16: |x| > 65504:
    inf after the cast) or if |x| exceeds
    ``max_abs``: a finite float32 as large as 1e25 still overflows the model's float32 arithmetic (its
    squares and norms) into NaN chunks, and poisons the stream's KV cache for the chunks after. The
    default bound, 1e9, is far beyond any joint in radians or metres (float32 resolves only 64 units
    there). Defaults of both caps: the StreamConfig defaults.
    """
    cap = _field_default(StreamConfig, "max_joints") if max_joints is None else max_joints
    limit = _field_default(StreamConfig, "max_abs_position") if max_abs is None else max_abs
    n_names, n_pos = len(msg.name), len(msg.position)
    if max(n_names, n_pos) > cap:
        raise InputRejected("too_large", f"joint state with {n_names} names and {n_pos} positions exceeds "
                                         f"max_joints {cap}")
    names = list(msg.name)
    if n_names != n_pos:
        raise InputRejected("malformed", f"{n_names} names but {n_pos} positions")
    index = {}
    for i, n in enumerate(names):
        if n in index:
            raise InputRejected("malformed", f"joint '{n}' appears twice")
        index[n] = i
    missing = [n for n in joint_names if n not in index]
    if missing:
        raise InputRejected("missing_joints", f"missing joint(s) {', '.join(missing)} (got {_names(names)})")
    pos = np.asarray(msg.position, dtype=np.float64)
    picked = pos[[index[n] for n in joint_names]]
    with np.errstate(over="ignore", invalid="ignore"):
        out = picked.astype(np.float32)
    ok = finite_in(out, dtype) & (np.abs(picked) <= limit)     # NaN compares False too
    if not ok.all():
        bad = [f"{n}={v!r}" for n, v, good in zip(joint_names, picked.tolist(), ok.tolist()) if not good]
        raise InputRejected("nonfinite", f"position(s) not finite in {dtype} (the model's precision) or beyond "
                                         f"max_abs_position {limit:g}: {', '.join(bad)}")
    return out


def actions_from_chunk(msg: ActionChunk, joint_names: list[str], horizon: int,
                       max_abs: float = 1e9, dtype: str = "float32") -> np.ndarray:
    """The actions a world model imagines, [horizon, len(joint_names)], from an ActionChunk (this server's
    WAM output, or any policy's): its first ``horizon`` steps, columns mapped by joint name."""
    names = list(msg.joint_names)
    rows, dof = int(msg.horizon), int(msg.dof)
    actions = np.frombuffer(msg.actions, dtype=np.float32) if len(msg.actions) else np.zeros(0, np.float32)
    if len(names) != dof or actions.size != rows * dof:
        raise InputRejected("malformed", f"ActionChunk of {rows}x{dof} with {len(names)} joint names and "
                                         f"{actions.size} values")
    return _select(actions.reshape(rows, dof), names, joint_names, horizon, "ActionChunk", max_abs, dtype)


def actions_from_trajectory(msg: JointTrajectory, joint_names: list[str], horizon: int,
                            max_abs: float = 1e9, dtype: str = "float32") -> np.ndarray:
    """The actions to imagine from a JointTrajectory: the positions of its first ``horizon`` points."""
    names = list(msg.joint_names)
    if any(len(p.positions) != len(names) for p in msg.points):
        raise InputRejected("malformed", f"JointTrajectory points must each hold {len(names)} positions")
    rows = np.array([list(p.positions) for p in msg.points], dtype=np.float64).reshape(len(msg.points), len(names))
    return _select(rows, names, joint_names, horizon, "JointTrajectory", max_abs, dtype)


def _select(rows: np.ndarray, names: list[str], joint_names: list[str], horizon: int, what: str,
            max_abs: float, dtype: str = "float32") -> np.ndarray:
    index = {n: i for i, n in enumerate(names)}
    if len(index) != len(names):
        raise InputRejected("malformed", f"{what} lists a joint twice")
    missing = [n for n in joint_names if n not in index]
    if missing:
        raise InputRejected("missing_joints", f"{what} lacks joint(s) {', '.join(missing)} (got {_names(names)})")
    if len(rows) < horizon:
        raise InputRejected("size", f"{what} has {len(rows)} steps; the world model imagines {horizon}")
    return checked_rows(rows[:horizon, [index[n] for n in joint_names]], what, max_abs, dtype)


def observation_from_msgs(image_msg: Image | CompressedImage, joint_msg: JointState, stream: StreamConfig,
                          model: ModelConfig) -> dict[str, np.ndarray]:
    """The observation tensors (unbatched float32) one chunk consumes, exactly as the node builds them."""
    return {"image": image_from_msg(image_msg, stream, model),
            "state": joints_from_msg(joint_msg, list(stream.joint_names), stream.max_joints,
                                     stream.max_abs_position, model.dtype)}
