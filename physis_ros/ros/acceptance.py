"""The server's acceptance rule for input messages, in one place.

The node (``RosStream.on_image`` / ``on_joints``) and the replay checker
(``physis-bag check``, :mod:`physis_ros.bags.analysis`) must agree on which
camera frames and joint states the server uses: the checker predicts the chunks
from the bag, so an input the node rejects must not be expected to produce a
chunk, and its reason must match the node's counter on ``/diagnostics`` and in
``physis-serve --summary-json``.

Each function returns the model tensor the node would store, or raises
:class:`~physis_ros.ros.conversions.InputRejected` with the node's reason. The
stamp check (:func:`~physis_ros.ros.conversions.check_stamp`) runs first when
``now`` (the node clock, seconds) is given, as in the node; the checker passes
``now=None`` because a replay restamps to the wall clock (or drives the node
clock from the bag), so the stamp verdict is the server's alone.
"""

from __future__ import annotations

import numpy as np
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from physis_ros.model.spec import ModelConfig
from physis_ros.msg import ActionChunk
from physis_ros.ros import conversions as conv
from physis_ros.serving.config import StreamConfig

InputRejected = conv.InputRejected


def accept_image(msg: Image | CompressedImage, stream: StreamConfig, model: ModelConfig,
                 now: float | None = None) -> np.ndarray:
    """The model's ``image`` input from a camera message, exactly as the node accepts it. The size cap
    comes first, so that an oversized frame counts as too large even when its transport made it stale."""
    conv.check_image_bytes(msg, stream.image.max_bytes)
    if now is not None:
        conv.check_stamp(msg.header.stamp, now, stream.max_future_s, stream.max_age_s)
    return conv.image_from_msg(msg, stream, model)


def accept_joints(msg: JointState, stream: StreamConfig, now: float | None = None,
                  model: ModelConfig | None = None) -> np.ndarray:
    """The model's ``state`` input from a joint state, exactly as the node accepts it (checked in the
    precision of ``model``: float32 if not given)."""
    if now is not None:
        conv.check_stamp(msg.header.stamp, now, stream.max_future_s, stream.max_age_s)
    return conv.joints_from_msg(msg, list(stream.joint_names), stream.max_joints, stream.max_abs_position,
                                model.dtype if model is not None else "float32")


def accept_actions(msg: ActionChunk | JointTrajectory, stream: StreamConfig, model: ModelConfig) -> np.ndarray:
    """A world model's ``actions`` input: the first steps of an ActionChunk or JointTrajectory, columns
    mapped by the stream's joint names. (No stamp check: actions are a command to imagine, stamped with
    whatever observation the policy acted on, not a sensor reading.)"""
    horizon = model.observation_shapes["actions"][0]
    names = list(stream.joint_names)
    if isinstance(msg, JointTrajectory):
        return conv.actions_from_trajectory(msg, names, horizon, stream.max_abs_position, model.dtype)
    return conv.actions_from_chunk(msg, names, horizon, stream.max_abs_position, model.dtype)
