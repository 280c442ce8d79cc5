"""Plain CDR bytes, ROS 2's wire format (XCDR1, as its rmws send it): a writer of exact messages with zeroed
padding (:class:`CdrWriter`, for the node's pre-serialized outputs, :mod:`physis_ros.ros.raw`) and the header
stamp of a raw message read and rewritten in place (for bag replay, :mod:`physis_ros.bags`). No ROS here:
bytes, offsets and numpy views."""

from __future__ import annotations

import struct

import numpy as np

ENCAPSULATION = b"\x00\x01\x00\x00"   # CDR little endian, no options: what rmw_fastrtps sends
BODY = len(ENCAPSULATION)              # CDR alignment counts from here; a leading std_msgs/Header starts here
STAMP = struct.Struct("<iI")            # builtin_interfaces/Time, little endian


class CdrWriter:
    """Plain little-endian CDR (XCDR1, as ROS 2 rmws use) with zeroed padding; remembers where named
    fields start (byte offsets in :attr:`buf`) and which bytes are alignment padding."""

    def __init__(self):
        self.buf = bytearray(ENCAPSULATION)
        self.at: dict[str, int] = {}
        self.padding: list[int] = []

    def _align(self, size: int) -> None:
        pad = -(len(self.buf) - BODY) % size
        self.padding += range(len(self.buf), len(self.buf) + pad)
        self.buf += bytes(pad)

    def put(self, fmt: str, *values, name: str | None = None) -> None:
        """Primitives of one size (``"Q"``, ``"iI"``), aligned to it."""
        self._align(struct.calcsize(fmt[-1]))
        if name:
            self.at[name] = len(self.buf)
        self.buf += struct.pack("<" + fmt, *values)

    def string(self, s: str) -> None:
        data = s.encode() + b"\0"
        self.put("I", len(data))
        self.buf += data

    def strings(self, items) -> None:
        self.put("I", len(items))
        for s in items:
            self.string(s)

    def array(self, dtype: str, values, name: str | None = None) -> None:
        """A sequence of numbers; an empty one has no alignment after its length (Fast CDR, rosbags)."""
        data = np.asarray(values, dtype=dtype)
        self.put("I", len(data))
        if len(data):
            self._align(data.itemsize)
            if name:
                self.at[name] = len(self.buf)
            self.buf += data.tobytes()

    def header(self, h) -> None:
        """A std_msgs/Header (``h``: one, or anything with ``stamp.sec``, ``stamp.nanosec`` and ``frame_id``)."""
        self.put("iI", h.stamp.sec, h.stamp.nanosec, name="stamp")
        self.string(h.frame_id)

    def check_against(self, rmw: bytes, what: str) -> None:
        """Every byte but the padding equals ``rmw``, the rmw's own serialization of the same message (whose
        length is only an upper bound); RuntimeError naming ``what`` if not."""
        theirs = np.frombuffer(rmw, np.uint8)
        ours = np.frombuffer(self.buf, np.uint8)
        keep = np.ones(len(ours), bool)
        keep[self.padding] = False
        keep[2:4] = False   # encapsulation options: rmws may note end padding there (ours needs none)
        if len(theirs) < len(ours) or not np.array_equal(theirs[:len(ours)][keep], ours[keep]):
            raise RuntimeError(f"CDR template of {what} ({len(ours)} bytes) disagrees with the rmw's serialization "
                               f"({len(theirs)} bytes, encapsulation {theirs[:4].tobytes()!r})")


def f_view(buf: bytearray, at: int, n: int, dtype: str) -> np.ndarray:
    """A writable numpy view of ``n`` numbers at byte offset ``at`` of ``buf`` (pins its size)."""
    return np.frombuffer(buf, dtype=dtype, count=n, offset=at)


def _endian(raw: bytes | memoryview) -> str:
    return "<" if raw[1] & 1 else ">"


def header_stamp_ns(raw: bytes | memoryview) -> int:
    """The header stamp (ns) of a raw CDR message that starts with a std_msgs/Header."""
    sec, nsec = struct.unpack_from(_endian(raw) + "iI", raw, BODY)
    return sec * 1_000_000_000 + nsec


def with_header_stamp(raw: bytes | memoryview, stamp_ns: int) -> bytes:
    """A copy of ``raw`` whose header stamp is ``stamp_ns`` (no deserialization)."""
    out = bytearray(raw)
    sec, nsec = divmod(int(stamp_ns), 1_000_000_000)
    struct.pack_into(_endian(raw) + "iI", out, BODY, sec, nsec)
    return bytes(out)
