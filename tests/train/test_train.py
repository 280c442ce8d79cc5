"""physis-train: the scripted expert, the differentiable noisy-KV computation (= what the server
computes), deterministic training whose loss falls, and the shipped demo checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from physis_ros.cli.train import main as train_main
from physis_ros.model import KVBatch, build_model, load_model_config
from physis_ros.model.checkpoint import load_checkpoint, read_checkpoint_config
from physis_ros.observations import ScriptedExpert, SyntheticScene, TrackingScene, locate_disc
from physis_ros.reference import ReferenceRollout
from physis_ros.train.dataset import sample_batch, training_episodes
from physis_ros.train.evaluate import tracking_error
from physis_ros.train.noisy_kv import rollout, sequence_velocities, trainable_model
from physis_ros.train.trainer import TrainSettings, train

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "checkpoints" / "tiny-wam-demo.safetensors"
TARGET_RATIO = 0.3


@pytest.fixture(scope="module")
def config():
    return load_model_config("tiny-wam")


# ----------------------------------------------------------------------------- the expert and the scenes

def test_expert_is_a_function_of_the_observation(config):
    expert = ScriptedExpert()
    for scene in (SyntheticScene(config.observation_shapes), TrackingScene(config.observation_shapes)):
        for stream in ("a", "b"):
            for c in (0, 5, 17):
                obs = scene.observation(stream, c)
                assert np.allclose(locate_disc(obs["image"]), scene.disc(stream, c), atol=1e-5)
                chunk = scene.expert(stream, c)
                assert chunk.shape == (16, 7) and chunk.dtype == np.float32
                assert np.allclose(expert.act(obs["image"], obs["state"]), chunk, atol=1e-4)
                # moves from the state towards the target, monotonically, within the joints' range
                target = expert.target(scene.disc(stream, c), 7)
                assert np.all(np.abs(target) <= 0.8)
                gap = np.abs(chunk - target)
                assert np.all(np.diff(gap, axis=0) <= 1e-6)


def test_tracking_scene_follows_the_expert_and_keeps_the_scene_image(config):
    free, tracking = SyntheticScene(config.observation_shapes), TrackingScene(config.observation_shapes)
    s = tracking.execute_steps
    assert s == 5                                   # 50 Hz control, 10 Hz chunks
    for c in range(6):
        a, b = free.observation("r", c), tracking.observation("r", c)
        assert np.array_equal(a["image"], b["image"])
        nxt = tracking.observation("r", c + 1)["state"]
        assert np.allclose(nxt, tracking.expert("r", c)[s - 1], atol=1e-6)
    # a fresh scene computes the same states (no hidden order dependence)
    assert np.array_equal(TrackingScene(config.observation_shapes).observation("r", 5)["state"],
                          tracking.observation("r", 5)["state"])


# ----------------------------------------------------------------------------- training == serving

def test_training_computation_equals_the_reference_bit_for_bit(config):
    """The rollout written with the training pieces (ListKV, unmemoised modulation) is the server's."""
    served, trainable = build_model(config), trainable_model(config)
    scene = TrackingScene(config.observation_shapes)
    obs = [scene.observation("r0", c) for c in range(config.window + 3)]   # past a full window
    ref = ReferenceRollout(served, seed=7)
    expected = [ref.step("r0", o).output for o in obs]
    got = rollout(trainable, [served.observation_tensors(o) for o in obs], seed=7, stream="r0")
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("sink", [False, True])
def test_sequence_velocities_equal_the_servers_kv_tables(config, sink):
    """One sequence at one step: ListKV (window + sink rule) == KVTable/KVBatch, bit for bit; and a
    batch of sequences at mixed steps equals each alone to float tolerance."""
    cfg = dataclasses.replace(config, sink=sink)
    served, trainable = build_model(cfg), trainable_model(cfg)
    data = training_episodes(cfg, 3, 8)
    batch = sample_batch(data, 3, 6, cfg.steps, torch.Generator().manual_seed(1))
    t = served.timesteps.timestep(batch.k).view(-1, 1, 1, 1)
    x = t * batch.eps + (1 - t) * batch.x0
    with torch.no_grad():
        together = sequence_velocities(trainable, batch.obs, x, batch.k)
        for i in range(3):
            ki = batch.k[i:i + 1]
            alone = sequence_velocities(trainable, [{n: o[n][i:i + 1] for n in o} for o in batch.obs], x[i:i + 1], ki)
            assert torch.allclose(alone, together[i:i + 1], atol=1e-5)
            tables = [served.new_kv_table(b, 1) for b in range(cfg.blocks)]
            ti = served.timesteps.timestep(ki)
            for s, o in enumerate(batch.obs):
                h = served.embed(served.encode({n: o[n][i:i + 1] for n in o}), x[i:i + 1, s], ti)
                for b in range(cfg.blocks):
                    h = served.block(b, h, ti, KVBatch(tables[b], [0]))
                assert torch.equal(served.head(h, ti), alone[:, s])


# ----------------------------------------------------------------------------- training

SMALL = dict(batch=4, episodes=4, chunks=6, lr=1e-3, warmup=2)


@pytest.mark.slow
def test_training_is_deterministic_from_the_seed(config):
    data = training_episodes(config, SMALL["episodes"], SMALL["chunks"])
    a = train(config, TrainSettings(steps=3, seed=5, **SMALL), data=data)
    b = train(config, TrainSettings(steps=3, seed=5, **SMALL), data=data)
    c = train(config, TrainSettings(steps=3, seed=6, **SMALL), data=data)
    assert a.losses == b.losses
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.losses != c.losses
    assert not torch.equal(sa["io.action_out.weight"], build_model(config).state_dict()["io.action_out.weight"])


@pytest.mark.slow
def test_loss_falls(config):
    settings = TrainSettings(steps=40, seed=0, batch=8, episodes=8, chunks=8, lr=1e-3, warmup=5)
    losses = train(config, settings).losses
    assert np.mean(losses[-8:]) < 0.5 * np.mean(losses[:4]), losses


# ----------------------------------------------------------------------------- the CLI and the shipped checkpoint

def test_cli_writes_a_servable_checkpoint_and_the_curve(config, tmp_path, capsys):
    out, curve = tmp_path / "m.safetensors", tmp_path / "curve.json"
    code = train_main(["--out", str(out), "--steps", "2", "--batch", "2", "--episodes", "2", "--chunks", "4",
                       "--eval-chunks", "1", "--threads", "1", "--json", str(curve)])
    assert code == 0
    assert read_checkpoint_config(out) == config          # the server compares it with the preset's
    data = json.loads(curve.read_text())
    assert len(data["losses"]) == 2 and data["settings"]["seed"] == 0
    assert set(data["tracking_error"]) == {"tracking", "free"}
    load_checkpoint(out)


@pytest.mark.parametrize("args, text", [
    (["--out", "x.pt"], "must end in .safetensors"),
    (["--out", "x.safetensors", "--steps", "0"], "--steps"),
    (["--out", "x.safetensors", "--model", "tiny-acwm"], "has no VAE to make their targets"),
    ([], "--out"),
])
def test_cli_errors_are_one_line(args, text, capsys):
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("physis-train: error:") and text in err[0]


def test_shipped_checkpoint_loads_and_tracks_the_expert(config):
    assert SHIPPED.is_file(), "ship the checkpoint: see physis_ros/cli/train.py for the command"
    assert SHIPPED.stat().st_size < 10 * 2**20
    assert read_checkpoint_config(SHIPPED) == config
    trained = load_checkpoint(SHIPPED)
    for kind in ("tracking", "free"):
        ours = tracking_error(trained, kind=kind, streams=("eval-0", "eval-1"), chunks=4)
        rand = tracking_error(build_model(config), kind=kind, streams=("eval-0", "eval-1"), chunks=4)
        assert ours["rms"] <= TARGET_RATIO * rand["rms"], (kind, ours, rand)
