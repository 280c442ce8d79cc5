"""Typed configuration: dataclasses loaded from YAML and validated once, at the edge.

Every config class is a frozen dataclass. ``from_mapping`` checks unknown keys,
types and ranges and raises :class:`ConfigError` naming the offending key (as a
dotted path) and what would be accepted, so a typo in ``config/*.yaml`` fails
at start-up instead of deep inside a worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""

    def __init__(self, key: str, problem: str, source: str | None = None):
        where = f" in {source}" if source else ""
        super().__init__(f"config key '{key}'{where}: {problem}")
        self.key = key
        self.problem = problem


def bounded(*, ge: float | None = None, le: float | None = None, gt: float | None = None,
            choices: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """Field metadata for range/choice validation: ``field(default=1, metadata=bounded(ge=1))``."""
    return {"ge": ge, "le": le, "gt": gt, "choices": choices}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming the key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        if len(concrete) == 1:  # Optional[X]: X's own error, with its full key path
            return _convert(value, concrete[0], key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as exc:
                errors.append(exc.problem)
        raise ConfigError(key, "; ".join(errors))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_mapping(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported config type {_type_name(tp)}")


def _check_bounds(value: Any, meta: dict[str, Any], key: str) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(key, f"{value!r} is not allowed; allowed values: {', '.join(map(repr, choices))}")
    for name, ok, text in (
        ("ge", lambda v, b: v >= b, ">="),
        ("le", lambda v, b: v <= b, "<="),
        ("gt", lambda v, b: v > b, ">"),
    ):
        bound = meta.get(name)
        if bound is not None and not ok(value, bound):
            raise ConfigError(key, f"{value!r} is out of range; must be {text} {bound}")


def from_mapping(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, validating keys, types and ranges."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(key, f"unknown key; known keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(key, f"required key is missing ({_type_name(hints[name])})")
            continue
        value = _convert(data[name], hints[name], key)
        _check_bounds(value, dict(f.metadata), key)
        kwargs[name] = value
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def to_mapping(obj: Any) -> dict[str, Any]:
    """The inverse of :func:`from_mapping` (plain dicts and lists, YAML/JSON-safe)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(obj)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{path} must hold a mapping at top level")
    return data


def load(cls: type[T], path: str | Path) -> T:
    """Load and validate dataclass ``cls`` from a YAML file; errors name the file and key."""
    data = load_yaml(path)
    try:
        return from_mapping(cls, data)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem, source=str(path)) from None


def repo_config_dir() -> Path:
    """The ``config/`` directory shipped with the package (source tree or installed share)."""
    here = Path(__file__).resolve().parent
    candidates = [here.parent / "config", here.parent.parent.parent.parent / "share" / "physis_ros" / "config"]
    for c in candidates:
        if c.is_dir():
            return c
    raise ConfigError("<config dir>", f"no config/ directory found (looked in {', '.join(map(str, candidates))})")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: workers, placement plan, transport, limits."""

    workers: int = dataclasses.field(default=2, metadata=bounded(ge=1, le=64))
    # "auto": the cost-model planner picks the plan from `profile` (measured at start if not given).
    plan: str = dataclasses.field(default="stage",
                                  metadata=bounded(choices=("sequential", "step", "block", "stage", "auto")))
    profile: str | None = None  # physis-profile JSON: seeds adaptive batching and the planner
    devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])  # one per worker, or one for all
    transport: str = dataclasses.field(default="tcp", metadata=bounded(choices=("tcp", "ipc")))
    bind_host: str = "127.0.0.1"
    threads_per_worker: int = dataclasses.field(default=1, metadata=bounded(ge=1))
    max_in_flight: int = dataclasses.field(default=0, metadata=bounded(ge=0))  # 0: derived from the plan
    # Merging same-block tasks changes fp32 rounding (results within 1e-5 relative of the reference);
    # "off" keeps outputs bit-identical to the sequential reference.
    batching: str = dataclasses.field(default="off", metadata=bounded(choices=("off", "on", "adaptive")))
    max_batch: int = dataclasses.field(default=4, metadata=bounded(ge=1, le=64))
    policy: str = dataclasses.field(default="oldest", metadata=bounded(choices=("oldest", "edf")))
    max_streams: int = dataclasses.field(default=8, metadata=bounded(ge=1))
    seed: int = 0
    checkpoint: str | None = None
    start_timeout_s: float = dataclasses.field(default=60.0, metadata=bounded(gt=0))
    heartbeat_timeout_s: float = dataclasses.field(default=1.0, metadata=bounded(gt=0))
    restart_workers: bool = True  # restart a lost worker and re-admit its streams with fresh KV
    # Workers on other hosts: the engine does not start them; `physis-worker --connect` does, by hand.
    spawn_workers: bool = True
    ctrl_port: int = dataclasses.field(default=0, metadata=bounded(ge=0, le=65535))  # 0: any free port
    curve_keys: str | None = None  # physis-keys directory; required to bind anything but loopback
    max_message_mb: int = dataclasses.field(default=256, metadata=bounded(ge=1))

    def validate(self) -> None:
        if len(self.devices) not in (1, self.workers):
            raise ConfigError("devices", f"give one device for all workers or one per worker "
                                         f"({self.workers}), got {len(self.devices)}")
        for d in self.devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise ConfigError("devices", f"{d!r} is not a device; use 'cpu' or 'cuda:N'")
        from physis_ros.runtime.security import is_loopback
        if self.transport == "tcp" and not is_loopback(self.bind_host) and not self.curve_keys:
            raise ConfigError("curve_keys", f"binding {self.bind_host} (not loopback) requires CurveZMQ keys: "
                                            "generate them with 'physis-keys DIR' and set curve_keys: DIR")

    def device_of(self, worker: int) -> str:
        return self.devices[0] if len(self.devices) == 1 else self.devices[worker]
