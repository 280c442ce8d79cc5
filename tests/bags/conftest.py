"""Bag tests: a ROS domain of this test process's own, the bundled bag, and the replay harness fixture.

``bag_check`` runs ``physis-bag check`` on the bundled bag once per session:
the server (``physis-serve --deterministic``) in a process of its own, replay
and recording in this one; tests assert on its result and on the bag it recorded.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from domains import domain

DATA = Path(__file__).resolve().parent.parent / "data"
SCENE_BAG = DATA / "scene_bag"
DOMAIN_ID = str(domain("bags"))


@contextlib.contextmanager
def own_ros_domain():
    """This process's DDS traffic (and that of the processes it starts) on a domain of its own, loopback only."""
    saved = {k: os.environ.get(k) for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")}
    os.environ["ROS_DOMAIN_ID"] = DOMAIN_ID
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    try:
        yield DOMAIN_ID
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True, scope="module")
def ros_domain():
    with own_ros_domain() as domain:
        yield domain


@pytest.fixture(scope="session")
def scene_bag() -> Path:
    assert (SCENE_BAG / "metadata.yaml").exists(), "bundled bag missing: run tools/make_scene_bag.py"
    return SCENE_BAG


@pytest.fixture(scope="session")
def bag_check(scene_bag, tmp_path_factory):
    """The replay harness on the bundled bag (outputs kept for the tests that read them)."""
    from physis_ros.bags.check import CheckOptions, run_check

    out = tmp_path_factory.mktemp("check")
    with own_ros_domain():
        return run_check(CheckOptions(bag=scene_bag, out=str(out), timeout_s=150.0))
