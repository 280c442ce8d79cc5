"""Wire format: one msgpack header frame (a typed message of :mod:`~physis_ros.runtime.protocol`)
followed by raw tensor frames, sent zero-copy.

Nothing is pickled. The header is decoded into the message types the receiving
socket accepts (a :class:`Channel`), with every field's type and range checked;
everything about a tensor (dtype, shape, byte size) is validated against the
limits before any buffer is viewed, so a malformed or hostile message raises
:class:`WireError` with a clear reason and the receiver carries on.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
import torch

from physis_ros.runtime import protocol as p

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
# numpy arrays are sent as they are (no torch on the path: an observation goes out without a torch op,
# each of which costs tens of microseconds when the process has been idle); bfloat16 is torch's alone.
NUMPY_TO_NAME = {np_dt: name for name, (np_dt, _) in DTYPES.items() if name != "bfloat16"}
MAX_HEADER_BYTES = 256 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_ENCODER = msgspec.msgpack.Encoder()

M = TypeVar("M")


class WireError(ValueError):
    """A message that cannot be accepted; the text says which field and why."""


class Channel(Generic[M]):
    """The message kinds one socket accepts, with their decoder."""

    def __init__(self, name: str, kinds: Any):
        self.name = name
        self.decoder = msgspec.msgpack.Decoder(kinds)


DATA: Channel[p.Task | p.Wake] = Channel("data", p.Task | p.Wake)
OUTPUT: Channel[p.Output | p.Wake] = Channel("output", p.Output | p.Wake)
TO_WORKER: Channel[p.ToWorker] = Channel("control (to worker)", p.ToWorker)
TO_ENGINE: Channel[p.ToEngine] = Channel("control (to engine)", p.ToEngine)


@dataclass
class Received(Generic[M]):
    msg: M
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _dtype_name(t: torch.Tensor | np.ndarray) -> str:
    name = (NUMPY_TO_NAME if isinstance(t, np.ndarray) else TORCH_TO_NAME).get(t.dtype)
    if name is None:
        raise WireError(f"tensor dtype {t.dtype} cannot be sent; allowed: {', '.join(DTYPES)} (numpy arrays: "
                        f"{', '.join(NUMPY_TO_NAME.values())}, little-endian)")
    return name


def _as_frame(t: torch.Tensor | np.ndarray) -> tuple[str, memoryview]:
    name = _dtype_name(t)
    if isinstance(t, np.ndarray):
        return name, memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if name == "bfloat16":
        t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
    return name, memoryview(t.numpy().reshape(-1).view(np.uint8))


def encode(msg: p.Message, tensors: Mapping[str, torch.Tensor | np.ndarray] | None = None) -> list[Any]:
    """Frames for ``socket.send_multipart(frames, copy=False)``; tensor frames are views, not copies.
    ``msg.tensors`` is filled in from ``tensors``. A task with a ``link`` or ``shm`` gets the declarations only:
    its tensors travel over that link or ring (runtime/hops.py, runtime/shm_hops.py)."""
    specs, frames = [], []
    out_of_band = getattr(msg, "link", None) is not None or getattr(msg, "shm", None) is not None
    for name, tensor in (tensors or {}).items():
        if out_of_band:
            specs.append(p.TensorSpec(name, _dtype_name(tensor), list(tensor.shape)))
            continue
        dtype, frame = _as_frame(tensor)
        specs.append(p.TensorSpec(name, dtype, list(tensor.shape)))
        frames.append(frame)
    msg.tensors = specs
    return [_ENCODER.encode(msg), *frames]


def _frame_bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf).cast("B")


def decode(frames: list[Any], channel: Channel[M], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Received[M]:
    """Validate and decode frames as one of ``channel``'s kinds; tensors are zero-copy views."""
    if not frames:
        raise WireError("empty message")
    try:
        views = [_frame_bytes(f) for f in frames]
    except (TypeError, ValueError) as exc:
        raise WireError(f"frame is not a byte buffer: {exc}") from None
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {views[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = channel.decoder.decode(views[0])
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid {channel.name} message: {exc}") from None
    except Exception as exc:  # DecodeError, and e.g. UnicodeDecodeError for bad utf-8: garbage either way
        raise WireError(f"{channel.name} header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    specs = msg.tensors
    if getattr(msg, "link", None) is not None or getattr(msg, "shm", None) is not None:
        # declared here, carried by a link or a shared ring: the receiver checks them before it reads
        if len(views) != 1:
            raise WireError(f"a task whose tensors come over a link has {len(views) - 1} tensor frames; expected none")
        return Received(msg)
    if len(specs) != len(views) - 1:
        raise WireError(f"header announces {len(specs)} tensor frames but {len(views) - 1} arrived "
                        "(truncated or extra frames)")
    tensors: dict[str, torch.Tensor] = {}
    for spec, view in zip(specs, views[1:]):
        if spec.name in tensors:
            raise WireError(f"tensor '{spec.name}' appears twice")
        tensors[spec.name] = _decode_tensor(spec, view, max_bytes)
    return Received(msg, tensors)


def _decode_tensor(spec: p.TensorSpec, view: memoryview, max_bytes: int) -> torch.Tensor:
    np_dtype, torch_dtype = DTYPES[spec.dtype]
    count = 1
    for d in spec.shape:
        count *= d
        if count * np_dtype.itemsize > max_bytes:
            raise WireError(f"tensor '{spec.name}' of shape {spec.shape} exceeds the message limit of "
                            f"{max_bytes} bytes")
    expected = count * np_dtype.itemsize
    if view.nbytes != expected:
        raise WireError(f"tensor '{spec.name}' {spec.dtype}{spec.shape} needs {expected} bytes but its frame has "
                        f"{view.nbytes}")
    array = np.frombuffer(view, dtype=np_dtype).reshape(spec.shape)
    if view.readonly:
        with warnings.catch_warnings():
            # A read-only buffer (bytes; frames received with copy=False are writable), which torch warns
            # about. The view stays zero-copy: nothing writes into a received tensor (every stage makes new
            # ones).
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
    else:
        t = torch.from_numpy(array)
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t


def expect_tensors(received: Received, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise WireError unless the message carries exactly these tensors with these shapes."""
    got = {k: tuple(v.shape) for k, v in received.tensors.items()}
    want = {k: tuple(s) for k, s in shapes.items()}
    if got != want:
        raise WireError(f"expected tensors {want}, got {got}")
