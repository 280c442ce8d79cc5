"""Pre-serialized output messages: the node's hot path publishes CDR bytes, not message objects.

A stream's ActionChunk and JointTrajectory have a fixed layout (its joint
names, frame id and horizon never change; a trajectory has one layout per number
of points still ahead), so each is serialized once and a chunk then writes only
the fields that change (stamps, chunk index, timeline fields, actions /
positions / velocities / accelerations) at their known offsets and publishes the bytes raw
(``Publisher.publish(bytes)``). This skips building rclpy message objects and
converting them field by field to C, the larger part of the node's per-chunk
cost on a cold CPU.

The template is written by :class:`physis_ros.cdr.CdrWriter`, not taken from
``rclpy.serialization.serialize_message``:
with rmw_fastrtps that returns the rmw's *estimated* size (JointTrajectory: 8 bytes
more per point) with leftover heap memory in the tail and in the alignment padding,
and strict decoders (rosbags: "CDR message size mismatch") reject the message. The
writer emits exactly the message's CDR with zeroed padding; the constructor
checks all its non-padding bytes against ``serialize_message``. tests/ros/test_raw.py
compares the bytes with rosbags' serializer.
"""

from __future__ import annotations

import struct

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.serialization import serialize_message

from physis_ros.cdr import BODY, STAMP, CdrWriter, f_view
from physis_ros.ros import outputs
from physis_ros.serving.config import StreamConfig
from physis_ros.ros.conversions import time_msg
from physis_ros.timeline import ChunkLanding

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class ActionChunkRaw:
    """One stream's ActionChunk as CDR bytes: ``render(chunk, actions, obs_stamp, placement)``."""

    def __init__(self, stream_name: str, stream: StreamConfig, horizon: int, dof: int):
        self.shape = (horizon, dof)
        msg = outputs.action_chunk_msg(stream_name, stream, 0, np.ones(self.shape, np.float32), Time())
        w = CdrWriter()                     # msg/ActionChunk.msg, field by field
        w.header(msg.header)
        w.string(msg.stream)
        w.put("Q", msg.chunk_index, name="chunk")
        w.put("d", msg.control_period)
        w.strings(msg.joint_names)
        w.put("II", msg.horizon, msg.dof)
        w.array("<f4", msg.actions, name="actions")
        w.put("Q", msg.first_step, name="first_step")
        w.put("iI", msg.step0_stamp.sec, msg.step0_stamp.nanosec, name="step0")
        w.put("I", msg.inference_delay_steps, name="delay")
        w.put("?", msg.late, name="late")
        w.put("I", msg.late_points, name="late_points")
        w.check_against(serialize_message(msg), type(msg).__name__)
        self.buf, self.at = w.buf, w.at
        self.actions = f_view(self.buf, w.at["actions"], horizon * dof, "<f4").reshape(self.shape)

    def render(self, chunk: int, actions: np.ndarray, obs_stamp: Time, placement: ChunkLanding) -> bytes:
        if actions.shape != self.shape:
            raise ValueError(f"actions of shape {actions.shape}, template made for {self.shape}")
        buf, at = self.buf, self.at
        STAMP.pack_into(buf, at["stamp"], obs_stamp.sec, obs_stamp.nanosec)
        _U64.pack_into(buf, at["chunk"], chunk)
        self.actions[...] = actions
        _U64.pack_into(buf, at["first_step"], placement.first_step)
        step0 = time_msg(placement.row0_due)
        STAMP.pack_into(buf, at["step0"], step0.sec, step0.nanosec)
        _U32.pack_into(buf, at["delay"], placement.delay_steps)
        _U32.pack_into(buf, at["late_points"], placement.first_row)
        buf[at["late"]] = placement.late
        return bytes(buf)   # a snapshot: the next render must not change what was handed out


class TrajectoryRaw:
    """One stream's JointTrajectory as CDR bytes: ``render(positions, velocities, accelerations, start)``
    for the rows still ahead (one template per number of rows, made when first needed); the message
    is :func:`physis_ros.ros.outputs.trajectory_msg`."""

    def __init__(self, stream: StreamConfig, horizon: int, dof: int):
        self.stream, self.horizon, self.dof = stream, horizon, dof
        self._templates: dict[int, _TrajectoryTemplate] = {}
        self.template(horizon)   # the common case, and any error, at start-up

    def template(self, points: int) -> _TrajectoryTemplate:
        t = self._templates.get(points)
        if t is None:
            if not 1 <= points <= self.horizon:
                raise ValueError(f"a trajectory of {points} points; 1 to {self.horizon} expected")
            t = self._templates[points] = _TrajectoryTemplate(self.stream, points, self.dof)
        return t

    def render(self, positions: np.ndarray, velocities: np.ndarray, accelerations: np.ndarray, start: Time) -> bytes:
        return self.template(len(positions)).render(positions, velocities, accelerations, start)


class _TrajectoryTemplate:
    def __init__(self, stream: StreamConfig, points: int, dof: int):
        self.shape = (points, dof)
        one = np.ones(self.shape)
        msg = outputs.trajectory_msg(stream, one, one, one, Time())
        w = CdrWriter()                     # trajectory_msgs/JointTrajectory, field by field
        w.header(msg.header)
        w.strings(msg.joint_names)
        w.put("I", len(msg.points))
        for i, p in enumerate(msg.points):
            w.array("<f8", p.positions, name=f"p{i}")
            w.array("<f8", p.velocities, name=f"v{i}")
            w.array("<f8", p.accelerations, name=f"a{i}")
            w.array("<f8", p.effort)
            w.put("iI", p.time_from_start.sec, p.time_from_start.nanosec)
        w.check_against(serialize_message(msg), type(msg).__name__)
        self.buf, self.stamp_at = w.buf, w.at["stamp"]
        # Each point's arrays sit at their own offsets (the padding between points alternates), but all
        # float64 data is 8-aligned after the encapsulation: one float64 view, indexed per element.
        self.f8 = f_view(self.buf, BODY, (len(self.buf) - BODY) // 8, "<f8")
        cols = np.arange(dof)
        self.index = {k: np.array([(w.at[f"{k}{i}"] - BODY) // 8 + cols for i in range(points)]) for k in "pva"}

    def render(self, positions: np.ndarray, velocities: np.ndarray, accelerations: np.ndarray, start: Time) -> bytes:
        for name, rows in (("positions", positions), ("velocities", velocities), ("accelerations", accelerations)):
            if rows.shape != self.shape:
                raise ValueError(f"{name} of shape {rows.shape}, template made for {self.shape}")
        STAMP.pack_into(self.buf, self.stamp_at, start.sec, start.nanosec)
        self.f8[self.index["p"]] = positions
        self.f8[self.index["v"]] = velocities
        self.f8[self.index["a"]] = accelerations
        return bytes(self.buf)   # a snapshot: the next render must not change what was handed out
