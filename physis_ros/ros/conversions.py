"""ROS messages -> model tensors: pure functions, shared by the node and the replay checker. The checks and
decoders behind them take bytes and lists (:mod:`physis_ros.serving.decode`); here the messages are unpacked.

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

import numpy as np
from builtin_interfaces.msg import Duration, Time
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from physis_ros.model.spec import ModelConfig
from physis_ros.msg import ActionChunk
from physis_ros.serving.config import StreamConfig
from physis_ros.serving.decode import (check_image_size, decode_compressed, joint_positions, raw_pixels,
                                       select_rows)
from physis_ros.serving.tensors import InputRejected, check_stamp_s, preprocess


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
def check_image_bytes(msg: Image | CompressedImage, max_bytes: int) -> None:
    """InputRejected("too_large") if the message carries more than ``max_bytes`` of image data (the length
    only); a CompressedImage's decoded size is checked from its header when it is decoded
    (:func:`~physis_ros.serving.decode.decode_compressed`)."""
    what = ("compressed image" if isinstance(msg, CompressedImage)
            else f"{msg.width}x{msg.height} {msg.encoding} image")
    check_image_size(len(msg.data), max_bytes, what)


def image_from_msg(msg: Image | CompressedImage, stream: StreamConfig, model: ModelConfig) -> np.ndarray:
    """The model's ``image`` input from a camera message (InputRejected if it is unusable). Messages
    over ``stream.image.max_bytes`` (raw bytes, or a compressed image's decoded size) are refused before
    any work; the full-size image is never copied or converted to float."""
    channels, size, _ = model.observation_shapes["image"]
    max_bytes = stream.image.max_bytes
    if isinstance(msg, CompressedImage):
        pixels, encoding = decode_compressed(msg.data, max_bytes)
    else:   # a view of the message's buffer
        pixels = raw_pixels(msg.data, msg.encoding, msg.height, msg.width, msg.step, max_bytes)
        encoding = msg.encoding.lower()
    return preprocess(pixels, encoding, size, channels, stream.image.preprocess, stream.image.pad_value)


# ---- joints -------------------------------------------------------------------------------------
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StreamConfig)}


def joints_from_msg(msg: JointState, joint_names: list[str], max_joints: int | None = None,
                    max_abs: float | None = None, dtype: str = "float32") -> np.ndarray:
    """Positions of ``joint_names`` (in that order) from a JointState with any order and extra joints
    (:func:`joint_positions`); the caps default to the StreamConfig defaults (``max_joints``,
    ``max_abs_position``: 1e9, far beyond any joint in radians or metres)."""
    return joint_positions(msg.name, msg.position, joint_names,
                           _DEFAULTS["max_joints"] if max_joints is None else max_joints,
                           _DEFAULTS["max_abs_position"] if max_abs is None else max_abs, dtype)


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
    return select_rows(actions.reshape(rows, dof), names, joint_names, horizon, "ActionChunk", max_abs, dtype)


def actions_from_trajectory(msg: JointTrajectory, joint_names: list[str], horizon: int,
                            max_abs: float = 1e9, dtype: str = "float32") -> np.ndarray:
    """The actions to imagine from a JointTrajectory: the positions of its first ``horizon`` points."""
    names = list(msg.joint_names)
    if any(len(p.positions) != len(names) for p in msg.points):
        raise InputRejected("malformed", f"JointTrajectory points must each hold {len(names)} positions")
    rows = np.array([list(p.positions) for p in msg.points], dtype=np.float64).reshape(len(msg.points), len(names))
    return select_rows(rows, names, joint_names, horizon, "JointTrajectory", max_abs, dtype)


def observation_from_msgs(image_msg: Image | CompressedImage, joint_msg: JointState, stream: StreamConfig,
                          model: ModelConfig) -> dict[str, np.ndarray]:
    """The observation tensors (unbatched float32) one chunk consumes, exactly as the node builds them."""
    return {"image": image_from_msg(image_msg, stream, model),
            "state": joints_from_msg(joint_msg, list(stream.joint_names), stream.max_joints,
                                     stream.max_abs_position, model.dtype)}
