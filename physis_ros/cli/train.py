"""``physis-train``: train a world-action model (tiny-wam, tiny-wan-wam) to imitate the scripted expert on the
synthetic scene.

The expert (physis_ros.observations.ScriptedExpert) looks at where the target disc is in the camera
image, maps it to a joint pose, and moves the 7 joints from their current state towards it. The model
is trained with flow matching on sequences of consecutive chunks at one noise level each, running the
server's noisy-KV computation (each chunk attends to the K/V its predecessors in the window wrote at
the same denoising step), so the checkpoint is served by the unchanged server. Deterministic from
--seed (same torch build and --threads); the checkpoint holds the model's config, so
`engine.checkpoint: <file>` (with `engine.model: tiny-wam`) or a stream's `model: <file>` serves it.
After training the checkpoint is loaded back and its tracking error (RMS, rad, against the expert on
held-out streams, run through the sequential reference) is compared with the random-init model's.

A Wan world-action model (tiny-wan-wam) is written as a checkpoint directory (``--out DIR``: diffusers'
``transformer/`` and ``vae/``, the adapter, ``physis_model.yaml``; ``model: DIR`` serves it). It learns the
expert's actions and, in the same chunk, the scene's video over the chunk's actions as its VAE encodes it
(physis_ros/train/frames.py); the loss is the mean of the two parts' velocity MSEs. A Wan world model
(tiny-wan-acwm) learns that video imagining the expert's chunk; ``--vae-steps N`` first trains its random VAE
on the scene's video (physis_ros/train/vae.py) so that its frames decode to pictures, and its evaluation
compares the predicted frames with the true video and with copying the last frame (``--figure`` draws them).

    physis-train --out config/checkpoints/tiny-wam-demo.safetensors [--steps 1000] [--seed 0]
                 [--batch 32] [--threads 1] [--history same_step|clean] [--json curve.json]

The shipped config/checkpoints/tiny-wan-wam-demo/ (served as wan_wam by config/serve_wan_tiny.yaml) was made by

    physis-train --model tiny-wan-wam --out config/checkpoints/tiny-wan-wam-demo --steps 800 --lr 2e-3 \
                 --episodes 64 --json config/checkpoints/tiny-wan-wam-demo.json

config/checkpoints/tiny-wan-wam-clean/ (the same model trained under the clean history rule, for
``physis-bench history-quality``) by the same command with ``--history clean --out
config/checkpoints/tiny-wan-wam-clean --json config/checkpoints/tiny-wan-wam-clean.json``,
and config/checkpoints/tiny-wan-acwm-demo/ (served as wan_wm) by

    physis-train --model tiny-wan-acwm --out config/checkpoints/tiny-wan-acwm-demo --steps 800 --lr 2e-3 \
                 --episodes 64 --vae-steps 300 --vae-episodes 16 --eval-chunks 8 \
                 --figure bench/out/tiny_wan_acwm_frames.png --json config/checkpoints/tiny-wan-acwm-demo.json

The shipped config/checkpoints/tiny-wam-demo.safetensors was made by

    physis-train --out config/checkpoints/tiny-wam-demo.safetensors --json config/checkpoints/tiny-wam-demo.json

(defaults: --steps 1000 --seed 0 --batch 32 --threads 1; the JSON beside it holds the command, the
loss curve, the wall time and the tracking errors). One thread is the default because it is the
faster one on a 2-core machine (two threads contend with everything else and were slower here).

Exit status: 0 success; 1 the run failed (the loss diverged); 2 usage or input error (bad flag or
value, unknown preset, a model that is not a world-action model, unwritable --out or --json);
70 internal error (a bug; PHYSIS_DEBUG=1 shows the traceback); 130 interrupted.
Errors are one line on stderr: 'physis-train: error: <what and the fix>'.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from physis_ros.console import (EXIT_FAILED, ArgumentParser, check_writable, cli_main, fail, model_arg,
                                   nonneg_int, positive_float, positive_int, set_threads, write_json)

PROG = "physis-train"


@cli_main(PROG)
def main(argv: list[str] | None = None) -> int:
    from physis_ros.train.trainer import TrainSettings

    d = TrainSettings()
    p = ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--out", required=True, help="checkpoint to write (.safetensors; a directory for a Wan model)")
    p.add_argument("--model", type=model_arg, default="tiny-wam", help="preset name or model YAML path (a WAM)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimiser steps")
    p.add_argument("--seed", type=nonneg_int, default=d.seed, help="data order, steps and noise")
    p.add_argument("--batch", type=positive_int, default=d.batch, help="sequences per step")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak Adam learning rate")
    p.add_argument("--episodes", type=positive_int, default=d.episodes, help="demonstration episodes")
    p.add_argument("--chunks", type=positive_int, default=d.chunks, help="chunks per episode")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (bits of the result may "
                   "depend on it)")
    p.add_argument("--eval-chunks", type=nonneg_int, default=16,
                   help="chunks per held-out stream for the tracking error (0: skip the evaluation)")
    p.add_argument("--json", help="write the settings, loss curve and tracking errors here")
    p.add_argument("--vae-steps", type=nonneg_int, default=0,
                   help="a Wan model with a random VAE (wan.vae_config): first train the VAE this many steps on the "
                        "scene's video and write it to OUT/vae (0: keep the VAE as configured)")
    p.add_argument("--vae-episodes", type=positive_int, default=16, help="episodes of video the VAE trains on")
    p.add_argument("--vae-lr", type=positive_float, default=2e-3, help="the VAE's Adam learning rate")
    p.add_argument("--figure", help="a world model: write true vs predicted frames of held-out chunks here (.png)")
    p.add_argument("--history", choices=("same_step", "clean"),
                   help="the history rule to train under (docs/history.md; default: the model's own): same_step "
                        "reads earlier chunks' K/V of the same noise level, clean the K/V of a t = 0 pass over the "
                        "expert's earlier chunks; the checkpoint is served under it unless a config says otherwise")
    args = p.parse_args(argv)
    out = Path(args.out)
    check_writable(args.json)

    import torch

    from physis_ros.config import ConfigError
    from physis_ros.model import build_model, load_model_config
    from physis_ros.model.checkpoint import load_checkpoint, save_checkpoint
    from tqdm import tqdm

    from physis_ros.train.dataset import check_trainable, training_episodes
    from physis_ros.train.evaluate import tracking_error
    from physis_ros.train.trainer import train

    set_threads(args.threads)
    try:
        config = load_model_config(args.model)
        if args.history:
            config = replace(config, history=args.history)
        check_trainable(config)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    directory = config.wan is not None          # a Wan model is a checkpoint directory
    if directory and out.suffix:
        fail(f"--out {out}: a Wan model is written as a checkpoint directory; give a path without a suffix")
    if not directory and out.suffix != ".safetensors":
        fail(f"--out {out} must end in .safetensors (the server recognises checkpoints by that suffix)")
    check_writable(out / "physis_model.yaml" if directory else out, "--out")
    if args.chunks < config.window + 1:
        fail(f"--chunks {args.chunks} is shorter than one training sequence (window + 1 = {config.window + 1})")
    if args.vae_steps and not (directory and config.wan.vae_config and not config.wan.vae):
        fail(f"--vae-steps: model '{config.name}' has no random VAE to train (a Wan model with wan.vae_config)")
    if args.figure and config.produces != "frames":
        fail(f"--figure: model '{config.name}' produces {config.produces}; pictures are of a world model's frames")
    check_writable(args.figure, "--figure")
    if args.vae_steps:
        config = train_vae_first(config, out / "vae", args)
    settings = TrainSettings(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                             episodes=args.episodes, chunks=args.chunks)
    print(f"{PROG}: {config.name}, {settings.steps} steps x {settings.batch} sequences of {config.window + 1} "
          f"chunks under the {config.history} history rule, seed {settings.seed}, {args.threads} threads",
          file=sys.stderr, flush=True)
    what = "demonstrations" + (" (each chunk's video through the VAE)" if config.spec.has_frames else "")
    started = time.perf_counter()
    with tqdm(total=settings.episodes, desc=what, unit="episode", file=sys.stderr, mininterval=1.0) as bar:
        data = training_episodes(config, settings.episodes, settings.chunks, progress=bar.update)
    data_seconds = time.perf_counter() - started
    with tqdm(total=settings.steps, desc="training", unit="step", file=sys.stderr, mininterval=1.0) as bar:
        def progress(step: int, loss: float, _seconds: float) -> None:
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.5f}", refresh=False)

        try:
            result = train(config, settings, data=data, progress=progress, progress_every=10)
        except FloatingPointError as exc:
            bar.close()
            fail(str(exc), EXIT_FAILED)
    if directory:
        from physis_ros.model.wan_adapter import save_directory

        save_directory(result.model, out, out.name, f"{config.name} trained by physis-train on the scripted "
                                                    f"expert ({settings.steps} steps, seed {settings.seed})")
        written = [f for f in out.rglob("*") if f.is_file()]
    else:
        save_checkpoint(result.model, out)
        written = [out]
    umask = os.umask(0)
    os.umask(umask)
    for f in written:
        os.chmod(f, 0o666 & ~umask)   # safetensors writes 0600; a server running as another user reads it
    size = sum(f.stat().st_size for f in written)
    print(f"wrote {out} ({size / 2**20:.2f} MiB) after {data_seconds:.1f} s of demonstrations and "
          f"{result.seconds:.1f} s of training; loss {result.losses[0]:.4f} (first) -> "
          f"{sum(result.losses[-50:]) / len(result.losses[-50:]):.4f} (mean of the last 50 steps)")
    summary = {"command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]), "model": config.name,
               "history": config.history, "threads": args.threads, "torch": torch.__version__, "checkpoint": str(out),
               "bytes": size,
               "data_seconds": round(data_seconds, 2),
               **result.summary()}
    if args.eval_chunks and config.produces == "frames":
        start = time.perf_counter()
        summary["world_error"] = evaluate_world(build_model(load_model_config(str(out))), build_model(config),
                                                args)
        summary["eval_seconds"] = round(time.perf_counter() - start, 2)
    elif args.eval_chunks:
        start = time.perf_counter()
        trained = build_model(load_model_config(str(out))) if directory else load_checkpoint(out)
        random_model = build_model(config)
        summary["tracking_error"] = evaluation = {}
        for kind in ("tracking", "free"):
            a = tracking_error(trained, kind=kind, chunks=args.eval_chunks)
            b = tracking_error(random_model, kind=kind, chunks=args.eval_chunks)
            evaluation[kind] = {"trained_rms": a["rms"], "random_rms": b["rms"], "ratio": a["rms"] / b["rms"],
                                "hold_rms": a["hold_rms"], "trained_max_abs": a["max_abs"]}
            print(f"tracking error ({kind} scene, {a['actions']} actions): trained {a['rms']:.4f} rad, random "
                  f"{b['rms']:.4f} rad, ratio {a['rms'] / b['rms']:.3f}; holding the state: {a['hold_rms']:.4f}")
        summary["eval_seconds"] = round(time.perf_counter() - start, 2)
    if args.json:
        write_json(args.json, summary)
    return 0


def train_vae_first(config, directory: Path, args):
    """Train ``config``'s random VAE on the scene's video (``--vae-*``), write it to ``directory`` and return the
    config naming it (``wan.vae``)."""
    import dataclasses

    import numpy as np
    import torch
    from tqdm import tqdm

    from physis_ros.model.wan_acwm import load_vae
    from physis_ros.observations import SyntheticScene
    from physis_ros.train.frames import FrameTargets
    from physis_ros.train.vae import VAESettings, train_vae

    video, scene = FrameTargets(config), SyntheticScene(config.observation_shapes)
    clips = torch.from_numpy(np.stack([video.video(scene, f"vae-{e}", c) for e in range(args.vae_episodes)
                                       for c in range(args.chunks)]))
    settings = VAESettings(steps=args.vae_steps, lr=args.vae_lr, seed=args.seed)
    vae = load_vae(config)
    with tqdm(total=settings.steps, desc=f"VAE on {len(clips)} clips", unit="step", file=sys.stderr,
              mininterval=1.0) as bar:
        def progress(step: int, mse: float) -> None:
            bar.update(1)
            bar.set_postfix(mse=f"{mse:.5f}", refresh=False)

        try:
            losses = train_vae(vae, clips, settings, progress)
        except FloatingPointError as exc:
            bar.close()
            fail(str(exc), EXIT_FAILED)
    vae.save_pretrained(directory)
    print(f"wrote the VAE to {directory}: reconstruction MSE {losses[0]:.5f} (first) -> "
          f"{sum(losses[-20:]) / len(losses[-20:]):.5f} (mean of the last 20 steps)", file=sys.stderr)
    return dataclasses.replace(config, wan=dataclasses.replace(config.wan, vae=str(directory.resolve()),
                                                               vae_config={}))


def evaluate_world(trained, random_model, args) -> dict:
    """A world model's frames against the scene's video, trained and random, beside copying the last frame."""
    from physis_ros.train.evaluate import world_error, world_figure

    out = {}
    for name, model in (("trained", trained), ("random", random_model)):
        e = world_error(model, chunks=args.eval_chunks)
        samples = e.pop("samples")
        out[name] = e
        print(f"frames against the true video ({e['chunks']} chunks), {name}: latent MSE {e['latent_mse']:.5f} "
              f"(copying the last frame {e['copy_latent_mse']:.5f}), pixel MSE {e['pixel_mse']:.6f} (copying "
              f"{e['copy_pixel_mse']:.6f})")
        if name == "trained" and args.figure:
            world_figure(samples, args.figure, f"{trained.config.name}: held-out chunks, decoded by its VAE")
            print(f"wrote {args.figure}")
    return out


if __name__ == "__main__":
    sys.exit(main())
