"""The benchmarks' simulated robot: it executes what the node would send, a jumping takeover eased."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.bench.robot import SimulatedRobot
from physis_ros.timeline import ControlTimeline

RATE = 50.0


def run_two_chunks(blend_steps: int) -> SimulatedRobot:
    """Chunk 0 (zeros) from step 0; chunk 1 (0.2 rad), for steps 6.., reaches the robot 2.5 steps after its row
    0 was due: it takes over at its row 3 (step 9), where chunk 0 prescribed 0."""
    timeline = ControlTimeline(RATE, horizon=16, execution=8, release_steps=6)    # the next chunk starts at row 6
    robot = SimulatedRobot(np.zeros(7), timeline, blend_steps=blend_steps)
    k, seam = robot.receive(-0.01, 0, 0.0, np.zeros((16, 7), np.float32))
    assert k == 0 and np.isnan(seam.position_jump)
    k, seam = robot.receive(6 / RATE + 2.5 / RATE, 6, 6 / RATE, np.full((16, 7), 0.2, np.float32), shift=6)
    assert k == 3 and seam.position_jump == pytest.approx(0.2)    # the seam as computed, either way
    return robot


def test_a_jumping_takeover_is_executed_eased_as_the_node_sends_it():
    robot = run_two_chunks(blend_steps=4)
    assert robot.eased_chunks == 1
    q = robot.trajectory()[:, 0]
    assert q[9] == 0.0 and q[12] == pytest.approx(0.2)              # from where chunk 0 had it, onto chunk 1
    assert robot.max_command_step() == pytest.approx(0.1, abs=1e-6)  # 0.2 over 3 rows (the next chunk's row 6)
    as_computed = run_two_chunks(blend_steps=0)
    assert as_computed.eased_chunks == 0 and as_computed.max_command_step() == pytest.approx(0.2)
    assert robot.jerk_rms() < as_computed.jerk_rms()
