"""Fixtures for the joint-scheduling tests (factories in sched_helpers.py)."""

from __future__ import annotations

import pytest

from sched_helpers import make_profile


@pytest.fixture(scope="session")
def profile_factory():
    return make_profile


@pytest.fixture(scope="session")
def h200_profiles():
    """Roofline profiles of the five paper-size backbones (modelled H200), computed once."""
    from physis_ros.scheduling.settings import load_device
    from physis_ros.scheduling.simulator import REPORT24_MODELS, load_profiles
    dev = load_device("h200")
    return dev, load_profiles(REPORT24_MODELS, dev)
