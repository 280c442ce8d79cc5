"""Is admission honest? On the same workers in one run: (a) robots are added with admission off
(``admission.enforce: false``: every robot placed on the least booked worker) until the p99 output interval
of any robot exceeds its SLO: the robots before that are the feasible maximum; (b) on a fresh server of the
same config (admission on, fresh calibration) robots join through :meth:`Server.join` until one is refused,
and every admitted robot is measured together for ``--measure-s``.

    physis-bench admission-accuracy --slo-ms 150 [--models tiny-wam,tiny-acwm] --json out.json [--plot out.png]

Robots are simulators (the stream's ``source``: the bundled scene's observation of each chunk when it is
due), one model after another from ``--models`` (``tiny-wam,tiny-acwm``: a mix), each at the control rate
at which its chunk's executed rows last the SLO (``--control-rate-hz`` to fix one). Each is released at its
admitted pace (the SLO less ``admission.pace_margin``), as the server does; no jitter buffer.

``--policy base`` measures admission without what a shared CPU host adds (``admission.policy``; auto picks
cpu-host for CPU workers): what the cpu-host policy buys.

JSON, times in ms: ``slo_ms``, ``models``, ``workers``, ``policy``, ``feasible`` (robots meeting the SLO together with
admission off; ``feasible_capped`` when ``--max-robots`` all met it; ``off_refused`` when a robot was refused
even so: a stage alone slower than the SLO, or memory), ``admitted``, ``rejected`` (the next
robot's reason label and detail), ``admitted_over_feasible`` (goal >= 0.8), ``admitted_meeting_slo`` (the
share of admitted robots whose interval p99 over ``--measure-s`` is within the SLO; goal 1.0), ``goals``,
``too_small`` (with ``note``: not even one robot is admitted, or meets the SLO alone), ``off`` (per step: the
robots, each one's interval p50/p99 over ``--window-s``, the workers) and ``on`` (per admitted robot: its
workers, chunks, interval p50/p99, ``meets_slo``). Exit status 0 whenever the run completed.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time

import torch

from physis_ros.config import ConfigError
from physis_ros.console import CliError, write_json
from physis_ros.model import load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import StreamConfig, serve_config
from physis_ros.serving.fit import execution_steps
from physis_ros.serving.server import Server
from physis_ros.telemetry import percentile

FIRST_CHUNK_S = 60.0   # a robot's first chunk comes within this (the model is built and profiled on first use)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ms", type=float, required=True, help="output-interval SLO of every robot (ms)")
    p.add_argument("--models", default="tiny-wam",
                   help="comma-separated models the robots run, one after another (tiny-wam,tiny-acwm: a mix)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="auto",
                   help="admission.policy of both phases (auto: cpu-host for CPU workers; base: the cost model and "
                        "the SLO alone, without what a shared CPU host adds)")
    p.add_argument("--control-rate-hz", type=float, default=None,
                   help="the robots' control rate (default: per model, the rate at which a chunk's executed rows "
                        "last the SLO interval, so the control timeline needs one chunk per SLO)")
    p.add_argument("--profiles", default="", help="admission.profiles (default: measured when the first robot asks)")
    p.add_argument("--max-robots", type=int, default=10, help="add at most this many robots in either phase")
    p.add_argument("--settle-s", type=float, default=4.0,
                   help="seconds after a robot's first chunk before the robots are measured (or the next joins)")
    p.add_argument("--window-s", type=float, default=20.0,
                   help="admission off: seconds the robots are measured after each one is added")
    p.add_argument("--measure-s", type=float, default=60.0,
                   help="admission on: seconds all the admitted robots are measured together")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG: max interval p99 per robot count (off), each admitted robot's (on)")


class Robots:
    """The robots of one server: each a simulator source, and the (emit time, interval) of its chunks."""

    def __init__(self, server: Server, models: list[str], slo_ms: float, control_rate_hz: float | None):
        self.server = server
        self.models = models
        self.slo_ms = slo_ms
        self.control_rate_hz = control_rate_hz
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        self.model_of: dict[str, str] = {}
        self.first: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def join(self, index: int) -> str:
        """Robot ``index`` joins (its model: the next of ``models``); raises Rejected."""
        name, model = f"robot{index}", self.models[index % len(self.models)]
        config = self.server.catalog.config_of(model)
        scene = SyntheticScene(config.observation_shapes)
        joints = [f"joint{i + 1}" for i in range(config.observation_shapes["state"][0])]
        # unless given, the control rate at which the chunk's executed rows last exactly the SLO interval
        rate = self.control_rate_hz or execution_steps(StreamConfig(joint_names=joints), config) * 1e3 / self.slo_ms
        got: list[tuple[float, float]] = []
        first = threading.Event()

        def source(c: int):
            return scene.observation(name, c), self.server.clock()

        def on_chunk(chunk) -> None:
            t = chunk.telemetry
            with self._lock:
                got.append((t.emit, t.interval_ms))
            first.set()

        self.server.join(name, model=model, slo_ms=self.slo_ms, joint_names=joints, control_rate_hz=rate,
                         source=source, on_chunk=on_chunk)
        self.intervals[name], self.first[name], self.model_of[name] = got, first, model
        return name

    def add(self, index: int, phase: str, settle_s: float) -> dict | None:
        """Robot ``index`` joins, and ``settle_s`` passes after its first chunk; None, or its refusal (the
        reason label and detail)."""
        try:
            name = self.join(index)
        except Rejected as exc:
            _say(f"{phase}: robot{index} refused: {exc.label} - {exc.detail}")
            return {"robot": f"robot{index}", "model": self.models[index % len(self.models)], "reason": exc.label,
                    "detail": exc.detail}
        _say(f"{phase}: {name} admitted on {', '.join(self.server.session(name).workers)}")
        if not self.first[name].wait(timeout=FIRST_CHUNK_S):
            raise RuntimeError(f"{name} got no chunk in {FIRST_CHUNK_S:g} s")
        time.sleep(settle_s)
        return None

    def window(self, start: float, end: float) -> dict[str, dict]:
        """Per robot: its chunks' intervals emitted in [start, end) (server clock): count, p50, p99."""
        out = {}
        for name, got in self.intervals.items():
            with self._lock:
                ms = [i for t, i in got if start <= t < end and not math.isnan(i)]
            out[name] = {"chunks": len(ms), "interval_ms_p50": _r(percentile(ms, 50)),
                         "interval_ms_p99": _r(percentile(ms, 99))}
        return out

    def measure(self, seconds: float) -> dict[str, dict]:
        start = self.server.clock()
        time.sleep(seconds)
        return self.window(start, self.server.clock())


def _r(x: float) -> float | None:
    """``x`` rounded for the JSON; None for nan (no chunks to tell)."""
    return None if math.isnan(x) else round(x, 3)


def _meets(stats: dict, slo_ms: float) -> bool:
    """Met when it published at least two chunks in the window and its interval p99 is within the SLO."""
    return stats["chunks"] >= 2 and stats["interval_ms_p99"] is not None and stats["interval_ms_p99"] <= slo_ms


def _config(args, enforce: bool) -> dict:
    return {"model": args.models[0],
            "engine": {"workers": args.workers, "batching": "off", "policy": "edf",
                       "max_streams": args.max_robots + 1},
            "admission": {"profiles": args.profiles, "enforce": enforce, "policy": args.policy}}


def admission_off(args) -> dict:
    """Add robots with admission off until one misses the SLO at p99: the feasible count and every step."""
    steps = []
    feasible = 0
    refused = None
    with Server.from_config(_config(args, enforce=False)) as server:
        robots = Robots(server, args.models, args.slo_ms, args.control_rate_hz)
        for n in range(args.max_robots):
            # a refusal with admission off: what no placement changes (a stage alone slower than the SLO, memory)
            refused = robots.add(n, "admission off", args.settle_s)
            if refused:
                break
            stats = robots.measure(args.window_s)
            met = all(_meets(s, args.slo_ms) for s in stats.values())
            p99s = [s["interval_ms_p99"] for s in stats.values()]
            worst = None if None in p99s else max(p99s)     # None: a robot published too little to tell
            steps.append({"robots": n + 1, "all_meet_slo": met, "utilisation": server.admission.utilisation(),
                          "interval_ms_p99_max": worst,
                          "streams": {k: {**s, "model": robots.model_of[k], "workers": server.session(k).workers}
                                      for k, s in stats.items()}})
            _say(f"admission off, {n + 1} robot(s): interval p99 max {worst} ms (SLO {args.slo_ms:g}) "
                 f"{'ok' if met else 'MISSED'}")
            if not met:
                break
            feasible = n + 1
    return {"feasible": feasible, "capped": feasible == args.max_robots, "steps": steps, "refused": refused}


def admission_on(args) -> dict:
    """Robots join through Server.join until one is refused; all admitted measured together."""
    rejected = None
    with Server.from_config(_config(args, enforce=True)) as server:
        robots = Robots(server, args.models, args.slo_ms, args.control_rate_hz)
        for n in range(args.max_robots):
            rejected = robots.add(n, "admission on", args.settle_s)
            if rejected:
                break
        workers = {k: server.session(k).workers for k in robots.intervals}
        stats = robots.measure(args.measure_s) if robots.intervals else {}
        utilisation = server.admission.utilisation()
    streams = {k: {**s, "model": robots.model_of[k], "workers": workers[k], "meets_slo": _meets(s, args.slo_ms)}
               for k, s in stats.items()}
    return {"admitted": len(streams), "rejected": rejected, "utilisation": utilisation, "streams": streams}


def summarize(args, off: dict, on: dict, wall_s: float) -> dict:
    feasible, admitted = off["feasible"], on["admitted"]
    meeting = sum(s["meets_slo"] for s in on["streams"].values())
    ratio = admitted / feasible if feasible else None
    share = meeting / admitted if admitted else None
    note = None
    if admitted == 0 and feasible == 0:
        note = (f"this machine is too small for one robot at {args.slo_ms:g} ms: admission refuses it, and with "
                f"admission off one robot alone misses the SLO")
    elif admitted == 0:
        note = f"admission refuses even one robot at {args.slo_ms:g} ms, yet {feasible} meet it with admission off"
    elif feasible == 0:
        note = f"with admission off not even one robot meets {args.slo_ms:g} ms alone"
    return {
        "benchmark": "admission-accuracy", "slo_ms": args.slo_ms, "models": args.models, "workers": args.workers,
        "policy": args.policy,
        "control_rate_hz": args.control_rate_hz, "window_s": args.window_s, "measure_s": args.measure_s,
        "settle_s": args.settle_s, "max_robots": args.max_robots, "profiles": args.profiles or "measured",
        "feasible": feasible, "feasible_capped": off["capped"], "off_refused": off["refused"],
        "admitted": admitted, "rejected": on["rejected"],
        "admitted_over_feasible": None if ratio is None else round(ratio, 3),
        "admitted_meeting_slo": None if share is None else round(share, 3),
        "goals": {"admitted_over_feasible_ge_0.8": ratio is not None and ratio >= 0.8,
                  "admitted_meeting_slo_1.0": share == 1.0},
        "too_small": admitted == 0, "note": note, "off": off["steps"], "on": on["streams"],
        "on_utilisation": on["utilisation"], "wall_s": round(wall_s, 1),
    }


def plot(result: dict, path: str) -> None:
    from physis_ros.bags.control_report import pyplot, save

    plt = pyplot()
    slo = result["slo_ms"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    counts = [s["robots"] for s in result["off"]]
    a.plot(counts, [s["interval_ms_p99_max"] or math.nan for s in result["off"]], "o-", label="worst robot's p99")
    a.axhline(slo, color="red", ls="--", label=f"SLO {slo:g} ms")
    a.axvline(result["feasible"] + 0.5, color="gray", ls=":", label=f"feasible: {result['feasible']}")
    a.set(xlabel="robots (admission off)", ylabel="output interval p99 (ms)",
          title=f"admission off, {result['window_s']:g} s windows")
    a.set_ylim(bottom=0)
    a.xaxis.get_major_locator().set_params(integer=True)
    a.legend(fontsize=8)
    names = list(result["on"])
    b.bar(range(len(names)), [result["on"][n]["interval_ms_p99"] or 0 for n in names],
          color=["tab:green" if result["on"][n]["meets_slo"] else "tab:red" for n in names])
    b.axhline(slo, color="red", ls="--")
    b.set_xticks(range(len(names)), [f"{n}\n{result['on'][n]['model']}" for n in names], fontsize=7)
    b.set(ylabel="output interval p99 (ms)",
          title=f"admission on: {result['admitted']} admitted, over {result['measure_s']:g} s")
    fig.suptitle(f"admission accuracy, SLO {slo:g} ms, {'+'.join(result['models'])}, {result['workers']} workers, "
                 f"policy {result.get('policy', 'auto')}: "
                 f"admitted/feasible {result['admitted_over_feasible']}, meeting SLO {result['admitted_meeting_slo']}",
                 fontsize=9)
    fig.tight_layout()
    save(fig, path)


def _say(text: str) -> None:
    print(f"physis-bench admission-accuracy: {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models:
        raise CliError("--models: give at least one model (e.g. tiny-wam or tiny-wam,tiny-acwm)")
    for model in args.models:
        try:
            load_model_config(model)
        except ConfigError as exc:
            raise CliError(f"--models: {exc}") from None
    try:
        serve_config(_config(args, enforce=True))
    except ConfigError as exc:
        raise CliError(f"--policy/--workers/--profiles: {exc}") from None
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    off = admission_off(args)
    on = admission_on(args)
    result = summarize(args, off, on, time.perf_counter() - t0)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    if result["note"]:
        _say(result["note"])
    print(json.dumps({k: result[k] for k in ("slo_ms", "feasible", "admitted", "admitted_over_feasible",
                                             "admitted_meeting_slo", "too_small")}))
    return 0
