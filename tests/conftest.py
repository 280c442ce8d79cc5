"""Shared test set-up: single-threaded torch (as the workers run), the fast tier's guard and small helpers.

Two tiers. ``make test`` runs everything. ``make test-fast`` (``PHYSIS_TEST_FAST=1``, ``-m "not slow"``)
runs the pure logic only: a test that starts a program, a worker process or a ROS context carries the
``slow`` marker, and in the fast tier anything that tries to start one fails at once, naming the test to
mark, so the fast tier cannot quietly grow into the slow one.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

TEST_TIMEOUT_S = 600   # per test, its fixtures' set-up included: the slowest takes about 75 s on a slow CI host
FAST_ENV = "PHYSIS_TEST_FAST"


class StartsAProcess(RuntimeError):
    """Raised in the fast tier where a test starts something that only the full tier may start."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise StartsAProcess(f"{what} in the fast tier (PHYSIS_TEST_FAST=1): mark this test or its module "
                             f"`pytest.mark.slow` (args {str(args[1:2])[:120]})")
    return refuse


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a program, worker process or ROS context, or computes for "
                                       "seconds; left out by `make test-fast`")
    if os.environ.get(FAST_ENV) == "1":
        subprocess.Popen.__init__ = _refuse("a program started (subprocess.Popen)")
        multiprocessing.process.BaseProcess.start = _refuse("a process started (multiprocessing)")
        try:
            import rclpy
        except ImportError:
            return
        rclpy.init = _refuse("a ROS context started (rclpy.init)")


def pytest_collection_modifyitems(items):
    # A test that hangs (one waited forever on its own event loop once) fails with every thread's stack
    # after TEST_TIMEOUT_S instead of running into CI's 90-minute limit with nothing said.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_wam():
    from physis_ros.model import build_model
    return build_model("tiny-wam")


@pytest.fixture(scope="session")
def tiny_acwm():
    from physis_ros.model import build_model
    return build_model("tiny-acwm")


EXAMPLE_FAMILY = Path(__file__).resolve().parents[1] / "examples" / "physis_gmlp"


@pytest.fixture(scope="session")
def example_family() -> Path:
    """The worked third-party model family (examples/physis_gmlp) installed into this venv as a user installs a
    package (a regular install: a server already running finds it), once per test process, under a lock
    (pytest-xdist runs test files in parallel); the path of its model YAML."""
    import sys
    import tempfile

    from filelock import FileLock

    with FileLock(str(Path(tempfile.gettempdir()) / "physis-example-family.lock")):
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                              "--no-deps", "--no-build-isolation", "--force-reinstall", str(EXAMPLE_FAMILY)],
                             capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return EXAMPLE_FAMILY / "physis_gmlp" / "gmlp-policy.yaml"
