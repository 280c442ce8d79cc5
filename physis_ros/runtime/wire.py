"""Wire format: a msgpack header frame followed by raw tensor frames, sent zero-copy.

Nothing is pickled. Everything about a tensor (dtype, shape, byte size) is
validated against the limits before any buffer is allocated or viewed, so a
malformed or hostile message raises :class:`WireError` with a clear reason and
the receiver carries on.

Header fields (a msgpack map with short keys, version ``VERSION``):

=========  =================================================================
``v``      format version
``kind``   message kind, one of ``KINDS``
``stream`` stream name (data plane) or ``""``
``chunk``  chunk index (data plane) or -1
``stage``  ``[k, b]`` the stage this task is for, or ``None``
``t``      list of ``[name, dtype, shape]``, one per tensor frame, in order
``ts``     timestamps and per-stage trace (kind-specific, plain numbers)
``body``   kind-specific plain data (control plane arguments, errors)
=========  =================================================================
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

VERSION = 1
KINDS = frozenset({
    # data plane
    "task", "output",
    # control plane
    "hello", "load", "assign", "start_stream", "stop_stream", "heartbeat", "stats", "shutdown",
    "ack", "error",
})
# dtype name -> (numpy storage dtype, torch dtype). bfloat16 travels as its raw 16-bit pattern.
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),
    "float64": (np.dtype("<f8"), torch.float64),
    "int64": (np.dtype("<i8"), torch.int64),
    "int32": (np.dtype("<i4"), torch.int32),
    "uint8": (np.dtype("u1"), torch.uint8),
}
TORCH_TO_NAME = {tdt: name for name, (_, tdt) in DTYPES.items()}
MAX_RANK = 8
MAX_TENSORS = 64
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class WireError(ValueError):
    """A message that cannot be accepted; the text says which field and why."""


@dataclass
class Message:
    kind: str
    stream: str = ""
    chunk: int = -1
    stage: tuple[int, int] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ts: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


def _as_frame(t: torch.Tensor) -> tuple[str, memoryview]:
    if t.dtype not in TORCH_TO_NAME:
        raise WireError(f"tensor dtype {t.dtype} cannot be sent; allowed: {', '.join(DTYPES)}")
    name = TORCH_TO_NAME[t.dtype]
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if name == "bfloat16":
        t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
    return name, memoryview(t.numpy().reshape(-1).view(np.uint8))


def encode(msg: Message) -> list[Any]:
    """Frames for ``socket.send_multipart(frames, copy=False)``; tensor frames are views, not copies."""
    if msg.kind not in KINDS:
        raise WireError(f"unknown message kind '{msg.kind}'")
    specs, frames = [], []
    for name, tensor in msg.tensors.items():
        dtype, frame = _as_frame(tensor)
        specs.append([name, dtype, list(tensor.shape)])
        frames.append(frame)
    header = {"v": VERSION, "kind": msg.kind, "stream": msg.stream, "chunk": msg.chunk,
              "stage": list(msg.stage) if msg.stage is not None else None,
              "t": specs, "ts": msg.ts, "body": msg.body}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _frame_bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf).cast("B")


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise WireError("header is not a map")
    if type(header.get("v")) is not int or header["v"] != VERSION:
        raise WireError(f"unknown format version {header.get('v')!r}; this build speaks version {VERSION}")
    if not isinstance(header.get("kind"), str) or header["kind"] not in KINDS:
        raise WireError(f"unknown message kind {header.get('kind')!r}")
    if not isinstance(header.get("stream", ""), str):
        raise WireError("field 'stream' must be a string")
    chunk = header.get("chunk", -1)
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        raise WireError("field 'chunk' must be an integer")
    stage = header.get("stage")
    if stage is not None and not (isinstance(stage, list) and len(stage) == 2
                                  and all(isinstance(x, int) and not isinstance(x, bool) for x in stage)):
        raise WireError("field 'stage' must be null or [step, block]")
    for key in ("ts", "body"):
        if not isinstance(header.get(key, {}), dict):
            raise WireError(f"field '{key}' must be a map")
    if not isinstance(header.get("t", []), list):
        raise WireError("field 't' must be a list of tensor specs")


def decode(frames: list[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Validate and decode frames; tensors are zero-copy views of the received buffers."""
    if not frames:
        raise WireError("empty message")
    views = [_frame_bytes(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {views[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(views[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise WireError(f"header is not valid msgpack: {exc.__class__.__name__}") from None
    _check_header(header)
    specs = header.get("t", [])
    if len(specs) > MAX_TENSORS:
        raise WireError(f"{len(specs)} tensors exceed the limit of {MAX_TENSORS}")
    if len(specs) != len(views) - 1:
        raise WireError(f"header announces {len(specs)} tensor frames but {len(views) - 1} arrived "
                        "(truncated or extra frames)")
    tensors = {}
    for i, (spec, view) in enumerate(zip(specs, views[1:])):
        tensors.update([_decode_tensor(i, spec, view, max_bytes)])
    stage = header.get("stage")
    return Message(kind=header["kind"], stream=header.get("stream", ""), chunk=header.get("chunk", -1),
                   stage=tuple(stage) if stage is not None else None, tensors=tensors,
                   ts=header.get("ts", {}), body=header.get("body", {}))


def _decode_tensor(i: int, spec: Any, view: memoryview, max_bytes: int) -> tuple[str, torch.Tensor]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
        raise WireError(f"tensor spec {i} must be [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"tensor '{name}' has unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= max_bytes for d in shape)):
        raise WireError(f"tensor '{name}' has an invalid shape {shape!r} (at most {MAX_RANK} non-negative dims)")
    np_dtype, torch_dtype = DTYPES[dtype]
    count = 1
    for d in shape:
        count *= d
        if count * np_dtype.itemsize > max_bytes:
            raise WireError(f"tensor '{name}' of shape {shape} exceeds the message limit of {max_bytes} bytes")
    expected = count * np_dtype.itemsize
    if view.nbytes != expected:
        raise WireError(f"tensor '{name}' {dtype}{shape} needs {expected} bytes but its frame has {view.nbytes}")
    array = np.frombuffer(view, dtype=np_dtype).reshape(shape)
    with warnings.catch_warnings():
        # Received zmq buffers are read-only and torch warns about that. The view stays
        # zero-copy: nothing writes into a received tensor (every stage makes new ones).
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return name, t
