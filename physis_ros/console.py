"""Small pieces shared by the command-line tools, and the error contract every physis-* command keeps.

Exit codes (each command's ``--help`` lists the ones it uses)::

    0    success
    1    the run failed (a check failed, the engine or a child process failed)
    2    usage or input error: unknown flag, bad value, missing argument, physis flag after
         --ros-args; missing, unreadable, empty, binary, corrupt or truncated input (bag, YAML,
         model YAML, profile JSON, checkpoint, keys directory). Nothing was run.
    3    physis-bag replay only: finished, but topics of unknown message types were skipped
    70   internal error (a bug): an unexpected exception; PHYSIS_DEBUG=1 prints its traceback
    130  interrupted (Ctrl-C)

An error is ONE line on stderr, ``<prog>: error: <what is wrong and how to fix it>``, and no
traceback reaches the user: :func:`run_main` turns every exception into such a line and its exit
code, and :class:`ArgumentParser` prints argparse's errors as one line (no usage block; ``--help``
shows the usage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SKIPPED = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """\
Exit status: 0 success; 1 the run failed; 2 usage or input error (bad flag or value, missing,
unreadable, empty, binary or corrupt input; nothing was run); 70 internal error (a bug;
PHYSIS_DEBUG=1 shows the traceback); 130 interrupted. Errors are one line on stderr:
'<prog>: error: <what and the fix>'."""

# Exceptions that mean "the input (a flag, a file) is wrong": exit 2. Matched by class name, so
# that this module imports none of the heavy packages that define them.
INPUT_ERRORS = {"ConfigError", "BagError", "UnknownTypeError", "CheckpointError", "InputRejected", "ZMQError",
                "YAMLError", "UnknownROSArgsError", "RCLInvalidROSArgsError", "SafetensorError", "ArgumentError"}
DEBUG_ENV = "PHYSIS_DEBUG"


class CliError(Exception):
    """An error to report as one line with an exit code (default 2: usage or input)."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.message = message
        self.code = code


def one_line(text: str) -> str:
    """Multi-line messages (YAML errors, logs) as one line: lines joined, caret markers dropped."""
    parts = [line.strip() for line in str(text).splitlines()]
    return " ".join(p for p in parts if p and set(p) != {"^"})


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {one_line(message)}"


def print_error(prog: str, message: str) -> None:
    print(error_line(prog, message), file=sys.stderr, flush=True)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def describe_exception(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached a command's top level."""
    if isinstance(exc, CliError):
        return exc.code, exc.message
    if isinstance(exc, UnicodeDecodeError):
        return EXIT_USAGE, (f"an input file is not UTF-8 text ({exc.reason} at byte {exc.start}): it looks binary "
                            f"or corrupt; give the YAML/JSON text file")
    if isinstance(exc, OSError):
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        what = exc.strerror or str(exc) or type(exc).__name__
        return EXIT_USAGE, f"{where}: {what}" if where else what
    if _names(exc) & INPUT_ERRORS or isinstance(exc, ValueError):
        text = str(exc) or type(exc).__name__
        if "UnknownROSArgsError" in _names(exc):
            text = ros_args_message(exc)
        return EXIT_USAGE, text
    if isinstance(exc, MemoryError):
        return EXIT_FAILED, "out of memory"
    return EXIT_INTERNAL, (f"internal error: {type(exc).__name__}: {exc} (a bug; run with {DEBUG_ENV}=1 for the "
                           f"traceback and report it)")


def run_main(prog: str, body: Callable[[list[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command's body under the error contract (see the module docstring)."""
    try:
        code = body(None if argv is None else list(argv))
        return EXIT_OK if code is None else int(code)
    except SystemExit as exc:    # argparse (--help: 0; errors: 2, already printed), signal handlers
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        print_error(prog, str(exc.code))
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - the last line of defence: never a traceback
        if os.environ.get(DEBUG_ENV):
            raise
        code, message = describe_exception(exc)
        print_error(prog, message)
        return code


def cli_main(prog: str):
    """Decorator: ``@cli_main("physis-x") def main(argv=None)`` runs under :func:`run_main`."""
    def wrap(body):
        def main(argv: Sequence[str] | None = None) -> int:
            return run_main(prog, body, argv)
        main.__doc__ = body.__doc__
        main.__wrapped__ = body
        return main
    return wrap


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error contract: ``<prog>: error: <message> (see '<prog> --help')``, exit 2.

    Subparsers made by ``add_subparsers`` are of this class too. ``formatter_class`` defaults to
    RawDescriptionHelpFormatter so that module docstrings keep their layout in ``--help``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print_error(self.prog, f"{message} (see '{self.prog} --help')")
        raise SystemExit(EXIT_USAGE)


# ----------------------------------------------------------------------------- argument types

def _number(kind, text: str, low: float | None, strict: bool):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got '{text}'") \
            from None
    if kind is float and value != value:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'")
    if low is not None and (value <= low if strict else value < low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got '{text}'")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, 0, True)


def nonneg_int(text: str) -> int:
    return _number(int, text, 0, False)


def positive_float(text: str) -> float:
    return _number(float, text, 0.0, True)


def nonneg_float(text: str) -> float:
    return _number(float, text, 0.0, False)


MAX_TEXT_BYTES = 64 * 1024 * 1024


def read_text_file(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file's contents, or :class:`CliError` naming the file, the problem and the fix."""
    p = Path(path)
    if not p.exists():
        raise CliError(f"{what} {p} does not exist")
    if p.is_dir():
        raise CliError(f"{what} {p} is a directory; give the file")
    try:
        if p.stat().st_size > MAX_TEXT_BYTES:
            raise CliError(f"{what} {p} is {p.stat().st_size / 2**20:.0f} MiB; that is not a config file")
        data = p.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    if not data.strip():
        raise CliError(f"{what} {p} is empty")
    if b"\x00" in data:
        raise CliError(f"{what} {p} is a binary file, not text (wrong path, or a corrupt copy?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"{what} {p} is not UTF-8 text (byte {exc.start}: {exc.reason}); binary or corrupt?") from None


def check_yaml_file(path: str | Path, what: str = "YAML file") -> Path:
    """A readable, non-empty YAML mapping (CliError otherwise); the detailed keys are checked by the loader."""
    import yaml

    from physis_ros.config import yaml_problem

    text = read_text_file(path, what)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CliError(f"{what} {path} is not valid YAML ({yaml_problem(exc)})") from None
    if not isinstance(data, dict):
        raise CliError(f"{what} {path} must hold a YAML mapping at top level, not {type(data).__name__}")
    return Path(path)


def check_json_file(path: str | Path, what: str = "JSON file") -> Any:
    """The parsed JSON of a file (CliError naming the file otherwise)."""
    text = read_text_file(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") \
            from None


def _typed(check: Callable[[str], Any]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        try:
            check(text)
        except CliError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
        return text
    convert.__name__ = check.__name__
    return convert


yaml_file = _typed(lambda p: check_yaml_file(p, "config"))
json_file = _typed(lambda p: check_json_file(p, "JSON file"))


def _model_arg(text: str) -> None:
    if Path(text).suffix in (".yaml", ".yml"):
        check_yaml_file(text, "model YAML")


model_arg = _typed(_model_arg)
model_arg.__name__ = "model"


def check_device(text: str) -> None:
    """A torch device this host has: ``cpu`` or ``cuda[:N]`` with N below the CUDA device count (CliError
    otherwise). Every ``--device`` that names a torch device (physis-worker, -rollout, -profile, -bench) uses it."""
    if text == "cpu":
        return                                  # the default: no torch import just to parse flags
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise CliError(f"{text!r} is not a torch device; give cpu or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"{text!r}: physis runs on cpu or cuda:N, not {device.type}")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise CliError(f"{text} is not available here ({torch.cuda.device_count()} CUDA device(s)); give cpu or "
                       f"cuda:N with N < the count")


device_arg = _typed(check_device)
device_arg.__name__ = "device"


# ----------------------------------------------------------------------------- serve configs and files

def set_threads(threads: int) -> None:
    """Single-threaded torch by default: one worker per core, as the server runs them."""
    import torch

    torch.set_num_threads(threads)


class StopSignals:
    """SIGINT and SIGTERM stop a serving command: :attr:`stop` is set and :attr:`why` names the signal (a
    command sets ``why`` itself when it stops for another reason)."""

    def __init__(self) -> None:
        import signal
        import threading

        self.stop = threading.Event()
        self.why = "stopped"

        def on_signal(signum, _frame) -> None:
            self.why = signal.Signals(signum).name
            self.stop.set()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def check_writable(path: str | Path | None, what: str = "--json") -> None:
    """Fail before a long run, not after it, if an output file cannot be written."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{what} {p} is a directory; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{what} {p}: cannot create its directory {p.parent} ({exc.strerror or exc})") from None
    if not os.access(p.parent, os.W_OK):
        raise CliError(f"{what} {p}: {p.parent} is not writable")


def check_checkpoint(path: str | Path, key: str = "engine.checkpoint") -> None:
    """A safetensors checkpoint whose header reads (CliError naming the file otherwise). The tensors'
    shapes are checked against the model when a worker loads it."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{key}: checkpoint {p} does not exist (or is not a file)")
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            f.keys()
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CliError(f"{key}: {p} is not a readable safetensors checkpoint ({one_line(str(exc)) or type(exc).__name__}"
                       f"); truncated or corrupt? write it with physis_ros.model.checkpoint.save_checkpoint") from None


def check_keys_dir(path: str | Path, key: str = "curve_keys") -> None:
    """A physis-keys directory whose key pairs load (CliError naming the problem otherwise)."""
    from physis_ros.runtime.security import CurveKeys

    p = Path(path)
    if not p.is_dir():
        raise CliError(f"{key}: {p} is not a directory; generate keys with 'physis-keys {p}'")
    try:
        CurveKeys.load(p)
    except ValueError as exc:
        raise CliError(f"{key}: {exc}") from None


def preflight_serve(cfg) -> None:
    """The files a serve config names (checkpoint, planner profile, CurveZMQ keys) are readable, and the
    checkpoint is the model's, so that a bad one is a one-line error before anything starts rather than a
    worker that never comes up."""
    engine = cfg.engine
    if engine.checkpoint:
        check_checkpoint(engine.checkpoint)
        from physis_ros.serving.capacity import Rejected
        from physis_ros.serving.catalog import check_default_checkpoint, model_config_of

        try:
            model = model_config_of(cfg.model)[0]
        except Rejected:
            model = None   # an unusable model is the node's error to report, naming 'model'
        if model is not None:
            check_default_checkpoint(model, engine.checkpoint)
    if getattr(engine, "profile", None):
        check_json_file(engine.profile, "engine.profile")
    if engine.curve_keys:
        check_keys_dir(engine.curve_keys, "engine.curve_keys")


def serve_config_or_exit(path: str | None, prog: str):
    """The serve config a tool was pointed at (the shipped one if None), as (path, ServeConfig); a bad
    one (or a bad file it names) ends the tool with exit code 2 and one line naming the problem."""
    from physis_ros.config import ConfigError
    from physis_ros.serving.config import default_serve_path, load_serve_config

    try:
        config = Path(path) if path else default_serve_path()
        check_yaml_file(config, "config")
        cfg = load_serve_config(config)
        preflight_serve(cfg)
    except (ConfigError, CliError) as exc:
        print_error(prog, exc.message if isinstance(exc, CliError) else str(exc))
        raise SystemExit(EXIT_USAGE) from None
    return config, cfg


def split_ros_args(prog: str, argv: Sequence[str]) -> list[str]:
    """The command's own arguments: ``argv`` without the ROS arguments (``--ros-args ... [--]``). A physis
    flag placed after ``--ros-args`` (rclpy: 'unknown ROS arguments') is a :class:`CliError`."""
    from rclpy.utilities import remove_ros_args

    try:
        return list(remove_ros_args([prog, *argv])[1:])
    except Exception as exc:  # UnknownROSArgsError, RCLInvalidROSArgsError
        raise CliError(ros_args_message(exc, prog)) from None


def ros_args_message(exc: BaseException, prog: str = "the command") -> str:
    text = one_line(str(exc))
    if "UnknownROSArgsError" in _names(exc):
        args = text.strip("[]").replace("'", "").replace(",", "")
        return (f"unknown ROS arguments after --ros-args: {args}; {prog}'s own flags go before --ros-args "
                f"(e.g. {prog} --duration 1 --ros-args -p NAME:=VALUE)")
    return f"bad ROS arguments: {text}; see 'ros2 run --help' for --ros-args syntax (-p NAME:=VALUE, -r FROM:=TO)"


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """End a command with a one-line error (reported by :func:`run_main` with the command's name)."""
    raise CliError(message, code)
