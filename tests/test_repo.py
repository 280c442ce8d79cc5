"""What the repository itself must keep: benchmark outputs in git stay summaries, not raw traces; the fast
test tier refuses a test that starts a program."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
BENCH_OUT_LIMIT = 3 * 1024 * 1024   # bytes of bench/out committed, all files together
FILE_LIMIT = 512 * 1024             # bytes of one committed bench/out file


def _tracked(under: str) -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", under], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_bench_out_in_git_holds_summaries_not_raw_traces():
    files = [p for p in _tracked("bench/out") if p.exists()]
    sizes = {str(p.relative_to(ROOT)): p.stat().st_size for p in files}
    big = {k: v for k, v in sizes.items() if v > FILE_LIMIT}
    assert not big, f"raw traces committed (write them with --raw and keep them local): {big}"
    assert sum(sizes.values()) <= BENCH_OUT_LIMIT, f"bench/out in git is {sum(sizes.values())} bytes"


def test_bench_out_is_ignored_so_new_traces_stay_local():
    _tracked("bench/out")
    probe = "bench/out/some_new_run.json"
    rc = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT).returncode
    assert rc == 0, f"{probe} would be committed by `git add -A`"


def test_the_fast_tier_refuses_an_unmarked_test_that_starts_a_program(tmp_path):
    (tmp_path / "test_sneaky.py").write_text(
        "import subprocess, sys\n"
        "def test_starts_python():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "PHYSIS_TEST_FAST": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-2000:]
    assert "StartsAProcess" in proc.stdout and "pytest.mark.slow" in proc.stdout
