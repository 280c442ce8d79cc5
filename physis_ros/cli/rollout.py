"""``physis-rollout``: the sequential reference rollout of a model over the synthetic scene.

Prints a live per-chunk table and optionally writes JSON with a sha256 per chunk
(over its float32 bytes) and one over the whole output, so two runs, or a
reference and a server, can be compared exactly.

    physis-rollout [--model tiny-wam] [--chunks 16] [--streams 1] [--seed 0] [--json out.json]
                   [--history same_step|clean|latest] [--history-groups G] [--tensors out.safetensors]
                   [--recompute]

``--history`` serves the model under another history rule than its own (docs/history.md); ``--tensors``
writes each chunk's output (``output.<stream>.<c>``) and initial noise (``noise.<stream>.<c>``), float32;
``--recompute`` computes every chunk by full recompute (no K/V cache) instead of the cached reference.
``--model DIR`` (a diffusers Wan transformer directory) takes ``--prompt-embeds`` and the latent size
(cli/rollout_wan.py).

Exit status: 0 success; 2 usage or input error (bad flag or value, unknown preset,
unreadable/empty/binary/invalid model YAML, unusable --device, unwritable --json);
70 internal error (a bug; PHYSIS_DEBUG=1 shows the traceback); 130 interrupted.
Errors are one line on stderr: 'physis-rollout: error: <what and the fix>'.
"""

from __future__ import annotations

import hashlib
import sys
import time

from pathlib import Path

from physis_ros.cli.rollout_wan import add_arguments as add_wan_arguments, run as run_wan
from physis_ros.console import (ArgumentParser, check_writable, cli_main, device_arg, fail, model_arg, nonneg_int,
                                   positive_int, set_threads, write_json)


def chunk_bytes(output) -> bytes:
    import numpy as np

    return np.ascontiguousarray(output.numpy(), dtype=np.float32).tobytes()


def rollout(model, source, streams: list[str], chunks: int, seed: int, recompute: bool):
    """The chunks of every stream (round robin): the cached reference, or the full recompute."""
    from physis_ros.reference import ReferenceChunk, reference_rollout

    if not recompute:
        yield from reference_rollout(model, source, streams, chunks, seed)
        return
    from physis_ros.recompute import RecomputeRollout

    full = {s: RecomputeRollout(model, seed, s) for s in streams}
    for c in range(chunks):
        for s in streams:
            start = time.perf_counter()
            out = full[s].step(model.observation_tensors(source(s, c)))
            yield ReferenceChunk(s, c, out, (time.perf_counter() - start) * 1e3)


def _prompt_only(directory: str) -> bool:
    """Whether a checkpoint directory's model reads prompt embeddings alone (a video trunk: its rollout takes
    --prompt-embeds), or cannot be read (the Wan rollout names what is wrong with it)."""
    from physis_ros.config import ConfigError
    from physis_ros.model import load_model_config

    try:
        return set(load_model_config(directory).spec.inputs) == {"prompt_embeds"}
    except ConfigError:
        return True


@cli_main("physis-rollout")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-rollout", description=__doc__)
    parser.add_argument("--model", type=model_arg, default="tiny-wam",
                        help="preset name, model YAML path, or a diffusers Wan transformer directory")
    parser.add_argument("--chunks", type=positive_int, default=16)
    parser.add_argument("--streams", type=positive_int, default=1, help="number of streams (robots), round robin")
    parser.add_argument("--seed", type=nonneg_int, default=0)
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="write per-chunk hashes and timings here")
    parser.add_argument("--live", action="store_true", help="print a table row per chunk as it is produced")
    parser.add_argument("--history", choices=("same_step", "clean", "latest"),
                        help="read history by this rule instead of the model's own (docs/history.md)")
    parser.add_argument("--history-groups", type=positive_int,
                        help="latest: G, chunk c-j is read ceil(j / G) - 1 steps later (default: the model's)")
    parser.add_argument("--tensors", help="write each chunk's output and initial noise here (.safetensors)")
    parser.add_argument("--recompute", action="store_true",
                        help="compute every chunk by full recompute of its history (no K/V cache; slow)")
    add_wan_arguments(parser)
    args = parser.parse_args(argv)
    check_writable(args.json)
    check_writable(args.tensors, "--tensors")
    set_threads(args.threads)       # the reference's threads, as many as each worker's with --plan
    if Path(args.model).is_dir() and _prompt_only(args.model):   # a Wan video trunk: cli/rollout_wan.py
        return run_wan(args)
    import numpy as np

    from physis_ros.config import ConfigError
    from physis_ros.model import build_model, load_model_config
    from physis_ros.observations import SyntheticScene
    try:
        config = load_model_config(args.model)
        if args.history or args.history_groups:
            from physis_ros.config import from_mapping, to_mapping
            from physis_ros.model.spec import ModelConfig

            config = from_mapping(ModelConfig, {**to_mapping(config), "history": args.history or config.history,
                                                "history_groups": args.history_groups or config.history_groups})
        model = build_model(config, device=args.device)
        if args.recompute and not model.sequence_recompute:
            fail(f"--recompute: model '{config.name}' is not recomputed through the stage contract (a Wan model is "
                 f"checked against diffusers' own blocks over the whole sequence: tests/model/test_wan_*.py)")
    except (ConfigError, ValueError, RuntimeError) as exc:
        fail(f"{exc}" if not isinstance(exc, RuntimeError) else f"cannot build the model on --device "
             f"{args.device}: {exc}")
    streams = [f"robot{i}" for i in range(args.streams)]
    scene = SyntheticScene(config.observation_shapes)
    total = hashlib.sha256()
    rows = []
    if args.live:
        print(f"{config.name}: {config.kind}, {config.blocks} blocks x {config.steps} steps, {config.history} "
              f"history{' (full recompute)' if args.recompute else ''}, "
              f"{config.tokens_per_chunk} tokens/chunk, output {list(config.output_shape)}, device {args.device}")
        print(f"{'stream':>8} {'chunk':>6} {'ms':>8} {'chunks/s':>9} {'|x|max':>8}  sha256")
    tensors = {}
    start = time.perf_counter()
    for n, r in enumerate(rollout(model, scene.observation, streams, args.chunks, args.seed, args.recompute), 1):
        if args.tensors:
            tensors[f"output.{r.stream}.{r.index}"] = r.output.float().contiguous()
            tensors[f"noise.{r.stream}.{r.index}"] = model.noise(args.seed, r.stream, r.index)[0].float().cpu()
        data = chunk_bytes(r.output)
        digest = hashlib.sha256(data).hexdigest()
        total.update(data)
        rows.append({"stream": r.stream, "index": r.index, "sha256": digest, "ms": round(r.ms, 3)})
        if args.live:
            rate = n / (time.perf_counter() - start)
            print(f"{r.stream:>8} {r.index:>6} {r.ms:>8.2f} {rate:>9.1f} {r.output.abs().max().item():>8.3f}"
                  f"  {digest[:16]}", flush=True)
    ms = np.array([r["ms"] for r in rows])
    print(f"{len(rows)} chunks: ms p50 {np.percentile(ms, 50):.2f}, p99 {np.percentile(ms, 99):.2f}; "
          f"output sha256 {total.hexdigest()}")
    if args.tensors:
        from safetensors.torch import save_file

        save_file(tensors, args.tensors, metadata={"model": config.name, "history": config.history,
                                                   "seed": str(args.seed), "recompute": str(args.recompute)})
    if args.json:
        write_json(args.json, {"model": config.name, "history": config.history, "seed": args.seed,
                               "recompute": args.recompute, "device": args.device,
                               "streams": streams, "chunks": rows, "output_sha256": total.hexdigest()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
