"""``physis-bench history-quality``: what noisy history costs in control quality, rule by rule (issue 59).

A checkpoint trained under the ``clean`` history rule (``physis-train --history clean``: each chunk learns
to read the K/V that a t = 0 pass over the earlier chunks wrote) is served under each rule on the same
bag and the same noise seeds:

- ``clean``: what it was trained for; one chunk in flight (the clean pass needs the finished chunk);
- ``latest``: the earlier chunks as they were at a later denoising step (the clean pass's where done);
- ``same_step``: the earlier chunks at the noise level of the step being computed (noisy K/V), the rule
  that lets chunks pipeline over workers.

Beside them a checkpoint trained and served under ``same_step``. Per (trained, served) rule and seed:

- ``tracking_rms``: the chunk's actions against the scripted expert's chunk for the same observation
  (:meth:`~physis_ros.observations.ScriptedExpert.act`: it finds the disc in the image the node would
  feed), RMS over chunks, rows and joints (rad);
- ``seam_p99``: the hand-off seam, the largest joint jump between a chunk's first row and the row the
  previous chunk prescribed for the same control step (:class:`~physis_ros.timeline.SeamTracker`, the
  node's own measure), p99 over the chunks (rad);
- ``interval_ms``: the chunk interval that rule allows, measured live (the engine and its workers,
  :func:`physis_ros.bench.pipeline.run_plan`) on the plan the planner predicts fastest among those the
  rule permits on ``--workers`` workers, with the planner's prediction beside it (fed the scene's
  observations: the compute does not depend on them).

The chunks are computed by the sequential reference (:class:`~physis_ros.reference.ReferenceRollout`),
which the server's chunks equal bit for bit under every rule (tests/runtime, tests/model), so a rule's
quality does not depend on this machine's speed; the interval does, and is this machine's.

The observations come from a rosbag2 recording (``--bag``; by default the scene bag of ``--chunks`` ticks
for ``--stream`` written into a temporary directory, what ``physis-bag generate --size 64x64 --tracking``
writes: the arm follows the expert, so consecutive expert chunks meet at the seams), read and
resized by the node's acceptance rule (:func:`physis_ros.bags.analysis.observation_tensors`). The default
bag's camera is square (64 x 64): the scene bag's usual 64 x 48 frame is padded to a square by the node's
preprocessing, which moves the disc in the model's image and leaves the expert's target (found in that
image) off by up to 0.2 of the frame.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from physis_ros.console import write_json

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS = ROOT / "config" / "checkpoints"
# (the rule the checkpoint was trained under, the rule it is served under)
PAIRS = (("clean", "clean"), ("clean", "latest"), ("clean", "same_step"), ("same_step", "same_step"))
# the shipped checkpoints' physis-train settings (config/checkpoints/tiny-wan-wam-{clean,demo}.json)
TRAIN_MODEL, TRAIN_SETTINGS = "tiny-wan-wam", dict(steps=800, lr=2e-3, episodes=64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clean", default=str(CHECKPOINTS / "tiny-wan-wam-clean"),
                   help="checkpoint directory trained under the clean rule (physis-train --history clean)")
    p.add_argument("--same-step", default=str(CHECKPOINTS / "tiny-wan-wam-demo"),
                   help="checkpoint directory trained under same_step")
    p.add_argument("--train", metavar="DIR",
                   help="first train both checkpoints into DIR/clean and DIR/same_step with the shipped ones' "
                        "settings (about 8 min each on one thread) and study those")
    p.add_argument("--train-seed", type=int, default=0, help="with --train: the training seed (data order, steps, "
                                                             "noise; the shipped checkpoints are seed 0)")
    p.add_argument("--bag", help="rosbag2 recording whose --stream observations are fed (default: the scene bag "
                                 "of --chunks ticks, written to a temporary directory)")
    p.add_argument("--config", default=str(ROOT / "config" / "serve_wan_tiny.yaml"),
                   help="serve config naming --stream's topics (how the node reads the bag)")
    p.add_argument("--stream", default="wan_wam", help="the stream of --config whose observations are fed")
    p.add_argument("--chunks", type=int, default=64, help="chunks per rollout (observations taken from the bag)")
    p.add_argument("--seeds", type=int, default=5, help="noise seeds 0..N-1, the same for every rule")
    p.add_argument("--workers", type=int, default=2, help="workers the interval is measured on")
    p.add_argument("--interval-chunks", type=int, default=60, help="chunks per live interval run")
    p.add_argument("--repeats", type=int, default=3, help="live interval rounds over the rules (medians)")
    p.add_argument("--json", default="bench/out/history_quality.json")
    p.add_argument("--plot", default="bench/out/history_quality.png")


def bag_observations(bag: str, config: str, stream: str, chunks: int) -> tuple[list[dict[str, np.ndarray]], float]:
    """The first ``chunks`` observations of ``stream`` in ``bag``, as the node feeds them to the model, and their
    rate (Hz, from the median gap between their stamps)."""
    from physis_ros.bags.analysis import observation_tensors
    from physis_ros.bags.inputs import input_observations
    from physis_ros.bags.serveconf import load_serve_info

    serve = load_serve_info(config)
    info = serve.stream(stream)
    got = input_observations(bag, serve).get(stream, [])
    if len(got) < chunks:
        raise ValueError(f"--bag {bag} has {len(got)} observations of stream '{stream}'; --chunks {chunks} needs "
                         f"as many (record a longer bag or lower --chunks)")
    got = got[:chunks]
    rate_hz = 1e9 / float(np.median(np.diff([o.stamp_ns for o in got])))
    return [observation_tensors(o, info, serve) for o in got], rate_hz


def control_stride(rate_hz: float, control_rate_hz: float) -> int:
    """Control steps between consecutive chunks' first rows (observations ``1 / rate_hz`` apart)."""
    return max(1, int(round(control_rate_hz / rate_hz)))


def chunk_quality(chunks: list[np.ndarray], experts: list[np.ndarray], stride: int, period: float) -> dict:
    """Tracking error against the expert and hand-off seams of a stream's consecutive action chunks
    ([horizon, dof] each; chunk c's first row is control step ``c * stride``)."""
    from physis_ros.timeline import SeamTracker, kinematics

    seams, tracker = [], SeamTracker()
    for c, actions in enumerate(chunks):
        positions = np.asarray(actions, dtype=np.float64)
        velocities, _ = kinematics(positions, period)
        seam = tracker.seam(c * stride, 0, positions, velocities)
        if not math.isnan(seam.position_jump):
            seams.append(seam.position_jump)
        tracker.executed(c * stride, positions, velocities)
    err = np.stack(chunks).astype(np.float64) - np.stack(experts).astype(np.float64)
    return {"tracking_rms": float(np.sqrt(np.mean(err ** 2))), "max_abs": float(np.abs(err).max()),
            "seam_p50": float(np.percentile(seams, 50)), "seam_p99": float(np.percentile(seams, 99))}


def served_under(directory: str, rule: str):
    """The checkpoint ``directory``'s model served under history ``rule``."""
    from physis_ros.model import build_model, load_model_config

    return build_model(replace(load_model_config(directory), history=rule))


def quality_rows(directories: dict[str, str], observations, seeds: int, stride: int) -> tuple[list[dict], dict]:
    """One row per (trained, served) pair of :data:`PAIRS` and seed; and the expert's own seams."""
    import torch

    from physis_ros.observations import ScriptedExpert
    from physis_ros.reference import ReferenceRollout

    expert = ScriptedExpert()
    period = 1.0 / expert.control_rate_hz
    experts = [expert.act(o["image"], o["state"]) for o in observations]
    rows = []
    for trained, rule in PAIRS:
        model = served_under(directories[trained], rule)
        for seed in range(seeds):
            start = time.perf_counter()
            ref = ReferenceRollout(model, seed)
            with torch.no_grad():
                chunks = [model.config.spec.actions_of(ref.step("r0", o).output.numpy()) for o in observations]
            rows.append({"trained": trained, "rule": rule, "seed": seed,
                         **chunk_quality(chunks, experts, stride, period),
                         "seconds": round(time.perf_counter() - start, 2)})
            print(f"trained {trained}, served {rule}, seed {seed}: tracking {rows[-1]['tracking_rms']:.4f} rad, "
                  f"seam p99 {rows[-1]['seam_p99']:.4f} rad", file=sys.stderr, flush=True)
    return rows, chunk_quality(experts, experts, stride, period)


def interval_rows(directory: str, workers: int, chunks: int, repeats: int) -> dict[str, dict]:
    """Per rule: the live chunk interval of the plan the planner predicts fastest among those the rule permits on
    ``workers`` workers (median over ``repeats`` interleaved rounds), beside the prediction."""
    from physis_ros.bench import pipeline
    from physis_ros.model import load_model_config
    from physis_ros.observations import SyntheticScene
    from physis_ros.runtime.planner import predict
    from physis_ros.runtime.plans import PLAN_NAMES, make_plan
    from physis_ros.runtime.profiler import measure_profile

    base = load_model_config(directory)
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    args = parser.parse_args(["--workers", str(workers), "--chunks", str(chunks), "--heartbeat-timeout", "5"])
    args.curve = None
    print(f"profiling {base.name} (the planner's stage costs) ...", file=sys.stderr, flush=True)
    args.profile = measure_profile(replace(base, history="clean"))    # every step's stages and the clean row's
    scene = SyntheticScene(base.observation_shapes)
    chosen = {}
    for rule in ("clean", "latest", "same_step"):
        config = replace(base, history=rule)
        plans = {}
        for name in PLAN_NAMES:
            try:
                plan = make_plan(name, config.steps, config.blocks, workers, clean=config.clean_pass)
            except ValueError:
                continue      # the rule refuses it (a block's steps split over workers)
            plans[name] = predict(plan, args.profile, host_cpus=os.cpu_count()).interval_ms   # as run_plan's
        chosen[rule] = (config, min(plans, key=plans.get), plans)
    runs: dict[str, list[dict]] = {rule: [] for rule in chosen}
    for r in range(repeats):
        for rule, (config, name, _) in chosen.items():
            entry, _ = pipeline.run_plan(name, config, args, scene, None)
            runs[rule].append(entry)
            print(f"[{rule} {r + 1}/{repeats}] plan {name}: interval p50 {entry['interval_ms_p50']:.2f} ms "
                  f"(predicted {entry['predicted_interval_ms']:.2f})", file=sys.stderr, flush=True)
    out = {}
    for rule, (config, name, plans) in chosen.items():
        entries = runs[rule]
        out[rule] = {"plan": name, "permitted_plans_predicted_ms": plans,
                     "in_flight": entries[0]["in_flight"],
                     "interval_ms": float(np.median([e["interval_ms_p50"] for e in entries])),
                     "predicted_interval_ms": entries[0]["predicted_interval_ms"],
                     "latency_ms": float(np.median([e["latency_ms_p50"] for e in entries])),
                     "rounds_ms": [e["interval_ms_p50"] for e in entries]}
    return out


def summarise(rows: list[dict], intervals: dict[str, dict]) -> dict[str, dict]:
    """Per (trained, served) pair: mean and spread (sample standard deviation, min, max) over seeds."""
    out = {}
    for trained, rule in PAIRS:
        mine = [r for r in rows if r["trained"] == trained and r["rule"] == rule]
        entry = {"trained": trained, "rule": rule, "seeds": len(mine)}
        for key in ("tracking_rms", "seam_p50", "seam_p99"):
            values = np.array([r[key] for r in mine])
            entry[key] = {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                          "min": float(values.min()), "max": float(values.max())}
        entry["interval_ms"] = intervals[rule]["interval_ms"]
        entry["predicted_interval_ms"] = intervals[rule]["predicted_interval_ms"]
        entry["latency_ms"] = intervals[rule]["latency_ms"]
        out[f"{trained}->{rule}"] = entry
    return out


def train_checkpoints(out: Path, seed: int = 0) -> dict[str, str]:
    """Both checkpoints trained as the shipped ones were (``physis-train --model tiny-wan-wam --steps 800 --lr 2e-3
    --episodes 64 --history RULE --seed SEED``); their directories."""
    from physis_ros.model import load_model_config
    from physis_ros.model.wan_adapter import save_directory
    from physis_ros.train.trainer import TrainSettings, train

    dirs = {"clean": str(out / "clean"), "same_step": str(out / "same_step")}
    settings = TrainSettings(**TRAIN_SETTINGS, seed=seed)
    for rule, directory in dirs.items():
        config = replace(load_model_config(TRAIN_MODEL), history=rule)

        def progress(step: int, loss: float, seconds: float, rule=rule) -> None:
            print(f"training under {rule}: step {step}/{settings.steps}, loss {loss:.5f}, {seconds:.0f} s",
                  file=sys.stderr, flush=True)

        result = train(config, settings, progress=progress, progress_every=100)
        save_directory(result.model, directory, f"{TRAIN_MODEL}-{rule}",
                       f"{TRAIN_MODEL} trained under the {rule} history rule, seed {seed} (physis-bench "
                       f"history-quality --train)")
    return dirs


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"trained {t}\nserved {r}" for t, r in PAIRS]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, title in ((axes[0], "tracking_rms", "tracking error vs expert (rad, RMS)"),
                           (axes[1], "seam_p99", "hand-off seam (rad): p99 bars, p50 diamonds")):
        for i, (trained, rule) in enumerate(PAIRS):
            mine = [r for r in result["rows"] if r["trained"] == trained and r["rule"] == rule]
            values = [r[key] for r in mine]
            ax.bar(i, np.mean(values), color="C%d" % i, alpha=0.6)
            ax.plot([i] * len(values), values, "k.", label="one seed" if i == 0 else None)
            if key == "seam_p99":
                ax.plot([i] * len(mine), [r["seam_p50"] for r in mine], "wD", mec="k", ms=4,
                        label="p50, one seed" if i == 0 else None)
        if key == "seam_p99":
            ax.axhline(result["expert"]["seam_p99"], color="gray", ls="--", label="the expert's own seams (p99)")
        ax.set_xticks(range(len(PAIRS)), labels, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax = axes[2]
    rules = list(result["intervals"])
    for i, rule in enumerate(rules):
        e = result["intervals"][rule]
        ax.bar(i - 0.27, e["interval_ms"], 0.27, color="C0", label="interval, measured" if i == 0 else None)
        ax.bar(i, e["predicted_interval_ms"], 0.27, color="C1", label="interval, planner" if i == 0 else None)
        ax.bar(i + 0.27, e["latency_ms"], 0.27, color="C2", label="latency, measured" if i == 0 else None)
        ax.text(i, max(e["interval_ms"], e["latency_ms"]) * 1.02, f"{e['plan']}, {e['in_flight']} in flight",
                ha="center", va="bottom", fontsize=8)
    top = max(max(e["interval_ms"], e["latency_ms"]) for e in result["intervals"].values())
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(range(len(rules)), [f"served {r}" for r in rules])
    ax.set_ylabel("ms (p50)")
    ax.set_title(f"chunk interval and latency on {result['workers']} workers (this machine)")
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{result['chunks']} chunks of the '{result['stream']}' bag, seeds 0..{result['seeds'] - 1}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    dirs = {"clean": args.clean, "same_step": args.same_step}
    if args.train:
        dirs = train_checkpoints(Path(args.train), args.train_seed)
    for trained, directory in dirs.items():
        if not (Path(directory) / "physis_model.yaml").is_file():
            print(f"physis-bench: error: --{trained.replace('_', '-')} {directory} is not a checkpoint directory "
                  f"(no physis_model.yaml); train one with physis-train --history {trained} or pass --train DIR",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="physis-history-quality-") as tmp:
        bag = args.bag
        if bag is None:
            from physis_ros.bags.scene import SceneSpec, write_scene_bag

            # A square camera: the node resizes it without padding, so the expert finds the disc where it is.
            spec = SceneSpec(namespaces=(args.stream,), duration_s=args.chunks / SceneSpec.rate_hz, width=64,
                             height=64, tracking=True)
            bag = str(Path(tmp) / "scene")
            write_scene_bag(bag, spec)
        try:
            observations, rate_hz = bag_observations(bag, args.config, args.stream, args.chunks)
        except (ValueError, KeyError) as exc:
            print(f"physis-bench: error: {exc}", file=sys.stderr)
            return 2
    from physis_ros.observations import ScriptedExpert

    stride = control_stride(rate_hz, ScriptedExpert.control_rate_hz)
    rows, expert = quality_rows(dirs, observations, args.seeds, stride)
    intervals = interval_rows(dirs["clean"], args.workers, args.interval_chunks, args.repeats)
    for row in rows:
        row["interval_ms"] = intervals[row["rule"]]["interval_ms"]
    result = {"command": " ".join(["physis-bench", "history-quality", *sys.argv[2:]]),
              "checkpoints": dirs, "train_seed": args.train_seed if args.train else 0,
              "bag": args.bag or "scene bag (physis_ros.bags.scene)", "stream": args.stream,
              "chunks": args.chunks, "seeds": args.seeds, "workers": args.workers, "observation_rate_hz": rate_hz,
              "control_stride": stride,
              "rows": rows, "summary": summarise(rows, intervals), "intervals": intervals, "expert": expert,
              "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1)}
    write_json(args.json, result)
    plot(result, args.plot)
    for key, e in result["summary"].items():
        print(f"{key:>22}: tracking {e['tracking_rms']['mean']:.4f} +- {e['tracking_rms']['std']:.4f} rad, "
              f"seam p50 {e['seam_p50']['mean']:.4f}, p99 {e['seam_p99']['mean']:.4f} +- {e['seam_p99']['std']:.4f} "
              f"rad, interval {e['interval_ms']:.1f} ms (predicted {e['predicted_interval_ms']:.1f}), latency "
              f"{e['latency_ms']:.1f} ms")
    print(f"wrote {args.json} and {args.plot} in {result['seconds']:.0f} s")
    return 0
