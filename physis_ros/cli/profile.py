"""``physis-profile``: measure per-stage time vs batch size, the per-hop transfer time, the worker's
own time per forward, the engine's per-chunk work and the co-run slowdown of CPU workers.
``--plan-workers 1,2,40`` also prints the planner's partition and predicted interval for those
worker counts in each batching mode (and stores them in the JSON under ``plans``).

The JSON it writes feeds the planner (``physis-bench timeshare --profile``),
the workers' adaptive batching and the joint scheduler's cost profiles.

Exit status: 0 success; 2 usage or input error (bad flag or value, missing --json,
unknown preset, unusable --device, unreadable/empty/binary/invalid model YAML, unwritable --json;
nothing was measured); 70 internal error (a bug; PHYSIS_DEBUG=1 shows the
traceback); 130 interrupted. Errors are one line on stderr:
'physis-profile: error: <what and the fix>'.
"""

from __future__ import annotations

import os
import sys

from physis_ros.console import (ArgumentParser, check_writable, cli_main, device_arg, fail, model_arg, nonneg_int,
                                   positive_int, set_threads, write_json)


@cli_main("physis-profile")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-profile", description=__doc__)
    parser.add_argument("--model", type=model_arg, default="tiny-wam", help="preset name or model YAML path")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    parser.add_argument("--batch-sizes", default="1,2,4", help="comma-separated batch sizes to time")
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--corun", type=nonneg_int, default=2,
                        help="also measure the slowdown with this many processes at once (CPU; 0: skip)")
    parser.add_argument("--plan-workers", default="",
                        help="comma-separated worker counts to plan for from this profile (e.g. 1,2,40)")
    parser.add_argument("--max-batch", type=positive_int, default=4, help="batch size bound the plans assume")
    parser.add_argument("--json", required=True, help="output path")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(sorted({int(x) for x in args.batch_sizes.split(",")}))
    except ValueError:
        fail(f"--batch-sizes wants comma-separated integers, e.g. 1,2,4; got '{args.batch_sizes}'")
    try:
        plan_workers = [int(x) for x in args.plan_workers.split(",") if x.strip()]
    except ValueError:
        fail(f"--plan-workers wants comma-separated worker counts, e.g. 1,2,40; got '{args.plan_workers}'")
    check_writable(args.json)
    from physis_ros.model import load_model_config
    from physis_ros.runtime.profiler import measure_profile

    set_threads(args.threads)
    config = load_model_config(args.model)
    if any(w < 1 for w in plan_workers):
        fail("--plan-workers takes worker counts >= 1")
    if sizes[0] != 1 or len(sizes) < 2 or any(b < 1 for b in sizes):
        fail("--batch-sizes must include 1 and at least one larger size")

    def progress(done: int, total: int) -> None:
        print(f"\rprofiling {config.name} on {args.device}: round {done}/{total}", end="", file=sys.stderr,
              flush=True)

    profile = measure_profile(config, args.device, sizes, args.repeats, progress, corun=args.corun)
    print(file=sys.stderr)
    plans = plan_report(config, profile, plan_workers, args.max_batch, args.device)
    write_json(args.json, {**profile.to_json(), **({"plans": plans} if plans else {})})
    per_stage = sorted(ms[1] for ms in profile.stage_ms.values())
    print(f"stage ms at batch 1: median {per_stage[len(per_stage) // 2]:.3f}, max {per_stage[-1]:.3f}; "
          f"batch {sizes[-1]} / {sizes[-1]} x batch 1 = "
          f"{sum(ms[sizes[-1]] for ms in profile.stage_ms.values()) / (sizes[-1] * sum(per_stage)):.2f}; "
          f"hop {profile.hop_ms:.3f} ms; worker overhead {profile.overhead_ms_per_call:.3f} ms per forward; engine "
          f"{profile.engine_ms:.3f} ms per chunk; {args.corun} processes at once run {profile.corun_slowdown:.2f}x "
          "slower")
    for p in plans:
        print(f"{p['workers']} worker(s), batching {p['batching']}: {p['plan']}; predicted interval "
              f"{p['predicted_interval_ms']:.2f} ms, mean batch {p['predicted_mean_batch']:.2f}")
    return 0


def plan_report(config, profile, worker_counts: list[int], max_batch: int, device: str) -> list[dict]:
    """The planner's choice per worker count and batching mode (workers share this host's cores on CPU)."""
    from physis_ros.runtime.batching import BATCHING
    from physis_ros.runtime.planner import choose_plan

    host_cpus = os.cpu_count() if device == "cpu" else None
    out = []
    for workers in worker_counts:
        for batching in BATCHING:
            pred = choose_plan(config.steps, config.blocks, workers, profile, batching, max_batch, host_cpus)
            out.append({"workers": workers, "batching": batching, "plan": pred.plan.describe(),
                        "workers_used": len(pred.plan.workers_used), "predicted_interval_ms": pred.interval_ms,
                        "predicted_mean_batch": pred.simulated.task_batch})
    return out


if __name__ == "__main__":
    sys.exit(main())
