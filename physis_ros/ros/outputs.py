"""Model outputs -> ROS messages: pure functions, the definition of what the node publishes.

A world-action model's chunk becomes an ActionChunk (every row, with where it lands on the stream's
control timeline, :meth:`physis_ros.timeline.ControlTimeline.land`) and a JointTrajectory of the rows
still ahead of the robot (:func:`trajectory_msg`). A world
model's chunk becomes a PredictedFrames. Each chunk also gets a ChunkTelemetry. The node publishes
the same ActionChunk and JointTrajectory as pre-serialized bytes (:mod:`physis_ros.ros.raw`); the
message builders here are their reference in the tests.
"""

from __future__ import annotations

import array
import math

import numpy as np
from builtin_interfaces.msg import Time
from sensor_msgs.msg import Image
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from physis_ros.msg import ActionChunk, ChunkTelemetry, PredictedFrames
from physis_ros.serving.config import StreamConfig
from physis_ros.ros.conversions import duration_msg, time_msg
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ChunkLanding


def action_chunk_msg(stream_name: str, stream: StreamConfig, chunk: int, actions: np.ndarray, obs_stamp: Time,
                     placement: ChunkLanding | None = None) -> ActionChunk:
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
    if placement is not None:
        msg.first_step = placement.first_step
        msg.step0_stamp = time_msg(placement.row0_due)
        msg.inference_delay_steps = placement.delay_steps
        msg.late_points = placement.first_row
        msg.late = placement.late
    return msg


def picture_msg(picture: np.ndarray, stamp: Time, frame_id: str) -> Image:
    """An RGB picture ``[H, W, 3]`` uint8 as a sensor_msgs/Image (rgb8)."""
    msg = Image()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(picture.shape[0]), int(picture.shape[1])
    msg.encoding, msg.is_bigendian, msg.step = "rgb8", 0, 3 * msg.width
    msg.data = np.ascontiguousarray(picture, dtype=np.uint8).tobytes()
    return msg


def frames_msg(stream_name: str, stream: StreamConfig, chunk: int, frames: np.ndarray, obs_stamp: Time
               ) -> PredictedFrames:
    """A world model's chunk: latent frames [F, C, h, w] as a PredictedFrames message."""
    f, c, h, w = frames.shape
    msg = PredictedFrames()
    msg.header.stamp = obs_stamp
    msg.header.frame_id = stream.frame_id
    msg.stream = stream_name
    msg.chunk_index = chunk
    msg.frames, msg.channels, msg.height, msg.width = f, c, h, w
    msg.latents = array.array("f", np.ascontiguousarray(frames, dtype=np.float32).tobytes())
    return msg


def trajectory_msg(stream: StreamConfig, positions: np.ndarray, velocities: np.ndarray,
                   accelerations: np.ndarray, start: Time) -> JointTrajectory:
    """Rows to execute as a JointTrajectory: point ``j`` at ``start + j * control_period`` with its
    positions, velocities and accelerations (physis_ros.timeline.kinematics, cut to the rows ahead)."""
    period = stream.control_period
    msg = JointTrajectory()
    msg.header.stamp = start
    msg.header.frame_id = stream.frame_id
    msg.joint_names = list(stream.joint_names)

    def f8(row) -> array.array:
        return array.array("d", np.ascontiguousarray(row, dtype=np.float64).tobytes())

    msg.points = [JointTrajectoryPoint(positions=f8(p), velocities=f8(v), accelerations=f8(a),
                                       time_from_start=duration_msg(j * period))
                  for j, (p, v, a) in enumerate(zip(positions, velocities, accelerations))]
    return msg


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
    msg.first_step = record.first_step
    msg.inference_delay_steps = record.delay_steps
    msg.late_points = record.late_points
    msg.late = record.late
    msg.seam_position_jump = record.seam_position_jump
    msg.seam_velocity_jump = record.seam_velocity_jump
    msg.seam_blended_rows = record.seam_blended_rows
    msg.tracking_error = record.tracking_error
    return msg
