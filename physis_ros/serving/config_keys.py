"""The serve config's keys: its dataclass tree walked into dotted keys (``engine.workers``,
``streams.robot0.slo_interval_ms``) with their types, metadata and values, which of them change at run time,
and what an unset optional key reads as. What a front end needs to expose the config as named settings (the
ROS node declares them as parameters: :mod:`physis_ros.ros.parameters`) and what the reference of every key
(:mod:`physis_ros.serving.config_reference`) is generated from."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from physis_ros.config import ConfigError, to_mapping
from physis_ros.serving.config import ServeConfig, StreamConfig, deep_merge, serve_config, unflatten

# Per stream (``streams.<name>.<key>``) and node-wide keys that take effect while the server runs.
RUNTIME_STREAM_KEYS = frozenset({"slo_interval_ms", "trajectory_start", "trajectory_start_offset_s",
                                 "seam_blend_steps", "image.preprocess", "image.pad_value", "max_future_s",
                                 "max_age_s"})
RUNTIME_KEYS = frozenset({"warn_throttle_s", "diagnostics_window_s", "diagnostics_miss_rate_warn",
                          "diagnostics_starved_s", "diagnostics_stale_intervals"})


@dataclass(frozen=True)
class ConfigLeaf:
    name: str                     # dotted key
    type: Any                     # the field's Python type (Optional removed): str, int, float, bool, list[str], ...
    meta: dict[str, Any]          # the field's bounded()/described() metadata
    section_doc: str              # description of the enclosing section, if any
    value: Any                    # None: unset
    optional: bool


def _optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) != len(typing.get_args(tp))
    return tp, False


def _walk(cls: type, obj: Any, prefix: str, section_doc: str = "") -> Iterator[ConfigLeaf]:
    """``obj`` None: an unset optional section, whose keys are declared without values."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, optional = _optional(hints[f.name])
        optional = optional or obj is None
        name = f"{prefix}{f.name}"
        value = getattr(obj, f.name) if obj is not None else None
        doc = f.metadata.get("doc", "")
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, value, name + ".", doc or section_doc)
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            for key, item in (value or {}).items():
                yield from _walk(typing.get_args(tp)[1], item, f"{name}.{key}.", section_doc)
        elif typing.get_origin(tp) is dict:     # a mapping of scalars (a stream's inputs): a key per entry
            for key, item in (value or {}).items():
                yield ConfigLeaf(f"{name}.{key}", typing.get_args(tp)[1], dict(f.metadata), section_doc, item, True)
        else:
            yield ConfigLeaf(name, tp, dict(f.metadata), section_doc, value, optional)


def leaves(config: ServeConfig) -> list[ConfigLeaf]:
    """Every parameter of a serve config, in declaration order."""
    return list(_walk(ServeConfig, config, ""))


def stream_leaves(stream: StreamConfig, name: str) -> list[ConfigLeaf]:
    """The parameters of one stream (``streams.<name>.*``), in declaration order."""
    return list(_walk(StreamConfig, stream, f"streams.{name}."))


def config_field(name: str) -> tuple[Any, bool, dict[str, Any], bool] | None:
    """(type, optional, metadata, in an optional section) of the serve-config leaf a dotted name denotes (any
    stream name under ``streams``), or None if it is not one."""
    cls: Any = ServeConfig
    parts = name.split(".")
    i = 0
    in_optional = False
    while i < len(parts):
        if not dataclasses.is_dataclass(cls):
            return None
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        if parts[i] not in fields:
            return None
        f = fields[parts[i]]
        tp, optional = _optional(typing.get_type_hints(cls)[parts[i]])
        i += 1
        if typing.get_origin(tp) is dict:
            if i >= len(parts):
                return None
            i += 1                      # the stream name, or the key of a mapping of scalars
            tp = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(tp):
            cls, in_optional = tp, in_optional or optional
            continue
        return (tp, optional, dict(f.metadata), in_optional) if i == len(parts) else None
    return None


def is_config_key(name: str) -> bool:
    """Whether a dotted name is a leaf of the serve-config tree (any stream name under ``streams``)."""
    return config_field(name) is not None


def unset_value(tp: Any, meta: dict[str, Any]) -> Any:
    """The value that stands for an unset optional key of type ``tp``, so that every key has a value a front
    end can show: empty for a string or a list, and for a number the bound just outside its range (0 for
    ``> 0``, 0 for ``>= 1``, -1 for ``>= 0``); None for a flag or an unbounded number."""
    if tp is str:
        return ""
    if tp in (float, int):
        if meta.get("gt") is not None:
            return tp(meta["gt"])
        if meta.get("ge") is not None:
            return tp(meta["ge"] - 1)
    if typing.get_origin(tp) in (list, tuple):
        return []
    return None   # a flag, or a number without a lower bound: none (the config resolves these to a value)


def given_value(name: str, value: Any) -> tuple[bool, Any]:
    """(given, value) of a key set by its name, as the serve config takes it: an optional key's unset value
    (:func:`unset_value`) is None; a key of an optional section given its unset value is not given (the
    section stays unset)."""
    found = config_field(name)
    if found is None or isinstance(value, bool):
        return True, value
    tp, optional, meta, in_optional = found
    if not optional and not in_optional:
        return True, value
    unset = unset_value(tp, meta)
    if unset is None or value != unset:
        return True, value
    return optional, None


@dataclass(frozen=True)
class KeyRules:
    """How a front end shows and guards one key: ``description``; ``low`` and ``high`` the range of its values
    (inclusive, the unset value included; None: open); ``read_only`` while the server runs (a stream's fixed
    keys are not: they leave with the stream, and a change is refused by :func:`check_runtime_change`);
    ``constraints`` what else holds, in words (strict bounds, choices, the unset value)."""

    description: str
    low: float | None
    high: float | None
    read_only: bool
    constraints: str


def key_rules(leaf: ConfigLeaf) -> KeyRules:
    meta = leaf.meta
    doc = meta.get("doc", "")
    if leaf.section_doc:
        doc = f"{doc} ({leaf.section_doc})" if doc else leaf.section_doc
    fixed = not is_runtime(leaf.name)
    read_only = fixed and not is_stream_key(leaf.name)
    constraints = ["fixed while the stream is served (a set is refused)"] if fixed and not read_only else []
    ge, le, gt = meta.get("ge"), meta.get("le"), meta.get("gt")
    low = ge if ge is not None else gt
    unset = unset_value(leaf.type, meta) if leaf.optional else None
    if unset is not None and low is not None:
        low = min(low, unset)
    if gt is not None:
        constraints.append(f"must be > {gt}")
    if meta.get("choices"):
        constraints.append("one of: " + ", ".join(map(str, meta["choices"])))
    if unset is not None:
        constraints.append(f"optional: {unset!r} means unset (none)")
    elif leaf.optional:
        constraints.append("optional")
    return KeyRules(doc, low, le, read_only, "; ".join(constraints))


def with_changes(config: ServeConfig, changes: dict[str, Any]) -> ServeConfig:
    """``config`` with the values of some dotted keys changed, validated as a config file is (ConfigError)."""
    return serve_config(deep_merge(to_mapping(config), unflatten(changes)))


def is_stream_key(name: str) -> bool:
    return name.startswith("streams.")


def is_runtime(name: str) -> bool:
    """Whether a dotted key takes effect while the server runs (the others need a restart, or for a stream
    its serving again)."""
    if name in RUNTIME_KEYS:
        return True
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == "streams" and parts[2] in RUNTIME_STREAM_KEYS


def check_runtime_change(old: ServeConfig, new: ServeConfig) -> None:
    """ConfigError naming the key if ``new`` changes a key of ``old`` that does not change at run time (a
    stream's fixed keys need it served again, a node-wide one a restart); keys of streams in only one of the
    two are not compared (a stream joining or leaving)."""
    before = {leaf.name: leaf.value for leaf in leaves(old)}
    for leaf in leaves(new):
        if leaf.name not in before or leaf.value == before[leaf.name] or is_runtime(leaf.name):
            continue
        if is_stream_key(leaf.name):
            raise ConfigError(leaf.name, "cannot change while the stream is served: remove it and serve it again "
                                         "with the new value")
        raise ConfigError(leaf.name, "cannot change at run time: restart the server with the new value")


def apply_trajectory_topic(mapping: dict[str, Any], topic: str) -> dict[str, Any]:
    """``--trajectory-topic`` / launch ``trajectory_topic:=``: the joint_trajectory topic of a config's
    only stream (a config with several streams sets ``streams.<name>.topics.joint_trajectory``)."""
    streams = mapping.get("streams")
    if not isinstance(streams, dict) or len(streams) != 1:
        n = len(streams) if isinstance(streams, dict) else 0
        raise ConfigError("streams", f"--trajectory-topic (launch argument trajectory_topic) applies to a config "
                                     f"with exactly one stream, this one has {n}; set "
                                     f"streams.<name>.topics.joint_trajectory for each stream instead")
    (name,) = streams
    return deep_merge(mapping, {"streams": {name: {"topics": {"joint_trajectory": topic}}}})
