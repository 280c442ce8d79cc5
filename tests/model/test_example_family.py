"""The worked third-party model family (examples/physis_gmlp, issue 53 item 3): installed into the venv as a
user installs a package, found through its entry point, and served by a Server bit for bit
as the sequential reference of the same model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_family_is_found_through_its_entry_point(example_family):
    probe = subprocess.run([sys.executable, "-c", "from physis_ros.model.families import family_names, load_family;"
                            "print(family_names(), load_family('gmlp').doc)"], capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert "'gmlp'" in probe.stdout and "gated-MLP" in probe.stdout


def test_the_example_family_is_served_bit_for_bit_as_its_reference(example_family):
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("example_family_client.py")), str(example_family)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["family"] == "physis_gmlp.model.GatedPolicy"
    assert out["workers"] and set(out["workers"]) <= {"w0", "w1"}   # its blocks built on the worker(s) hosting them
    assert "failed" not in proc.stderr, proc.stderr[-2000:]          # leaving released them (release_blocks)
    assert out["indices"] == [0, 1, 2, 3] and out["equal"] == [True] * 4, out
