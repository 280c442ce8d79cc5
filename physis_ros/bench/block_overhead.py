"""Our stage path over one real-shape Wan block against diffusers' own ``WanTransformerBlock`` forward on the same
inputs: what serving a Wan trunk through the stage contract costs over diffusers.

For each preset (the real architectures, random init: config/models/) and dtype, block 0 is built once. *Ours*
is :meth:`WanModel.block <physis_ros.model.wan_model.WanModel.block>` as a worker runs a stage: the hidden state
``[text; video]`` split and joined again, self-attention through the stage-local K/V slot (its history empty,
nothing appended, so the attention work is diffusers'), cross-attention K/V of the text kept in the slot (as
served: computed at the first call, read after). *Diffusers* is a copy of the same module with diffusers' own
attention processors, called as ``WanTransformer3DModel.forward`` calls it (video tokens, text tokens, the
step's ``timestep_proj``, RoPE from the trunk). The two outputs are compared (fp32: equal bit for bit).

The calls alternate (which one goes first alternates too), one warm-up each, then ``--repeats`` timed pairs;
the ratio ours / diffusers of each pair, its median and spread. The chunk is the preset's own (3 latent frames)
unless ``--frames`` says fewer (a 14B block at its own chunk takes most of a minute a call on 2 cores); the
H200 roofline of one block forward at that shape and at the preset's own chunk is listed beside (modelled, not
measured).

    physis-bench block-overhead [--presets wan2.1-1.3b,wan2.2-5b] [--dtypes fp32,bf16] [--frames F]
                                [--repeats 3] [--threads 2] [--json out.json]

JSON: ``rows`` (preset, dtype, video_tokens, text_tokens, ours_ms and diffusers_ms medians, ratio_median,
ratio_min, ratio_max, pairs, max_abs_diff, h200_roofline_ms at this shape and at the preset's chunk),
``target`` (ratio_max 1.05 on the median; met per row), ``machine``, ``command``. Exit status 1 when an fp32
output differs from diffusers'.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

TARGET = 1.05
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="wan2.1-1.3b,wan2.2-5b",
                   help="comma-separated Wan presets or model YAMLs (default wan2.1-1.3b,wan2.2-5b; wan2.1-14b takes "
                        "minutes a call here)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--frames", type=int, default=0,
                   help="latent frames of the chunk timed (default 0: the preset's own chunk)")
    p.add_argument("--repeats", type=int, default=3, help="timed pairs per preset and dtype (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--json", help="write the summary here")


def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def measure(preset: str, dtype: str, frames: int, repeats: int) -> dict[str, Any]:
    """One preset and dtype: the pairs timed and the outputs compared."""
    import torch

    from physis_ros.model import build_model, load_model_config
    from physis_ros.model.kv import KVBatch
    from physis_ros.model.wan import patchify, time_embedding
    from physis_ros.scheduling.profiles import roofline_ms
    from physis_ros.scheduling.settings import load_device

    own = load_model_config(preset)
    if own.kind != "wan":
        raise ValueError(f"--presets: {preset} is a {own.kind} model, not a Wan trunk")
    config = replace(own, dtype=DTYPES[dtype], wan=replace(own.wan, frames=frames or own.wan.frames))
    model = build_model(config, hosted_blocks=[0])
    io, torch_dtype = config.wan, model.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((1, *config.output_shape), generator=gen).to(torch_dtype)
    text = (torch.randn((1, io.text_tokens, config.hidden), generator=gen) * 0.5).to(torch_dtype)
    t = model.timesteps.timestep(torch.tensor([config.steps]))
    table = model.new_kv_table(0, 1)
    with torch.no_grad():
        video = patchify(model.trunk, x)
        h = torch.cat([text, video], dim=1)
        _, proj = time_embedding(model.trunk, (t.double() * 1000.0).float(), torch_dtype)
        rotary = model.trunk.rope(x)
        theirs = copy.deepcopy(model.blocks["0"])
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        theirs.attn1.set_processor(WanAttnProcessor())
        theirs.attn2.set_processor(WanAttnProcessor())

        def ours():
            return model.block(0, h, t, KVBatch(table, [0], [False]))[:, io.text_tokens:]

        def diffusers():
            return theirs(video, text, proj, rotary)

        pairs = []
        for r in range(repeats + 1):
            first, second = (ours, diffusers) if r % 2 == 0 else (diffusers, ours)
            a_ms, a_out = _timed(first)
            b_ms, b_out = _timed(second)
            ours_ms, diff_ms = (a_ms, b_ms) if first is ours else (b_ms, a_ms)
            out_ours, out_diff = (a_out, b_out) if first is ours else (b_out, a_out)
            if r:                          # round 0 warms both up (and fills the slot's text K/V)
                pairs.append((ours_ms, diff_ms))
        diff = float((out_ours.float() - out_diff.float()).abs().max())
    ratios = [o / d for o, d in pairs]
    h200 = load_device("h200")
    return {"preset": config.name, "dtype": dtype, "frames": config.wan.frames, "video_tokens": table.tokens_per_chunk,
            "text_tokens": io.text_tokens, "block_params": config.block_params(),
            "ours_ms": round(statistics.median(o for o, _ in pairs), 2),
            "diffusers_ms": round(statistics.median(d for _, d in pairs), 2),
            "ratio_median": round(statistics.median(ratios), 4), "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4), "pairs": [[round(o, 2), round(d, 2)] for o, d in pairs],
            "max_abs_diff": diff, "met": statistics.median(ratios) <= TARGET,
            "h200_roofline_ms": round(roofline_ms(config, h200, 1), 3),
            "h200_roofline_ms_preset_chunk": round(roofline_ms(replace(own, dtype=DTYPES[dtype]), h200, 1), 3)}


def run(args: argparse.Namespace) -> int:
    import torch

    from physis_ros.console import fail

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        fail(f"--dtypes: {', '.join(bad) or 'none given'}; give fp32 and/or bf16")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        fail("--presets: give at least one Wan preset")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, presets, dtypes)
    finally:
        torch.set_num_threads(threads)    # in-process callers (tests) keep their own setting


def _run(args: argparse.Namespace, presets: list[str], dtypes: list[str]) -> int:
    import torch

    from physis_ros.console import fail, write_json

    rows = []
    print(f"{'preset':<14} {'dtype':<5} {'tokens':>7} {'ours ms':>9} {'diffusers ms':>13} {'ratio':>7} "
          f"{'spread':>15} {'max|diff|':>10} {'H200 ms':>8}")
    for preset in presets:
        for dtype in dtypes:
            try:
                row = measure(preset, dtype, args.frames, args.repeats)
            except (ValueError, OSError) as exc:
                fail(str(exc))
            rows.append(row)
            print(f"{row['preset']:<14} {dtype:<5} {row['video_tokens']:>7} {row['ours_ms']:>9.1f} "
                  f"{row['diffusers_ms']:>13.1f} {row['ratio_median']:>7.3f} "
                  f"{row['ratio_min']:>7.3f}-{row['ratio_max']:<7.3f} {row['max_abs_diff']:>10.2e} "
                  f"{row['h200_roofline_ms']:>8.3f}", flush=True)
    exact = all(r["max_abs_diff"] == 0.0 for r in rows if r["dtype"] == "fp32")
    summary = {"rows": rows, "target": {"ratio_max": TARGET, "met": all(r["met"] for r in rows)},
               "fp32_equal": exact, "threads": args.threads,
               "machine": {"cpu": platform.machine(), "cores": os.cpu_count(),
                           "torch": torch.__version__},
               "command": " ".join(["physis-bench", *sys.argv[1:]])}
    if args.json:
        write_json(args.json, summary)
    if not exact:
        print("fp32 output differs from diffusers' block", file=sys.stderr)
        return 1
    return 0
