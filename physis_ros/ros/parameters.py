"""ROS 2 parameters of ``physis_server``, derived from the serve config's dataclass tree.

Every leaf of :class:`~physis_ros.serving.config.ServeConfig` (``EngineConfig`` included) is declared as a
parameter with a dotted name (``engine.workers``, ``streams.robot0.slo_interval_ms``), its value from
the merged config (file < ROS parameters < command line), and a descriptor built from the field's
metadata (``bounded(ge=, le=, gt=, choices=, doc=)``): description, integer or floating-point range,
choices and strict bounds as ``additional_constraints``, and ``read_only`` for every node-wide key that
cannot change while the node runs. A stream's keys (``streams.<name>.*``) come and go with the stream: a
stream that joins through a ServeStream goal declares the same ones a configured stream has, and a
stream that leaves undeclares its own. ROS 2 cannot undeclare a read-only parameter, so a stream's keys
that cannot change while it is served are declared changeable and every set of them is refused by the
server's check (the reason names the key; ``additional_constraints`` says so). An optional value that is unset (``slo_interval_ms``) is declared with its
type and no value; an unset optional section (``qos.input``) has its keys declared the same way.

The few keys that can change at run time (:data:`RUNTIME_STREAM_KEYS`, :data:`RUNTIME_KEYS`) go through
a set-parameters callback that validates the new values with the same ``from_mapping`` rules as the
config file and refuses bad ones with the config error (the key and what it accepts); accepted ones
are handed to the node, which swaps in the new config.

ROS parameter overrides whose names are not serve-config keys (a shared ``/**`` parameters file
written for other nodes) are not declared: they are collected in ``ignored`` for one warning. The
node's own parameters (``use_sim_time``, ``qos_overrides.*``) are rclpy's.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.parameter import Parameter

from physis_ros.config import ConfigError
from physis_ros.serving.config import ServeConfig, StreamConfig, deep_merge, serve_config, unflatten
from physis_ros.serving.config_keys import (ConfigLeaf, apply_trajectory_topic, check_runtime_change, given_value,
                                            is_config_key, key_rules, leaves, stream_leaves, unset_value,
                                            with_changes)

# Parameters rclpy declares for every node; not serve-config keys handled here.
NODE_PARAMETERS = frozenset({"use_sim_time", "start_type_description_service"})
NODE_PREFIXES = ("qos_overrides.",)

_INT64 = (-2**63, 2**63 - 1)
_ARRAY = {str: Parameter.Type.STRING_ARRAY, int: Parameter.Type.INTEGER_ARRAY,
          float: Parameter.Type.DOUBLE_ARRAY, bool: Parameter.Type.BOOL_ARRAY}
_SCALAR = {str: Parameter.Type.STRING, int: Parameter.Type.INTEGER, float: Parameter.Type.DOUBLE,
           bool: Parameter.Type.BOOL}


def _param_type(tp: Any, name: str) -> Parameter.Type:
    if tp in _SCALAR:
        return _SCALAR[tp]
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        if args and args[0] in _ARRAY:
            return _ARRAY[args[0]]
    raise TypeError(f"config key '{name}' has type {tp!r}, which has no ROS parameter type")


def ros_type(leaf: ConfigLeaf) -> Parameter.Type:
    return _param_type(leaf.type, leaf.name)


def descriptor(leaf: ConfigLeaf) -> ParameterDescriptor:
    rules = key_rules(leaf)
    d = ParameterDescriptor(description=rules.description, read_only=rules.read_only,
                            additional_constraints=rules.constraints)
    low, high, ptype = rules.low, rules.high, ros_type(leaf)
    if low is None and high is None:
        return d
    if ptype == Parameter.Type.DOUBLE:
        d.floating_point_range = [FloatingPointRange(from_value=float(low) if low is not None else -math.inf,
                                                     to_value=float(high) if high is not None else math.inf, step=0.0)]
    elif ptype == Parameter.Type.INTEGER:
        d.integer_range = [IntegerRange(from_value=int(low) if low is not None else _INT64[0],
                                        to_value=int(high) if high is not None else _INT64[1], step=1)]
    return d


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else value


def split_overrides(overrides: dict[str, Parameter]) -> tuple[dict[str, Any], list[str]]:
    """ROS parameter overrides -> (serve-config values by dotted name, names that are not ours)."""
    known, foreign = {}, []
    for name, param in overrides.items():
        if name in NODE_PARAMETERS or name.startswith(NODE_PREFIXES) or param.type_ == Parameter.Type.NOT_SET:
            continue
        if is_config_key(name):
            given, value = given_value(name, _plain(param.value))
            if given:
                known[name] = value
        else:
            foreign.append(name)
    return known, sorted(foreign)


class ServeParameters:
    """The node's serve config as ROS parameters: build (merge + validate), declare, then keep the
    runtime-changeable ones in step (validate before, apply after each accepted set)."""

    def __init__(self, node, file_mapping: dict[str, Any] | None, overrides: dict[str, Any] | None,
                 trajectory_topic: str = ""):
        self.node = node
        ros = getattr(node, "_parameter_overrides", {})   # --params-file / -p / launch parameters=
        known, self.ignored = split_overrides(ros)
        mapping = deep_merge(deep_merge(file_mapping or {}, unflatten(known)), overrides or {})
        if node.get_parameter("use_sim_time").value:
            mapping["use_sim_time"] = True
        if trajectory_topic:
            mapping = apply_trajectory_topic(mapping, trajectory_topic)
        self.config: ServeConfig = serve_config(mapping)
        self.types: dict[str, Parameter.Type] = {}
        self._apply: Callable[[ServeConfig, ServeConfig], None] | None = None
        self._check: Callable[[ServeConfig], None] | None = None

    def declare(self) -> None:
        """Declare every key of the config (at start)."""
        self._declare(leaves(self.config))

    def add_stream(self, name: str, stream: StreamConfig) -> None:
        """A stream joined (a ServeStream goal): its keys, as a configured stream has them, with its values
        (a configured stream admitted as configured keeps the ones declared at start)."""
        prefix = f"streams.{name}."
        if self.config.streams.get(name) == stream and any(k.startswith(prefix) for k in self.types):
            return
        self.remove_stream(name)
        self.config = dataclasses.replace(self.config, streams={**self.config.streams, name: stream})
        self._declare(stream_leaves(stream, name))

    def remove_stream(self, name: str) -> None:
        """A stream left: its keys are undeclared and it leaves the config (a configured stream removed is
        not admitted again when the engine restarts)."""
        prefix = f"streams.{name}."
        for key in [k for k in self.types if k.startswith(prefix)]:
            self.node.undeclare_parameter(key)
            del self.types[key]
        if name in self.config.streams:
            self.config = dataclasses.replace(
                self.config, streams={k: v for k, v in self.config.streams.items() if k != name})

    def _declare(self, leaves: list[ConfigLeaf]) -> None:
        node = self.node
        for leaf in leaves:
            if leaf.name in NODE_PARAMETERS:
                continue
            desc = descriptor(leaf)
            value = _plain(leaf.value)
            if value is None and leaf.optional:
                value = unset_value(leaf.type, leaf.meta)   # every declared parameter has a value
            # our set callbacks take only known names: a declaration (which rclpy runs through them) is no change
            ptype = ros_type(leaf)
            if value is None or value == []:
                node.declare_parameter(leaf.name, ptype, desc, ignore_override=True)
                if value == []:
                    node.set_parameters([Parameter(leaf.name, ptype, [])])
            else:
                node.declare_parameter(leaf.name, value, desc, ignore_override=True)
            self.types[leaf.name] = ptype

    def attach(self, apply: Callable[[ServeConfig, ServeConfig], None],
               check: Callable[[ServeConfig], None] | None = None) -> None:
        """Start validating and applying changes; ``check(new)`` may refuse a change with a ConfigError
        beyond what the config alone says (a stream's model), ``apply(old, new)`` runs after a set
        succeeded."""
        self._apply, self._check = apply, check
        self.node.add_pre_set_parameters_callback(self._coerce)
        self.node.add_on_set_parameters_callback(self._validate)
        self.node.add_post_set_parameters_callback(self._applied)

    # ---- callbacks ------------------------------------------------------------------------------------
    def _coerce(self, params: list[Parameter]) -> list[Parameter]:
        """An integer for a floating-point key (``ros2 param set ... slo_interval_ms 40``) is taken as a float."""
        out = []
        for p in params:
            if self.types.get(p.name) == Parameter.Type.DOUBLE and p.type_ == Parameter.Type.INTEGER:
                p = Parameter(p.name, Parameter.Type.DOUBLE, float(p.value))
            out.append(p)
        return out

    def _updated(self, params: list[Parameter]) -> ServeConfig:
        changes = {}
        for p in params:
            if p.name in self.types:
                given, value = given_value(p.name, _plain(p.value))
                if given:
                    changes[p.name] = value
        return with_changes(self.config, changes)

    def _validate(self, params: list[Parameter]) -> SetParametersResult:
        ours = [p for p in params if p.name in self.types]
        if not ours:
            return SetParametersResult(successful=True)
        for p in ours:
            if p.type_ == Parameter.Type.NOT_SET:
                return SetParametersResult(successful=False, reason=f"{p.name} cannot be unset")
        try:
            updated = self._updated(ours)
            check_runtime_change(self.config, updated)      # read_only refuses node-wide ones before this
            if self._check is not None:
                self._check(updated)
        except ConfigError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _applied(self, params: list[Parameter]) -> None:
        ours = [p for p in params if p.name in self.types]
        if not ours:
            return
        old = self.config
        self.config = self._updated(ours)
        if self._apply is not None:
            self._apply(old, self.config)
        self.node.get_logger().info("parameters set: " + ", ".join(f"{p.name}={p.value!r}" for p in ours))
