"""Wire format: round trips, zero-copy decode, and clear errors for malformed input."""

import msgpack
import pytest
import torch

from physis_ros.runtime import wire
from physis_ros.runtime.wire import Message, WireError, decode, encode


def frames_of(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8])
def test_round_trip_every_dtype(dtype):
    t = (torch.randn(2, 3, 4) * 10).to(dtype)
    msg = Message("task", "robot0", 7, (4, 0), {"x": t, "empty": torch.zeros(0, 5, dtype=dtype)},
                  {"trace": [[4, 0, "w0", 0.1, 0.2, 1]]}, {"k": "v"})
    out = decode(frames_of(msg))
    assert (out.kind, out.stream, out.chunk, out.stage) == ("task", "robot0", 7, (4, 0))
    assert out.tensors["x"].dtype == dtype and torch.equal(out.tensors["x"], t)
    assert out.tensors["empty"].shape == (0, 5)
    assert out.ts == msg.ts and out.body == msg.body


def test_decode_is_zero_copy():
    t = torch.arange(12, dtype=torch.float32)
    frames = frames_of(Message("output", tensors={"x": t}))
    buf = bytearray(frames[1])
    out = decode([frames[0], buf])
    buf[0:4] = bytes(4)  # the decoded tensor is a view of the received buffer
    assert out.tensors["x"][0].item() == 0.0 and out.tensors["x"][1].item() == 1.0


def test_non_contiguous_and_non_cpu_safe_encode():
    t = torch.randn(4, 6)[:, ::2]
    out = decode(frames_of(Message("task", tensors={"x": t})))
    assert torch.equal(out.tensors["x"], t)


def header(**fields) -> bytes:
    base = {"v": wire.VERSION, "kind": "task", "stream": "s", "chunk": 0, "stage": [1, 0], "t": [], "ts": {},
            "body": {}}
    base.update(fields)
    return msgpack.packb(base)


@pytest.mark.parametrize("frames, text", [
    ([], "empty message"),
    ([b"\xc1garbage"], "not valid msgpack"),
    ([msgpack.packb([1, 2])], "header is not a map"),
    ([header(v=99)], "unknown format version 99"),
    ([header(kind="exec")], "unknown message kind 'exec'"),
    ([header(stage=[1])], "'stage' must be null or [step, block]"),
    ([header(chunk="3")], "'chunk' must be an integer"),
    ([header(t=[["x", "float32", [2]]])], "announces 1 tensor frames but 0 arrived"),
    ([header(), b"1234"], "announces 0 tensor frames but 1 arrived"),
    ([header(t=[["x", "object", [1]]]), b"12345678"], "unknown dtype 'object'"),
    ([header(t=[["x", "float32", [-1]]]), b""], "invalid shape"),
    ([header(t=[["x", "float32", [1] * 9]]), b"1234"], "invalid shape"),
    ([header(t=[["x", "float32", [3]]]), b"12345678"], "needs 12 bytes but its frame has 8"),
    ([header(t=[["x", "float32", [2 ** 20, 2 ** 20]]]), b"1234"], "exceeds the message limit"),
    ([header(t=[["x"]]), b"1234"], "must be [name, dtype, shape]"),
])
def test_malformed_messages_raise_clear_errors(frames, text):
    with pytest.raises(WireError) as info:
        decode(frames)
    assert text in str(info.value)


def test_oversize_message_is_refused_before_decoding():
    frames = frames_of(Message("task", tensors={"x": torch.zeros(1000)}))
    with pytest.raises(WireError, match="exceeds the limit of 1000 bytes"):
        decode(frames, max_bytes=1000)


def test_unknown_kind_and_dtype_refused_on_encode():
    with pytest.raises(WireError, match="unknown message kind"):
        encode(Message("pickle"))
    with pytest.raises(WireError, match="cannot be sent"):
        encode(Message("task", tensors={"x": torch.zeros(2, dtype=torch.complex64)}))
