"""``physis-rollout --model DIR``: the reference rollout of a Wan transformer directory (cli/rollout.py's
command for a diffusers directory), over diffusers' own modules (physis_ros/model/wan.py), so that anyone
can recompute a chunk.

    physis-rollout --model DIR --prompt-embeds FILE [--chunks N] [--seed S] [--frames F --height H --width W]
                   [--history same_step|clean] [--window W] [--steps K --shift S] [--recompute]
                   [--tensors OUT.safetensors] [--json OUT.json]

Chunk ``c``'s initial noise is float32 ``[1, C, F, H, W]`` (latent units) from the seed, the stream
``robot0`` and ``c`` (as every model's noise); the sampler is the one docs/models.md states (Euler on the
velocity over ``sigmas``, K + 1 values). ``--tensors`` writes ``noise.<c>``, ``output.<c>`` and ``sigmas``;
``--json`` a sha256 per chunk. ``--recompute`` computes every chunk by diffusers' ``forward`` over the whole
history at once instead of the K/V cache.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from physis_ros.console import fail, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-embeds", help="Wan directories: safetensors holding 'prompt_embeds' [1, L, text_dim] "
                                           "(the text encoder's output; the encoder is not run here)")
    p.add_argument("--frames", type=int, default=2, help="Wan directories: latent frames per chunk (default 2)")
    p.add_argument("--height", type=int, default=8, help="Wan directories: latent height (default 8)")
    p.add_argument("--width", type=int, default=8, help="Wan directories: latent width (default 8)")
    p.add_argument("--window", type=int, default=2, help="Wan directories: history chunks read (default 2)")
    p.add_argument("--steps", type=int, default=4, help="Wan directories: denoising steps K (default 4)")
    p.add_argument("--shift", type=float, default=1.0, help="Wan directories: grid shift (default 1: uniform)")


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


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from physis_ros.model.interface import derived_seed
    from physis_ros.model.timesteps import FlowMatchingTimesteps
    from physis_ros.model.wan import WanLoadError, WanStages, load_wan, transformer_dir
    from physis_ros.model.wan_history import recompute, rollout

    for flag in ("frames", "height", "width", "window", "steps", "chunks"):
        if getattr(args, flag) < 1:
            fail(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if not args.shift > 0:
        fail(f"--shift must be > 0, got {args.shift}")
    if args.streams != 1:
        fail("--streams: a Wan directory's rollout is one stream (robot0)")
    history = args.history or "same_step"
    try:
        wan = load_wan(args.model, blocks=() if args.recompute else None)   # --recompute: diffusers' own model
    except WanLoadError as exc:
        fail(str(exc))
    c = wan.config
    p_t, p_h, p_w = c["patch_size"]
    for flag, size, patch in (("frames", args.frames, p_t), ("height", args.height, p_h), ("width", args.width, p_w)):
        if size % patch:
            fail(f"--{flag} {size} is not a multiple of the model's patch size {patch}")
    if args.chunks * args.frames // p_t > c.get("rope_max_seq_len", 1024):
        fail(f"--chunks x --frames: {args.chunks * args.frames} latent frames lie past the model's RoPE table "
             f"({c.get('rope_max_seq_len', 1024)} positions): fewer chunks or frames")
    prompt = prompt_embeds(args.prompt_embeds, c["text_dim"])
    sigmas = [float(x) for x in reversed(FlowMatchingTimesteps(args.steps, args.shift).t.tolist())]
    shape = (1, c["in_channels"], args.frames, args.height, args.width)
    noises = []
    for k in range(args.chunks):
        gen = torch.Generator().manual_seed(derived_seed("noise", args.seed, "robot0", k))
        noises.append(torch.randn(shape, generator=gen, dtype=torch.float32))
    start = time.perf_counter()
    with torch.no_grad():
        if args.recompute:
            from diffusers import WanTransformer3DModel

            full = WanTransformer3DModel.from_pretrained(str(transformer_dir(args.model)))
            outputs = recompute(full.eval(), noises, sigmas, prompt, history, args.window)
        else:
            stages = WanStages(wan)
            outputs = rollout(stages, noises, sigmas, stages.encode(prompt), history, args.window)
    seconds = time.perf_counter() - start
    total, rows, tensors = hashlib.sha256(), [], {"sigmas": torch.tensor(sigmas, dtype=torch.float32)}
    for k, out in enumerate(outputs):
        data = np.ascontiguousarray(out.numpy(), dtype=np.float32).tobytes()
        total.update(data)
        rows.append({"stream": "robot0", "index": k, "sha256": hashlib.sha256(data).hexdigest()})
        tensors[f"noise.{k}"], tensors[f"output.{k}"] = noises[k].contiguous(), out.float().contiguous()
        if args.live:
            print(f"chunk {k}: |x|max {out.abs().max().item():.3f}  {rows[-1]['sha256'][:16]}", flush=True)
    print(f"{len(rows)} chunks of {list(shape)} in {seconds:.2f} s ({history} history, window {args.window}"
          f"{', full recompute' if args.recompute else ''}); output sha256 {total.hexdigest()}")
    meta = {"model": str(args.model), "history": history, "window": str(args.window), "seed": str(args.seed),
            "recompute": str(args.recompute)}
    if args.tensors:
        from safetensors.torch import save_file

        save_file(tensors, args.tensors, metadata=meta)
    if args.json:
        write_json(args.json, {**meta, "window": args.window, "seed": args.seed, "recompute": args.recompute,
                               "shape": list(shape), "sigmas": sigmas, "chunks": rows,
                               "output_sha256": total.hexdigest()})
    return 0
