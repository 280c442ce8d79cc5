"""openpi's wire format against the real openpi-client's msgpack_numpy (both ways), messages a hostile client
could send, the URI query as Server.join's keywords, and an observation mapped onto a model's inputs."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy

from physis_ros.openpi.codec import MalformedMessage, join_request, lookup, observation_parts, pack, unpack
from physis_ros.serving.openpi_config import OpenpiConfig, is_loopback
from physis_ros.serving.tensors import InputRejected

CFG = OpenpiConfig()
WAM_INPUTS = {"image": (3, 32, 32), "state": (7,)}


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int64", "float16", "float32", "float64", "bool", ">f4"])
def test_arrays_the_real_client_packs_are_read_exactly(dtype):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(4, 5, 3)) * 50).astype(dtype)
    obs = {"observation/image": array, "observation/state": np.float32(0.5), "prompt": "pick up the cube",
           "nested": {"deep": np.arange(3)}}
    got = unpack(msgpack_numpy.Packer().pack(obs))
    assert got["observation/image"].dtype == array.dtype and got["observation/image"].shape == array.shape
    assert np.array_equal(got["observation/image"], array)
    assert got["observation/state"] == np.float32(0.5) and got["prompt"] == "pick up the cube"
    assert np.array_equal(got["nested"]["deep"], np.arange(3))


def test_our_replies_are_read_by_the_real_client_bit_for_bit():
    actions = np.random.default_rng(1).normal(size=(16, 7)).astype(np.float32)
    reply = msgpack_numpy.unpackb(pack({"actions": actions, "server_timing": {"infer_ms": 1.5, "chunk": 3}}))
    assert reply["actions"].dtype == np.float32 and reply["actions"].tobytes() == actions.tobytes()
    assert reply["server_timing"] == {"infer_ms": 1.5, "chunk": 3}
    # what the real server's own packer writes, we write the same bytes
    assert pack({"actions": actions}) == msgpack_numpy.packb({"actions": actions})


def _array_header(over: dict) -> dict:
    return {b"__ndarray__": True, b"data": b"\0" * 12, b"dtype": "<f4", b"shape": [3], **over}


@pytest.mark.parametrize("message, says", [
    ("a text frame", "text frame"),
    (b"\xc1\xc1\xc1", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "send a dict"),
    (msgpack.packb({"x": 1})[:-1], "not msgpack"),
    (msgpack.packb({"x": _array_header({b"dtype": "|O"})}), "not read"),
    (msgpack.packb({"x": _array_header({b"dtype": "|V8"})}), "not read"),
    (msgpack.packb({"x": _array_header({b"dtype": "<c8"})}), "not read"),
    (msgpack.packb({"x": _array_header({b"data": b"\0" * 11})}), "needs 12 bytes"),
    (msgpack.packb({"x": _array_header({b"shape": [1 << 40, 1 << 40]})}), "needs"),
    (msgpack.packb({"x": _array_header({b"shape": [-1, -12]})}), "non-negative"),
    (msgpack.packb({"x": _array_header({b"dtype": "no such dtype"})}), "msgpack_numpy"),
    (msgpack.packb({"x": {b"__ndarray__": True}}), "msgpack_numpy"),
    (msgpack.packb({"x": {b"__npgeneric__": True, b"data": 1, b"dtype": "|O"}}), "not read"),
    (b"\x91" * 100_000, "not msgpack"),     # nested a hundred thousand deep
])
def test_malformed_messages_are_named_never_pickled_or_crashing(message, says):
    with pytest.raises(MalformedMessage, match=says):
        unpack(message)


def test_the_uri_query_becomes_join_keywords_with_the_sections_defaults():
    name, fields = join_request("name=r0&model=tiny-wam&slo_ms=150&joint_names=a,b,c&image.preprocess=pad"
                                "&control_rate_hz=25&handoff=hard", CFG, "openpi_0")
    assert name == "r0"
    assert fields == {"model": "tiny-wam", "slo_ms": 150, "joint_names": ["a", "b", "c"],
                      "image": {"preprocess": "pad"}, "control_rate_hz": 25, "handoff": "hard", "cadence": "request"}
    name, fields = join_request("", OpenpiConfig(model="tiny-acwm", slo_ms=90.0, control_rate_hz=10.0), "openpi_7")
    assert name == "openpi_7" and fields == {"model": "tiny-acwm", "slo_ms": 90.0, "control_rate_hz": 10.0,
                                             "cadence": "request", "handoff": "none", "joint_names": None}


@pytest.mark.parametrize("query, says", [
    ("speed=3", "speed: not a stream key"), ("image.colour=red", "image has no key 'colour'"),
    ("name=a&name=b", "given twice"), ("slo_interval_ms=100", "not a stream key"),
])
def test_a_bad_query_is_refused_naming_the_key(query, says):
    with pytest.raises(ValueError, match=says):
        join_request(query, CFG, "x")


def test_observation_keys_map_onto_the_models_inputs_and_the_rest_is_ignored():
    frame = np.zeros((10, 12, 3), np.uint8)
    obs = {"observation/image": frame, "observation/wrist_image": frame + 1, "observation/state": np.ones(7),
           "prompt": "ignored"}
    parts = observation_parts(obs, CFG, WAM_INPUTS)
    assert list(parts.images) == ["observation/image"] and parts.images["observation/image"] is frame
    assert parts.state is obs["observation/state"] and parts.actions is None
    # only the wrist camera sent: the model's one camera is the first key present
    parts = observation_parts({"observation/wrist_image": frame, "observation/state": np.ones(7)}, CFG, WAM_INPUTS)
    assert list(parts.images) == ["observation/wrist_image"]
    # nested, aloha style
    aloha = OpenpiConfig(image_keys=["images/cam_high"], state_key="state")
    parts = observation_parts({"images": {"cam_high": frame}, "state": np.ones(7)}, aloha, WAM_INPUTS)
    assert parts.images["images/cam_high"] is frame
    assert lookup({"a": {"b": 1}}, "a/c") is None


def test_a_missing_input_is_named_with_the_keys_that_were_sent():
    with pytest.raises(InputRejected, match="observation/state: missing.*keys sent: observation/image, prompt"):
        observation_parts({"observation/image": np.zeros((2, 2, 3), np.uint8), "prompt": "x"}, CFG, WAM_INPUTS)
    with pytest.raises(InputRejected, match="observation/image: missing"):
        observation_parts({"observation/state": np.ones(7)}, CFG, WAM_INPUTS)
    with pytest.raises(InputRejected, match="actions: missing"):
        observation_parts({"observation/image": 1, "observation/state": 1}, CFG, {**WAM_INPUTS, "actions": (16, 7)})


def test_loopback_is_what_reaches_only_this_machine():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("robot-host")
