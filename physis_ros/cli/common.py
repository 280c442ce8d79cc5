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


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
