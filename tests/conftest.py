"""Shared test set-up: single-threaded torch (as the workers run) and small helpers."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

TEST_TIMEOUT_S = 600   # per test, its fixtures' set-up included: the slowest takes about 75 s on a slow CI host


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
