"""Bag files: open with clear errors, write with message definitions, QoS by type.

Everything here is rclpy-free except :func:`rclpy_class` (imported lazily), so
the generator, the analysis and the report also run where rclpy does not.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from rosbags.interfaces import MessageDefinitionFormat, Nodetype
from rosbags.rosbag2 import Reader, Writer
from rosbags.rosbag2.enums import StoragePlugin
from rosbags.rosbag2.errors import WriterError
from rosbags.typesys import Stores, get_typestore, get_types_from_msg

PACKAGE = "physis_ros"
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}

# Types of the server's topics by name, so that a recorder can subscribe before
# a publisher exists (discovery would lose the first messages). A world model's
# ``actions`` input has no entry: it is an ActionChunk or a JointTrajectory
# (``streams.<name>.actions_type``), which the serve config tells
# (:attr:`physis_ros.bags.serveconf.ServeInfo.topic_types`); discovery otherwise.
KNOWN_TOPIC_TYPES = {
    "camera/image_raw": "sensor_msgs/msg/Image",
    "camera/image_raw/compressed": "sensor_msgs/msg/CompressedImage",
    "joint_states": "sensor_msgs/msg/JointState",
    "action_chunk": "physis_ros/msg/ActionChunk",
    "expert_actions": "physis_ros/msg/ActionChunk",
    "joint_trajectory": "trajectory_msgs/msg/JointTrajectory",
    "predicted_frames": "physis_ros/msg/PredictedFrames",
    "telemetry": "physis_ros/msg/ChunkTelemetry",
    "diagnostics": "diagnostic_msgs/msg/DiagnosticArray",
    "clock": "rosgraph_msgs/msg/Clock",
}

# Packages whose messages are sensor streams: best-effort sensor-data QoS.
SENSOR_PACKAGES = ("sensor_msgs",)
SENSOR_TYPES = {"nav_msgs/msg/Odometry", "geometry_msgs/msg/WrenchStamped"}


class BagError(RuntimeError):
    """A bag is missing, unreadable, truncated, or holds something we cannot handle."""


class UnknownTypeError(BagError):
    """A message type that this Python environment has no rclpy type support for."""


def known_topic_type(topic: str) -> str | None:
    """The message type of one of the server's topics, judged by its name (``/ns/action_chunk``)."""
    name = topic.strip("/")
    for suffix, msgtype in KNOWN_TOPIC_TYPES.items():
        if name == suffix or name.endswith("/" + suffix):
            return msgtype
    return None


def is_sensor_type(msgtype: str) -> bool:
    return msgtype.split("/")[0] in SENSOR_PACKAGES or msgtype in SENSOR_TYPES


# ----------------------------------------------------------------------------- types

def msg_dir() -> Path | None:
    """This package's ``msg/`` directory (source tree or installed share), if present."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "msg", Path(sys.prefix) / "share" / PACKAGE / "msg"):
        if candidate.is_dir() and any(candidate.glob("*.msg")):
            return candidate
    return None


@lru_cache(maxsize=1)
def typestore():
    """ROS 2 Kilted definitions plus this package's ``msg/*.msg`` (so bags carry their definitions)."""
    store = get_typestore(Stores.ROS2_KILTED)
    directory = msg_dir()
    if directory is not None:
        types = {}
        for path in sorted(directory.glob("*.msg")):
            types.update(get_types_from_msg(path.read_text(), f"{PACKAGE}/msg/{path.stem}"))
        store.register(types)
    return store


def rclpy_class(msgtype: str):
    """The rclpy message class of ``pkg/msg/Name``; :class:`UnknownTypeError` if not installed."""
    parts = msgtype.split("/")
    if len(parts) != 3 or parts[1] != "msg":
        raise UnknownTypeError(f"'{msgtype}' is not a message type name (expected pkg/msg/Name)")
    try:
        cls = getattr(importlib.import_module(f"{parts[0]}.msg"), parts[2])
    except (ImportError, AttributeError) as exc:
        raise UnknownTypeError(f"message type {msgtype} is not installed ({exc})") from None
    return cls


_IDL_TO_MSG = {"float": "float32", "double": "float64", "boolean": "bool", "octet": "byte",
               "long double": "float64"}


def _msg_field_type(idl: str) -> tuple[str, list[str]]:
    """rclpy field type ('sequence<float, 5>', 'std_msgs/Header', 'int32[3]') -> .msg type + nested types."""
    m = re.fullmatch(r"sequence<(.+?)(?:,\s*(\d+))?>", idl)
    if m:
        inner, nested = _msg_field_type(m.group(1))
        return inner + (f"[<={m.group(2)}]" if m.group(2) else "[]"), nested
    m = re.fullmatch(r"(.+)\[(\d+)\]", idl)
    if m:
        inner, nested = _msg_field_type(m.group(1))
        return f"{inner}[{m.group(2)}]", nested
    m = re.fullmatch(r"(w?string)<(\d+)>", idl)
    if m:
        return f"{m.group(1)}<={m.group(2)}", []
    if "/" in idl:
        pkg, name = idl.split("/")[0], idl.split("/")[-1]
        return f"{pkg}/{name}", [f"{pkg}/msg/{name}"]
    return _IDL_TO_MSG.get(idl, idl), []


def ensure_type(msgtype: str) -> None:
    """Make sure the typestore knows ``msgtype``; learn it (and its nested types) from rclpy if not."""
    store = typestore()
    if msgtype in store.fielddefs:
        return
    cls = rclpy_class(msgtype)
    lines, nested = [], []
    for name, idl in cls.get_fields_and_field_types().items():
        ftype, sub = _msg_field_type(idl)
        lines.append(f"{ftype} {name}")
        nested += sub
    for sub in nested:
        ensure_type(sub)
    store.register(get_types_from_msg("\n".join(lines) + "\n", msgtype))


_NUMPY = {"bool": np.bool_, "byte": np.uint8, "char": np.uint8, "octet": np.uint8, "float32": np.float32,
          "float64": np.float64, "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
          "int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64}


def _zero(nodetype, desc):
    """The default value of one field (as rosidl defaults it) in the typestore's representation."""
    if nodetype == Nodetype.NAME:
        return new_message(desc)
    if nodetype == Nodetype.BASE:
        name = desc[0]
        return "" if name in ("string", "wstring") else False if name == "bool" else \
            0.0 if name.startswith("float") else 0
    (sub_type, sub_desc), size = desc
    if sub_type == Nodetype.BASE and sub_desc[0] in _NUMPY:
        return np.zeros(size if nodetype == Nodetype.ARRAY else 0, dtype=_NUMPY[sub_desc[0]])
    return [_zero(sub_type, sub_desc) for _ in range(size if nodetype == Nodetype.ARRAY else 0)]


def new_message(msgtype: str, **fields):
    """A typestore message of ``msgtype`` with ``fields`` set and every other field at its default (zero,
    empty), so that writers keep working when a message definition gains a field."""
    store = typestore()
    ensure_type(msgtype)
    unknown = set(fields) - {name for name, _ in store.fielddefs[msgtype][1]}
    if unknown:
        raise TypeError(f"{msgtype} has no field(s) {', '.join(sorted(unknown))}")
    values = {name: fields[name] if name in fields else _zero(*spec) for name, spec in store.fielddefs[msgtype][1]}
    return store.types[msgtype](**values)


# ----------------------------------------------------------------------------- reading

@dataclass
class TopicSummary:
    topic: str
    msgtype: str
    count: int


@dataclass
class BagInfo:
    path: Path
    storage: str
    start_ns: int
    end_ns: int
    count: int
    topics: list[TopicSummary]

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


def _bag_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise BagError(f"bag {path} does not exist")
    if path.is_file() and path.suffix not in (".mcap", ".db3"):
        if path.name == "metadata.yaml":
            return path.parent
        raise BagError(f"{path} is not a bag (expected a rosbag2 directory, a .mcap or a .db3 file)")
    if path.is_dir() and not (path / "metadata.yaml").exists():
        raise BagError(f"{path} is not a rosbag2 directory: it has no metadata.yaml")
    return path


def _explain(path: Path, exc: Exception) -> BagError:
    text = str(exc) or type(exc).__name__
    hint = ""
    if any(w in text.lower() for w in ("magic", "truncat", "malformed", "not a database", "unexpected end",
                                       "length", "short read", "out of range")):
        hint = (" -- the file looks truncated or corrupt (was the recorder killed before it closed the bag?)")
    return BagError(f"cannot read bag {path}: {text}{hint}")


@contextmanager
def open_bag(path: str | Path) -> Iterator[Reader]:
    """``with open_bag(path) as reader``: an opened rosbags :class:`Reader`, errors as :class:`BagError`
    (a topic recorded with the wrong schema among them: :func:`check_schemas`)."""
    path = _bag_path(path)
    try:
        reader = Reader(path)
        reader.open()
    except Exception as exc:  # ReaderError, OSError, sqlite3.DatabaseError, struct.error...: all bag problems
        raise _explain(path, exc) from None
    try:
        check_schemas(reader)
        yield reader
    finally:
        reader.close()


def check_schemas(reader: Reader) -> None:
    """BagError naming the topic and both schemas when a topic is recorded with another message type than
    physis_ros reads or writes there (:data:`KNOWN_TOPIC_TYPES`, by the topic's name), or with the type's
    name but another definition than the one installed (its fields differ). Without this a camera topic
    recorded as ``std_msgs/msg/String`` was replayed as garbage (exit 0) and failed the check as a bug."""
    for conn in reader.connections:
        want = known_topic_type(conn.topic)
        if want is not None and conn.msgtype != want:
            raise BagError(f"topic {conn.topic} is recorded as {conn.msgtype}, but physis_ros reads and writes "
                           f"{want} there (a wrong schema: re-record the topic, or record it under another name)")
        msgdef = conn.msgdef.data if conn.msgdef is not None else ""
        if not msgdef or conn.msgdef.format != MessageDefinitionFormat.MSG:
            continue          # (a bag without definitions, or IDL ones: the type name is all there is to check)
        try:
            ensure_type(conn.msgtype)
        except UnknownTypeError:
            continue          # not installed here: the commands that need it say so (replay skips it, exit 3)
        try:
            theirs = get_types_from_msg(msgdef, conn.msgtype)[conn.msgtype][1]
        except Exception as exc:  # rosbags' parser raises its own errors for a malformed definition
            raise BagError(f"topic {conn.topic}: the bag's definition of {conn.msgtype} cannot be read "
                           f"({type(exc).__name__}: {exc})") from None
        ours = typestore().fielddefs[conn.msgtype][1]
        if theirs != ours:
            got = ", ".join(name for name, _ in theirs)
            need = ", ".join(name for name, _ in ours)
            raise BagError(f"topic {conn.topic} is recorded as {conn.msgtype} with another definition than the "
                           f"installed one (fields {got or 'none'}; installed: {need}): a wrong schema, re-record it")


def bag_info(path: str | Path) -> BagInfo:
    path = _bag_path(path)
    with open_bag(path) as reader:
        topics = [TopicSummary(t, info.msgtype or "?", info.msgcount) for t, info in sorted(reader.topics.items())]
        storage = "mcap" if any(Path(path).rglob("*.mcap")) or Path(path).suffix == ".mcap" else "sqlite3"
        return BagInfo(path, storage, reader.start_time, reader.end_time, reader.message_count, topics)


def iter_messages(reader: Reader, topics: Iterable[str] | None = None, start_ns: int | None = None
                  ) -> Iterator[tuple[str, str, int, bytes]]:
    """(topic, msgtype, log time ns, raw CDR) in log-time order; read errors become :class:`BagError`."""
    wanted = None if topics is None else set(topics)
    conns = [c for c in reader.connections if wanted is None or c.topic in wanted]
    if not conns:
        return
    try:
        for conn, stamp, raw in reader.messages(connections=conns, start=start_ns):
            yield conn.topic, conn.msgtype, stamp, raw
    except BagError:
        raise
    except Exception as exc:
        raise _explain(Path(reader.path), exc) from None


def read_all(path: str | Path, topics: Iterable[str] | None = None) -> list[tuple[str, str, int, bytes]]:
    with open_bag(path) as reader:
        return list(iter_messages(reader, topics))


def mcap_files(path: str | Path) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(path.glob("*.mcap"))


def read_with_mcap(path: str | Path) -> list[tuple[str, str, str, int, bytes]]:
    """Read a bag's mcap files with the ``mcap`` library (independent of rosbags).

    Returns (topic, schema name, schema encoding, log time ns, data); raises
    :class:`BagError` if the bag has no mcap file or it does not parse.
    """
    from mcap.reader import make_reader

    files = mcap_files(path)
    if not files:
        raise BagError(f"{path} has no .mcap file")
    out = []
    for file in files:
        try:
            with file.open("rb") as f:
                for schema, channel, message in make_reader(f).iter_messages(log_time_order=True):
                    out.append((channel.topic, schema.name if schema else "", schema.encoding if schema else "",
                                message.log_time, bytes(message.data)))
        except Exception as exc:
            raise _explain(file, exc) from None
    return out


# ----------------------------------------------------------------------------- writing

class BagWriter:
    """A rosbag2 writer whose connections carry full message definitions (custom types included)."""

    def __init__(self, path: str | Path, storage: str = "mcap"):
        if storage not in STORAGES:
            raise BagError(f"unknown storage '{storage}'; use one of {', '.join(STORAGES)}")
        self.path = Path(path)
        self.storage = storage
        try:
            self.writer = Writer(self.path, version=Writer.VERSION_LATEST, storage_plugin=STORAGES[storage])
            self.writer.open()
        except (WriterError, OSError) as exc:
            raise BagError(f"cannot create bag {self.path}: {exc}") from None
        self.connections = {}
        self.counts: dict[str, int] = {}
        self.closed = False

    def add_topic(self, topic: str, msgtype: str) -> None:
        if topic in self.connections:
            return
        ensure_type(msgtype)
        self.connections[topic] = self.writer.add_connection(topic, msgtype, typestore=typestore())
        self.counts[topic] = 0

    def write(self, topic: str, stamp_ns: int, raw: bytes | memoryview) -> None:
        self.writer.write(self.connections[topic], int(stamp_ns), raw)
        self.counts[topic] += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()

    def __enter__(self) -> BagWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- message types with a header

def has_header(msgtype: str) -> bool:
    """Whether the message starts with a ``std_msgs/Header`` (so its stamp sits at a fixed offset)."""
    try:
        ensure_type(msgtype)
    except UnknownTypeError:
        return False
    fields = typestore().fielddefs.get(msgtype)
    if not fields or not fields[1]:
        return False
    name, (_, ftype) = fields[1][0]
    return name == "header" and ftype == "std_msgs/msg/Header"
