"""Typed configuration: dataclasses loaded from YAML and validated once, at the edge.

Every config class is a frozen dataclass. ``from_mapping`` checks unknown keys,
types and ranges and raises :class:`ConfigError` naming the offending key (as a
dotted path) and what would be accepted, so a typo in ``config/*.yaml`` fails
at start-up instead of deep inside a worker.
"""

from __future__ import annotations

import dataclasses
import math
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
            choices: tuple[Any, ...] | None = None, doc: str = "") -> dict[str, Any]:
    """Field metadata for range/choice validation and a one-line description (what ``ros2 param
    describe`` shows): ``field(default=1, metadata=bounded(ge=1, doc="..."))``."""
    return {"ge": ge, "le": le, "gt": gt, "choices": choices, "doc": doc}


def described(doc: str) -> dict[str, Any]:
    """Field metadata with only a description."""
    return bounded(doc=doc)


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
        if not math.isfinite(value):  # YAML's .inf/.nan would defeat every range check downstream
            raise ConfigError(key, f"expected a finite number, got {value!r}")
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


def yaml_problem(exc: Exception) -> str:
    """Where and what is wrong in a YAML text, without quoting it (an error message never echoes a file's
    content: the file may hold what the sender of a request must not read back)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (getattr(exc, "problem", None) or type(exc).__name__)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError("<file>", f"{path} is not a text (UTF-8) YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML ({yaml_problem(exc)})") from None
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
