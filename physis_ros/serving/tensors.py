"""Observations as a model takes them, from plain arrays: camera pixels resampled to the model's size
(:func:`preprocess`, the exact area average of the 8-bit image), joint rows checked in the model's
precision (:func:`finite_in`, :func:`checked_rows`). Anything unusable raises :class:`InputRejected`
with a short ``reason`` (the counter a front end reports) and a ``detail`` naming the problem. Pure
functions, shared by the Server API and the ROS messages' conversion (:mod:`physis_ros.ros.conversions`).
"""

from __future__ import annotations

import cv2
import numpy as np

# encoding -> (channels in the message, indices of R, G, B; None for mono)
ENCODINGS: dict[str, tuple[int, tuple[int, int, int] | None]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, None),
}
LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, applied in float64


class InputRejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_stamp_s(sec: float, now: float, max_future_s: float, max_age_s: float) -> float:
    """``sec`` (an observation's stamp, seconds) if it is plausible against the server clock ``now``; else
    InputRejected (``future_stamp`` more than ``max_future_s`` ahead, ``stale_stamp`` more than ``max_age_s``
    old where that is positive, ``no_clock`` while the clock reads 0)."""
    if now <= 0.0:
        raise InputRejected("no_clock", "the node clock is not running yet (use_sim_time without /clock)")
    if sec - now > max_future_s:
        raise InputRejected("future_stamp", f"stamp {sec:.3f} is {sec - now:.3f} s ahead of the node clock "
                                            f"(limit {max_future_s} s)")
    if max_age_s > 0 and now - sec > max_age_s:
        raise InputRejected("stale_stamp", f"stamp {sec:.3f} is {now - sec:.3f} s old (limit {max_age_s} s)")
    return sec


def _cell_edges(n_plane: int, size: int, offset: int, n_image: int):
    """Output cell i spans [i * n_plane / size, (i + 1) * n_plane / size) of the plane, in which the image
    occupies [offset, offset + n_image). Returns, per edge (size + 1), the edge in image coordinates
    clipped to the image, as an integer part and a fraction (exact rational arithmetic), and per cell the
    length of image it covers (the rest is padding)."""
    num = np.arange(size + 1, dtype=np.int64) * n_plane
    whole = num // size - offset
    frac = (num % size).astype(np.float64) / size
    before, after = whole < 0, whole >= n_image
    whole = np.clip(whole, 0, n_image)
    frac[before | after] = 0.0
    covered = np.diff(whole + frac)
    return whole, frac, covered


def area_average(pixels: np.ndarray, size: int, plane: tuple[int, int] | None = None,
                 offset: tuple[int, int] = (0, 0), pad: float = 0.0) -> np.ndarray:
    """The exact area average (box filter over each output cell, fractional pixels weighted by their
    overlap) of uint8 [h, w, ch] onto [size, size, ch], float64 in pixel units (0..255).

    ``plane`` (height, width) is the area being resampled, with the image at ``offset`` in it and ``pad``
    (pixel units) elsewhere: padding is accounted for analytically, never materialized. Rows are summed
    by ``cv2.reduce`` in int32 (exact, SIMD, GIL released) over bands of whole rows straight from the
    message buffer; only [size, w * ch] of float64 is ever allocated, so nothing image-sized is copied
    or converted. Deterministic to the bit: integer sums and a fixed sequence of float64 operations.
    """
    h, w, ch = pixels.shape
    ph, pw = plane if plane is not None else (h, w)
    rows = pixels.reshape(h, w * ch)                        # a view, also for padded or cropped rows
    yi, yf, ycov = _cell_edges(ph, size, offset[0], h)
    band = np.zeros((size, w * ch), dtype=np.float64)       # the only allocation of image width
    for i in range(size):
        if yi[i + 1] > yi[i]:                               # whole rows [yi[i], yi[i+1]): exact int32 sum
            band[i] = cv2.reduce(rows[yi[i]:yi[i + 1]], 0, cv2.REDUCE_SUM, dtype=cv2.CV_32S)[0]
        if yf[i + 1]:                                       # the cell ends inside row yi[i+1]
            band[i] += yf[i + 1] * rows[yi[i + 1]]
        if yf[i]:                                           # ... and starts inside row yi[i]
            band[i] -= yf[i] * rows[yi[i]]
    if pad:
        band += (ph / size - ycov)[:, None] * pad
    band /= ph / size                                       # [size, w * ch]: row averages per column
    cols = band.reshape(size, w, ch)
    xi, xf, xcov = _cell_edges(pw, size, offset[1], w)
    partial = cols[:, np.minimum(xi, w - 1)] * xf[None, :, None]  # [size, size + 1, ch]
    np.cumsum(cols, axis=1, out=cols)                       # in place: cols[:, x] = sum of columns <= x
    before = np.where(xi > 0, xi - 1, 0)
    at = np.where((xi > 0)[None, :, None], cols[:, before], 0.0) + partial    # integral up to each edge
    out = at[:, 1:] - at[:, :-1]
    if pad:
        out += (pw / size - xcov)[None, :, None] * pad
    out /= pw / size
    return out


def preprocess(pixels: np.ndarray, encoding: str | None, size: int, channels: int, mode: str,
               pad_value: float = 0.0) -> np.ndarray:
    """uint8 [h, w, ch] -> float32 [channels, size, size] in [0, 1].

    ``encoding`` names the channel order (rgb8, bgr8, rgba8, bgra8, mono8; None: RGB or mono by
    channel count). ``mode``: resize (stretch), center_crop (central square, then resize) or pad
    (pad the short side to a square with ``pad_value``, then resize). Resampling is the exact area
    average (:func:`area_average`) of the 8-bit image; channels are picked, and grayscale models get
    luma, on the small result (both are linear, so the order does not matter).
    """
    if mode not in ("resize", "center_crop", "pad"):
        raise ValueError(f"unknown preprocess mode {mode!r}")
    h, w, ch = pixels.shape
    order = ENCODINGS[encoding][1] if encoding is not None else ((0, 1, 2) if ch >= 3 else None)
    if mode == "resize" or h == w:
        avg = area_average(pixels, size)
    elif mode == "center_crop":
        m = min(h, w)
        y0, x0 = (h - m) // 2, (w - m) // 2
        avg = area_average(pixels[y0:y0 + m, x0:x0 + m], size)
    else:                                                   # pad
        m = max(h, w)
        avg = area_average(pixels, size, (m, m), ((m - h) // 2, (m - w) // 2), float(pad_value) * 255.0)
    if order is None:
        gray = avg[:, :, 0]
        chw = np.stack([gray] * 3) if channels == 3 else gray[None]
    elif channels == 3:
        chw = np.stack([avg[:, :, i] for i in order])
    else:
        r, g, b = (avg[:, :, i] for i in order)
        chw = (LUMA[0] * r + LUMA[1] * g + LUMA[2] * b)[None]
    chw = chw / 255.0
    np.clip(chw, 0.0, 1.0, out=chw)  # (float64 rounding could step past 1 by an ulp)
    return np.ascontiguousarray(chw, dtype=np.float32)


# bfloat16 (which numpy lacks) rounds a float32 to inf at and beyond the midpoint past its largest value
BF16_OVERFLOW = float.fromhex("0x1.ffp+127")     # (2 - 2**-8) * 2**127 = 3.396e38


def finite_in(f32: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Which of ``f32`` (the observation tensor's float32 values) stay finite when the model casts them to
    ``dtype`` (float32, float16 or bfloat16). 1e5 is finite in float32 but inf in float16 (largest 65504)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "float16":
            return np.isfinite(f32.astype(np.float16))
        if dtype == "bfloat16":
            return np.isfinite(f32) & (np.abs(f32) < BF16_OVERFLOW)
        return np.isfinite(f32)


def checked_rows(rows: np.ndarray, what: str, max_abs: float, dtype: str = "float32") -> np.ndarray:
    """Rows (as float32) checked in the model's precision, as a joint state's positions are checked."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(rows, dtype=np.float64).astype(np.float32)
    if not finite_in(out, dtype).all() or np.abs(out).max(initial=0.0) > max_abs:
        raise InputRejected("nonfinite", f"{what} holds values {dtype} (the model's precision) cannot represent "
                                         f"or beyond {max_abs:g}")
    return out
