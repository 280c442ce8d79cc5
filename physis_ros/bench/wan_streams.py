"""``physis-bench wan``: the Wan streams beside tiny-wam, in one run: for each model, ``physis-bench pipeline``
(the stage pipeline against the sequential plan on the same workers, with the cost model's predicted interval
of each plan) and ``physis-bench timeshare`` (batching off, on and adaptive: the same-weight batching of one
model's stages across chunks), rounds interleaved over the models so that this machine's drift hits them
alike. Ratios are taken within a round, then their median and spread over the rounds.

Writes ``--json`` (per model and round: each plan's measured and predicted interval, stage vs sequential,
batching on vs off, the time-shared outputs' largest difference from the sequential reference) and ``--plot``
(measured against predicted interval, and the two ratios, per model)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from physis_ros.bench import pipeline, timeshare

MODELS = "tiny-wam,tiny-wan-wam,tiny-wan-acwm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=MODELS, help="comma-separated models (presets, YAMLs or directories)")
    p.add_argument("--workers", type=int, default=2, help="worker processes of the pipeline runs")
    p.add_argument("--chunks", type=int, default=60, help="chunks per pipeline plan and per batching mode")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the models, interleaved")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG: measured vs predicted interval, the ratios per model")


def _parsed(add, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def one_round(model: str, args: argparse.Namespace, work: Path, r: int) -> dict:
    """One model's pipeline and timeshare runs (one repeat each), as their JSON summaries say."""
    pipe_json, share_json = work / f"pipe-{r}-{model.replace('/', '_')}.json", work / f"ts-{r}.json"
    pipeline.run(_parsed(pipeline.add_arguments, [
        "--model", model, "--workers", str(args.workers), "--plans", "sequential,stage", "--chunks",
        str(args.chunks), "--repeats", "1", "--no-parallel-limit", "--verify", "--json", str(pipe_json)]))
    timeshare.run(_parsed(timeshare.add_arguments, [
        "--model", model, "--chunks", str(args.chunks), "--repeats", "1", "--json", str(share_json)]))
    pipe, share = json.loads(pipe_json.read_text()), json.loads(share_json.read_text())
    plans = {name: {"interval_ms": entry["interval_ms_p50"], "predicted_ms": entry["predicted_interval_ms"],
                    "max_abs_diff_vs_reference": entry["max_abs_diff_vs_reference"]}
             for name, entry in pipe["plans"].items()}
    modes = {mode: {"interval_ms": share[mode]["interval_ms_p50"], "predicted_ms": share[mode]["predicted_interval_ms"],
                    "mean_batch": share[mode]["mean_batch"]} for mode in ("batching_off", "batching_on", "adaptive")}
    return {"plans": plans,
            "stage_vs_sequential": plans["sequential"]["interval_ms"] / plans["stage"]["interval_ms"],
            "batching_on_vs_off": share["speedup_on_vs_off"],
            "batching_adaptive_vs_off": share["speedup_adaptive_vs_off"],
            "timeshare_predicted_ms": share["predicted_interval_ms"],
            "timeshare_max_abs_diff_vs_reference": share["max_abs_diff_vs_reference"],
            "timeshare_modes": modes}


def summarise(rounds: list[dict]) -> dict:
    out = {}
    for key in ("stage_vs_sequential", "batching_on_vs_off", "batching_adaptive_vs_off"):
        values = [r[key] for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    for plan in rounds[0]["plans"]:
        measured = [r["plans"][plan]["interval_ms"] for r in rounds]
        predicted = [r["plans"][plan]["predicted_ms"] for r in rounds]
        out[f"{plan}_interval_ms"] = statistics.median(measured)
        out[f"{plan}_predicted_ms"] = statistics.median(predicted)
        out[f"{plan}_measured_vs_predicted"] = statistics.median(m / p for m, p in zip(measured, predicted))
    out["timeshare_max_abs_diff_vs_reference"] = max(r["timeshare_max_abs_diff_vs_reference"] for r in rounds)
    out["pipeline_max_abs_diff_vs_reference"] = max(p["max_abs_diff_vs_reference"] for r in rounds
                                                    for p in r["plans"].values())
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(models))
    for offset, plan, colour in ((-0.2, "sequential", "tab:grey"), (0.2, "stage", "tab:blue")):
        s = [result["models"][m]["summary"] for m in models]
        left.bar([i + offset for i in x], [v[f"{plan}_interval_ms"] for v in s], 0.38, color=colour,
                 label=f"{plan}: measured")
        left.scatter([i + offset for i in x], [v[f"{plan}_predicted_ms"] for v in s], color="black", zorder=3,
                     marker="_", s=400, label="cost model's prediction" if plan == "stage" else None)
    left.set_xticks(list(x), models)
    left.set_ylabel("chunk interval, ms (p50)")
    left.set_title(f"pipeline on {result['workers']} CPU workers: measured vs predicted")
    left.legend(fontsize=8)
    for offset, key, colour in ((-0.2, "stage_vs_sequential", "tab:blue"), (0.2, "batching_on_vs_off", "tab:orange")):
        s = [result["models"][m]["summary"][key] for m in models]
        right.bar([i + offset for i in x], [v["median"] for v in s], 0.38, color=colour, label=key.replace("_", " "),
                  yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]], capsize=4)
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xticks(list(x), models)
    right.set_ylabel("speed-up (x), median and range over rounds")
    right.set_title("stage pipeline and same-weight batching")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from physis_ros.console import fail, write_json

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        fail("--models: give at least one model")
    from physis_ros.config import ConfigError
    from physis_ros.model import load_model_config

    for model in models:           # every name checked before the first run
        try:
            load_model_config(model)
        except ConfigError as exc:
            fail(f"--models {model}: {exc}")
    rounds: dict[str, list[dict]] = {m: [] for m in models}
    with tempfile.TemporaryDirectory(prefix="physis-bench-wan-") as tmp:
        for r in range(args.rounds):
            for model in models:
                got = one_round(model, args, Path(tmp), r)
                rounds[model].append(got)
                print(f"[round {r + 1}/{args.rounds}] {model}: stage {got['plans']['stage']['interval_ms']:.2f} ms "
                      f"(predicted {got['plans']['stage']['predicted_ms']:.2f}), sequential "
                      f"{got['plans']['sequential']['interval_ms']:.2f} ms; stage x{got['stage_vs_sequential']:.2f}, "
                      f"batching x{got['batching_on_vs_off']:.2f}", flush=True)
    result = {"workers": args.workers, "chunks": args.chunks, "rounds": args.rounds,
              "models": {m: {"summary": summarise(rs), "rounds": rs} for m, rs in rounds.items()}}
    for m in models:
        s = result["models"][m]["summary"]
        print(f"{m}: stage vs sequential x{s['stage_vs_sequential']['median']:.2f} "
              f"[{s['stage_vs_sequential']['min']:.2f}, {s['stage_vs_sequential']['max']:.2f}], batching on vs off "
              f"x{s['batching_on_vs_off']['median']:.2f}, stage interval {s['stage_interval_ms']:.2f} ms vs "
              f"{s['stage_predicted_ms']:.2f} predicted ({s['stage_measured_vs_predicted']:.2f}x)")
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0
