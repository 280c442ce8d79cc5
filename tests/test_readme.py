"""README.md is a user's document whose commands run as written (issue 49 items 1 and 2).

Every fenced ``bash`` block carries a marker on the line before it: ``<!-- test: run -->`` (run here, as
written, by :func:`test_readme_blocks_run_as_written`), ``<!-- test: tests/... -->`` (the named test file
runs it) or ``<!-- test: skip (why) -->`` (the few that need tools not on PyPI, or are the set-up and CI
commands themselves). Every relative link in README and docs/ resolves inside the clone, and every
``physis-*`` command README names is one the package installs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from domains import domain

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250


def blocks(language: str = "bash") -> list[tuple[str, str]]:
    """(marker, body) of each ```bash (or ``language``) block of README, in order."""
    text = README.read_text()
    out = []
    for m in re.finditer(rf"(?:^<!-- test: ([^\n]*?) -->\n)?^```{language}\n(.*?)^```$", text, re.M | re.S):
        out.append((m.group(1) or "", m.group(2)))
    return out


def test_readme_is_a_users_document_of_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, len(lines)
    assert "shared/" not in README.read_text()                  # nothing outside the clone


def test_every_shell_block_says_how_it_is_tested():
    found = blocks()
    assert len(found) >= 4
    found += blocks("python")
    for marker, body in found:
        assert marker == "run" or marker.startswith("skip (") or marker.startswith("tests/"), (marker, body)
        if marker.startswith("tests/"):
            assert (ROOT / marker.split()[0]).is_file(), marker


def test_every_relative_link_resolves():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"


def test_every_command_readme_names_is_installed():
    setup = (ROOT / "setup.py").read_text()
    installed = set(re.findall(r"[\"'](physis-[a-z-]+)\s*=", setup))
    named = set(re.findall(r"\b(physis-[a-z]+)\b", README.read_text()))
    assert named and named <= installed, named - installed


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (marker, _) in enumerate(blocks()) if marker == "run"])
def test_readme_blocks_run_as_written(index, tmp_path):
    """The block runs with bash -e in a directory holding the clone's config/ and tests/data, with the venv's
    commands on PATH (what `make setup` gives), on a ROS domain of this test's own."""
    _, body = blocks()[index]
    for name in ("config", "tests"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PHYSIS_DEBUG"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               ROS_DOMAIN_ID=str(domain("spare")), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    proc = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400, stdin=subprocess.DEVNULL)
    where = f"{body}\n--- exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, where
    assert "Traceback" not in proc.stdout + proc.stderr, where
    if "physis-stream add" in body:
        # robot2 was admitted and served; robot3 refused for the control timeline, the line says what to change
        assert '"outcome": "cancelled"' in proc.stdout, where
        assert "timeline:" in proc.stdout + proc.stderr and "refused, as expected" in proc.stdout, where
    if "--openpi" in body:   # the real openpi client got the chunk of its observation
        assert "(16, 7)" in proc.stdout.splitlines(), where
    if "physis-bag check" in body:
        assert (tmp_path / "out" / "check" / "report" / "summary.md").is_file(), where


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (marker, _) in enumerate(blocks("python")) if marker == "run"])
def test_readme_python_blocks_run_as_written(index, tmp_path):
    """The Server API example runs as written, from a directory holding the clone's config/: one chunk of
    tiny-wam's 16 x 7 actions, and the second robot refused with the ``timeline`` label."""
    _, body = blocks("python")[index]
    (tmp_path / "config").symlink_to(ROOT / "config", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PHYSIS_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    where = f"{body}\n--- exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, where
    assert "Traceback" not in proc.stderr, where
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("0 (16, 7) ") and lines[0].endswith(" ms"), where
    assert lines[1] == "r1 refused: timeline", where

