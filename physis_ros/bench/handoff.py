"""Delay-aware hand-off between chunks (model/handoff.py), measured: seams, smoothness and tracking on a
simulated robot.

One :class:`~physis_ros.serving.server.Server` with ``--workers`` worker processes serves the trained demo
policy (and, once, the randomly initialised model for scale) to ``--robots`` robots at a time, each joining
through the Server API as any client does, on its control timeline (cadence ``timeline``: one release every
``s`` steps, admitted, placed and paced by the server). Each robot is simulated
(:class:`~physis_ros.bench.robot.SimulatedRobot`): it executes the chunks it receives on the timeline, closed
loop (each robot is the stream's ``source``: its observation is the bundled scene's camera view now plus the
arm's commanded position now), and a chunk reaches it ``d`` extra control steps after the server hands it out,
the injected delay. For every hand-off mode (none, hard, soft) and ``d`` in ``--delays`` it reports the seam
(position and velocity jump where a new chunk takes over), the jerk of what the arm executed, late points and
chunks, the tracking error against the scene's scripted expert for the same observations (over the rows the
robot is sent: from the first not yet due to the chunk's end), and the response overhead: from the moment the
simulated camera's frame is ready to the chunk handed out, minus the chunk's compute on its workers (the frame
is stamped at capture; its render, the sensor's own time, is reported beside it as ``sensor_ms_p50`` and
counted in ``response_overhead_from_capture_ms_p50``; of it, ``overhead_queue_ms_p50`` waited in worker ready
queues and ``overhead_hops_ms_p50`` was on the wire). Every run serves the same stream names, so modes and
delays see the same sampler noise (drawn from seed, stream and chunk) as well as the same scene.

    physis-bench handoff [--checkpoint config/checkpoints/tiny-wam-demo.safetensors] [--chunks 60]
                         [--modes none,hard,soft] [--delays 0,2,4] [--capture-margin 0.3|off]
                         [--seam-blend-steps 4]
                         [--json out.json] [--plot out.png]

JSON: ``runs`` (per model, mode and delay: seam jump p50/p99 (as computed), seam velocity jump p99, jerk
RMS and ``max_command_step`` of what the arm was commanded (a seam that jumps is eased over
``--seam-blend-steps`` rows, as the node sends it; ``eased_chunks``), late points and chunks, tracking
error (and split: ``tracking_error_frozen_rows`` over the executed rows the hand-off froze to the previous
chunk's, ``tracking_error_free_rows`` over the rows after them, ``frozen_rows_executed_mean`` a chunk),
``capture_lead_steps_p50`` (how far ahead of row 0 the observation was taken), ``unfrozen_takeovers``
(chunks the robot switched to past their frozen rows), ``target_tracking_error`` (closed loop: the arm
against the expert's target pose at every executed step), the delay the hand-off assumed, the response
overhead p50 per robot, from the frame and from its capture), ``tracking_error_trained`` /
``tracking_error_random``, ``targets`` (the issue's ratios), ``targets_met`` and ``passed``. Exit status: 0
every target met; 1 a target missed or a non-finite seam; 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import threading
import time
from pathlib import Path

import numpy as np
import torch

from physis_ros.bench.robot import SimulatedRobot
from physis_ros.console import write_json
from physis_ros.model.handoff import MODES
from physis_ros.observations import ScriptedExpert, SyntheticScene
from physis_ros.runtime.settings import EngineConfig
from physis_ros.serving.config import StreamConfig
from physis_ros.serving.fit import stream_timeline
from physis_ros.serving.server import Server
from physis_ros.serving.session import Chunk
from physis_ros.telemetry import percentile
from physis_ros.timeline import ControlTimeline, rms

ROOT = Path(__file__).resolve().parents[2]
DEMO_CHECKPOINT = ROOT / "config" / "checkpoints" / "tiny-wam-demo.safetensors"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEMO_CHECKPOINT), help="the trained policy (tiny-wam safetensors)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--robots", type=int, default=2, help="robots served at once in each run (the demo runs 2)")
    p.add_argument("--chunks", type=int, default=60, help="chunks per robot and run")
    p.add_argument("--modes", default=",".join(MODES), help="hand-off modes to run")
    p.add_argument("--delays", default="0,2,4", help="injected extra delays d (control steps)")
    p.add_argument("--control-rate-hz", type=float, default=50.0)
    p.add_argument("--execution-horizon", type=int, default=8, help="s: steps each chunk is executed for")
    p.add_argument("--socket", choices=("tcp", "ipc"), default="tcp")
    p.add_argument("--capture-margin", type=_margin, default=ControlTimeline.capture_margin,
                   help="with a hand-off, take each observation ahead of its slot so that the estimated arrival "
                        "lands this many steps before a control step ('off': at the slot)")
    p.add_argument("--wake-ahead-us", type=int, default=EngineConfig.wake_ahead_us,
                   help="engine.wake_ahead_us (0: the receivers are not woken ahead of a chunk)")
    p.add_argument("--seam-blend-steps", type=_blend_steps, default=StreamConfig.seam_blend_steps,
                   help="the robot is sent a takeover that jumps eased over this many rows, as the node sends it "
                        "(the stream key seam_blend_steps; 0: as computed)")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG: seam jumps per mode and delay, executed trajectory vs expert")


def _margin(text: str) -> float | None:
    if text == "off":
        return None
    value = float(text)
    if not 0.0 <= value <= 0.9:     # as a stream's capture_margin_steps
        raise argparse.ArgumentTypeError(f"--capture-margin must be 0-0.9 steps or 'off', got {text}")
    return value


def _blend_steps(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 64:        # as a stream's seam_blend_steps
        raise argparse.ArgumentTypeError(f"--seam-blend-steps must be 0-64 rows, got {text}")
    return value


@dataclasses.dataclass
class RobotRun:
    """What one simulated robot saw in one run."""

    robot: SimulatedRobot
    frames: dict = dataclasses.field(default_factory=dict)      # chunk -> (captured, frame ready, arm there)
    seams: list = dataclasses.field(default_factory=list)       # (position jump, velocity jump) per chunk
    tracking: list = dataclasses.field(default_factory=list)    # RMS vs the expert over the rows sent (k on)
    # The same, split: the executed rows the hand-off froze (the previous chunk's) and the free ones after
    tracking_frozen: list = dataclasses.field(default_factory=list)
    tracking_free: list = dataclasses.field(default_factory=list)
    frozen_executed: list = dataclasses.field(default_factory=list)    # rows of the previous chunk's it ran
    overhead_ms: list = dataclasses.field(default_factory=list)            # from the frame being ready
    overhead_capture_ms: list = dataclasses.field(default_factory=list)    # from its capture (sensor included)
    sensor_ms: list = dataclasses.field(default_factory=list)              # the simulated camera's render
    # the overhead's parts: waits in worker ready queues, transfers (engine -> worker -> engine)
    queue_ms: list = dataclasses.field(default_factory=list)
    hops_ms: list = dataclasses.field(default_factory=list)
    delays: list = dataclasses.field(default_factory=list)      # d the hand-off assumed
    # Takeovers at a frozen row (the robot's first executed row < d, the previous chunk executed): with a
    # hand-off (hard, soft) such a seam is exactly 0 whatever the load (none freezes nothing); (chunk, jump)
    frozen_takeovers: list = dataclasses.field(default_factory=list)
    unfrozen_takeovers: int = 0     # with a hand-off: came later than its frozen rows, the robot switched past them
    capture_lead_steps: list = dataclasses.field(default_factory=list)   # observation taken ahead of row 0
    last_executed: int | None = None
    outputs: list = dataclasses.field(default_factory=list)     # (first_step, actions) for the plot
    resets: int = 0             # its stream was reset (a worker lost under load): its seams are not the hand-off's
    scenario: Scenario | None = None

    def target_tracking(self, skip_steps: int) -> float:
        """Closed loop: RMS of the arm's commanded pose at every executed control step (after the first
        ``skip_steps``) against the expert's target pose for where the disc is at that step."""
        traj, robot, sc = self.robot.trajectory(), self.robot, self.scenario
        if robot.t0 is None or sc is None or len(traj) <= skip_steps:
            return math.nan
        first, dof = robot.first_executed_step, traj.shape[1]
        targets = np.array([sc.expert.target(SyntheticScene.disc_center(robot.t0 + n * robot.period - sc.t0, sc.phase),
                                             dof) for n in range(first, first + len(traj))])
        return rms(traj[skip_steps:], targets[skip_steps:])


class Scenario:
    """The bundled scene seen by one robot: the camera now, the arm where the robot has it, the expert."""

    def __init__(self, name: str, shapes: dict, horizon: int, rate_hz: float, t0: float):
        self.name = name
        self.shapes = shapes
        self.phase = SyntheticScene.phase(name)
        self.expert = ScriptedExpert(horizon, rate_hz)
        self.t0 = t0   # the scene's start on the server clock (s): its motion is counted from here

    def observe(self, now: float, q: np.ndarray) -> dict[str, np.ndarray]:
        """The observation at ``now`` with the arm at ``q``."""
        image = SyntheticScene.image(self.shapes["image"], now - self.t0, self.phase)
        return {"image": image, "state": q.astype(np.float32)}

    def expert_chunk(self, now: float, q: np.ndarray) -> np.ndarray:
        """The expert's chunk for the observation at ``now`` with the arm at ``q`` (the score, computed when
        the chunk is back, not on the serving path)."""
        return self.expert.chunk(q, self.expert.target(SyntheticScene.disc_center(now - self.t0, self.phase), len(q)))


def serve_run(server: Server, model: str, names: list[str], mode: str, d: int, chunks: int,
              args: argparse.Namespace) -> dict[str, RobotRun]:
    """Serve ``names`` together for ``chunks`` chunks each, closed loop with their simulated robots, through
    the Server API as any client is served: each robot joins with its stream keys (hand-off ``mode``, extra
    delay ``d``), is admitted and paced by the server, and renders its observation when its chunk is due."""
    cfg = server.catalog.config_of(model)
    rate, s = args.control_rate_hz, args.execution_horizon
    horizon = cfg.control_horizon
    interval_ms = s / rate * 1e3
    margin = server.config.admission.pace_margin
    runs: dict[str, RobotRun] = {}
    done = threading.Semaphore(0)
    for i, name in enumerate(names):
        # Robot i sees the same scene (target path, from its start) in every run: modes and delays are
        # compared on the same motion, not on paths of different difficulty.
        scenario = Scenario(f"robot{i}", cfg.observation_shapes, horizon, rate, server.clock())
        q0 = SyntheticScene.joints(cfg.observation_shapes["state"][0], 0.0, scenario.phase)
        stream = StreamConfig(joint_names=[f"joint{j + 1}" for j in range(len(q0))], control_rate_hz=rate,
                              execution_horizon=s, handoff=mode, extra_delay_steps=d,
                              capture_margin_steps=args.capture_margin, seam_blend_steps=args.seam_blend_steps)
        # the robot's own copy of the stream's timeline (what the server places the chunks on)
        timeline = stream_timeline(stream, cfg, False, interval_ms, margin)
        robot = SimulatedRobot(q0, timeline, d, blend_steps=args.seam_blend_steps)
        run = runs[name] = RobotRun(robot, scenario=scenario)

        def source(c: int, run: RobotRun = run, scenario: Scenario = scenario):
            now = server.clock()
            q = run.robot.position(now)
            obs = scenario.observe(now, q)
            run.frames[c] = (now, server.clock(), np.array(q))
            return obs, now

        def on_chunk(chunk: Chunk, run: RobotRun = run, scenario: Scenario = scenario) -> None:
            if len(run.seams) >= chunks:
                return
            rec, index, output = chunk.telemetry, chunk.index, chunk.actions
            k, seam = run.robot.receive(server.clock(), rec.first_step, rec.step0, output, rec.shift)
            captured, ready, q = run.frames.pop(index)
            expert = scenario.expert_chunk(captured, q)
            run.seams.append((seam.position_jump, seam.velocity_jump))
            if k < rec.delay_steps and run.last_executed == index - 1:
                run.frozen_takeovers.append((index, seam.position_jump))
            elif mode != "none" and run.last_executed == index - 1 and k < len(output):
                run.unfrozen_takeovers += 1
            run.capture_lead_steps.append((rec.step0 - captured) * rate)
            if k < len(output):
                run.last_executed = index
                run.tracking.append(rms(output[k:], expert[k:]))
                split = k if mode == "none" else max(k, rec.delay_steps)
                run.tracking_frozen.append(rms(output[k:split], expert[k:split]))
                run.tracking_free.append(rms(output[split:], expert[split:]))
                run.frozen_executed.append(split - k)
            compute = sum(rec.stage_ms)
            run.overhead_ms.append((rec.emit - ready) * 1e3 - compute)
            run.overhead_capture_ms.append((rec.emit - captured) * 1e3 - compute)
            run.sensor_ms.append((ready - captured) * 1e3)
            run.queue_ms.append(rec.queue_ms)
            run.hops_ms.append(sum(rec.hops_ms))
            run.delays.append(rec.delay_steps)
            run.outputs.append((rec.first_step, np.array(output), expert))
            if len(run.seams) == chunks:
                done.release()

        server.admit(name, dataclasses.replace(stream, model=model), on_chunk=on_chunk, source=source)
    deadline = time.monotonic() + 60.0 + chunks * interval_ms / 1e3 * 20
    for name in names:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"the robots did not get {chunks} chunks each in time "
                               f"({ {n: len(r.seams) for n, r in runs.items()} })")
    for name in names:
        runs[name].resets = sum(server.session(name).health.resets.values())
        server.leave(name)
    return runs


def _nanmean(values: list[float]) -> float | None:
    """Mean of the finite values (a chunk with no row in a part gives nan); None if there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _split(row: dict) -> str:
    """The tracking error's split for the progress line ('' where nothing was frozen)."""
    if not row["frozen_rows_executed_mean"]:
        return ""
    return (f"frozen rows {row['tracking_error_frozen_rows']:.4f} over {row['frozen_rows_executed_mean']:.2f} "
            f"a chunk (captured {row['capture_lead_steps_p50']:.2f} steps ahead, {row['unfrozen_takeovers']} "
            f"switched past them), free rows {row['tracking_error_free_rows']:.4f}; ")


def summarize_run(mode: str, d: int, model: str, runs: dict[str, RobotRun], skip: int, skip_steps: int = 0) -> dict:
    """One row of ``runs``: metrics over every robot, the first ``skip`` chunks of each (``skip_steps`` control
    steps of the executed trajectory) left out (start-up)."""
    seams = [s for r in runs.values() for s in r.seams[skip:]]
    pos = [s[0] for s in seams]
    return {
        "mode": mode, "delay_steps": d, "model": model, "robots": len(runs),
        "chunks": sum(len(r.seams) for r in runs.values()),
        "resets": sum(r.resets for r in runs.values()),
        "seam_jump_p50": percentile(pos, 50), "seam_jump_p99": percentile(pos, 99),
        "seam_velocity_jump_p99": percentile([s[1] for s in seams], 99),
        "jerk_rms": float(np.mean([r.robot.jerk_rms() for r in runs.values()])),
        # what the arm was commanded: its largest step between two control steps, and the takeovers eased
        "max_command_step": max(r.robot.max_command_step() for r in runs.values()),
        "eased_chunks": sum(r.robot.eased_chunks for r in runs.values()),
        "late_points": sum(r.robot.late_points for r in runs.values()),
        "late_chunks": sum(r.robot.late_chunks for r in runs.values()),
        "tracking_error": float(np.mean([t for r in runs.values() for t in r.tracking[skip:]])),
        # split: over the executed rows the hand-off froze, and over the free rows after them (none: all free)
        "tracking_error_frozen_rows": _nanmean([t for r in runs.values() for t in r.tracking_frozen[skip:]]),
        "tracking_error_free_rows": _nanmean([t for r in runs.values() for t in r.tracking_free[skip:]]),
        "frozen_rows_executed_mean": _nanmean([n for r in runs.values() for n in r.frozen_executed[skip:]]),
        # the arm against the moving target (closed loop), over the steps after the skipped chunks' period
        "target_tracking_error": float(np.mean([r.target_tracking(skip_steps)
                                                for r in runs.values()])),
        # takeovers at a row the hand-off froze, and the largest seam among them (0.0: every one exact)
        "frozen_takeovers": sum(len(r.frozen_takeovers) for r in runs.values()),
        "frozen_takeover_jump_max": max((j for r in runs.values() for _, j in r.frozen_takeovers), default=0.0),
        "unfrozen_takeovers": sum(r.unfrozen_takeovers for r in runs.values()),
        "capture_lead_steps_p50": percentile([x for r in runs.values() for x in r.capture_lead_steps[skip:]], 50),
        "assumed_delay_steps_p50": percentile([x for r in runs.values() for x in r.delays[skip:]], 50),
        "response_overhead_ms_p50": {name: percentile(r.overhead_ms[skip:], 50) for name, r in runs.items()},
        "response_overhead_from_capture_ms_p50": {name: percentile(r.overhead_capture_ms[skip:], 50)
                                                  for name, r in runs.items()},
        "sensor_ms_p50": {name: percentile(r.sensor_ms[skip:], 50) for name, r in runs.items()},
        # of the overhead, p50 over every robot: queued in workers, on the wire (the rest: the engine's own path)
        "overhead_queue_ms_p50": percentile([x for r in runs.values() for x in r.queue_ms[skip:]], 50),
        "overhead_hops_ms_p50": percentile([x for r in runs.values() for x in r.hops_ms[skip:]], 50),
    }


def run_all(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    delays = [int(x) for x in args.delays.split(",") if x.strip()]
    config = {"model": "tiny-wam", "engine": {"workers": args.workers, "transport": args.socket,
                                              "wake_ahead_us": args.wake_ahead_us},
              "admission": {"profiles": str(ROOT / "config" / "profiles")}}
    skip = min(max(4, ControlTimeline.delay_warmup), args.chunks // 4)   # start-up and the delay estimate's warm-up
    rows, examples = [], {}
    with Server.from_config(config) as server:
        horizon = server.catalog.config_of(args.checkpoint).control_horizon

        def one(model: str, mode: str, d: int, label: str) -> dict:
            # The same stream names in every run: a chunk's sampler noise is drawn from (seed, stream, chunk),
            # so modes and delays are compared on the same noise as well as the same motion. Names new to
            # each run drew new noise, which moved a run's tracking error by up to 10 % on its own.
            names = [f"robot{i}" for i in range(args.robots)]
            runs = serve_run(server, model, names, mode, d, args.chunks, args)
            row = summarize_run(mode, d, label, runs, skip, skip * args.execution_horizon)
            examples[(label, mode, d)] = runs[names[0]]
            print(f"  {label:<7} {mode:<5} d={d}: seam p50/p99 {row['seam_jump_p50']:.4f}/{row['seam_jump_p99']:.4f}"
                  f" rad, velocity p99 {row['seam_velocity_jump_p99']:.3f} rad/s, jerk {row['jerk_rms']:.1f}, largest "
                  f"command step {row['max_command_step']:.3f} rad ({row['eased_chunks']} eased), "
                  f"late points {row['late_points']} (chunks {row['late_chunks']}), tracking "
                  f"{row['tracking_error']:.4f} ({_split(row)}arm vs target {row['target_tracking_error']:.4f}), "
                  f"overhead p50 "
                  f"{', '.join(f'{v:.2f}' for v in row['response_overhead_ms_p50'].values())} ms (from capture "
                  f"{', '.join(f'{v:.2f}' for v in row['response_overhead_from_capture_ms_p50'].values())}; "
                  f"queued {row['overhead_queue_ms_p50']:.2f}, wire {row['overhead_hops_ms_p50']:.2f})",
                  flush=True)
            return row

        random_row = one("tiny-wam", "none", 0, "random")
        for d in delays:
            for mode in modes:
                rows.append(one(str(args.checkpoint), mode, d, "trained"))
    trained_none = [r for r in rows if r["mode"] == "none" and r["delay_steps"] == 0]
    result = {
        "benchmark": "handoff", "workers": args.workers, "robots": args.robots, "chunks": args.chunks,
        "control_rate_hz": args.control_rate_hz, "execution_horizon": args.execution_horizon, "horizon": horizon,
        "checkpoint": str(args.checkpoint), "skipped_chunks": skip, "torch_threads": torch.get_num_threads(),
        "wake_ahead_us": args.wake_ahead_us, "capture_margin_steps": args.capture_margin,
        "seam_blend_steps": args.seam_blend_steps,
        "runs": rows,
        "tracking_error_trained": trained_none[0]["tracking_error"] if trained_none else rows[0]["tracking_error"],
        "tracking_error_random": random_row["tracking_error"],
        "random": random_row,
    }
    result["targets"] = targets(result)
    result["targets_met"] = targets_met(result["targets"])
    result["passed"] = all(result["targets_met"].values())
    result["_examples"] = examples
    return result


def targets(result: dict) -> dict:
    """The issue's targets, evaluated on this run's numbers."""
    by = {(r["mode"], r["delay_steps"]): r for r in result["runs"]}
    out: dict = {}
    for (mode, d), row in by.items():
        none = by.get(("none", d))
        if mode == "soft" and d >= 2 and none is not None:
            # null: soft closed every seam (p99 exactly 0), an improvement no ratio expresses
            out[f"soft_vs_none_seam_p99_ratio_d{d}"] = (none["seam_jump_p99"] / row["seam_jump_p99"]
                                                         if row["seam_jump_p99"] > 0 else None)
            out[f"soft_vs_none_tracking_change_d{d}"] = row["tracking_error"] / none["tracking_error"] - 1.0
    out["trained_vs_random_tracking"] = result["tracking_error_trained"] / result["tracking_error_random"]
    out["late_chunks"] = sum(r["late_chunks"] for r in result["runs"])
    out["response_overhead_ms_p50_max"] = max(v for r in result["runs"] for v in r["response_overhead_ms_p50"].values())
    return out


def targets_met(t: dict) -> dict[str, bool]:
    """Each target of the issue: met or not (a target whose runs were not asked for is left out)."""
    met = {"trained_vs_random_tracking <= 0.3": t["trained_vs_random_tracking"] <= 0.3,
           "no chunk entirely late": t["late_chunks"] == 0,
           "response overhead p50 <= 2 ms": t["response_overhead_ms_p50_max"] <= 2.0}
    for key, value in t.items():
        if key.startswith("soft_vs_none_seam_p99_ratio_"):
            met[f"{key} >= 2"] = value is None or value >= 2.0
        elif key.startswith("soft_vs_none_tracking_change_"):
            met[f"{key} <= +10%"] = value <= 0.10
    return met


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = result["runs"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        ax1.plot([r["delay_steps"] for r in rs], [r["seam_jump_p99"] for r in rs], "o-", label=f"{mode} p99")
        ax1.plot([r["delay_steps"] for r in rs], [r["seam_jump_p50"] for r in rs], "x--", alpha=0.6,
                 label=f"{mode} p50")
    ax1.set_xlabel("injected delay d (control steps)")
    ax1.set_ylabel("seam position jump (rad, max over joints)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.set_title("where a new chunk takes over")
    example = result["_examples"].get(("trained", "soft", max(r["delay_steps"] for r in rows)))
    if example is not None:
        dt = 1.0 / result["control_rate_hz"]
        x = example.robot.trajectory()
        start = example.robot.first_executed_step
        ax2.plot((start + np.arange(len(x))) * dt, x[:, 0], label="executed (joint 1)", color="C0")
        for first_step, _, expert in example.outputs[::2]:
            ax2.plot((first_step + np.arange(len(expert))) * dt, expert[:, 0], color="C1", alpha=0.4, lw=0.8)
        ax2.plot([], [], color="C1", alpha=0.4, label="expert's chunks")
        ax2.set_xlabel("control time (s)")
        ax2.set_ylabel("joint 1 (rad)")
        ax2.legend(fontsize=8)
        ax2.set_title("trained policy, soft hand-off, largest d")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    unknown = [m for m in args.modes.split(",") if m.strip() and m.strip() not in MODES]
    if unknown:
        from physis_ros.console import CliError
        raise CliError(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    torch.set_num_threads(1)
    print(f"physis-bench handoff: {args.robots} robot(s) per run on {args.workers} worker(s), {args.chunks} chunks "
          f"each, modes {args.modes}, d in {{{args.delays}}}", flush=True)
    result = run_all(args)
    if args.plot:
        plot(result, args.plot)
    del result["_examples"]
    for key, value in result["targets"].items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    for target, ok in result["targets_met"].items():
        print(f"  target {target}: {'met' if ok else 'MISSED'}")
    if args.json:
        write_json(args.json, result)
    finite = all(math.isfinite(r["seam_jump_p99"]) for r in result["runs"])
    return 0 if finite and result["passed"] else 1
