"""Message -> tensor conversions: decoding, preprocessing, joint mapping, rejection."""

import array
import dataclasses
import io
import math
import statistics
import time
import tracemalloc

import cv2
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from sensor_msgs.msg import CompressedImage, Image, JointState

from physis_ros.model.spec import load_model_config
from physis_ros.ros import conversions as conv
from physis_ros.serving.config import serve_config
from physis_ros.serving.decode import REASONS, compressed_header

JOINTS = [f"joint{i}" for i in range(1, 8)]
MODEL = load_model_config("tiny-wam")


def stream(**kw):
    return serve_config({"streams": {"r": {"joint_names": JOINTS, **kw}}}).streams["r"]


def image_msg(pixels: np.ndarray, encoding: str, pad: int = 0) -> Image:
    h, w = pixels.shape[:2]
    ch = 1 if pixels.ndim == 2 else pixels.shape[2]
    rows = pixels.reshape(h, w * ch)
    if pad:
        rows = np.concatenate([rows, np.zeros((h, pad), np.uint8)], axis=1)
    return Image(height=h, width=w, encoding=encoding, step=w * ch + pad, data=rows.tobytes())


def joint_msg(names, positions) -> JointState:
    return JointState(name=list(names), position=[float(p) for p in positions])


RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)


def test_rgb_bgr_mono_and_row_padding():
    s = stream(image={"preprocess": "resize"})
    ref = np.transpose(RGB, (2, 0, 1)).astype(np.float32) / 255.0
    got = conv.image_from_msg(image_msg(RGB, "rgb8"), s, MODEL)
    assert got.dtype == np.float32 and got.shape == (3, 32, 32)
    np.testing.assert_allclose(got, ref, atol=1e-7)
    np.testing.assert_array_equal(conv.image_from_msg(image_msg(RGB[:, :, ::-1].copy(), "bgr8"), s, MODEL), got)
    np.testing.assert_array_equal(conv.image_from_msg(image_msg(RGB, "rgb8", pad=5), s, MODEL), got)
    rgba = np.concatenate([RGB, np.full((32, 32, 1), 7, np.uint8)], axis=2)
    np.testing.assert_array_equal(conv.image_from_msg(image_msg(rgba, "rgba8"), s, MODEL), got)
    mono = conv.image_from_msg(image_msg(RGB[:, :, 0].copy(), "mono8"), s, MODEL)
    assert mono.shape == (3, 32, 32)
    np.testing.assert_array_equal(mono[0], mono[2])


@pytest.mark.parametrize("h, w", [(48, 64), (480, 640), (20, 16), (32, 32)])
@pytest.mark.parametrize("mode", ["resize", "center_crop", "pad"])
def test_any_resolution_becomes_model_size(h, w, mode):
    px = RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = conv.image_from_msg(image_msg(px, "rgb8"), stream(image={"preprocess": mode}), MODEL)
    assert out.shape == (3, 32, 32) and out.dtype == np.float32
    assert 0.0 <= out.min() and out.max() <= 1.0
    again = conv.image_from_msg(image_msg(px, "rgb8"), stream(image={"preprocess": mode}), MODEL)
    np.testing.assert_array_equal(out, again)  # deterministic


def test_center_crop_and_pad_geometry():
    # A 32x64 image: left half black, right half white.
    px = np.zeros((32, 64, 3), np.uint8)
    px[:, 32:] = 255
    crop = conv.image_from_msg(image_msg(px, "rgb8"), stream(image={"preprocess": "center_crop"}), MODEL)
    np.testing.assert_array_equal(crop[:, :, :16], 0.0)   # the central 32x32 square, unresized
    np.testing.assert_array_equal(crop[:, :, 16:], 1.0)
    pad = conv.image_from_msg(image_msg(px, "rgb8"),
                              stream(image={"preprocess": "pad", "pad_value": 0.5}), MODEL)
    assert np.allclose(pad[:, 0, :], 0.5, atol=0.02) and np.allclose(pad[:, -1, :], 0.5, atol=0.02)
    assert pad[:, 16, 31] == pytest.approx(1.0) and pad[:, 16, 0] == pytest.approx(0.0)
    uniform = np.full((480, 640, 3), 200, np.uint8)
    out = conv.image_from_msg(image_msg(uniform, "rgb8"), stream(image={"preprocess": "resize"}), MODEL)
    np.testing.assert_allclose(out, 200 / 255, rtol=1e-6)  # the filter's weights sum to one


@pytest.mark.parametrize("make, reason", [
    (lambda: Image(height=4, width=4, encoding="yuv422", step=8, data=bytes(32)), "encoding"),
    (lambda: Image(height=4, width=4, encoding="16UC1", step=8, data=bytes(32)), "encoding"),
    (lambda: Image(height=4, width=4, encoding="rgb8", step=12, data=bytes(47)), "size"),
    (lambda: Image(height=4, width=4, encoding="rgb8", step=10, data=bytes(40)), "size"),
    (lambda: Image(height=0, width=4, encoding="rgb8", step=12, data=b""), "size"),
])
def test_bad_images_rejected(make, reason):
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(make(), stream(), MODEL)
    assert err.value.reason == reason and err.value.detail


def test_compressed_png_matches_raw_and_corrupt_is_rejected():
    # a png from another encoder than the decoder's (Pillow is optional: only matplotlib brings it)
    PILImage = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    PILImage.fromarray(RGB).save(buf, format="PNG")
    msg = CompressedImage(format="png", data=buf.getvalue())
    np.testing.assert_array_equal(conv.image_from_msg(msg, stream(), MODEL),
                                  conv.image_from_msg(image_msg(RGB, "rgb8"), stream(), MODEL))
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(CompressedImage(format="jpeg", data=b"not a jpeg"), stream(), MODEL)
    assert err.value.reason == "decode"


def test_joints_by_name_with_extras_and_any_order():
    names = ["gripper"] + JOINTS[::-1]
    pos = [0.04] + [float(i) for i in range(7, 0, -1)]
    out = conv.joints_from_msg(joint_msg(names, pos), JOINTS)
    np.testing.assert_array_equal(out, np.arange(1, 8, dtype=np.float32))
    assert out.dtype == np.float32


@pytest.mark.parametrize("names, pos, reason", [
    (JOINTS[:6], range(6), "missing_joints"),
    (JOINTS, [0, 0, math.nan, 0, 0, 0, 0], "nonfinite"),
    (JOINTS, [0, 0, 0, math.inf, 0, 0, 0], "nonfinite"),
    (JOINTS, range(6), "malformed"),
    (JOINTS + ["joint1"], range(8), "malformed"),
    ([], [], "missing_joints"),
])
def test_bad_joint_states_rejected(names, pos, reason):
    with pytest.raises(conv.InputRejected) as err:
        conv.joints_from_msg(joint_msg(names, pos), JOINTS)
    assert err.value.reason == reason


def test_nan_in_an_unused_joint_is_fine():
    out = conv.joints_from_msg(joint_msg(JOINTS + ["gripper"], list(range(7)) + [math.nan]), JOINTS)
    assert np.isfinite(out).all()


def test_stamp_checks():
    now = 1000.0
    assert conv.check_stamp(conv.time_msg(999.9), now, 0.5, 1.0) == pytest.approx(999.9)
    for stamp, reason in ((1001.0, "future_stamp"), (998.0, "stale_stamp")):
        with pytest.raises(conv.InputRejected) as err:
            conv.check_stamp(conv.time_msg(stamp), now, 0.5, 1.0)
        assert err.value.reason == reason
    assert conv.check_stamp(conv.time_msg(10.0), now, 0.5, 0.0) == 10.0  # max_age 0: off
    with pytest.raises(conv.InputRejected) as err:
        conv.check_stamp(conv.time_msg(0.0), 0.0, 0.5, 1.0)
    assert err.value.reason == "no_clock"


def test_time_conversions_exact():
    t = Time(sec=1_700_000_123, nanosec=456_789_012)
    assert conv.stamp_ns(t) == 1_700_000_123_456_789_012
    back = conv.time_msg(conv.stamp_to_sec(t))
    assert back.sec == t.sec and abs(back.nanosec - t.nanosec) < 1000
    d = conv.duration_msg(0.02 * 16)
    assert (d.sec, d.nanosec) == (0, 320_000_000)


def test_observation_from_msgs():
    obs = conv.observation_from_msgs(image_msg(RGB, "rgb8"), joint_msg(JOINTS, range(7)), stream(), MODEL)
    assert set(obs) == set(MODEL.observation_shapes)
    for name, shape in MODEL.observation_shapes.items():
        assert obs[name].shape == shape and obs[name].dtype == np.float32


# ---- heavy inputs (issue 12): cost, caps, float32 finiteness ------------------------------------
MONO_MODEL = dataclasses.replace(MODEL, wam=dataclasses.replace(MODEL.wam, image_channels=1))
LUMA = np.array([0.299, 0.587, 0.114])


def _box_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in]: the share of source pixel x in output cell i (exact overlap of the two intervals)."""
    edges = np.arange(n_out + 1) * (n_in / n_out)
    lo, hi = edges[:-1, None], edges[1:, None]
    x = np.arange(n_in)[None, :]
    return np.clip(np.minimum(hi, x + 1) - np.maximum(lo, x), 0.0, None) / (n_in / n_out)


def area_reference(px: np.ndarray, size: int, mode: str, pad_value: float = 0.0) -> np.ndarray:
    """The exact area average (float64, [ch, size, size], in [0, 1]) of the cropped or padded image,
    computed the slow obvious way: build the plane, multiply by overlap weights."""
    plane = px.astype(np.float64) / 255.0
    h, w = plane.shape[:2]
    if mode == "center_crop" and h != w:
        m = min(h, w)
        y0, x0 = (h - m) // 2, (w - m) // 2
        plane = plane[y0:y0 + m, x0:x0 + m]
    elif mode == "pad" and h != w:
        m = max(h, w)
        y0, x0 = (m - h) // 2, (m - w) // 2
        padded = np.full((m, m, plane.shape[2]), pad_value)
        padded[y0:y0 + h, x0:x0 + w] = plane
        plane = padded
    wy, wx = _box_weights(plane.shape[0], size), _box_weights(plane.shape[1], size)
    rows = np.tensordot(wy, plane, axes=(1, 0))                       # [size, w, ch]
    return np.einsum("ywc,xw->cyx", rows, wx, optimize=True)


@pytest.mark.parametrize("h, w", [(480, 640), (37, 53), (20, 16), (1080, 1920), (33, 31), (5, 200)])
@pytest.mark.parametrize("mode", ["resize", "center_crop", "pad"])
def test_preprocess_is_the_area_average(h, w, mode):
    px = RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
    s = stream(image={"preprocess": mode, "pad_value": 0.25})
    out = conv.image_from_msg(image_msg(px, "rgb8"), s, MODEL)
    ref = area_reference(px, 32, mode, 0.25)
    assert out.dtype == np.float32 and out.shape == (3, 32, 32)
    assert 0.0 <= out.min() and out.max() <= 1.0
    np.testing.assert_allclose(out, ref, atol=1e-6)  # no 8-bit rounding of the averages
    # every channel order and a padded row step give the same tensor, bit for bit
    for enc, arr in (("bgr8", px[:, :, ::-1]), ("rgba8", np.dstack([px, np.full((h, w), 9, np.uint8)])),
                     ("bgra8", np.dstack([px[:, :, ::-1], np.zeros((h, w), np.uint8)]))):
        np.testing.assert_array_equal(conv.image_from_msg(image_msg(np.ascontiguousarray(arr), enc, pad=3),
                                                          s, MODEL), out)


def test_grayscale_model_and_mono_images():
    s = stream(image={"preprocess": "resize"})
    px = RNG.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    gray = conv.image_from_msg(image_msg(px, "rgb8"), s, MONO_MODEL)
    assert gray.shape == (1, 32, 32) and gray.dtype == np.float32
    ref = np.tensordot(LUMA, area_reference(px, 32, "resize"), axes=1)
    np.testing.assert_allclose(gray[0], ref, atol=1e-6)
    np.testing.assert_array_equal(conv.image_from_msg(image_msg(px[:, :, ::-1].copy(), "bgr8"), s, MONO_MODEL), gray)
    mono = px[:, :, 1].copy()
    one = conv.image_from_msg(image_msg(mono, "mono8"), s, MONO_MODEL)
    np.testing.assert_allclose(one[0], area_reference(mono[:, :, None], 32, "resize")[0], atol=1e-6)
    three = conv.image_from_msg(image_msg(mono, "mono8"), s, MODEL)
    assert three.shape == (3, 32, 32) and all(np.array_equal(three[0], three[c]) for c in (1, 2))
    np.testing.assert_array_equal(three[0], one[0])


def _cpu_ms(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1e3)
    return statistics.median(times)


@pytest.mark.parametrize("mode", ["resize", "center_crop", "pad"])
def test_a_1080p_frame_is_cheap_in_time_and_memory(mode):
    """Issue 12: a 1080p frame cost 35-260 ms of the executor thread and ~100 MB of float copies."""
    px = RNG.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    msg, s = image_msg(px, "rgb8"), stream(image={"preprocess": mode})
    conv.image_from_msg(msg, s, MODEL)  # warm
    tracemalloc.start()
    try:
        conv.image_from_msg(msg, s, MODEL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < px.nbytes // 3, f"peak {peak / 1e6:.1f} MB of numpy allocations for a {px.nbytes / 1e6:.1f} MB image"
    cpu = _cpu_ms(lambda: conv.image_from_msg(msg, s, MODEL))
    assert cpu < 15.0, f"{mode}: {cpu:.1f} ms of CPU per 1080p frame"   # ~1 ms here; generous for a loaded VM


def test_deterministic_across_opencv_thread_counts():
    px = RNG.integers(0, 256, (1080, 1920, 4), dtype=np.uint8)
    s = stream(image={"preprocess": "pad", "pad_value": 0.3})
    threads = cv2.getNumThreads()
    try:
        outs = []
        for n in (1, 2, 4):
            cv2.setNumThreads(n)
            outs.append(conv.image_from_msg(image_msg(px, "bgra8"), s, MODEL))
    finally:
        cv2.setNumThreads(threads)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_image_byte_cap():
    s = stream(image={"max_bytes": 1000})
    ok = RNG.integers(0, 256, (18, 18, 3), dtype=np.uint8)    # 972 bytes
    conv.image_from_msg(image_msg(ok, "rgb8"), s, MODEL)
    big = RNG.integers(0, 256, (19, 19, 3), dtype=np.uint8)   # 1083 bytes
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(image_msg(big, "rgb8"), s, MODEL)
    assert err.value.reason == "too_large" and "1083" in err.value.detail and "1000" in err.value.detail
    assert "too_large" in REASONS


def test_default_caps_take_4k_and_refuse_8k_cheaply():
    s = stream()
    assert s.image.max_bytes >= 3840 * 2160 * 4          # 4K rgba8/bgra8 fits
    assert s.image.max_bytes < 7680 * 4320 * 3           # 8K rgb8 does not
    assert 7 <= s.max_joints < 100_000
    big = Image(height=4320, width=7680, encoding="rgb8", step=7680 * 3)
    big.data = bytes(7680 * 4320 * 3)                        # ~100 MB
    t0 = time.thread_time()
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(big, s, MODEL)
    assert err.value.reason == "too_large"
    assert time.thread_time() - t0 < 0.01   # rejected before any work on the pixels


def test_joint_count_cap():
    names = JOINTS + [f"extra{i}" for i in range(40)]
    msg = joint_msg(names, range(len(names)))
    np.testing.assert_array_equal(conv.joints_from_msg(msg, JOINTS, max_joints=47), np.arange(7, dtype=np.float32))
    with pytest.raises(conv.InputRejected) as err:
        conv.joints_from_msg(msg, JOINTS, max_joints=46)
    assert err.value.reason == "too_large" and "47" in err.value.detail
    huge = JointState(name=[f"j{i}" for i in range(100_000)])   # names only: rejected before pairing
    with pytest.raises(conv.InputRejected) as err:
        conv.joints_from_msg(huge, JOINTS)
    assert err.value.reason == "too_large"
    obs_stream = stream(max_joints=8)
    with pytest.raises(conv.InputRejected) as err:
        conv.observation_from_msgs(image_msg(RGB, "rgb8"), msg, obs_stream, MODEL)
    assert err.value.reason == "too_large"


@pytest.mark.parametrize("value", [-1e39, 3.5e38, float(np.finfo(np.float32).max) * 1.0000001, math.nan])
def test_joint_positions_are_checked_in_float32(value):
    """Finite in float64 but inf once cast to float32, the model's precision (even with no magnitude bound)."""
    pos = [0.0] * 7
    pos[3] = value
    with pytest.raises(conv.InputRejected) as err:
        conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS, max_abs=math.inf)
    assert err.value.reason == "nonfinite" and "joint4" in err.value.detail


def test_huge_joint_positions_are_rejected():
    """Issue 12: 1e30 passed, and the model's float32 arithmetic turned it into NaN chunks (1e30 itself
    is a finite float32: its square is not)."""
    pos = [0.0, 0.0, 0.0, 1e30, 0.0, 0.0, 0.0]
    with pytest.raises(conv.InputRejected) as err:
        conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS)
    assert err.value.reason == "nonfinite" and "joint4=1e+30" in err.value.detail
    assert stream().max_abs_position == 1e9
    pos[3] = -1e9
    assert conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS)[3] == -1e9
    pos[3] = 1.000001e9
    with pytest.raises(conv.InputRejected):
        conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS)
    assert conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS, max_abs=1e10)[3] == np.float32(1.000001e9)
    with pytest.raises(conv.InputRejected) as err:
        conv.observation_from_msgs(image_msg(RGB, "rgb8"), joint_msg(JOINTS, pos), stream(max_abs_position=10.0),
                                   MODEL)
    assert err.value.reason == "nonfinite"


def test_large_but_representable_positions_pass_without_a_bound():
    big = float(np.finfo(np.float32).max)
    out = conv.joints_from_msg(joint_msg(JOINTS, [big, -big, 1e38, 1e-50, -0.0, 5.0, 1e6]), JOINTS, max_abs=math.inf)
    assert np.isfinite(out).all() and out[0] == np.finfo(np.float32).max and out[3] == 0.0


def test_inputs_are_checked_in_the_precision_the_model_uses():
    """Issue 12: inputs must be checked "in the precision the model uses", and a model may run in float16:
    1e5 is finite in float32 (so it passed) but inf once the float16 model casts it."""
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from physis_ros.ros import acceptance

    half = dataclasses.replace(MODEL, dtype="float16")
    pos = [0.0, 0.0, 0.0, 1e5, 0.0, 0.0, 0.0]
    assert conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS)[3] == 1e5            # fine for float32
    assert acceptance.accept_joints(joint_msg(JOINTS, pos), stream(), model=MODEL)[3] == 1e5
    for reject in (lambda: conv.joints_from_msg(joint_msg(JOINTS, pos), JOINTS, dtype="float16"),
                   lambda: acceptance.accept_joints(joint_msg(JOINTS, pos), stream(), model=half),
                   lambda: conv.observation_from_msgs(image_msg(RGB, "rgb8"), joint_msg(JOINTS, pos), stream(), half)):
        with pytest.raises(conv.InputRejected) as err:
            reject()
        assert err.value.reason == "nonfinite" and "joint4=100000.0" in err.value.detail
        assert "float16" in err.value.detail
    pos[3] = 65504.0                                                                  # float16's largest: kept
    assert acceptance.accept_joints(joint_msg(JOINTS, pos), stream(), model=half)[3] == 65504.0
    # a world model's actions input, the same rule
    acwm = dataclasses.replace(load_model_config("tiny-acwm"), dtype="float16")
    rows = [[0.0] * 7 for _ in range(8)]
    rows[2][5] = 7e4
    traj = JointTrajectory(joint_names=JOINTS, points=[JointTrajectoryPoint(positions=r) for r in rows])
    assert acceptance.accept_actions(traj, stream(), dataclasses.replace(acwm, dtype="float32"))[2, 5] == 7e4
    with pytest.raises(conv.InputRejected, match="float16") as err:
        acceptance.accept_actions(traj, stream(), acwm)
    assert err.value.reason == "nonfinite"
    # bfloat16 keeps float32's range (numpy has no bfloat16: the rounding bound is checked)
    big = [0.0] * 7
    big[0] = 3.39e38
    assert conv.joints_from_msg(joint_msg(JOINTS, big), JOINTS, max_abs=math.inf, dtype="bfloat16")[0] > 3e38
    big[0] = 3.3962e38
    with pytest.raises(conv.InputRejected):
        conv.joints_from_msg(joint_msg(JOINTS, big), JOINTS, max_abs=math.inf, dtype="bfloat16")


def _encode(px: np.ndarray, ext: str, *params) -> CompressedImage:
    bgr = px[:, :, ::-1] if px.ndim == 3 and px.shape[2] == 3 else px
    if px.ndim == 3 and px.shape[2] == 4:
        bgr = px[:, :, [2, 1, 0, 3]]
    ok, buf = cv2.imencode(ext, np.ascontiguousarray(bgr), list(params))
    assert ok
    return CompressedImage(format=ext.lstrip("."), data=buf.tobytes())


def test_compressed_encodings():
    s = stream(image={"preprocess": "pad"})
    px = RNG.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    raw = conv.image_from_msg(image_msg(px, "rgb8"), s, MODEL)
    np.testing.assert_array_equal(conv.image_from_msg(_encode(px, ".png"), s, MODEL), raw)  # lossless
    smooth = cv2.GaussianBlur(px, (0, 0), 3)
    jpeg = conv.image_from_msg(_encode(smooth, ".jpg", cv2.IMWRITE_JPEG_QUALITY, 95), s, MODEL)
    np.testing.assert_allclose(jpeg, conv.image_from_msg(image_msg(smooth, "rgb8"), s, MODEL), atol=0.03)
    # grayscale png -> mono; rgba png -> alpha dropped; 16-bit png -> 8 bit
    gray = px[:, :, 0].copy()
    np.testing.assert_array_equal(conv.image_from_msg(_encode(gray, ".png"), s, MODEL),
                                  conv.image_from_msg(image_msg(gray, "mono8"), s, MODEL))
    rgba = np.dstack([px, np.full(px.shape[:2], 3, np.uint8)])
    np.testing.assert_array_equal(conv.image_from_msg(_encode(rgba, ".png"), s, MODEL), raw)
    wide = px.astype(np.uint16) * 257
    np.testing.assert_array_equal(conv.image_from_msg(_encode(wide, ".png"), s, MODEL), raw)


def test_compressed_caps_and_garbage():
    s = stream(image={"max_bytes": 16_000})
    px = RNG.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    flat = _encode(np.zeros_like(px), ".png")                      # ~100 bytes, 16200 decoded
    assert len(flat.data) < 1000
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(flat, s, MODEL)                        # decoded size over the cap
    assert err.value.reason == "too_large" and "90x60" in err.value.detail
    conv.image_from_msg(_encode(np.zeros_like(px[:, :88]), ".png"), s, MODEL)   # 15840: fits
    # a png header that claims 100000 x 100000 (a decompression bomb) is refused before decoding
    head = bytearray(_encode(px[:2, :2], ".png").data)
    head[16:24] = (100_000).to_bytes(4, "big") * 2
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(CompressedImage(format="png", data=bytes(head)), stream(), MODEL)
    assert err.value.reason == "too_large"
    # a jpeg header likewise (SOF0 carries height and width)
    jpg = bytearray(_encode(px, ".jpg").data)
    sof = jpg.find(b"\xff\xc0")
    jpg[sof + 5:sof + 9] = (60_000).to_bytes(2, "big") * 2
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(CompressedImage(format="jpeg", data=bytes(jpg)), stream(), MODEL)
    assert err.value.reason == "too_large"
    with pytest.raises(conv.InputRejected) as err:
        conv.image_from_msg(CompressedImage(format="png", data=bytes(20_000)), s, MODEL)  # the bytes themselves
    assert err.value.reason == "too_large"
    for data in (b"", b"\x89PNG\r\n\x1a\n" + bytes(30), b"\xff\xd8\xff\xe0garbage", b"BM" + bytes(60),
                 _encode(px, ".png").data[:200]):
        with pytest.raises(conv.InputRejected) as err:
            conv.image_from_msg(CompressedImage(format="png", data=data), stream(), MODEL)
        assert err.value.reason == "decode", data[:10]


def test_jpeg_size_found_behind_long_metadata_segments():
    """EXIF / ICC segments (64 KB each, possibly several) come before the frame header."""
    px = RNG.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    jpg = bytes(_encode(px, ".jpg").data)
    app = b"\xff\xe2" + (65535).to_bytes(2, "big") + bytes(65533)        # an APP2 segment of 64 KB
    padded = jpg[:2] + app * 3 + jpg[2:]
    assert compressed_header(padded) == ("jpeg", 50, 40, 3)
    assert compressed_header(array.array("B", padded)) == ("jpeg", 50, 40, 3)   # as rclpy hands it
    np.testing.assert_array_equal(conv.image_from_msg(CompressedImage(format="jpeg", data=padded), stream(), MODEL),
                                  conv.image_from_msg(CompressedImage(format="jpeg", data=jpg), stream(), MODEL))
    gray = _encode(px[:, :, 0].copy(), ".jpg").data
    assert compressed_header(gray) == ("jpeg", 50, 40, 1)


def test_corrupt_compressed_images_do_not_log(capfd):
    px = RNG.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    with pytest.raises(conv.InputRejected):
        conv.image_from_msg(CompressedImage(format="png", data=_encode(px, ".png").data[:100]), stream(), MODEL)
    assert "WARN" not in capfd.readouterr().err


def test_unknown_mode_is_an_error_even_for_square_images():
    for px in (RGB, RGB[:, :20]):
        with pytest.raises(ValueError):
            conv.preprocess(px, "rgb8", 32, 3, "stretch")
