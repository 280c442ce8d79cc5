"""Wire format: typed headers round trip, tensors decode zero-copy, and malformed input (wrong
types, unknown fields, NaN, kinds a socket does not take, bad tensor frames) raises a clear
WireError naming the field, never anything else."""

import math

import msgpack
import numpy as np
import pytest
import torch

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.wire import WireError, decode, encode


def frames_of(msg, tensors=None) -> list[bytes]:
    return [bytes(f) for f in encode(msg, tensors)]


def task(**fields) -> p.Task:
    base = dict(stream="robot0", chunk=7, stage=(4, 0), epoch=2, seed=5, order=1.5, deadline=1.6, sent=1.5,
                hops=[0.1], trace=[p.TraceEntry(4, 0, "w0", 0.1, 0.2, 1)])
    base.update(fields)
    return p.Task(**base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8])
def test_round_trip_every_dtype(dtype):
    t = (torch.randn(2, 3, 4) * 10).to(dtype)
    out = decode(frames_of(task(), {"x": t, "empty": torch.zeros(0, 5, dtype=dtype)}), wire.DATA)
    assert out.msg == task(tensors=out.msg.tensors)
    assert out.tensors["x"].dtype == dtype and torch.equal(out.tensors["x"], t)
    assert out.tensors["empty"].shape == (0, 5)



@pytest.mark.parametrize("dtype", ["<f4", "<f2", "<f8", "<i8", "<i4", "u1"])
def test_numpy_arrays_go_out_as_the_same_bytes_as_tensors(dtype):
    a = (np.arange(24).reshape(2, 3, 4) * 1.5).astype(dtype)[:, ::2]      # not contiguous: sent as its values
    as_numpy, as_torch = frames_of(task(), {"x": a}), frames_of(task(), {"x": torch.from_numpy(a.copy())})
    assert as_numpy == as_torch
    assert np.array_equal(decode(as_numpy, wire.DATA).tensors["x"].numpy(), a)


@pytest.mark.parametrize("array, named", [(np.zeros(3, ">f4"), ">f4"), (np.zeros(3, np.complex64), "complex64"),
                                          (np.zeros(3, np.uint16), "uint16")])
def test_a_numpy_dtype_the_wire_does_not_carry_is_refused_by_name(array, named):
    with pytest.raises(WireError, match=f"dtype {named} cannot be sent.*little-endian"):
        encode(task(), {"x": array})


def test_received_frames_that_are_writable_decode_without_a_warning_and_read_only_ones_quietly(recwarn):
    t = torch.arange(6, dtype=torch.float32)
    header, body = frames_of(task(), {"x": t})
    for buf in (bytearray(body), body):   # frames received with copy=False are writable; bytes are not
        assert torch.equal(decode([header, buf], wire.DATA).tensors["x"], t)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]

@pytest.mark.parametrize("msg, channel", [
    (p.Output(stream="r", chunk=1, epoch=0, worker="w1", trace=[p.TraceEntry(1, 7, "w1", 0.0, 1.0, 4)]), wire.OUTPUT),
    (p.Load(req=3, batching="adaptive", faults=p.FaultInjection(drop_task=4)), wire.TO_WORKER),
    (p.StartStream(req=4, stream="r", epoch=1, model=p.ModelRef(id="m", config={"name": "m"},
                                                                   batch_costs={"0": {"1": 0.5}}),
                   stages=[(4, 0)], routes=[p.Route((4, 0), "ipc:///tmp/x")]),
     wire.TO_WORKER),
    (p.StopStream(req=5, stream="r"), wire.TO_WORKER),
    (p.Hello(worker="w0", data="tcp://127.0.0.1:5", pid=12, device="cpu", host="h"), wire.TO_ENGINE),
    (p.Heartbeat(worker="w0", queue=3, stats=p.WorkerStats(tasks=9, compute_ms=1.5)), wire.TO_ENGINE),
    (p.Ack(req=1, worker="w0", blocks=[1], kv_bytes=10, stats=p.WorkerStats()), wire.TO_ENGINE),
    (p.Failed(req=1, worker="w0", error="no"), wire.TO_ENGINE),
    (p.TaskLost(worker="w0", stream="r", chunk=3, epoch=1, reason="queue_full"), wire.TO_ENGINE),
    (p.LogRecord(worker="w0", level="warning", text="hi"), wire.TO_ENGINE),
])
def test_every_kind_round_trips_on_its_channel(msg, channel):
    assert decode(frames_of(msg), channel).msg == msg


def test_decode_is_zero_copy():
    t = torch.arange(12, dtype=torch.float32)
    frames = frames_of(p.Output(stream="r", chunk=0, epoch=0, worker="w0"), {"x": t})
    buf = bytearray(frames[1])
    out = decode([frames[0], buf], wire.OUTPUT)
    buf[0:4] = bytes(4)  # the decoded tensor is a view of the received buffer
    assert out.tensors["x"][0].item() == 0.0 and out.tensors["x"][1].item() == 1.0


def test_non_contiguous_encode():
    t = torch.randn(4, 6)[:, ::2]
    assert torch.equal(decode(frames_of(task(), {"x": t}), wire.DATA).tensors["x"], t)


def raw_task(**changes) -> bytes:
    header = msgpack.unpackb(frames_of(task())[0])
    for k, v in changes.items():
        if v is ...:
            header.pop(k)
        else:
            header[k] = v
    return msgpack.packb(header)


@pytest.mark.parametrize("frames, text", [
    ([], "empty message"),
    ([b"\xc1garbage"], "not valid msgpack"),
    ([msgpack.packb([1, 2])], "invalid data message"),
    ([raw_task(v=99)], "$.v"),
    ([raw_task(kind="exec")], "$.kind"),
    ([raw_task(kind="output")], "$.kind"),        # a valid kind, but not one a data socket takes
    ([raw_task(stage=[1])], "$.stage"),
    ([raw_task(stage=[-1, 0])], "$.stage[0]"),    # steps count from 1 (0: the clean pass)
    ([raw_task(chunk="3")], "$.chunk"),
    ([raw_task(chunk=-1)], "$.chunk"),
    ([raw_task(seed="5")], "$.seed"),             # wrong types of the fields that once crashed a worker
    ([raw_task(sent="now")], "$.sent"),
    ([raw_task(sent=math.nan)], "$.sent"),
    ([raw_task(order=math.inf)], "$.order"),
    ([raw_task(order=[1])], "$.order"),
    ([raw_task(hops={"a": 1})], "$.hops"),
    ([raw_task(hops=[-1.0])], "$.hops[0]"),
    ([raw_task(trace=[[4, 0, "w0", 0.1]])], "$.trace[0]"),
    ([raw_task(trace=[[4, 0, "w0", 0.1, 0.2, True]])], "$.trace[0]"),
    ([raw_task(epoch=...)], "epoch"),
    ([raw_task(extra=1)], "unknown field"),
    ([raw_task(stream="")], "$.stream"),
    ([raw_task(tensors=[["x", "float32", [2]]])], "announces 1 tensor frames but 0 arrived"),
    ([raw_task(), b"1234"], "announces 0 tensor frames but 1 arrived"),
    ([raw_task(tensors=[["x", "object", [1]]]), b"12345678"], "$.tensors[0]"),
    ([raw_task(tensors=[["x", "float32", [-1]]]), b""], "$.tensors[0]"),
    ([raw_task(tensors=[["x", "float32", [1] * 9]]), b"1234"], "$.tensors[0]"),
    ([raw_task(tensors=[["x", "float32", [3]]]), b"12345678"], "needs 12 bytes but its frame has 8"),
    ([raw_task(tensors=[["x", "float32", [2 ** 20, 2 ** 20]]]), b"1234"], "exceeds the message limit"),
    ([raw_task(tensors=[["x", "float32", [1]], ["x", "float32", [1]]]), b"1234", b"1234"], "appears twice"),
    ([raw_task(tensors=[["x"]]), b"1234"], "$.tensors[0]"),
])
def test_malformed_messages_raise_clear_errors(frames, text):
    with pytest.raises(WireError) as info:
        decode(frames, wire.DATA)
    assert text in str(info.value)


def test_oversize_message_is_refused_before_decoding():
    frames = frames_of(task(), {"x": torch.zeros(1000)})
    with pytest.raises(WireError, match="exceeds the limit of 1000 bytes"):
        decode(frames, wire.DATA, max_bytes=1000)


def test_unsendable_dtype_refused_on_encode():
    with pytest.raises(WireError, match="cannot be sent"):
        encode(task(), {"x": torch.zeros(2, dtype=torch.complex64)})


def test_control_kinds_are_refused_on_the_data_socket_and_vice_versa():
    with pytest.raises(WireError, match=r"\$\.kind"):
        decode(frames_of(p.Shutdown(req=1)), wire.DATA)
    with pytest.raises(WireError, match=r"\$\.kind"):
        decode(frames_of(task()), wire.TO_WORKER)
    with pytest.raises(WireError, match=r"\$\.kind"):
        decode(frames_of(p.Hello(worker="w", data="ipc:///x", pid=1, device="cpu")), wire.TO_WORKER)
