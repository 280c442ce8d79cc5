"""Camera frames and joint states as a front end receives them (bytes, names and positions) -> checked arrays,
before any tensor work: the raw and compressed (png, jpeg) image decoders, with their byte caps checked first,
and the joint-name matching of joint states and action rows. Anything wrong raises :class:`InputRejected`
with a ``reason`` from :data:`REASONS` (the counter names on /diagnostics) and a detail naming the problem.
They run on a thread every robot shares, so they stay cheap whatever arrives. (The ROS messages are unpacked
into these in :mod:`physis_ros.ros.conversions`.)"""

from __future__ import annotations

import cv2
import numpy as np

from physis_ros.serving.tensors import ENCODINGS, InputRejected, checked_rows, finite_in

# Rejection reasons (counter names on /diagnostics).
REASONS = ("encoding", "size", "too_large", "decode", "nonfinite", "missing_joints", "malformed",
           "future_stamp", "stale_stamp", "no_clock", "queue_full", "unpaired")


def check_image_size(n: int, max_bytes: int, what: str) -> None:
    """InputRejected("too_large") if an image message carries ``n`` > ``max_bytes`` bytes: the first check on a
    camera message (cheap: the length only), so that an oversized frame is reported as such even when its
    transport took long enough to make it stale too."""
    if n > max_bytes:
        raise InputRejected("too_large", f"{what} of {n} bytes exceeds image.max_bytes {max_bytes}")


def raw_pixels(data, encoding: str, height: int, width: int, step: int, max_bytes: int | None = None) -> np.ndarray:
    """A raw image as uint8 [h, w, channels] (channels as encoded), a view of ``data`` (no copy); checks the
    encoding, the byte cap (``too_large``, before anything else is done) and the sizes."""
    enc = encoding.lower()
    if enc not in ENCODINGS:
        raise InputRejected("encoding", f"unsupported encoding '{encoding}' (supported: {', '.join(ENCODINGS)})")
    n = len(data)
    h, w, step = int(height), int(width), int(step)
    if max_bytes is not None:
        check_image_size(n, max_bytes, f"{w}x{h} {encoding} image")
    ch = ENCODINGS[enc][0]
    if h == 0 or w == 0:
        raise InputRejected("size", f"empty image {w}x{h}")
    if step < w * ch:
        raise InputRejected("size", f"step {step} < width {w} x {ch} bytes per pixel ({encoding})")
    if n != step * h:
        raise InputRejected("size", f"data has {n} bytes, step x height = {step} x {h} = {step * h}")
    pixels = np.frombuffer(data, dtype=np.uint8)
    return pixels.reshape(h, step)[:, : w * ch].reshape(h, w, ch)


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


def decode_compressed(data, max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """A jpeg/png image as (uint8 [h, w, 3] BGR, "bgr8") or ([h, w, 1], "mono8"), decoded by OpenCV (alpha
    dropped, 16 bit reduced to 8, EXIF orientation ignored). The data's size and the decoded size the header
    announces are checked against ``max_bytes`` before decoding."""
    n = len(data)
    if max_bytes is not None:
        check_image_size(n, max_bytes, "compressed image")
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


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def joint_positions(names, positions, joint_names: list[str], max_joints: int, max_abs: float,
                    dtype: str = "float32") -> np.ndarray:
    """Positions of ``joint_names`` (in that order) from a joint state's ``names`` and ``positions`` (any order,
    extra joints allowed).

    A state listing more than ``max_joints`` names or positions is refused (``too_large``) before it is looked
    at. Positions are checked in the model's precision (``dtype``) and rejected as ``nonfinite`` if it cannot
    represent them (float32: |x| > 3.4e38, float16: |x| > 65504: inf after the cast) or if |x| exceeds
    ``max_abs``: a finite float32 as large as 1e25 still overflows the model's float32 arithmetic (its squares
    and norms) into NaN chunks, and poisons the stream's KV cache for the chunks after.
    """
    cap, limit = max_joints, max_abs
    n_names, n_pos = len(names), len(positions)
    if max(n_names, n_pos) > cap:
        raise InputRejected("too_large", f"joint state with {n_names} names and {n_pos} positions exceeds "
                                         f"max_joints {cap}")
    names = list(names)
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
    pos = np.asarray(positions, dtype=np.float64)
    picked = pos[[index[n] for n in joint_names]]
    with np.errstate(over="ignore", invalid="ignore"):
        out = picked.astype(np.float32)
    ok = finite_in(out, dtype) & (np.abs(picked) <= limit)     # NaN compares False too
    if not ok.all():
        bad = [f"{n}={v!r}" for n, v, good in zip(joint_names, picked.tolist(), ok.tolist()) if not good]
        raise InputRejected("nonfinite", f"position(s) not finite in {dtype} (the model's precision) or beyond "
                                         f"max_abs_position {limit:g}: {', '.join(bad)}")
    return out


def select_rows(rows: np.ndarray, names: list[str], joint_names: list[str], horizon: int, what: str,
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


