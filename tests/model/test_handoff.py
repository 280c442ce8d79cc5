"""The hand-off rule: real-time chunking's weights, and frozen rows that equal the previous chunk exactly."""

import math

import pytest
import torch

from physis_ros.model.handoff import Handoff, guide, step_weights, weights


def test_soft_weights_follow_the_rtc_schedule():
    h, rows, s, d = Handoff("soft", 2, 6), 16, 6, 2
    w = weights(h, rows)
    overlap = rows - s
    assert w[:d].tolist() == [1.0, 1.0] and w[overlap:].eq(0).all()
    for i in range(d, overlap):
        c = (overlap - i) / (overlap - d + 1)
        assert w[i].item() == pytest.approx(c * (math.exp(c) - 1) / (math.e - 1))
    assert all(w[i] >= w[i + 1] for i in range(rows - 1))  # decays towards the new chunk's own plan
    assert weights(Handoff("hard", 2, 6), rows).tolist() == [1.0, 1.0] + [0.0] * 14


def test_per_step_pulls_compound_to_the_schedule_and_frozen_rows_stay_frozen():
    h, rows, steps = Handoff("soft", 3, 6), 16, 4
    w, per_step = weights(h, rows), step_weights(h, rows, steps)
    assert per_step[:3].tolist() == [1.0, 1.0, 1.0] and per_step[10:].eq(0).all()
    assert torch.allclose(1 - (1 - per_step) ** steps, w, atol=1e-6)     # K pulls of w' = one pull of w
    assert (per_step[3:10] < w[3:10]).all()
    assert torch.equal(step_weights(h, rows, 1), w)
    assert torch.equal(step_weights(Handoff("hard", 3, 6), rows, steps), weights(Handoff("hard", 3, 6), rows))


def test_the_last_step_freezes_the_first_d_rows_exactly():
    torch.manual_seed(0)
    prev = torch.randn(16, 7)
    x, v = torch.randn(16, 7), torch.randn(16, 7)
    for mode, steps in (("hard", 1), ("soft", 1), ("soft", 4)):
        out, clean = guide(x, v, 0.25, 0.0, prev, Handoff(mode, 3, 5), steps)
        assert torch.equal(out, clean)
        assert torch.equal(out[:3], prev[5:8])           # bit for bit what the previous chunk committed
        assert not torch.equal(out[12:], prev[12:].roll(0))  # beyond the overlap: the new chunk's own plan
    # an earlier step moves x towards the guided estimate without landing on it
    out, clean = guide(x, v, 0.75, 0.5, prev, Handoff("hard", 3, 5))
    assert torch.equal(clean[:3], prev[5:8]) and not torch.equal(out[:3], prev[5:8])


def test_without_a_previous_chunk_the_step_is_the_plain_flow_update_up_to_rounding():
    torch.manual_seed(1)
    x, v = torch.randn(16, 7), torch.randn(16, 7)
    out, clean = guide(x, v, 0.75, 0.5, None, Handoff("soft", 2, 8))
    assert torch.allclose(out, x + (0.5 - 0.75) * v, atol=1e-6) and torch.allclose(clean, x - 0.75 * v)
