"""``physis-profile``: measure per-stage time vs batch size, the per-hop transfer time, the worker's
own time per forward, the engine's per-chunk work and the co-run slowdown of CPU workers.

The JSON it writes feeds the planner (``physis-bench timeshare --profile``),
the workers' adaptive batching and the joint scheduler's cost profiles.
"""

from __future__ import annotations

import argparse
import sys

from physis_ros.cli.common import fail, set_threads, write_json
from physis_ros.config import ConfigError
from physis_ros.model import load_model_config
from physis_ros.runtime.profiler import measure_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-profile", description=__doc__)
    parser.add_argument("--model", default="tiny-wam", help="preset name or model YAML path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,2,4", help="comma-separated batch sizes to time")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--corun", type=int, default=2,
                        help="also measure the slowdown with this many processes at once (CPU; 0: skip)")
    parser.add_argument("--json", required=True, help="output path")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    try:
        config = load_model_config(args.model)
        sizes = tuple(sorted({int(x) for x in args.batch_sizes.split(",")}))
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    if sizes[0] != 1 or len(sizes) < 2:
        fail("--batch-sizes must include 1 and at least one larger size")

    def progress(done: int, total: int) -> None:
        print(f"\rprofiling {config.name} on {args.device}: round {done}/{total}", end="", file=sys.stderr,
              flush=True)

    profile = measure_profile(config, args.device, sizes, args.repeats, progress, corun=args.corun)
    print(file=sys.stderr)
    write_json(args.json, profile.to_json())
    per_stage = sorted(ms[1] for ms in profile.stage_ms.values())
    print(f"stage ms at batch 1: median {per_stage[len(per_stage) // 2]:.3f}, max {per_stage[-1]:.3f}; "
          f"batch {sizes[-1]} / {sizes[-1]} x batch 1 = "
          f"{sum(ms[sizes[-1]] for ms in profile.stage_ms.values()) / (sizes[-1] * sum(per_stage)):.2f}; "
          f"hop {profile.hop_ms:.3f} ms; worker overhead {profile.overhead_ms_per_call:.3f} ms per forward; engine "
          f"{profile.engine_ms:.3f} ms per chunk; {args.corun} processes at once run {profile.corun_slowdown:.2f}x "
          "slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
