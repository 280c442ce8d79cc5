"""Shared test set-up: single-threaded torch (as the workers run) and small helpers."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_wam():
    from physis_ros.model import build_model
    return build_model("tiny-wam")


@pytest.fixture(scope="session")
def tiny_acwm():
    from physis_ros.model import build_model
    return build_model("tiny-acwm")
