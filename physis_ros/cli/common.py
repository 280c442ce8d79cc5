"""Small pieces shared by the command-line tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def set_threads(threads: int) -> None:
    """Single-threaded torch by default: one worker per core, as the server runs them."""
    torch.set_num_threads(threads)


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def serve_config_or_exit(path: str | None, prog: str):
    """The serve config a tool was pointed at (the shipped one if None), as (path, ServeConfig); a bad
    one ends the tool with exit code 2 and the error naming the field."""
    from physis_ros.config import ConfigError
    from physis_ros.ros.config import default_serve_path, load_serve_config

    config = Path(path or default_serve_path())
    try:
        return config, load_serve_config(config)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
