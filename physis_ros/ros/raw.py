"""Pre-serialized output messages: the node's hot path publishes CDR bytes, not message objects.

A stream's ActionChunk and JointTrajectory have a fixed layout (its joint
names, frame id and horizon never change), so each is serialized once with
sentinel values in the fields that change per chunk (stamp, chunk index,
actions / positions / velocities); a chunk then patches those bytes in place
and publishes them raw (``Publisher.publish(bytes)``). This skips building
rclpy message objects and converting them field by field to C, the larger part
of the node's per-chunk cost on a cold CPU. The result deserializes to exactly
the message :mod:`~physis_ros.ros.conversions` builds (tests/ros/test_raw.py).
"""

from __future__ import annotations

import struct

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.serialization import serialize_message

from physis_ros.ros import conversions as conv
from physis_ros.ros.config import StreamConfig

_STAMP = struct.Struct("<iI")     # builtin_interfaces/Time in little-endian CDR
_U64 = struct.Struct("<Q")
_SENTINEL_SEC, _SENTINEL_NSEC = 0x1357_9BDF, 0x2468_ACE0
_SENTINEL_CHUNK = 0x0F1E_2D3C_4B5A_6978


def _sentinel(n: int, dtype, base: float) -> np.ndarray:
    return (base + np.arange(1, n + 1, dtype=np.float64) * 1.000123e-3).astype(dtype)


class RawTemplate:
    """A serialized message whose sentinel byte runs are patched in place."""

    def __init__(self, msg, sentinels: dict[str, bytes]):
        self.buf = bytearray(serialize_message(msg))
        if self.buf[:2] != b"\x00\x01":  # CDR little endian (what struct formats above assume)
            raise RuntimeError(f"unexpected CDR encapsulation {bytes(self.buf[:4])!r}")
        self.slots: dict[str, tuple[int, int]] = {}
        for name, data in sentinels.items():
            at = self.buf.find(data)
            if at < 0 or self.buf.find(data, at + 1) >= 0:
                raise RuntimeError(f"sentinel of '{name}' not found exactly once in the serialized template")
            self.slots[name] = (at, len(data))

    def patch(self, name: str, data: bytes) -> None:
        at, n = self.slots[name]
        if len(data) != n:
            raise ValueError(f"'{name}' takes {n} bytes, got {len(data)}")
        self.buf[at:at + n] = data

    def gather_index(self, names: list[str]) -> np.ndarray:
        """Byte positions of several slots, concatenated (for one vectorised patch)."""
        return np.concatenate([np.arange(at, at + n) for at, n in (self.slots[k] for k in names)])

    def patch_index(self, index: np.ndarray, data: np.ndarray) -> None:
        np.frombuffer(self.buf, dtype=np.uint8)[index] = data.view(np.uint8).reshape(-1)

    def bytes(self) -> bytes:
        return bytes(self.buf)


def _stamp_bytes(t: Time) -> bytes:
    return _STAMP.pack(t.sec, t.nanosec)


class ActionChunkRaw:
    """One stream's ActionChunk as CDR bytes: ``render(chunk, actions, obs_stamp)``."""

    def __init__(self, stream_name: str, stream: StreamConfig, horizon: int, dof: int):
        self.shape = (horizon, dof)
        actions = _sentinel(horizon * dof, np.float32, 7.0).reshape(horizon, dof)
        msg = conv.action_chunk_msg(stream_name, stream, _SENTINEL_CHUNK, actions,
                                    Time(sec=_SENTINEL_SEC, nanosec=_SENTINEL_NSEC))
        self.t = RawTemplate(msg, {"stamp": _STAMP.pack(_SENTINEL_SEC, _SENTINEL_NSEC),
                                   "chunk": _U64.pack(_SENTINEL_CHUNK), "actions": actions.tobytes()})

    def render(self, chunk: int, actions: np.ndarray, obs_stamp: Time) -> bytes:
        if actions.shape != self.shape:
            raise ValueError(f"actions of shape {actions.shape}, template made for {self.shape}")
        self.t.patch("stamp", _stamp_bytes(obs_stamp))
        self.t.patch("chunk", _U64.pack(chunk))
        self.t.patch("actions", np.ascontiguousarray(actions, dtype="<f4").tobytes())
        return self.t.bytes()


class TrajectoryRaw:
    """One stream's JointTrajectory as CDR bytes: ``render(actions, start)``; point i's positions are
    action row i, velocities :func:`~physis_ros.ros.conversions.trajectory_velocities`."""

    def __init__(self, stream: StreamConfig, horizon: int, dof: int):
        self.shape = (horizon, dof)
        self.period = stream.control_period
        pos = _sentinel(horizon * dof, np.float64, 11.0).reshape(horizon, dof)
        vel = _sentinel(horizon * dof, np.float64, 23.0).reshape(horizon, dof)
        msg = conv.trajectory_msg(stream, pos, Time(sec=_SENTINEL_SEC, nanosec=_SENTINEL_NSEC))
        for p, v in zip(msg.points, vel):
            p.velocities = v.tolist()
        sentinels = {"stamp": _STAMP.pack(_SENTINEL_SEC, _SENTINEL_NSEC)}
        for i in range(horizon):
            sentinels[f"p{i}"] = pos[i].tobytes()
            sentinels[f"v{i}"] = vel[i].tobytes()
        self.t = RawTemplate(msg, sentinels)
        self.index = self.t.gather_index([f"p{i}" for i in range(horizon)] + [f"v{i}" for i in range(horizon)])

    def render(self, actions: np.ndarray, start: Time) -> bytes:
        if actions.shape != self.shape:
            raise ValueError(f"actions of shape {actions.shape}, template made for {self.shape}")
        pos = np.ascontiguousarray(actions, dtype="<f8")
        vel = np.ascontiguousarray(conv.trajectory_velocities(pos, self.period), dtype="<f8")
        self.t.patch("stamp", _stamp_bytes(start))
        self.t.patch_index(self.index, np.concatenate([pos.reshape(-1), vel.reshape(-1)]))
        return self.t.bytes()
