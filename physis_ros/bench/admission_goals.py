"""Admission (scheduling/admission.py) in the served product, live: robots join a running ``physis-serve``
through the ``~/serve_stream`` action until one is rejected; then a robot of a second model joins where
capacity remains (where none does, it is rejected with the reason and asks again once a robot has left); then
one robot leaves and a new one joins. Run once with the workers batching (``adaptive``: admission credits
time-sharing at the batch-cost curve) and once without (``off``: no credit).

    physis-bench admission [--modes adaptive,off] [--window 8] [--settle 3] --json out.json [--plot out.png]

Processes, as on a robot: the server (``physis-serve``, a config without streams: tiny-wam, 2 CPU
workers), the robots' inputs (``physis-synthetic``: camera + joint states per robot namespace) and this
benchmark (the robots' ServeStream clients, a subscriber of each robot's ``action_chunk``,
``/telemetry``, ``/diagnostics`` and ``/rosout``), on a private ROS domain. The second model's robot
(a world model) imagines what ``robot0`` commands: its ``actions`` topic is ``/robot0/action_chunk``;
it asks for each ``--second-slo-ms`` in turn until admitted. Both models are profiled once, in this
process, before the first server starts, and every server of the run admits with those files
(``admission.profiles``): the modes differ only by the batching credit, and the benchmark replays each
decision on the same :class:`~physis_ros.serving.capacity.ServerAdmission` to report the placements
(checked against the server: its ``ListStreams`` workers and the utilisation it logs).

After every admitted join, and after the leave, each running stream is measured over ``--window``
seconds once ``--settle`` seconds have passed since the newcomer's first chunk (what happened to the
others meanwhile is kept too, under ``settle``). No jitter buffer: chunks go out when done.

JSON (``--json``), every number raw; times in s, durations in ms:

- ``benchmark`` "admission", ``command``, ``completed``, ``wall_s``, ``settings`` (models, SLOs, window,
  settle, camera, headroom, pace_margin, ...), ``profiles`` (per model: source, chunk_ms at batch 1 and
  per sample at batch 4, corun_slowdown, the file), ``host`` (cpus, load average at start and end).
- ``runs``: one per mode and round, each with ``mode``, ``round``, ``config`` (the server's serve YAML
  as written), ``server_exit``, and
  - ``events``: every join, rejection and leave: ``kind`` (join/leave), ``stream``, ``model``,
    ``slo_ms``, ``pace_ms``, ``admitted``, ``reason``/``detail`` (rejections, as the server said),
    ``workers`` (the server's feedback), ``decision_s``, ``placement`` (the replayed decision: ranks,
    devices, ``compute_ms`` and ``hop_ms`` per worker), ``mirror_agrees``, ``predicted_utilisation``
    (the replay's, per worker, batching credited as the server does) and ``server_utilisation`` (from
    the server's log line), ``list_streams`` (ListStreams: stream -> workers).
  - ``phases``: one per measured state, ``label``, ``event`` (index), ``window`` (start, end, s),
    ``load_avg_1m``, ``cpu`` (machine busy and steal fractions of all cores; CPU cores used by the
    server, each worker, the synthetic robots and this process, their sum ``ours_cores`` and
    ``others_cores``: what other work on the machine took meanwhile), ``streams`` (per running stream:
    ``model``, ``workers``, ``slo_ms``, ``pace_ms``, ``predicted_compute_ms`` per worker per chunk
    (batch 1, co-run slowdown included), ``measured_compute_ms`` per worker per chunk (p50 of the
    chunk's stage compute from telemetry: a stream on one worker is exact, a split one is apportioned
    by the predicted ratio, ``compute_split``), ``chunks``, ``chunks_per_s``, ``interval_ms`` and
    ``latency_ms`` (p50, p99, max), ``deadline_misses``, ``gaps`` (missing chunk indices),
    ``lost_to_robot`` (chunks in telemetry that this process never got on the robot's action_chunk, or
    predicted_frames), ``mean_batch``, ``queue_ms_p50``, ``observation_age_ms_p50``, ``meets_slo``
    (interval p99 <= SLO)), ``settle`` (per stream over the settle time: interval max and
    p99, misses, gaps), ``workers`` (per worker: ``predicted_utilisation``, ``server_utilisation``,
    ``measured_busy`` = compute time / wall time from the worker's own counters on /diagnostics,
    ``cpu``, ``stages``, ``batches``, ``mean_batch``), ``all_meet_slo``, ``gaps``.
  - ``streams``: per stream over its whole life: chunks, first/last index, gaps, misses, the goal's
    result (outcome, chunks_emitted, chunks_lost).
  - ``admitted``: count of the first model, the second model's SLO (or null), ``rejections``;
    ``slo_held`` (every phase, every stream), ``gaps``.
- ``summary``: per mode (first round): admitted counts, slo_held, gaps, worst interval p99 / SLO.
- ``targets`` and ``passed``: every admitted stream's interval p99 within its SLO in every phase, no
  gaps, and at least as many first-model streams admitted as ``physis-bench streams`` (3).

Raw rows (``--raw``, a separate file: hundreds of kB a run): ``raw_columns`` and ``runs``, one per run
with ``mode``, ``round`` and ``streams``: stream -> per chunk rows.

Exit status: 0 the targets were met; 1 the benchmark ran and a target was missed, or the server or a
robot process failed; 2 usage or input error; 70 internal error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from physis_ros.bench.admission_observe import RAW_COLUMNS
from physis_ros.bench.admission_run import JOINTS, SECOND, Interrupted, Run, RunFailed, _say

STREAMS_BENCH_ADMITS = 3   # what the engine-level `physis-bench streams` admitted (bench/RESULTS.md, joint scheduling live)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="base serve YAML (engine, admission; its streams are dropped); "
                                                  "default: the bundled config/serve.yaml")
    p.add_argument("--model", default="tiny-wam", help="the robots' model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slo-ms", type=float, default=100.0, help="output-interval SLO of each robot")
    p.add_argument("--control-rate-hz", type=float, default=50.0)
    p.add_argument("--second-model", default="tiny-acwm", help="the model of the robot that joins where capacity "
                                                               "remains ('' to skip)")
    p.add_argument("--second-slo-ms", default="200,300,400", help="SLOs it asks for in turn until admitted")
    p.add_argument("--second-control-rate-hz", type=float, default=10.0)
    p.add_argument("--modes", default="adaptive,off", help="engine.batching of each run (adaptive, on, off)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the modes this many times (interleaved)")
    p.add_argument("--headroom", type=float, default=None, help="admission.headroom (default: the config's)")
    p.add_argument("--pace-margin", type=float, default=None, help="admission.pace_margin (default: the config's)")
    p.add_argument("--host-reserve-cores", type=float, default=None,
                   help="admission.host_reserve_cores (default: the config's)")
    p.add_argument("--max-streams", type=int, default=None, help="join at most this many robots of the model "
                                                                 "(default 20; --quick 2)")
    p.add_argument("--window", type=float, default=None, help="seconds measured per phase (default 8; --quick 1.5)")
    p.add_argument("--settle", type=float, default=None, help="seconds after a newcomer's first chunk (or a leave) "
                                                              "before the window (default 3; --quick 1)")
    p.add_argument("--rate", type=float, default=30.0, help="synthetic camera/joint-state rate (Hz)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--profiles", default=None, help="directory of physis-profile JSONs <model>.cpu.json to admit "
                                                    "with (default: both models measured now)")
    p.add_argument("--profile-repeats", type=int, default=None, help="timing rounds when measuring (default: the "
                                                                     "config's admission.profile_repeats; --quick 2)")
    p.add_argument("--quick", action="store_true", help="short windows, 2 robots at most: a smoke test")
    p.add_argument("--domain", type=int, default=0, help="ROS_DOMAIN_ID (0: a private one from the pid)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="wait this long for the server, a decision "
                                                                      "or a first chunk")
    p.add_argument("--logs", default=None, help="keep the server's and robots' logs here")
    p.add_argument("--json", help="write results here (summaries: no per-chunk rows)")
    p.add_argument("--raw", help="write the per-chunk rows of every stream here (large: keep out of git)")
    p.add_argument("--plot", help="write a PNG: interval p99 per stream and phase vs SLO, predicted vs measured "
                                  "worker load")

# ---------------------------------------------------------------------------------------------- set-up
def _settings(args: argparse.Namespace) -> dict:
    from physis_ros.console import CliError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("adaptive", "on", "off")]
    if not modes or bad:
        raise CliError(f"--modes: give engine.batching modes from adaptive, on, off (got {args.modes!r})")
    try:
        tries = [float(x) for x in args.second_slo_ms.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--second-slo-ms: give comma-separated numbers, got {args.second_slo_ms!r}") from None
    if args.second_model and (not tries or any(not t > 0 for t in tries)):
        raise CliError(f"--second-slo-ms: give SLOs > 0 ms, got {args.second_slo_ms!r}")
    q = args.quick
    return {"modes": modes, "second_slo_tries": tries,
            "window_s": args.window if args.window is not None else (1.5 if q else 8.0),
            "settle_s": args.settle if args.settle is not None else (1.0 if q else 3.0),
            "max_streams": args.max_streams if args.max_streams is not None else (2 if q else 20)}


def _serve_mapping(args, base: dict, mode: str, profiles_dir: str, cap: int) -> dict:
    from physis_ros.serving.config import deep_merge

    engine = base.get("engine") or {}
    admission = {"profiles": profiles_dir}
    if args.headroom is not None:
        admission["headroom"] = args.headroom
    if args.pace_margin is not None:
        admission["pace_margin"] = args.pace_margin
    if args.host_reserve_cores is not None:
        admission["host_reserve_cores"] = args.host_reserve_cores
    # Admission, not the engine's stream table, must be what says no: room for every robot this run may join.
    max_streams = max(int(engine.get("max_streams", 8)), cap + 4)
    return deep_merge({k: v for k, v in base.items() if k != "streams"},
                      {"model": args.model, "engine": {"workers": args.workers, "batching": mode,
                                                       "max_streams": max_streams},
                       "admission": admission, "streams": {}})


def _check_robot(model_ref: str, slo: float, rate: float, what: str):
    """A robot's request must fit its model (the server would say model-mismatch): exit 2 before running."""
    from physis_ros.config import ConfigError, from_mapping
    from physis_ros.model.spec import load_model_config
    from physis_ros.serving.config import StreamConfig
    from physis_ros.serving.fit import check_stream_model

    try:
        cfg = load_model_config(model_ref)
        stream = from_mapping(StreamConfig, {"joint_names": JOINTS, "slo_interval_ms": slo, "control_rate_hz": rate})
        check_stream_model(what, stream, cfg)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem) from None
    return cfg


def _profiles(args, models: list, repeats: int, corun: float, out_dir: Path) -> dict:
    """Both models' cost profiles as files the servers read (admission.profiles) and the replay loads."""
    import json

    from physis_ros.console import set_threads
    from physis_ros.runtime.costs import load_profile

    set_threads(1)  # as the workers run
    info = {}
    for cfg in models:
        path = out_dir / f"{cfg.name}.cpu.json"
        given = Path(args.profiles) / f"{cfg.name}.cpu.json" if args.profiles else None
        if given is not None:
            profile = load_profile(given, cfg)
            how = f"given: {given}"
        else:
            import dataclasses

            from physis_ros.runtime.profiler import measure_profile

            _say(f"measuring the {cfg.name} profile ({repeats} rounds)")
            profile = measure_profile(cfg, "cpu", repeats=repeats)
            # what the server does with a profile it measures itself (physis_ros.serving.catalog)
            profile = dataclasses.replace(profile, corun_slowdown=max(profile.corun_slowdown, corun))
            how = "measured in the benchmark process before the servers started"
        path.write_text(json.dumps(profile.to_json(), indent=1))
        profile = load_profile(path, cfg)   # exactly what the server reads
        per4 = sum(profile.time_ms(s, 4) for s in profile.order) / 4
        info[cfg.name] = {"source": profile.source, "how": how, "file": str(path),
                          "chunk_ms": round(profile.chunk_ms(), 3), "chunk_ms_per_sample_at_batch_4": round(per4, 3),
                          "corun_slowdown": profile.corun_slowdown, "hop_ms": round(profile.hop_ms, 4),
                          "profile": profile}
    return info


# ---------------------------------------------------------------------------------------------- the benchmark
def run(args: argparse.Namespace) -> int:
    import yaml

    from physis_ros.console import serve_config_or_exit, write_json
    from physis_ros.serving.config import load_serve_mapping, serve_config

    st = _settings(args)
    wall0 = time.monotonic()
    config_in, _ = serve_config_or_exit(args.config, "physis-bench admission")
    base = load_serve_mapping(config_in)
    model_cfg = _check_robot(args.model, args.slo_ms, args.control_rate_hz, "--slo-ms")
    models = [model_cfg]
    if args.second_model:
        for slo in st["second_slo_tries"]:
            second_cfg = _check_robot(args.second_model, slo, args.second_control_rate_hz, "--second-slo-ms")
        if second_cfg.name != model_cfg.name:
            models.append(second_cfg)
    tmp = tempfile.TemporaryDirectory(prefix="physis-bench-admission-")
    work = Path(tmp.name)
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    cap = st["max_streams"]
    cfgs = {}
    for mode in st["modes"]:   # every server config is checked before anything starts
        mapping = _serve_mapping(args, base, mode, str(work), cap)
        cfgs[mode] = (serve_config(mapping, source=f"--config {config_in} + batching {mode}"), mapping)
    any_cfg = cfgs[st["modes"][0]][0]
    robots = {f"robot{i}": {"namespace": f"robot{i}", "joint_names": JOINTS} for i in range(cap + 1)}
    if args.second_model:
        robots[SECOND] = {"namespace": SECOND, "joint_names": JOINTS}
    synthetic_yaml = work / "robots.yaml"
    synthetic_yaml.write_text(yaml.safe_dump({"engine": {"max_streams": len(robots)}, "streams": robots}))

    domain = args.domain or 1 + os.getpid() % 100
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    repeats = args.profile_repeats or (2 if args.quick else any_cfg.admission.profile_repeats)
    out = {"benchmark": "admission", "command": "physis-bench admission " + " ".join(sys.argv[2:]),
           "completed": False,
           "settings": {"model": args.model, "second_model": args.second_model or None, "workers": args.workers,
                        "slo_ms": args.slo_ms, "control_rate_hz": args.control_rate_hz,
                        "second_slo_ms_tries": st["second_slo_tries"],
                        "second_control_rate_hz": args.second_control_rate_hz, "modes": st["modes"],
                        "rounds": args.rounds, "window_s": st["window_s"], "settle_s": st["settle_s"],
                        "max_streams": cap, "quick": args.quick, "jitter_buffer": None,
                        "camera": {"rate_hz": args.rate, "width": args.width, "height": args.height},
                        "headroom": any_cfg.admission.headroom, "pace_margin": any_cfg.admission.pace_margin,
                        "host_reserve_cores": any_cfg.admission.host_reserve_cores,
                        "corun_slowdown": any_cfg.admission.corun_slowdown, "policy": any_cfg.engine.policy,
                        "max_batch": any_cfg.engine.max_batch, "engine_max_streams": any_cfg.engine.max_streams,
                        "profile_repeats": repeats, "ros_domain_id": domain, "base_config": str(config_in),
                        "code": str(Path(__file__).resolve().parents[1])},
           "host": {"cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in os.getloadavg()]}, "runs": []}
    profiles = _profiles(args, models, repeats, any_cfg.admission.corun_slowdown, work)
    out["profiles"] = {k: {kk: vv for kk, vv in v.items() if kk != "profile"} for k, v in profiles.items()}

    import threading

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from physis_ros.launcher import Child, synthetic_command

    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    rclpy.init(domain_id=domain, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("physis_bench_admission")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    _say(f"ROS_DOMAIN_ID {domain}; {args.model} robots (SLO {args.slo_ms:g} ms) on {args.workers} workers; modes "
         f"{', '.join(st['modes'])}; {st['settle_s']:g} s settle + {st['window_s']:g} s window per phase; load "
         f"average {out['host']['load_avg_start']}")
    synthetic = Child("synthetic", synthetic_command(synthetic_yaml, "--rate", str(args.rate), "--width",
                                                     str(args.width), "--height", str(args.height)),
                      log=logs / "synthetic.log")
    code, failure = 0, None
    try:
        for r in range(args.rounds):
            for mode in st["modes"]:
                cfg, mapping = cfgs[mode]
                path = work / f"serve_{mode}.yaml"
                path.write_text(yaml.safe_dump({"/**": {"ros__parameters": mapping}}))
                if synthetic.poll() is not None:
                    raise RunFailed(f"physis-synthetic exited ({synthetic.poll()}):\n{synthetic.tail()}")
                runner = Run(args, st, node, executor, stop, mode, r, path, cfg, profiles, synthetic, logs)
                try:
                    out["runs"].append(runner.execute())
                except (RunFailed, Interrupted):
                    out["runs"].append(runner.result())   # what was measured before it stopped
                    raise
        out["completed"] = True
    except Interrupted:
        code, failure = 130, "interrupted"
    except RunFailed as exc:
        code, failure = 1, str(exc)
        print(f"physis-bench admission: {exc}", file=sys.stderr)
    finally:
        synthetic.stop()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        signal.signal(signal.SIGINT, previous)
    out["failure"] = failure
    out["host"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.monotonic() - wall0, 1)
    _conclude(out, args.slo_ms)
    raw = {"raw_columns": RAW_COLUMNS,
           "runs": [{"mode": run["mode"], "round": run["round"],
                     "streams": {name: s.pop("raw") for name, s in run["streams"].items()}} for run in out["runs"]]}
    if args.raw:
        write_json(args.raw, raw)
    if args.json:
        write_json(args.json, out)
    if args.plot and out["runs"]:
        plot(out, args.plot)
    tmp.cleanup()
    if code:
        return code
    return 0 if out["passed"] else 1


def _conclude(out: dict, slo_ms: float) -> None:
    summary = {}
    for run in out["runs"]:
        if run["mode"] in summary:
            continue
        ratios = [s["interval_ms"]["p99"] / s["slo_ms"] for p in run["phases"] for s in p["streams"].values()
                  if s["interval_ms"]["p99"] is not None]
        summary[run["mode"]] = {
            "admitted_first_model": run["admitted"]["first_model"],
            "second_model_slo_ms": run["admitted"]["second_model_slo_ms"],
            "rejections": [f"{r['stream']}: {r['reason']}" for r in run["admitted"]["rejections"]],
            "slo_held": run["slo_held"], "gaps": run["gaps"],
            "worst_interval_p99_over_slo": round(max(ratios), 3) if ratios else None,
            "phases_meeting_slo": f"{sum(p['all_meet_slo'] for p in run['phases'])}/{len(run['phases'])}",
            "mirror_agrees": run["mirror_agrees"]}
    out["summary"] = summary
    out["targets"] = {"interval_p99_within_slo": "every admitted stream, every phase, no jitter buffer",
                      "gaps": 0, "admitted_at_least": STREAMS_BENCH_ADMITS}
    out["passed"] = bool(out["completed"] and summary and all(
        s["slo_held"] and s["gaps"] == 0 and s["admitted_first_model"] >= STREAMS_BENCH_ADMITS
        for s in summary.values()))
    for mode, s in summary.items():
        second = ("" if s["second_model_slo_ms"] is None else
                  f" + {out['settings']['second_model']} at SLO {s['second_model_slo_ms']:g} ms")
        print(f"[{mode}] admitted {s['admitted_first_model']} x {out['settings']['model']}{second}; "
              f"rejected: {', '.join(s['rejections']) or 'none'}; SLO held in {s['phases_meeting_slo']} phases "
              f"(worst p99/SLO {s['worst_interval_p99_over_slo']}); gaps {s['gaps']}")
    print(f"targets (p99 <= SLO everywhere, 0 gaps, >= {STREAMS_BENCH_ADMITS} admitted): "
          f"{'PASS' if out['passed'] else 'FAIL'}", flush=True)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        ax, bx = row
        names = sorted({n for p in run["phases"] for n in p["streams"]}, key=lambda n: (len(n), n))
        for name in names:
            xs = [p["index"] for p in run["phases"] if name in p["streams"]]
            ys = [p["streams"][name]["interval_ms"]["p99"] for p in run["phases"] if name in p["streams"]]
            ax.plot(xs, ys, marker="o", label=name)
        for slo in sorted({s["slo_ms"] for p in run["phases"] for s in p["streams"].values()}):
            ax.axhline(slo, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks([p["index"] for p in run["phases"]], [p["label"].split(" ")[0] for p in run["phases"]],
                      rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("interval p99 ms (log)")
        ax.set_title(f"batching {run['mode']}: interval p99 per stream (dashed: SLO)", fontsize=9)
        if names:
            ax.legend(fontsize=6, ncol=3)
        for w in (run["phases"][0]["workers"] if run["phases"] else {}):
            xs = [p["index"] for p in run["phases"]]
            bx.plot(xs, [p["workers"][w]["predicted_utilisation"] for p in run["phases"]], "--", marker="x",
                    label=f"{w} predicted")
            bx.plot(xs, [p["workers"][w]["measured_busy"] for p in run["phases"]], marker="o", label=f"{w} measured")
        bx.set_ylabel("fraction of worker time")
        bx.set_title("worker load: scheduler's utilisation vs measured compute/wall", fontsize=9)
        if run["phases"]:
            bx.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)
