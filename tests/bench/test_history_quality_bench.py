"""physis-bench history-quality (issue 59): the seam and tracking measures on hand-made chunks, the tracking scene
bag the study feeds, and the whole study on the shipped checkpoints (few chunks and seeds): one row per (trained,
served) rule and seed, each rule's interval on a plan it permits, and a summary that is the rows' mean and spread."""

from __future__ import annotations

import json

import numpy as np
import pytest

from physis_ros.bench.history_quality import PAIRS, chunk_quality, control_stride
from physis_ros.cli.bench import main


def ramp(chunks: int, stride: int, horizon: int = 16, dof: int = 7) -> list[np.ndarray]:
    """Chunks of one straight trajectory: chunk c's row i is control step c * stride + i."""
    return [np.tile(((c * stride + np.arange(horizon)) * 0.01)[:, None], (1, dof)) for c in range(chunks)]


def test_chunks_of_one_trajectory_meet_at_their_seams_and_a_jump_is_measured():
    stride = control_stride(10.0, 50.0)
    assert stride == 5
    smooth = ramp(10, stride)
    q = chunk_quality(smooth, smooth, stride, 0.02)
    assert q["tracking_rms"] == 0.0 and q["seam_p99"] == pytest.approx(0.0, abs=1e-12)
    jumped = [c + (0.5 if i == 3 else 0.0) for i, c in enumerate(smooth)]      # chunk 3 off by 0.5 rad
    q = chunk_quality(jumped, smooth, stride, 0.02)
    assert q["seam_p99"] == pytest.approx(0.5) and q["seam_p50"] == pytest.approx(0.0, abs=1e-12)
    assert q["max_abs"] == pytest.approx(0.5) and q["tracking_rms"] == pytest.approx(0.5 / np.sqrt(10))


def test_the_tracking_scene_bag_records_an_arm_that_follows_the_expert():
    from physis_ros.bags.bagio import typestore
    from physis_ros.bags.scene import SceneSpec, scene_messages
    from physis_ros.observations import SyntheticScene, TrackingScene

    store = typestore()

    def positions(spec):
        return [store.deserialize_cdr(raw, t).position for topic, t, _, raw in scene_messages(spec)
                if topic.endswith("joint_states")]

    follows = positions(SceneSpec(namespaces=("r0",), duration_s=1.0, tracking=True))
    arm = TrackingScene({"state": (7,)})
    assert len(follows) == 10
    for tick, got in enumerate(follows):
        assert np.allclose(got, arm.observation_state("r0", tick, 7), atol=1e-6)
    for tick in range(9):     # the state at tick + 1 is where the expert's chunk for tick took the arm
        assert np.allclose(follows[tick + 1], arm.expert("r0", tick)[arm.execute_steps - 1], atol=1e-5)
    free = positions(SceneSpec(namespaces=("r0",), duration_s=1.0))
    assert np.allclose(free[3], SyntheticScene.joints(7, 0.3, SyntheticScene.phase("r0")))


@pytest.mark.slow
def test_the_study_on_the_shipped_checkpoints(tmp_path):
    out, png = tmp_path / "hq.json", tmp_path / "hq.png"
    assert main(["history-quality", "--chunks", "8", "--seeds", "2", "--interval-chunks", "16", "--repeats", "1",
                 "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert [(r["trained"], r["rule"], r["seed"]) for r in data["rows"]] == [
        (t, r, s) for t, r in PAIRS for s in (0, 1)]
    for row in data["rows"]:
        assert 0 < row["tracking_rms"] < 0.3 and 0 < row["seam_p99"] < 1.0, row   # trained: random-init is ~1.3
        assert row["interval_ms"] == data["intervals"][row["rule"]]["interval_ms"] > 0
    for (trained, rule), key in zip(PAIRS, data["summary"]):
        mine = [r["tracking_rms"] for r in data["rows"] if (r["trained"], r["rule"]) == (trained, rule)]
        assert key == f"{trained}->{rule}"
        assert data["summary"][key]["tracking_rms"]["mean"] == pytest.approx(np.mean(mine))
        assert data["summary"][key]["tracking_rms"]["std"] == pytest.approx(np.std(mine, ddof=1))
    seeds = [r["tracking_rms"] for r in data["rows"] if r["rule"] == "clean"]
    assert seeds[0] != seeds[1]                       # the noise seed matters, so the spread is real
    intervals = data["intervals"]
    assert intervals["clean"]["in_flight"] == intervals["latest"]["in_flight"] == 1
    assert intervals["same_step"]["in_flight"] > 1    # same_step pipelines chunks over the workers
    for rule, e in intervals.items():
        assert e["plan"] in e["permitted_plans_predicted_ms"]
        assert e["predicted_interval_ms"] == pytest.approx(min(e["permitted_plans_predicted_ms"].values()))
    assert "step" not in intervals["clean"]["permitted_plans_predicted_ms"]   # a block's steps split: refused
    assert data["expert"]["tracking_rms"] == 0.0 and data["expert"]["seam_p99"] < 0.05
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["history-quality", "--clean", str(tmp_path), "--json", str(tmp_path / "x.json"),
                 "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "--clean" in err and "physis-train --history clean" in err and "Traceback" not in err


def test_train_writes_both_checkpoints_under_their_rules(tmp_path, monkeypatch):
    from physis_ros.bench import history_quality
    from physis_ros.serving.catalog import model_config_of

    monkeypatch.setattr(history_quality, "TRAIN_SETTINGS", dict(steps=2, batch=2, episodes=2, chunks=4))
    dirs = history_quality.train_checkpoints(tmp_path)
    for rule, directory in dirs.items():
        config, _ = model_config_of(directory)
        assert config.history == rule and config.kind == "wan_wam"
