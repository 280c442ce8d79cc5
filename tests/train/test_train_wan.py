"""physis-train on a Wan world-action model (tiny-wan-wam): the training computation is the server's (diffusers'
own blocks through the served K/V rule), its frame targets are the VAE's encoding of the scene's video, the
checkpoint directory it writes is served bit for bit as the model it trained, and the shipped one tracks the
expert."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from physis_ros.cli.train import main as train_main
from physis_ros.model import KVBatch, build_model, load_model_config
from physis_ros.observations import SyntheticScene, TrackingScene
from physis_ros.reference import ReferenceRollout
from physis_ros.serving.catalog import model_config_of
from physis_ros.train.dataset import sample_batch, training_episodes
from physis_ros.train.evaluate import tracking_error
from physis_ros.train.frames import FrameTargets
from physis_ros.train.noisy_kv import rollout, sequence_velocities, trainable_model
from physis_ros.train.trainer import TrainSettings, flow_matching_loss, train

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "checkpoints" / "tiny-wan-wam-demo"
TARGET_RATIO = 0.3


@pytest.fixture(scope="module")
def config():
    return load_model_config("tiny-wan-wam")


@pytest.mark.parametrize("rule", ["same_step", "clean"])
def test_training_rollout_equals_the_served_reference_bit_for_bit(config, rule):
    """Diffusers' blocks through ListKV (keys placed at their RoPE positions, the prompt-free cross-attention
    projected per call) give the server's chunks, past a full window; under ``clean`` through a read-only noisy
    pass, then the t = 0 pass that writes."""
    cfg = dataclasses.replace(config, history=rule)
    served, trainable = build_model(cfg), trainable_model(cfg)
    scene = TrackingScene(cfg.observation_shapes)
    obs = [scene.observation("r0", c) for c in range(cfg.window + 3)]
    ref = ReferenceRollout(served, seed=3)
    expected = [ref.step("r0", o).output for o in obs]
    got = rollout(trainable, [served.observation_tensors(o) for o in obs], seed=3, stream="r0")
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    if rule == "clean":
        same = rollout(trainable_model(config), [served.observation_tensors(o) for o in obs], seed=3, stream="r0")
        assert torch.equal(same[0], got[0]) and not torch.equal(same[-1], got[-1])   # the rules differ past chunk 0


def test_sequence_velocities_equal_the_servers_kv_tables_and_carry_gradients(config):
    served, trainable = build_model(config), trainable_model(config)
    data = training_episodes(config, 2, 5)
    batch = sample_batch(data, 2, config.window + 2, config.steps, torch.Generator().manual_seed(4))
    assert batch.x0.shape == (2, config.window + 2, *config.output_shape)
    t = served.timesteps.timestep(batch.k).view(-1, 1, 1)
    x = t * batch.eps + (1 - t) * batch.x0
    together = sequence_velocities(trainable, batch.obs, x, batch.k)
    with torch.no_grad():
        for i in range(2):
            tables = [served.new_kv_table(b, 1) for b in range(config.blocks)]
            ti = served.timesteps.timestep(batch.k[i:i + 1])
            for s, o in enumerate(batch.obs):
                h = served.embed(served.encode({n: o[n][i:i + 1] for n in o}), x[i:i + 1, s], ti)
                for b in range(config.blocks):
                    h = served.block(b, h, ti, KVBatch(tables[b], [0]))
                assert torch.allclose(served.head(h, ti), together[i:i + 1, s], atol=1e-5)
    loss = flow_matching_loss(trainable, batch)
    loss.backward()
    adapter = dict(trainable.adapter.named_parameters())
    assert adapter["action_out.weight"].grad is not None and adapter["action_out.weight"].grad.abs().sum() > 0
    assert trainable.blocks["0"].attn1.to_k.weight.grad.abs().sum() > 0      # history K/V is learned through


def test_clean_rule_sequence_velocities_read_the_teacher_forced_clean_kv(config):
    """Each noisy chunk reads what a t = 0 pass over the earlier chunks' expert targets wrote in the server's
    K/V tables; the clean targets change every chunk but the first, and gradients reach the clean pass."""
    cfg = dataclasses.replace(config, history="clean")
    served, trainable = build_model(cfg), trainable_model(cfg)
    data = training_episodes(cfg, 2, 5)
    batch = sample_batch(data, 2, cfg.window + 2, cfg.steps, torch.Generator().manual_seed(6))
    t = served.timesteps.timestep(batch.k).view(-1, 1, 1)
    x = t * batch.eps + (1 - t) * batch.x0
    together = sequence_velocities(trainable, batch.obs, x, batch.k, batch.x0)
    with torch.no_grad():
        for i in range(2):
            tables = [served.new_kv_table(b, 1) for b in range(cfg.blocks)]
            ti = served.timesteps.timestep(batch.k[i:i + 1])
            t0 = served.timesteps.timestep(torch.zeros(1, dtype=torch.long))
            for s, o in enumerate(batch.obs):
                cond = served.encode({n: o[n][i:i + 1] for n in o})
                h = served.embed(cond, x[i:i + 1, s], ti)
                for b in range(cfg.blocks):
                    h = served.block(b, h, ti, KVBatch(tables[b], [0], [False]))
                assert torch.allclose(served.head(h, ti), together[i:i + 1, s], atol=1e-5)
                h = served.embed(cond, batch.x0[i:i + 1, s], t0)
                for b in range(cfg.blocks):
                    h = served.block(b, h, t0, KVBatch(tables[b], [0]))
        other = sequence_velocities(trainable, batch.obs, x, batch.k, batch.x0.flip(0))
    assert torch.equal(other[:, 0], together[:, 0].detach()) and not torch.allclose(other[:, 1:], together[:, 1:])
    x0 = batch.x0.clone().requires_grad_(True)
    sequence_velocities(trainable, batch.obs, x, batch.k, x0).square().sum().backward()
    assert x0.grad[:, :-1].abs().sum() > 0 and x0.grad[:, -1].abs().sum() == 0   # the last chunk writes nothing read


def test_sequence_velocities_refuse_what_they_do_not_train(config):
    data = training_episodes(config, 1, 3)
    batch = sample_batch(data, 1, 2, config.steps, torch.Generator().manual_seed(0))
    clean = trainable_model(dataclasses.replace(config, history="clean"))
    with pytest.raises(ValueError, match="x0"):
        sequence_velocities(clean, batch.obs, batch.x0, batch.k)
    latest = trainable_model(dataclasses.replace(config, history="latest"))
    with pytest.raises(ValueError, match="train under same_step or clean"):
        sequence_velocities(latest, batch.obs, batch.x0, batch.k, batch.x0)


def test_frame_targets_are_the_vaes_encoding_of_the_chunks_video(config):
    """The first latent frame is the chunk's own camera (Wan's causal VAE encodes it alone); the video spans the
    chunk's actions (16 rows at 50 Hz); different chunks differ."""
    from physis_ros.model.wan_acwm import camera_latent

    targets = FrameTargets(config)
    assert targets.frames == 5 and targets.size == (64, 64)
    scene = SyntheticScene(config.observation_shapes)
    latents = targets.latents(scene, "s0", 3)
    assert latents.shape == (3, 4, 2, 8, 8) and torch.isfinite(latents).all()
    video = targets.video(scene, "s0", 1)
    phase = scene.phase("s0")
    assert targets.span_s == pytest.approx(0.32)
    assert np.array_equal(video[:, 0], scene.image((3, 64, 64), 0.1, phase))
    assert np.array_equal(video[:, -1], scene.image((3, 64, 64), 0.1 + targets.span_s, phase))
    with torch.no_grad():
        alone = camera_latent(targets.vae, targets.scale, torch.from_numpy(video[None, :, 0]))
    assert torch.allclose(alone[0, :, 0], latents[1, :, 0], atol=1e-5)
    assert (latents[0] - latents[2]).abs().max() > 1e-3


@pytest.mark.slow
def test_training_is_deterministic_and_the_loss_falls(config):
    settings = TrainSettings(steps=30, batch=8, episodes=4, chunks=6, lr=2e-3, warmup=3, seed=1)
    data = training_episodes(config, settings.episodes, settings.chunks)
    a, b = train(config, settings, data=data), train(config, settings, data=data)
    assert a.losses == b.losses
    assert np.mean(a.losses[-5:]) < 0.5 * np.mean(a.losses[:3]), a.losses


def test_cli_writes_a_directory_served_as_the_model_it_trained(config, tmp_path):
    out, curve = tmp_path / "wan-demo", tmp_path / "curve.json"
    code = train_main(["--model", "tiny-wan-wam", "--out", str(out), "--steps", "2", "--batch", "2",
                       "--episodes", "2", "--chunks", "4", "--eval-chunks", "1", "--json", str(curve)])
    assert code == 0
    for name in ("physis_model.yaml", "adapter.safetensors", "adapter.json", "transformer/config.json",
                 "transformer/diffusion_pytorch_model.safetensors", "vae/config.json"):
        assert (out / name).is_file(), name
    loaded, checkpoint = model_config_of(str(out))
    assert checkpoint is None and loaded.kind == "wan_wam" and loaded.name == "wan-demo"
    assert loaded.wan.vae == str((out / "vae").resolve())
    for field in ("steps", "window", "timestep_shift", "hidden", "heads", "blocks", "output_shape"):
        assert getattr(loaded, field) == getattr(config, field), field
    data = json.loads(curve.read_text())
    assert len(data["losses"]) == 2 and set(data["tracking_error"]) == {"tracking", "free"}
    # the directory serves the trained weights: its chunks are not the random preset's, and the same
    # directory loaded twice gives the same chunks
    obs = TrackingScene(config.observation_shapes).observation("r", 0)
    a = ReferenceRollout(build_model(loaded), 0).step("r", obs).output
    b = ReferenceRollout(build_model(load_model_config(str(out))), 0).step("r", obs).output
    c = ReferenceRollout(build_model(config), 0).step("r", obs).output
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cli_trains_under_the_clean_rule_and_the_directory_is_served_under_it(tmp_path):
    out, curve = tmp_path / "wan-clean", tmp_path / "curve.json"
    assert train_main(["--model", "tiny-wan-wam", "--history", "clean", "--out", str(out), "--steps", "2", "--batch",
                       "2", "--episodes", "2", "--chunks", "4", "--eval-chunks", "0", "--json", str(curve)]) == 0
    loaded, _ = model_config_of(str(out))
    assert loaded.history == "clean" and json.loads(curve.read_text())["history"] == "clean"


def test_cli_refuses_a_rule_it_does_not_train(tmp_path, capsys):
    assert train_main(["--model", "tiny-wan-wam", "--history", "latest", "--out", str(tmp_path / "x")]) == 2
    assert "--history" in capsys.readouterr().err


@pytest.mark.parametrize("args, text", [
    (["--model", "tiny-wan-wam", "--out", "x.safetensors"], "checkpoint directory"),
    (["--model", "wan2.1-1.3b", "--out", "x"], "from no actions"),
])
def test_cli_errors_are_one_line(args, text, capsys):
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("physis-train: error:") and text in err[0]


@pytest.mark.parametrize("name, rule", [("tiny-wan-wam-demo", "same_step"), ("tiny-wan-wam-clean", "clean")])
def test_shipped_wan_wam_is_bundled_and_tracks_the_expert(config, name, rule):
    shipped = SHIPPED.parent / name
    assert (shipped / "physis_model.yaml").is_file(), "ship it: see physis_ros/cli/train.py for the command"
    assert sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file()) < 10 * 2**20
    trained_config, _ = model_config_of(name)        # the bundled name
    assert trained_config.kind == "wan_wam" and trained_config.output_shape == config.output_shape
    assert trained_config.history == rule
    trained = build_model(trained_config)
    for kind in ("tracking", "free"):
        ours = tracking_error(trained, kind=kind, streams=("eval-0", "eval-1"), chunks=4)
        rand = tracking_error(build_model(config), kind=kind, streams=("eval-0", "eval-1"), chunks=4)
        assert ours["rms"] <= TARGET_RATIO * rand["rms"], (kind, ours, rand)


# ----------------------------------------------------------------------------- the world model (tiny-wan-acwm)

@pytest.fixture(scope="module")
def world():
    return load_model_config("tiny-wan-acwm")


def test_a_world_model_imagines_the_experts_chunk_and_learns_the_videos_latents(world):
    from physis_ros.observations import ScriptedExpert

    data = training_episodes(world, 2, 5)
    assert data.world and data.frames.shape == (2, 5, 4, 2, 8, 8)
    batch = sample_batch(data, 3, world.window + 1, world.steps, torch.Generator().manual_seed(2))
    assert batch.x0.shape == (3, world.window + 1, *world.output_shape)
    assert set(batch.obs[0]) == {"image", "state", "actions"} and batch.obs[0]["image"].shape == (3, 3, 64, 64)
    scene = SyntheticScene(world.observation_shapes)
    chunk = scene.expert(data.streams[0], 1, ScriptedExpert(horizon=16))
    assert np.array_equal(data.actions[0, 1].numpy(), chunk)
    assert torch.equal(data.frames[0], FrameTargets(world).latents(scene, data.streams[0], 5))
    # one training step's loss is the frames' velocity MSE, with gradients into the trunk and the adapter
    model = trainable_model(world)
    loss = flow_matching_loss(model, batch)
    loss.backward()
    assert model.adapter["actions"].weight.grad.abs().sum() > 0 and model.adapter["camera_pos"].weight.grad is not None


def test_the_vae_learns_the_scenes_video_and_normalises_its_latents(world):
    from physis_ros.model.wan_acwm import LatentScale, load_vae, video_latent
    from physis_ros.train.vae import VAESettings, train_vae

    targets, scene = FrameTargets(world), SyntheticScene(world.observation_shapes)
    clips = torch.from_numpy(np.stack([targets.video(scene, f"v{e}", c) for e in range(2) for c in range(4)]))
    vae = load_vae(world)

    def error() -> float:
        with torch.no_grad():
            return float((vae.decode(vae.encode(clips * 2 - 1).latent_dist.mode()).sample - (clips * 2 - 1))
                         .square().mean())

    before = error()
    losses = train_vae(vae, clips, VAESettings(steps=25, batch=4, lr=2e-3))
    assert len(losses) == 25 and error() < 0.5 * before
    with torch.no_grad():
        latents = video_latent(vae, LatentScale(vae), clips)
    per_channel = latents.transpose(0, 1).flatten(1)
    assert torch.allclose(per_channel.mean(1), torch.zeros(4), atol=1e-3)
    assert torch.allclose(per_channel.std(1), torch.ones(4), atol=1e-3)


def test_cli_trains_a_world_models_vae_then_its_trunk_and_pictures_it(world, tmp_path):
    out, curve, picture = tmp_path / "wm", tmp_path / "curve.json", tmp_path / "frames.png"
    code = train_main(["--model", "tiny-wan-acwm", "--out", str(out), "--steps", "2", "--batch", "2", "--episodes",
                       "2", "--chunks", "4", "--eval-chunks", "1", "--vae-steps", "2", "--vae-episodes", "1",
                       "--figure", str(picture), "--json", str(curve)])
    assert code == 0
    loaded, _ = model_config_of(str(out))
    assert loaded.kind == "wan_acwm" and loaded.wan.vae == str((out / "vae").resolve()) and not loaded.wan.vae_config
    stored = json.loads((out / "vae" / "config.json").read_text())
    assert stored["latents_std"] != [1.0] * 4                     # the trained VAE's own statistics
    data = json.loads(curve.read_text())
    assert set(data["world_error"]) == {"trained", "random"}
    assert {"latent_mse", "copy_latent_mse", "pixel_mse", "copy_pixel_mse"} <= set(data["world_error"]["trained"])
    assert picture.stat().st_size > 1000
    obs = {**TrackingScene(world.observation_shapes).observation("r", 0),
           "actions": np.zeros((16, 7), np.float32)}
    a = ReferenceRollout(build_model(loaded), 0).step("r", obs).output
    assert a.shape == world.output_shape and torch.isfinite(a).all()


@pytest.mark.parametrize("args, text", [
    (["--out", "x.safetensors", "--vae-steps", "3"], "no random VAE to train"),
    (["--model", "tiny-wan-wam", "--out", "x", "--figure", "f.png"], "pictures are of a world model"),
])
def test_cli_refuses_what_it_cannot_do_in_one_line(args, text, capsys):
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0]


def test_shipped_wan_world_model_beats_copying_the_last_frame(world):
    """The trained world model's frames are closer to the true video than the camera held still, in its VAE's
    latents and in pixels, on held-out streams."""
    from physis_ros.train.evaluate import world_error

    directory = ROOT / "config" / "checkpoints" / "tiny-wan-acwm-demo"
    assert sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) < 10 * 2**20
    trained_config, _ = model_config_of("tiny-wan-acwm-demo")
    assert trained_config.kind == "wan_acwm" and trained_config.wan.vae == str((directory / "vae").resolve())
    ours = world_error(build_model(trained_config), streams=("eval-0", "eval-1"), chunks=3)
    assert ours["latent_mse"] < ours["copy_latent_mse"] and ours["pixel_mse"] < ours["copy_pixel_mse"], ours
