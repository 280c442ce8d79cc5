"""``physis-rollout --model DIR``: the rollout of a Wan transformer directory (cli/rollout.py's command for a
diffusers directory) through the model contract (the ``wan`` family, physis_ros/model/wan_model.py), so that
anyone can recompute a chunk.

    physis-rollout --model DIR --prompt-embeds FILE [--chunks N] [--seed S] [--frames F --height H --width W]
                   [--history same_step|clean|latest] [--window W] [--steps K --shift S] [--dtype fp32|bf16|fp16]
                   [--plan P --workers N] [--recompute] [--tensors OUT.safetensors] [--json OUT.json]

The model is the directory's (its ``physis_model.yaml`` or the family's defaults); each flag given overrides
that field. Chunk ``c``'s initial noise is float32 ``[1, C, F, H, W]`` (latent units) from the seed, the
stream ``robot0`` and ``c`` (as every model's noise); the sampler is the one docs/models.md states (Euler on
the velocity over ``sigmas``, K + 1 values). By default the chunks come from the sequential reference;
``--plan`` serves them through the engine and ``--workers`` worker processes (the same outputs, bit for bit);
``--recompute`` computes every chunk by diffusers' ``forward`` over the whole history at once (absolute RoPE
positions, so chunks x frames must fit the trunk's table). ``--tensors`` writes ``noise.<c>``, ``output.<c>``
and ``sigmas``; ``--json`` a sha256 per chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from physis_ros.console import fail, write_json

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FLAGS = {"wan.frames": "frames", "wan.height": "height", "wan.width": "width", "window": "window", "steps": "steps",
         "timestep_shift": "shift", "history": "history", "dtype": "dtype"}   # config key -> the flag that sets it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-embeds", help="Wan directories: safetensors holding 'prompt_embeds' [1, L, text_dim] "
                                           "(the text encoder's output; the encoder is not run here)")
    p.add_argument("--frames", type=int, help="Wan directories: latent frames per chunk (default: the model's)")
    p.add_argument("--height", type=int, help="Wan directories: latent height (default: the model's)")
    p.add_argument("--width", type=int, help="Wan directories: latent width (default: the model's)")
    p.add_argument("--window", type=int, help="Wan directories: history chunks read (default: the model's)")
    p.add_argument("--steps", type=int, help="Wan directories: denoising steps K (default: the model's)")
    p.add_argument("--shift", type=float, help="Wan directories: grid shift (default: the model's; with --steps "
                                               "alone, 1: uniform)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="Wan directories: weights and states (default: the "
                                                         "model's; fp32 where diffusers keeps fp32)")
    p.add_argument("--plan", choices=("sequential", "step", "block", "stage"),
                   help="Wan directories: serve the chunks through the engine and worker processes by this plan "
                        "(default: the sequential reference, in this process)")
    p.add_argument("--workers", type=int, default=2, help="Wan directories: worker processes with --plan (default 2)")


def prompt_embeds(path: str | None, text_dim: int):
    from safetensors import safe_open

    if not path:
        fail("--prompt-embeds: a Wan model needs its prompt embeddings (safetensors with 'prompt_embeds' "
             f"[1, L, {text_dim}])")
    try:
        with safe_open(path, "pt") as f:
            if "prompt_embeds" not in f.keys():
                fail(f"--prompt-embeds {path}: no tensor 'prompt_embeds' (has: {', '.join(f.keys()) or 'none'})")
            embeds = f.get_tensor("prompt_embeds")
    except OSError as exc:
        fail(f"--prompt-embeds {path}: {exc}")
    except Exception as exc:   # noqa: BLE001 (safetensors' own errors)
        fail(f"--prompt-embeds {path}: not a readable safetensors file ({exc})")
    if embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[2] != text_dim or not embeds.is_floating_point():
        fail(f"--prompt-embeds {path}: prompt_embeds is {embeds.dtype} {list(embeds.shape)}; the model takes "
             f"float [1, L, {text_dim}]")
    return embeds.float()


def wan_config(args: argparse.Namespace, text_tokens: int):
    """The directory's model config with the flags given as overrides (one-line error naming the field)."""
    from physis_ros.config import ConfigError, from_mapping, to_mapping
    from physis_ros.model.spec import ModelConfig, load_model_config

    try:
        mapping = to_mapping(load_model_config(args.model))
        if mapping.get("kind") != "wan":
            fail(f"--model {args.model}: a {mapping.get('kind')} model, not a Wan trunk")
        mapping["wan"] = {**mapping["wan"], "text_tokens": text_tokens, **{
            flag: getattr(args, flag) for flag in ("frames", "height", "width") if getattr(args, flag) is not None}}
        if args.window is not None:
            mapping["window"] = args.window
        if args.steps is not None:
            mapping.update(steps=args.steps, sigmas=None, timestep_shift=args.shift or 1.0)
        elif args.shift is not None:
            mapping.update(sigmas=None, timestep_shift=args.shift)
        if args.history:
            mapping["history"] = args.history
        if args.history_groups:
            mapping["history_groups"] = args.history_groups
        if args.dtype:
            mapping["dtype"] = DTYPES[args.dtype]
        return from_mapping(ModelConfig, mapping)
    except ConfigError as exc:
        flag = FLAGS.get(exc.key)
        if flag is not None and getattr(args, flag) is not None:
            fail(f"--{flag} {getattr(args, flag)}: {exc.problem}")
        fail(f"--model {args.model}: {exc}")


def chunks_of(config, args, source) -> list:
    """Every chunk's output ([C, F, H, W] float32 tensors): the sequential reference, or served by --plan."""
    import torch

    from physis_ros.model import build_model
    from physis_ros.reference import reference_rollout

    if args.plan is None:
        return [r.output for r in reference_rollout(build_model(config), source, ["robot0"], args.chunks, args.seed)]
    from physis_ros.runtime.offline import run_chunks
    from physis_ros.runtime.settings import EngineConfig

    engine = EngineConfig(plan=args.plan, workers=args.workers, seed=args.seed, heartbeat_timeout_s=20.0,
                          threads_per_worker=args.threads)   # as many as the reference's: the same arithmetic
    return [torch.from_numpy(o.output) for o in run_chunks(config, engine, ["robot0"], args.chunks, source)["robot0"]]


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from physis_ros.model.interface import derived_seed
    from physis_ros.model.wan import transformer_dir
    from physis_ros.model.wan_family import trunk_config
    from physis_ros.model.wan_history import recompute

    for flag in ("frames", "height", "width", "window", "steps", "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            fail(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.shift is not None and not args.shift > 0:
        fail(f"--shift must be > 0, got {args.shift}")
    if args.streams != 1:
        fail("--streams: a Wan directory's rollout is one stream (robot0)")
    from physis_ros.config import ConfigError

    try:
        trunk = trunk_config(args.model)
    except ConfigError as exc:
        fail(exc.problem)
    prompt = prompt_embeds(args.prompt_embeds, trunk["text_dim"])
    config = wan_config(args, prompt.shape[1])
    io = config.wan
    if args.recompute and config.history == "latest":
        fail("--recompute: the full recompute with diffusers' forward covers same_step and clean; the latest rule "
             "runs by the sequential reference (leave out --recompute)")
    if args.recompute and args.chunks * io.frames > trunk.get("rope_max_seq_len", 1024):
        fail(f"--chunks x --frames: {args.chunks * io.frames} latent frames lie past the model's RoPE table "
             f"({trunk.get('rope_max_seq_len', 1024)} positions), which --recompute's absolute positions need: "
             f"fewer chunks or frames")
    sigmas = [float(x) for x in reversed(_grid(config))]
    shape = (1, *config.output_shape)
    noises = []
    for k in range(args.chunks):
        gen = torch.Generator().manual_seed(derived_seed("noise", args.seed, "robot0", k))
        noises.append(torch.randn(shape, generator=gen, dtype=torch.float32))
    observation = {"prompt_embeds": prompt[0].numpy()}
    start = time.perf_counter()
    with torch.no_grad():
        if args.recompute:
            from diffusers import WanTransformer3DModel

            full = WanTransformer3DModel.from_pretrained(str(transformer_dir(args.model)))
            outputs = [o[0] for o in recompute(full.eval(), noises, sigmas, prompt, config.history, config.window)]
        else:
            outputs = chunks_of(config, args, lambda stream, chunk: observation)
    seconds = time.perf_counter() - start
    total, rows, tensors = hashlib.sha256(), [], {"sigmas": torch.tensor(sigmas, dtype=torch.float32)}
    for k, out in enumerate(outputs):
        out = out.float().contiguous()[None]
        data = np.ascontiguousarray(out.numpy(), dtype=np.float32).tobytes()
        total.update(data)
        rows.append({"stream": "robot0", "index": k, "sha256": hashlib.sha256(data).hexdigest()})
        tensors[f"noise.{k}"], tensors[f"output.{k}"] = noises[k].contiguous(), out
        if args.live:
            print(f"chunk {k}: |x|max {out.abs().max().item():.3f}  {rows[-1]['sha256'][:16]}", flush=True)
    how = "full recompute" if args.recompute else (f"{args.plan} plan on {args.workers} workers" if args.plan
                                                     else "sequential reference")
    print(f"{len(rows)} chunks of {list(shape)} in {seconds:.2f} s ({config.history} history, window "
          f"{config.window}, {config.steps} steps, {config.dtype}, {how}); output sha256 {total.hexdigest()}")
    meta = {"model": str(args.model), "history": config.history, "window": str(config.window),
            "seed": str(args.seed), "recompute": str(args.recompute), "dtype": config.dtype}
    if args.tensors:
        from safetensors.torch import save_file

        save_file(tensors, args.tensors, metadata=meta)
    if args.json:
        write_json(args.json, {**meta, "window": config.window, "seed": args.seed, "recompute": args.recompute,
                               "plan": args.plan, "workers": args.workers if args.plan else None,
                               "shape": list(shape), "sigmas": sigmas, "chunks": rows,
                               "output_sha256": total.hexdigest()})
    return 0


def _grid(config) -> list[float]:
    """t_0 .. t_K of the model's denoising grid (t_0 = 0)."""
    from physis_ros.model.timesteps import FlowMatchingTimesteps

    return FlowMatchingTimesteps(config.steps, config.timestep_shift, config.sigmas).t.tolist()
