"""``physis-bench openpi``: openpi clients served by our front end against openpi-server, in one run.

The same model is served (a) by openpi-server's ``WebsocketPolicyServer`` wrapping a policy that runs it
in-process, one observation after another (:mod:`physis_ros.bench.openpi_peer`: our sequential
reference), and (b) by ``physis-serve --no-ros --openpi`` over ``--workers`` CPU workers. The real
``openpi-client`` talks to both, each client a thread of this process sending a 224x224 camera frame, the
state vector and a prompt.

- **Closed loop** (``--clients 1,2,4,8``): each client sends its next observation when the reply
  arrives, for ``--duration`` s after a warm-up. Aggregate chunks/s and the round trip (p50, p99) per
  client count, and ours/peer ratios. Such clients ask for more than any booking, so our server runs
  this part with admission off (``admission.enforce: false``); they join at ``--closed-rate-hz``.
- **Paced** (``--paced-clients``): each client sends one observation per control interval (the model's
  horizon / 2 at 50 Hz: 160 ms for tiny-wam), spread over the interval, and its SLO is that interval.
  The largest client count whose p99 round trip stays within the SLO (every client connected, none
  refused, no errors), per server, and ours/peer; ours with admission on, as users run it (a client it
  cannot hold to its SLO is refused, where the peer queues it).

Writes ``--json`` (every run, the ratios, the goals: aggregate >= 1.5x the peer's at 4 clients, p99 no
worse at 1 client, paced capacity >= 2x) and ``--plot``. Exit 1 if a server did not start or a run had
errors other than refusals.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from physis_ros.console import CliError, write_json
from physis_ros.launcher import Child

GOAL_AGGREGATE_X = 1.5      # ours / peer aggregate chunks/s at GOAL_AT clients
GOAL_AT = 4
GOAL_PACED_X = 2.0          # ours / peer largest paced client count within the SLO


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-wam", help="model preset served by both (default tiny-wam)")
    p.add_argument("--workers", type=int, default=2, help="our CPU workers (default 2)")
    p.add_argument("--clients", default="1,2,4,8", help="closed-loop client counts (default 1,2,4,8)")
    p.add_argument("--paced-clients", default="1,2,3,4,5,6,8,10,12",
                   help="paced client counts, tried in order (default 1,2,3,4,5,6,8,10,12)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per run (default 10)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring in each run (default 1)")
    p.add_argument("--closed-rate-hz", type=float, default=10.0,
                   help="control rate our closed-loop clients join at (default 10)")
    p.add_argument("--peer-threads", type=int, default=0, help="the peer's torch threads (0: every core)")
    p.add_argument("--start-timeout", type=float, default=180.0, help="wait this long for a server (s)")
    p.add_argument("--json", default="bench/out/openpi.json", help="summary JSON (default bench/out/openpi.json)")
    p.add_argument("--plot", default="bench/out/openpi.png", help="plot (default bench/out/openpi.png)")
    p.add_argument("--logs", default="", help="directory for the servers' logs (default: a temporary one)")


def _say(text: str) -> None:
    print(f"physis-bench openpi: {text}", file=sys.stderr, flush=True)


def _counts(text: str, flag: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise CliError(f"{flag}: give client counts >= 1, comma-separated (e.g. 1,2,4,8), got {text!r}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observation(seed: int, dof: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=dof).astype(np.float32), "prompt": "put the cube in the bowl"}


def wait_healthy(port: int, child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.poll()}):\n{child.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{child.name} was not healthy within {timeout_s:g} s:\n{child.tail()}")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, s) of process ``pid`` and every process below it (a server's workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for p in cpu:
        q = p
        while q and q != pid:
            q = parent.get(q, 0)
        if q == pid:
            total += cpu[p]
    return total


def run_clients(url_of: Callable[[int], str], n: int, dof: int, warmup_s: float, duration_s: float,
                period_s: float | None, server_pid: int | None = None) -> dict:
    """``n`` clients (threads), closed loop (``period_s`` None) or one observation per ``period_s`` each,
    phases spread over the period; their round trips in the measured window, and the CPU time the server
    (its process tree) and the clients (this process) took in it."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    rtts: list[list[float]] = [[] for _ in range(n)]
    refused: list[str] = []
    errors: list[str] = []
    start = [0.0]
    ready = threading.Barrier(n + 1, action=lambda: start.__setitem__(0, time.monotonic()))   # one clock for all

    def client(i: int) -> None:
        obs = observation(i, dof)
        try:
            policy = WebsocketClientPolicy(url_of(i))
        except Exception as exc:   # noqa: BLE001 (a refusal: the reason is the close frame's)
            refused.append(f"client {i}: {str(exc)[:200]}")
            ready.wait()
            return
        try:
            ready.wait()
            t0 = start[0]
            measure_from, end = t0 + warmup_s, t0 + warmup_s + duration_s
            k = 0
            while True:
                if period_s is not None:
                    due = t0 + (i / n + k) * period_s
                    k += 1
                    if due > time.monotonic():
                        time.sleep(due - time.monotonic())
                sent = time.monotonic()
                if sent >= end:
                    break
                policy.infer(obs)
                if sent >= measure_from:
                    rtts[i].append((time.monotonic() - sent) * 1e3)
                if period_s is not None:   # a late reply skips the slots it overran: no burst to catch up
                    k = max(k, int((time.monotonic() - t0) / period_s - i / n) + 1)
        except Exception as exc:   # noqa: BLE001
            errors.append(f"client {i}: {str(exc)[:200]}")
        finally:
            policy._ws.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait(120)
    time.sleep(warmup_s)
    server0, clients0 = cpu_seconds(server_pid) if server_pid else 0.0, time.process_time()
    time.sleep(duration_s)
    server_cpu = cpu_seconds(server_pid) - server0 if server_pid else 0.0
    clients_cpu = time.process_time() - clients0
    for t in threads:
        t.join(warmup_s + duration_s + 60)
    flat = [x for r in rtts for x in r]
    out = {"clients": n, "connected": n - len(refused), "refused": refused, "errors": errors,
           "chunks": len(flat), "chunks_per_s": round(len(flat) / duration_s, 2)}
    if flat:
        out.update(rtt_ms_p50=round(float(np.percentile(flat, 50)), 2),
                   rtt_ms_p99=round(float(np.percentile(flat, 99)), 2), rtt_ms_max=round(max(flat), 2),
                   per_client_chunks=[len(r) for r in rtts],
                   server_cpu_ms_per_chunk=round(server_cpu * 1e3 / len(flat), 2),
                   clients_cpu_ms_per_chunk=round(clients_cpu * 1e3 / len(flat), 2))
    return out


def within(run: dict, slo_ms: float) -> bool:
    return (run["connected"] == run["clients"] and not run["errors"] and run["chunks"] > 0
            and run["rtt_ms_p99"] <= slo_ms)


def sweep(url_of, counts: list[int], args, dof: int, period_s: float, slo_ms: float, who: str,
          pid: int) -> list[dict]:
    """Paced runs in order until two in a row miss the SLO."""
    runs, misses = [], 0
    for n in counts:
        run = run_clients(url_of, n, dof, args.warmup, args.duration, period_s, pid)
        run["within_slo"] = within(run, slo_ms)
        runs.append(run)
        _say(f"{who} paced {n}: p99 {run.get('rtt_ms_p99', float('nan')):.1f} ms, connected {run['connected']}, "
             f"{'within' if run['within_slo'] else 'NOT within'} {slo_ms:g} ms")
        misses = 0 if run["within_slo"] else misses + 1
        if misses == 2:
            break
    return runs


def closed_runs(who: str, pid: int, url_of, args, counts, dof) -> list[dict]:
    closed = []
    for n in counts:
        run = run_clients(url_of, n, dof, args.warmup, args.duration, None, pid)
        closed.append(run)
        _say(f"{who} closed {n}: {run['chunks_per_s']:.1f} chunks/s, p50 {run.get('rtt_ms_p50', float('nan')):.1f} "
             f"p99 {run.get('rtt_ms_p99', float('nan')):.1f} ms, server CPU "
             f"{run.get('server_cpu_ms_per_chunk', float('nan')):.1f} ms/chunk, connected {run['connected']}")
    return closed


def paced_max(paced: list[dict]) -> int:
    ok = [r["clients"] for r in paced if r["within_slo"]]
    return max(ok) if ok else 0


def ratios(peer: dict, ours: dict) -> dict:
    by_n = {r["clients"]: r for r in peer["closed"]}
    closed = {}
    for r in ours["closed"]:
        p = by_n.get(r["clients"])
        if p and p["chunks"] and r["chunks"]:
            closed[str(r["clients"])] = {"aggregate": round(r["chunks_per_s"] / p["chunks_per_s"], 3),
                                         "rtt_p50": round(r["rtt_ms_p50"] / p["rtt_ms_p50"], 3),
                                         "rtt_p99": round(r["rtt_ms_p99"] / p["rtt_ms_p99"], 3)}
    paced = ours["paced_max_clients"] / peer["paced_max_clients"] if peer["paced_max_clients"] else None
    return {"closed": closed, "paced_max_clients": paced}


def goals(r: dict) -> dict:
    at, one = r["closed"].get(str(GOAL_AT)), r["closed"].get("1")
    return {f"aggregate_at_{GOAL_AT}_ge_{GOAL_AGGREGATE_X}x": None if at is None else at["aggregate"] >= GOAL_AGGREGATE_X,
            "rtt_p99_at_1_no_worse": None if one is None else one["rtt_p99"] <= 1.0,
            f"paced_ge_{GOAL_PACED_X}x": None if r["paced_max_clients"] is None
            else r["paced_max_clients"] >= GOAL_PACED_X}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    for i, who in enumerate(("peer", "ours")):
        closed = [r for r in result[who]["closed"] if r["chunks"]]
        n = [r["clients"] for r in closed]
        label = result["servers"][who]
        a.plot(n, [r["chunks_per_s"] for r in closed], "o-", color=f"C{i}", label=label)
        b.plot(n, [r["rtt_ms_p50"] for r in closed], "o-", color=f"C{i}", label=f"{label} p50")
        b.plot(n, [r["rtt_ms_p99"] for r in closed], "x--", color=f"C{i}", label=f"{label} p99")
        paced = [r for r in result[who]["paced"] if r["chunks"] and r["connected"] == r["clients"]]
        c.plot([r["clients"] for r in paced], [r["rtt_ms_p99"] for r in paced], "o-", color=f"C{i}",
               label=f"{label} (max within: {result[who]['paced_max_clients']})")
        refused = [r for r in result[who]["paced"] if r["connected"] < r["clients"]]
        if refused:
            c.plot([r["clients"] for r in refused], [r.get("rtt_ms_p99", 0) for r in refused], "x", color=f"C{i}",
                   markersize=9, label="some refused by admission (p99 of the admitted)")
    c.axhline(result["slo_ms"], color="k", linestyle=":", label=f"SLO {result['slo_ms']:g} ms")
    a.set(xlabel="clients (closed loop)", ylabel="aggregate chunks/s", title="throughput")
    b.set(xlabel="clients (closed loop)", ylabel="round trip (ms)", title="round trip per request")
    c.set(xlabel="clients (each paced at its control interval)", ylabel="round trip p99 (ms)",
          title="paced: p99 vs the SLO")
    for ax, where in ((a, "lower right"), (b, "upper left"), (c, "upper left")):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc=where)
    fig.suptitle(f"openpi clients, {result['model']}: openpi-server (sequential) vs physis_ros "
                 f"({result['workers']} CPU workers), {os.cpu_count()} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from physis_ros.model import load_model_config

    counts = _counts(args.clients, "--clients")
    paced_counts = _counts(args.paced_clients, "--paced-clients")
    model = load_model_config(args.model)
    horizon, dof = model.spec.actions_shape
    rate = 50.0
    period_s = (horizon // 2) / rate
    slo_ms = period_s * 1e3
    logs = Path(args.logs or tempfile.mkdtemp(prefix="physis-openpi-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = {"model": args.model, "workers": args.workers, "duration_s": args.duration, "warmup_s": args.warmup,
              "slo_ms": slo_ms, "paced_period_s": period_s, "closed_rate_hz": args.closed_rate_hz,
              "cpu_count": os.cpu_count(), "peer_threads": args.peer_threads or "torch default",
              "servers": {"peer": "openpi-server (sequential)", "ours": f"physis_ros ({args.workers} workers)"}}
    code = 0

    port = free_port()
    peer = Child("openpi-server", [sys.executable, "-m", "physis_ros.bench.openpi_peer", "--port", str(port),
                                   "--model", args.model, "--threads", str(args.peer_threads)],
                 env=env, log=logs / "peer.log")
    try:
        wait_healthy(port, peer, args.start_timeout)
        url = f"ws://127.0.0.1:{port}"
        result["peer"] = {"closed": closed_runs("peer", peer.pid, lambda i: url, args, counts, dof)}
        result["peer"]["paced"] = sweep(lambda i: url, paced_counts, args, dof, period_s, slo_ms, "peer", peer.pid)
    finally:
        peer.stop()

    # Ours twice: closed-loop clients send as fast as replies come, beyond any booking, so admission (whose
    # load calibration sees the workers busier than booked) is off for them; paced clients keep their
    # booking, and admission is on, as a user runs it.
    profiles = Path(__file__).resolve().parents[2] / "config" / "profiles"
    result["ours"] = {}
    for part, enforce in (("closed", False), ("paced", True)):
        port = free_port()
        config = logs / f"serve_{part}.yaml"
        config.write_text(yaml.safe_dump({"model": args.model, "engine": {"workers": args.workers, "max_streams": 16},
                                          "admission": {"enforce": enforce,
                                                        "profiles": str(profiles) if profiles.is_dir() else ""}}))
        ours = Child("physis-serve", [sys.executable, "-m", "physis_ros.cli.serve", "--no-ros", "--openpi",
                                      str(port), "--config", str(config)], env=env, log=logs / f"ours_{part}.log")
        try:
            wait_healthy(port, ours, args.start_timeout)
            base = f"ws://127.0.0.1:{port}/?"
            if part == "closed":
                result["ours"]["closed"] = closed_runs(
                    "ours", ours.pid, lambda i: f"{base}name=c{i}&control_rate_hz={args.closed_rate_hz:g}", args,
                    counts, dof)
            else:
                result["ours"]["paced"] = sweep(lambda i: f"{base}name=p{i}&control_rate_hz={rate:g}&slo_ms={slo_ms:g}",
                                                paced_counts, args, dof, period_s, slo_ms, "ours", ours.pid)
        finally:
            ours.stop()
    for who in ("peer", "ours"):
        result[who]["paced_max_clients"] = paced_max(result[who]["paced"])
    result["admission"] = {"closed": "off (admission.enforce false)", "paced": "on"}

    result["ratio_ours_over_peer"] = ratios(result["peer"], result["ours"])
    result["goals"] = goals(result["ratio_ours_over_peer"])
    for who in ("peer", "ours"):
        for r in result[who]["closed"] + result[who]["paced"]:
            if r["errors"]:
                code = 1
                _say(f"{who}: errors in a run of {r['clients']} clients: {r['errors'][:2]}")
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
        _say(f"wrote {args.plot}")
    _say(f"ratios ours/peer: {result['ratio_ours_over_peer']}; goals: {result['goals']}")
    return code
