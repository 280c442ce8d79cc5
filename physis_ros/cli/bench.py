"""``physis-bench SUBCOMMAND``: benchmarks that write JSON (and plots).

    physis-bench pipeline | timeshare | soak | streams | ros | admission | handoff | hop | goals | churn | wan
                 | admission-accuracy | openpi | block-overhead | history-quality  [options]
    (physis-bench SUB --help)

Each subcommand lives in ``physis_ros.bench.<name>`` (or the module ``MODULES`` names) and provides
``add_arguments(parser)`` and ``run(args) -> int``. Flags they share are checked
here before anything starts: counts and durations in range, ``--model`` (preset or
model YAML), ``--profile`` (physis-profile JSON), ``--config`` (serve YAML),
``--plans``/``--plan``/``--batching`` names, ``--json``/``--plot`` writable.

Exit status (every subcommand): 0 success; 1 the benchmark ran but failed (e.g.
verification against the reference); 2 usage or input error (bad flag or value,
unknown preset or plan, missing/empty/binary/invalid YAML or JSON, unwritable
output; nothing was run); 70 internal error (a bug; PHYSIS_DEBUG=1 shows the
traceback); 130 interrupted. Errors are one line on stderr:
'physis-bench: error: <what and the fix>'.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from physis_ros.console import (ArgumentParser, CliError, check_json_file, check_writable, check_yaml_file,
                                   cli_main)

SUBCOMMANDS = {
    "pipeline": "stage pipeline vs the sequential/step/block baselines",
    "timeshare": "time-sharing: batching off vs on vs adaptive, planner prediction",
    "soak": "two streams for minutes: memory, lost chunks, interval drift",
    "streams": "joint scheduling live: admit tiny-wam streams onto local workers until one is rejected",
    "ros": "ROS layer: emit -> subscriber delay and lost chunks through the real node",
    "admission": "robots join the running server through the action until rejected; SLO vs measured, batching "
                 "credited vs not",
    "handoff": "chunk hand-off none/hard/soft under injected delay: seams, jerk, tracking on a simulated robot",
    "device": "the device check: profile, 1 worker then several time-sharing one device per hop transport, "
              "equivalence to the reference, memory (bench/device_check.sh)",
    "hop": "hidden-state hop time per transport (zmq tcp/ipc, gloo; nccl on CUDA) vs memcpy, 64K-64M",
    "goals": "a burst of ServeStream goals at once: every goal answered (admitted, or refused with a reason)",
    "churn": "robots join and leave over and over: the RSS of the server and of each worker after N cycles",
    "openpi": "openpi clients (the real openpi-client) on our front end vs openpi-server's sequential "
              "WebsocketPolicyServer: closed-loop throughput and round trip, paced clients within the SLO",
    "admission-accuracy": "robots added with admission off until one misses the SLO (feasible), then through "
                          "Server.join with admission on: admitted / feasible, admitted meeting the SLO",
    "block-overhead": "our stage path over one real-shape Wan block vs diffusers' own WanTransformerBlock forward "
                      "(CPU, fp32 and bf16, interleaved pairs, median ratio and spread)",
    "history-quality": "one trained Wan WAM served under the clean, latest and same_step history rules on the same "
                       "bag and seeds: tracking error, hand-off seam p99, chunk interval (bench/out/history_quality)",
    "wan": "the Wan streams beside tiny-wam in one run: pipeline (stage vs sequential, cost model's prediction) and "
           "time-sharing (batching on vs off) per model, rounds interleaved",
}

# subcommand -> its module in physis_ros.bench where the two names differ (a module is not named like another
# layer's module of another concept: scheduling/admission.py, runtime/streams.py)
MODULES = {"admission": "admission_goals", "streams": "streams_live", "block-overhead": "block_overhead",
           "wan": "wan_streams", "history-quality": "history_quality"}

# flag (argparse dest) -> (lowest value, whether the bound is excluded)
BOUNDS = {
    "workers": (1, False), "chunks": (1, False), "repeats": (1, False), "streams": (1, False),
    "max_batch": (1, False), "width": (1, False), "height": (1, False), "skip": (0, False), "domain": (0, False),
    "minutes": (0, True), "sample_s": (0, True), "slo_ms": (0, True), "duration": (0, True), "rate": (0, True),
    "paced_rate": (0, True), "floor_rate": (0, True), "start_timeout": (0, True), "stagger_s": (0, False),
    "warmup": (0, False), "pace_margin_ms": (0, False), "headroom": (0, False), "emit_delay_ms": (0, False),
    "window": (0, True), "settle": (0, False), "rounds": (1, False), "max_streams": (1, False),
    "control_rate_hz": (0, True), "second_control_rate_hz": (0, True), "pace_margin": (0, False),
    "host_reserve_cores": (0, False),
    "profile_repeats": (1, False), "robots": (1, False), "execution_horizon": (1, False), "burst": (1, False), "max_pending_goals": (1, False), "cancels": (1, False),
    "cycles": (1, False), "heartbeat_timeout": (0, True), "baseline": (1, False), "tolerance": (0, False), "sample": (1, False),
    "reply_timeout": (0, True), "settle_s": (0, False), "window_s": (0, True), "measure_s": (0, True),
    "max_robots": (1, False), "closed_rate_hz": (0, True), "peer_threads": (0, False), "frames": (0, False),
    "threads": (1, False), "seeds": (1, False), "interval_chunks": (1, False),
    "train_seed": (0, False),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
    """The shared flags of the subcommands, before any worker starts (CliError: one line, exit 2)."""
    values = vars(args)
    for dest, (low, strict) in BOUNDS.items():
        value = values.get(dest)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value != value or (value <= low if strict else value < low):
            raise CliError(f"{_flag(dest)} must be {'>' if strict else '>='} {low}, got {value}")
    if values.get("headroom") is not None and values["headroom"] >= 1:
        raise CliError(f"--headroom is the fraction of device time kept free: give a value in [0, 1), "
                       f"got {values['headroom']}")
    for dest in ("json", "raw", "plot"):
        check_writable(values.get(dest), _flag(dest))
    if values.get("config"):
        check_yaml_file(values["config"], "--config")
    from physis_ros.config import ConfigError
    from physis_ros.model import load_model_config

    if values.get("model"):
        model = values["model"]
        if model.endswith((".yaml", ".yml")):
            check_yaml_file(model, "--model")
        try:
            load_model_config(model)
        except ConfigError as exc:
            raise CliError(f"--model: {exc}") from None
    if values.get("profile"):
        from physis_ros.model import load_model_config
        from physis_ros.runtime.costs import profile_from_json

        try:
            profile_from_json(check_json_file(values["profile"], "--profile"),
                              load_model_config(values.get("model") or "tiny-wam"), where=values["profile"])
        except ValueError as exc:
            raise CliError(f"--profile {values['profile']}: {exc}") from None
    if values.get("plans") is not None or values.get("plan") is not None:
        from physis_ros.runtime.plans import PLAN_NAMES

        for dest in ("plans", "plan"):
            names = [p.strip() for p in (values.get(dest) or "").split(",") if p.strip()]
            if values.get(dest) is not None and not names:
                raise CliError(f"{_flag(dest)}: give at least one plan ({', '.join(PLAN_NAMES)})")
            unknown = [p for p in names if p not in PLAN_NAMES]
            if unknown:
                raise CliError(f"{_flag(dest)}: unknown plan(s) {', '.join(unknown)}; choose from "
                               f"{', '.join(PLAN_NAMES)}")
    if values.get("batching") is not None:
        from physis_ros.runtime.batching import BATCHING

        if values["batching"] not in BATCHING:
            raise CliError(f"--batching: unknown mode '{values['batching']}'; choose from {', '.join(BATCHING)}")


@cli_main("physis-bench")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    # Only the chosen subcommand's module is imported (they import torch): a bad command line fails fast.
    words = sys.argv[1:] if argv is None else argv
    chosen = next((w for w in words if not w.startswith("-")), None)
    module = None
    for name, help_text in SUBCOMMANDS.items():
        if name == chosen:
            module = importlib.import_module(f"physis_ros.bench.{MODULES.get(name, name.replace('-', '_'))}")
        p = sub.add_parser(name, help=help_text, description=module.__doc__ if name == chosen else help_text,
                           epilog="Exit status" + __doc__.split("Exit status")[1])
        if name == chosen:
            module.add_arguments(p)
    args = parser.parse_args(argv)
    check_args(args)
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
