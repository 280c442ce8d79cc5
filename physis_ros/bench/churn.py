"""``physis-bench churn``: robots join and leave a running server over and over; does memory come back?

One physis-serve (``--workers`` workers, tiny-wam, no robots publishing: admitted streams are placed,
their KV allocated and their ROS side made, but they never compute) and ``--cycles`` cycles of: send
``--streams`` ServeStream goals, wait until each is decided, cancel every admitted one, wait for each
result. The resident memory (RSS) of the server and of each worker process is read from ``/proc`` after
every cycle; what the server itself reports on /diagnostics at the end (the engine's ``rss_mb``, each
worker's ``rss_bytes``) is kept beside it.

The JSON summary (``--json``): RSS per process every ``--sample`` cycles, the value after ``--baseline``
cycles (default 50, when the allocators have settled) and after the last, their ratio, admitted counts
per cycle (each cycle must admit what the first did) and the target: every process within ``--tolerance``
(5 %) of its baseline. Exit status 1 when a process grew past it or a cycle admitted fewer streams.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from physis_ros.bench.goals import Burst, serving
from physis_ros.console import write_json
from physis_ros.heap import rss_mb

JOINTS = [f"joint{i}" for i in range(1, 8)]


def add_arguments(p) -> None:
    p.add_argument("--cycles", type=int, default=1000, help="join/leave cycles (default 1000)")
    p.add_argument("--streams", type=int, default=3, help="goals sent each cycle (default 3)")
    p.add_argument("--workers", type=int, default=1, help="the server's workers (default 1)")
    p.add_argument("--baseline", type=int, default=50, help="compare with the RSS after this many cycles")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed growth over the baseline (0.05: 5 %%)")
    p.add_argument("--sample", type=int, default=10, help="keep the RSS every this many cycles in the JSON")
    p.add_argument("--start-timeout", type=float, default=120.0, help="wait this long for the server (s)")
    p.add_argument("--json", default="bench/out/churn.json", help="summary JSON (default bench/out/churn.json)")
    p.add_argument("--logs", default="", help="directory for the server's log (default: a temporary one)")


def _say(text: str) -> None:
    print(f"physis-bench churn: {text}", file=sys.stderr, flush=True)


def _workers_of(server_pid: int) -> dict[int, str]:
    """pid -> worker name of the server's worker processes (its children running physis_ros.cli.worker)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if b"physis_ros.cli.worker" in args and b"--id" in args:
            out[int(entry.name)] = args[args.index(b"--id") + 1].decode()
    return out


def _reported(burst: Burst, workers) -> dict[str, float | None]:
    """The RSS the server's latest /diagnostics reports: its own (engine ``rss_mb``) and each worker's."""
    burst.spin_until(lambda: False, 2.5)            # a fresh /diagnostics after the last cycle
    engine = burst.statuses.get("engine", {}).get("rss_mb")
    out = {"server": float(engine) if engine else None}
    for w in workers:
        b = burst.statuses.get(f"worker {w}", {}).get("rss_bytes")
        out[w] = round(int(b) / 2**20, 1) if b else None
    return out


def _cycle(burst: Burst, cycle: int, streams: int, timeout: float) -> int:
    """One join/leave cycle; the number admitted."""
    fb: dict[str, bool] = {}
    handles, results = {}, {}
    for i in range(streams):
        name = f"c{i}"
        goal = burst.ServeStream.Goal(stream=name, topic_namespace=f"churn_{name}", joint_names=JOINTS)
        sent = burst.client.send_goal_async(goal, feedback_callback=lambda _m, n=name: fb.setdefault(n, True))
        handles[name] = sent
    if not burst.spin_until(lambda: all(s.done() for s in handles.values()), timeout):
        raise RuntimeError(f"cycle {cycle}: goals not taken within {timeout:g} s")
    for name, sent in handles.items():
        results[name] = sent.result().get_result_async()
    if not burst.spin_until(lambda: all(n in fb or results[n].done() for n in handles), timeout):
        raise RuntimeError(f"cycle {cycle}: goals not decided within {timeout:g} s")
    admitted = [n for n in handles if n in fb]
    for n in admitted:
        handles[n].result().cancel_goal_async()
    if not burst.spin_until(lambda: all(results[n].done() for n in admitted), timeout):
        raise RuntimeError(f"cycle {cycle}: cancelled goals without a result within {timeout:g} s")
    return len(admitted)


def run(args) -> int:
    config = {"model": "tiny-wam", "diagnostics_period_s": 1.0, "engine": {"workers": args.workers}}
    with serving(config, 10 * args.streams, args.logs, args.start_timeout, _say) as up:
        return 1 if up is None else _run(args, *up)


def _run(args, burst: Burst, server) -> int:
    workers = _workers_of(server.pid)
    names = {server.pid: "server", **workers}
    rss: dict[str, list[tuple[int, float]]] = {n: [] for n in names.values()}
    admitted: list[int] = []
    start = time.monotonic()
    for cycle in range(1, args.cycles + 1):
        admitted.append(_cycle(burst, cycle, args.streams, 60.0))
        if cycle % args.sample == 0 or cycle in (1, args.baseline, args.cycles):
            for pid, name in names.items():
                mb = rss_mb(pid)
                if mb is not None:
                    rss[name].append((cycle, round(mb, 1)))
        if cycle % 50 == 0 or cycle == args.cycles:
            now = {n: v[-1][1] for n, v in rss.items() if v}
            _say(f"cycle {cycle}/{args.cycles} ({time.monotonic() - start:.0f} s): admitted {admitted[-1]}; "
                 f"RSS MB {now}")
    base = min(args.baseline, args.cycles)
    growth = {}
    for name, series in rss.items():
        at_base = next((mb for c, mb in series if c == base), None)
        last = series[-1][1] if series else None
        growth[name] = None if at_base is None or last is None else round(last / at_base - 1.0, 4)
    grew = {n: g for n, g in growth.items() if g is not None and g > args.tolerance}
    fewer = [i + 1 for i, n in enumerate(admitted) if n < admitted[0]]
    summary = {"cycles": args.cycles, "streams_per_cycle": args.streams, "workers": args.workers,
               "baseline_cycle": base, "tolerance": args.tolerance, "growth_over_baseline": growth,
               "rss_mb": rss, "admitted_first": admitted[0], "cycles_admitting_fewer": fewer[:50],
               "seconds": round(time.monotonic() - start, 1), "server_alive": server.poll() is None,
               "diagnostics_rss_mb": _reported(burst, workers.values())}
    write_json(args.json, summary)
    ok = not grew and not fewer and summary["server_alive"]
    _say(f"growth after cycle {base}: {growth}; {'OK' if ok else 'FAILED'}; JSON {args.json}")
    return 0 if ok else 1
