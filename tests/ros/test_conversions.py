"""Message <-> tensor conversions: decoding, preprocessing, joint mapping, rejection, outputs."""

import io
import math

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from sensor_msgs.msg import CompressedImage, Image, JointState

from physis_ros.model.presets import load_model_config
from physis_ros.ros import conversions as conv
from physis_ros.ros.config import serve_config
from physis_ros.telemetry import ChunkRecord

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
    from PIL import Image as PILImage
    assert conv.compressed_decoder_available() is None
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


def test_action_chunk_and_trajectory():
    s = stream(control_rate_hz=50.0, frame_id="base")
    actions = RNG.standard_normal((16, 7)).astype(np.float32)
    stamp = Time(sec=5, nanosec=7)
    msg = conv.action_chunk_msg("r", s, 3, actions, stamp)
    assert (msg.stream, msg.chunk_index, msg.horizon, msg.dof) == ("r", 3, 16, 7)
    assert msg.header.stamp == stamp and msg.header.frame_id == "base"
    assert list(msg.joint_names) == JOINTS and msg.control_period == pytest.approx(0.02)
    np.testing.assert_array_equal(np.frombuffer(msg.actions, np.float32).reshape(16, 7), actions)

    traj = conv.trajectory_msg(s, actions, stamp)
    assert traj.header.stamp == stamp and list(traj.joint_names) == JOINTS and len(traj.points) == 16
    pos = np.array([p.positions for p in traj.points])
    vel = np.array([p.velocities for p in traj.points])
    np.testing.assert_array_equal(pos, actions.astype(np.float64))
    np.testing.assert_array_equal(vel[-1], 0.0)  # ends at rest: joint_trajectory_controller accepts it
    np.testing.assert_allclose(vel[5], (pos[6] - pos[4]) / 0.04)
    times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in traj.points]
    np.testing.assert_allclose(times, 0.02 * np.arange(1, 17))

    builder = conv.TrajectoryBuilder(s, 16)  # reused message: same content as a fresh one
    for _ in range(2):
        again = builder.build(actions, stamp)
    assert again == traj
    emit_start = conv.trajectory_start(stream(trajectory_start="emit", trajectory_start_offset_s=0.1), stamp, 9.0)
    assert conv.stamp_to_sec(emit_start) == pytest.approx(9.1)
    assert conv.trajectory_start(s, stamp, 9.0) == stamp


def test_telemetry_msg():
    rec = ChunkRecord(stream="r", chunk=4, obs_stamp=100.0, enqueue=100.01, emit=100.15, interval_ms=float("nan"),
                      stage_ms=[1.0, 3.0, 2.0], queue_ms=0.5, hops_ms=[0.1], batch_sizes=[1, 2, 1],
                      deadline_miss=True)
    msg = conv.telemetry_msg(rec)
    assert msg.stream == "r" and msg.chunk_index == 4 and msg.deadline_miss
    assert msg.output_interval_ms == 0.0  # first chunk: no interval
    assert msg.response_latency_ms == pytest.approx(150.0) and msg.observation_age_ms == pytest.approx(10.0)
    assert (msg.stage_compute_ms_min, msg.stage_compute_ms_max, msg.stage_compute_ms_sum) == (1.0, 3.0, 6.0)
    assert list(msg.batch_sizes) == [1, 2, 1] and msg.header.stamp == msg.emit_stamp
    assert conv.stamp_to_sec(msg.emit_stamp) == pytest.approx(100.15)
    assert msg.handover_stamp == msg.emit_stamp  # no handover time given
    assert conv.stamp_to_sec(conv.telemetry_msg(rec, handover=100.1503).handover_stamp) == pytest.approx(100.1503)
