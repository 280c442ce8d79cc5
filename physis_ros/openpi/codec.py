"""openpi's wire format, read and written without pickle, and an openpi observation mapped onto a model's
inputs.

A message is msgpack; a numpy array inside it is the map openpi-client's ``msgpack_numpy`` packs
(``{b"__ndarray__": True, b"data": bytes, b"dtype": "<f4", b"shape": [...]}``; a numpy scalar
``{b"__npgeneric__": True, b"data": x, b"dtype": ...}``). Only numeric and bool arrays are read (never
object, void or complex ones), and an array's bytes must match its dtype and shape exactly. The URI's query
string (``?name=r0&model=tiny-wam&slo_ms=150&joint_names=j1,j2``) becomes :meth:`Server.join`'s keywords.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import msgpack
import numpy as np
import yaml

from physis_ros.serving.config import StreamConfig
from physis_ros.serving.openpi_config import OpenpiConfig
from physis_ros.serving.tensors import InputRejected

ARRAY_KINDS = "biuf"   # bool, signed and unsigned integers, floats
MAX_RANK = 8
STREAM_FIELDS = typing.get_type_hints(StreamConfig)
JOIN_KEYS = ("name", "model", "slo_ms")   # Server.join's own keywords; every other key is a StreamConfig key


class MalformedMessage(ValueError):
    """A message that is not openpi's msgpack (or holds an array we do not read); the text says why."""


def _array(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
            shape = tuple(int(n) for n in obj[b"shape"])
            data = obj[b"data"]
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"an array's header is not msgpack_numpy's ({exc})") from None
        if dtype.kind not in ARRAY_KINDS:
            raise MalformedMessage(f"arrays of dtype {dtype} are not read; send bool, integer or float arrays")
        if len(shape) > MAX_RANK or any(n < 0 for n in shape):
            raise MalformedMessage(f"array shape {shape}: at most {MAX_RANK} non-negative sizes")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            raise MalformedMessage(f"array of {dtype} {shape} needs {math.prod(shape) * dtype.itemsize} bytes, "
                                   f"got {len(data) if isinstance(data, bytes) else type(data).__name__}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
        except (KeyError, TypeError) as exc:
            raise MalformedMessage(f"a scalar's header is not msgpack_numpy's ({exc})") from None
        if dtype.kind not in ARRAY_KINDS:
            raise MalformedMessage(f"scalars of dtype {dtype} are not read")
        return dtype.type(obj[b"data"])
    return obj


def unpack(message: bytes | str) -> dict[str, Any]:
    """An observation message as a dict (arrays as read-only numpy arrays); MalformedMessage says what is
    wrong with it."""
    if isinstance(message, str):
        raise MalformedMessage("a text frame; send the observation as msgpack bytes (openpi_client's Packer)")
    try:
        out = msgpack.unpackb(message, object_hook=_array, strict_map_key=False)
    except MalformedMessage:
        raise
    except Exception as exc:   # msgpack's own errors (truncated data, extra bytes, nesting too deep)
        raise MalformedMessage(f"not msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(out, dict):
        raise MalformedMessage(f"the observation is a {type(out).__name__}; send a dict of named arrays")
    return out


def _pack_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def pack(obj: Mapping[str, Any]) -> bytes:
    """A reply (or the metadata) as openpi-client's ``msgpack_numpy.unpackb`` reads it."""
    return msgpack.packb(obj, default=_pack_array)


def lookup(obs: Mapping[str, Any], key: str) -> Any:
    """``obs[key]``, else ``key`` as a path through nested dicts (``images/cam_high`` in
    ``{"images": {"cam_high": ...}}``); None if absent."""
    if key in obs:
        return obs[key]
    node: Any = obs
    for part in key.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class ObservationParts:
    """An openpi observation's parts as :meth:`Session.tensors` takes them."""

    images: dict[str, np.ndarray] | None
    state: np.ndarray | None
    actions: np.ndarray | None


def observation_parts(obs: Mapping[str, Any], config: OpenpiConfig, inputs: Mapping[str, tuple]) -> ObservationParts:
    """The parts of ``obs`` a model with observation ``inputs`` (``image``, ``state``, ``actions``) takes,
    found by the configured keys; keys it does not take (a prompt, a second camera) are ignored. A part
    it takes that is missing raises InputRejected (``missing``) naming the key."""
    sent = ", ".join(sorted(map(str, obs))[:12]) or "none"

    def need(key: str, what: str) -> Any:
        value = lookup(obs, key) if key else None
        if value is None:
            raise InputRejected("missing", f"{key or what}: missing; the model takes {what} (keys sent: {sent}); "
                                           f"the keys are set by openpi.image_keys / state_key / actions_key")
        return value

    images = None
    if "image" in inputs:
        key = next((k for k in config.image_keys if lookup(obs, k) is not None), config.image_keys[0]
                   if config.image_keys else "")
        images = {key: need(key, "a camera frame (HxWx3 uint8)")}
    state = need(config.state_key, f"{inputs['state'][0]} joint positions") if "state" in inputs else None
    actions = need(config.actions_key, f"actions to imagine {list(inputs['actions'])}") if "actions" in inputs else None
    return ObservationParts(images, state, actions)


def join_request(query: str, config: OpenpiConfig, default_name: str) -> tuple[str, dict[str, Any]]:
    """A connection's URI query as (stream name, :meth:`Server.join` keywords): ``name``, ``model``,
    ``slo_ms`` and any serve-config stream key (``joint_names=a,b``: lists comma-separated; ``image.preprocess=
    pad``: dotted into its section); unset ones from ``openpi:``'s defaults. ValueError names a bad key."""
    fields: dict[str, Any] = {"model": config.model, "control_rate_hz": config.control_rate_hz,
                              "cadence": "request", "handoff": "none"}
    if config.slo_ms is not None:
        fields["slo_ms"] = config.slo_ms
    name = default_name
    seen: set[str] = set()
    for key, text in parse_qsl(query, keep_blank_values=True, max_num_fields=64):
        if key in seen:
            raise ValueError(f"{key}: given twice in the URI")
        seen.add(key)
        if key == "name":
            name = text
            continue
        if key == "slo_ms":
            fields[key] = _scalar(text, float | None)
            continue
        head, _, rest = key.partition(".")
        tp = STREAM_FIELDS.get(head)
        if tp is None or head in ("slo_interval_ms", "inputs"):    # inputs: files on the server, never a client's
            known = ", ".join([*JOIN_KEYS, *(k for k in STREAM_FIELDS if k not in ("slo_interval_ms", "inputs",
                                                                                  *JOIN_KEYS))])
            raise ValueError(f"{key}: not a stream key; known: {known}")
        if rest:
            section = typing.get_type_hints(tp) if isinstance(tp, type) else {}
            if rest not in section:
                raise ValueError(f"{key}: {head} has no key {rest!r} (keys: {', '.join(section) or 'none'})")
            fields.setdefault(head, {})[rest] = _scalar(text, section[rest])
        else:
            fields[head] = _scalar(text, tp)
    if "joint_names" not in fields:
        fields["joint_names"] = None   # filled from the model's dof by the front end
    return name, fields


def _scalar(text: str, tp: Any) -> Any:
    """A query value as the field's type would read it from YAML (lists comma-separated; strings as sent)."""
    if typing.get_origin(tp) is list:
        return [t.strip() for t in text.split(",") if t.strip()]
    if tp is str:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text   # the config's own check names the key and the type it wants
