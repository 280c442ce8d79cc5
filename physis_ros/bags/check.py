"""The replay harness (``physis-bag check``, and the ``bag_check`` pytest fixture).

1. starts the server (``physis-serve --config C --deterministic``) as a separate process;
2. in this process, records the server's outputs (per stream by its model's kind: a
   world-action model's action chunks and trajectories, a world model's predicted
   frames; telemetry, diagnostics) to a bag and waits for the engine to report "serving";
3. replays the bag's inputs (camera and joint-state topics, and a world model's actions
   to imagine) with their original timing,
   header stamps shifted to now (``--restamp``, so that the node's stale-stamp
   check accepts them and latencies are meaningful) or, with ``--sim-time``,
   untouched with the bag's ``/clock`` driving the server (``use_sim_time``);
   waits for every expected chunk, stops the server;
4. analyses the recorded bag (:mod:`physis_ros.bags.analysis`): the inputs the
   server must reject (its own acceptance rule, :mod:`physis_ros.ros.acceptance`)
   listed by reason and compared with the server's counters (its
   ``--summary-json``); every chunk of an accepted observation accounted for,
   indices contiguous, chunk ``c`` used observation ``c``, one trajectory (WAM) and one
   telemetry per chunk, every output value finite, latency statistics, and
   equality with the sequential reference fed the same observations (image, joint
   state and, for a world model, the actions paired to that image).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.bags.analysis import Analysis, analyse, load_outputs
from physis_ros.bags.bagio import BagError, bag_info
from physis_ros.bags.inputs import Inputs, collect_inputs
from physis_ros.bags.serveconf import ServeInfo, load_serve_info


@dataclass
class CheckOptions:
    bag: Path
    config: str | None = None          # serve config (default config/serve.yaml)
    out: str | None = None             # keep outputs here (default: a temporary directory)
    timeout_s: float = 120.0           # whole run
    start_timeout_s: float = 90.0      # server up and serving
    idle_timeout_s: float = 20.0       # no new chunk for this long after the replay: give up waiting
    subscriber_timeout_s: float = 20.0  # serving, but an input topic has no subscriber for this long: give up
    rate: float = 1.0
    reference: bool = True
    sim_time: bool = False             # server on use_sim_time, replay publishes /clock, stamps untouched
    server_cmd: str | None = None
    report: bool = False
    verbose: bool = False


@dataclass
class CheckResult:
    bag: Path
    analysis: Analysis = field(default_factory=Analysis)
    error: str | None = None
    recorded: Path | None = None
    replay: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.analysis.ok

    def summary(self) -> str:
        lines = [f"physis-bag check {self.bag}: {'PASS' if self.ok else 'FAIL'}"]
        if self.error:
            lines.append(f"  error: {self.error}")
        for item in self.analysis.items:
            lines.append(f"  [{'ok' if item.ok else 'FAIL'}] {item.name}: {item.detail}")
        if self.analysis.stats:
            cols = [("chunks", "chunks", "{:.0f}"), ("e2e_ms_p50", "e2e p50", "{:.1f}"),
                    ("e2e_ms_p99", "e2e p99", "{:.1f}"), ("latency_ms_p50", "lat p50", "{:.1f}"),
                    ("latency_ms_p99", "lat p99", "{:.1f}"), ("interval_ms_p50", "int p50", "{:.1f}"),
                    ("interval_ms_p99", "int p99", "{:.1f}"), ("obs_age_ms_p50", "age p50", "{:.1f}")]
            lines.append("  " + f"{'stream':<10}" + "".join(f"{h:>9}" for _, h, _ in cols) + "   (ms; e2e = "
                         "observation published -> chunk received, lat = node's response latency)")
            for name, st in self.analysis.stats.items():
                lines.append("  " + f"{name:<10}" + "".join(
                    f"{fmt.format(st[k]) if k in st else '-':>9}" for k, _, fmt in cols))
        if self.replay:
            t = self.replay.get("timing", {})
            if t:
                lines.append(f"  replay: {self.replay['messages']} messages, timing error p50 {t['p50_us']:.0f} us, "
                             f"p99 {t['p99_us']:.0f} us, max {t['max_us']:.0f} us")
        if self.server:
            lines.append(f"  server: exit {self.server.get('exit')}, "
                         f"rejected inputs {self.server.get('rejected', 'n/a')}")
        if self.recorded:
            lines.append(f"  outputs: {self.recorded}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"bag": str(self.bag), "ok": self.ok, "error": self.error,
                "checks": [i.__dict__ for i in self.analysis.items], "stats": self.analysis.stats,
                "replay": self.replay, "server": self.server, "seconds": self.seconds,
                "recorded": str(self.recorded) if self.recorded else None}


def server_command(options: CheckOptions, serve: ServeInfo, summary_json: Path) -> list[str]:
    if options.server_cmd:
        return shlex.split(options.server_cmd)
    exe = Path(sys.executable).parent / "physis-serve"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "physis_ros.cli.serve"]
    if serve.path is not None:
        cmd += ["--config", str(serve.path)]
    # --duration bounds the server's life even if this process dies without stopping it.
    cmd += ["--deterministic", "--duration", f"{options.timeout_s + 60:.0f}", "--summary-json", str(summary_json)]
    if options.sim_time:
        cmd.append("--use-sim-time")
    # Lossless inputs: the replay publishes reliable and the server subscribes reliable, so a loaded
    # machine cannot drop an observation (best effort, a robot's usual sensor QoS, may).
    reliable = [a for s in serve.streams for a in ("-p", f"streams.{s.name}.qos.input.reliability:=reliable",
                                                   "-p", f"streams.{s.name}.qos.input.depth:=1000")]
    # A world model's actions are subscribed with its qos.action_chunk profile (a command, reliable as
    # published): reliable, volatile (what the replay offers) and deep, so that none is dropped either.
    for s in serve.streams:
        if "actions" in s.topics:
            reliable += [a for key, value in (("reliability", "reliable"), ("durability", "volatile"),
                                              ("depth", "1000"))
                         for a in ("-p", f"streams.{s.name}.qos.action_chunk.{key}:={value}")]
    return cmd + ["--ros-args", *reliable]


def stop_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """SIGINT, then SIGTERM, then SIGKILL to its process group (it was started in a session of its own)."""
    for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _engine_serving(raw: bytes) -> bool:
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.serialization import deserialize_message

    msg = deserialize_message(raw, DiagnosticArray)
    return any(s.name.endswith("engine") and s.message == "serving" for s in msg.status)


def run_check(options: CheckOptions) -> CheckResult:
    """Run the whole harness; never raises for a failing server or bag (see ``result.error``)."""
    result = CheckResult(Path(options.bag))
    t_start = time.monotonic()
    try:
        serve = load_serve_info(options.config)
        fed = serve.fed_by_outputs()
        if fed:
            topic, stream = next(iter(fed.items()))
            raise BagError(f"stream {stream} takes {topic}, an output of this server: a replay cannot feed it "
                           f"deterministically; point streams.{stream}.topics.actions at a topic the bag holds "
                           f"(physis-bag generate --config C writes /<ns>/actions)")
        info = bag_info(options.bag)
        present = {t.topic for t in info.topics}
        inputs_topics = [t for t in serve.input_topics if t in present]
        if not inputs_topics:
            raise BagError(f"{options.bag} has none of the server's input topics ({', '.join(serve.input_topics)})")
        from physis_ros.console import preflight_serve
        preflight_serve(serve.config)      # checkpoint, profile, keys readable: before a server waits on them
        inputs = collect_inputs(options.bag, serve)
    except Exception as exc:      # BagError, ConfigError, CliError; an unreadable model or message
        result.error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        return result
    workdir = Path(options.out) if options.out else Path(tempfile.mkdtemp(prefix="physis-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    recorded = workdir / "outputs"
    if recorded.exists():
        if not (recorded / "metadata.yaml").exists():
            result.error = f"{recorded} exists and is not a bag; not overwriting it"
            return result
        shutil.rmtree(recorded)
    try:
        _run(options, serve, inputs, inputs_topics, workdir, recorded, result)
    except BagError as exc:
        result.error = str(exc)
    result.seconds["total"] = round(time.monotonic() - t_start, 2)
    if not options.out and result.ok:
        shutil.rmtree(workdir, ignore_errors=True)
        result.recorded = None
    return result


def _run(options: CheckOptions, serve: ServeInfo, inputs: Inputs, inputs_topics, workdir: Path, recorded: Path,
         result: CheckResult) -> None:
    from physis_ros.bags.record import Recorder, wait_until
    from physis_ros.bags.replay import ReplayOptions, Replayer
    from physis_ros.bags.rosnode import RosSession

    deadline = time.monotonic() + options.timeout_s
    expected = {name: len(obs) for name, obs in inputs.observations.items()}
    chunk_topic = {s.chunk_topic: s.name for s in serve.streams}
    received = {name: 0 for name in expected}
    state = {"telemetry": 0, "serving": False, "last_output": time.monotonic()}

    def on_message(topic: str, raw: bytes, _ns: int) -> None:
        if topic in chunk_topic:
            received[chunk_topic[topic]] += 1
            state["last_output"] = time.monotonic()
        elif topic == serve.telemetry_topic:
            state["telemetry"] += 1
        elif topic == "/diagnostics" and not state["serving"]:
            state["serving"] = _engine_serving(raw)

    log_path = workdir / "server.log"
    summary_json = workdir / "server.json"
    cmd = server_command(options, serve, summary_json)
    published: dict[tuple[str, int], tuple[int | None, int]] = {}
    t0 = time.monotonic()
    with RosSession("physis_bag_check") as ros, open(log_path, "w") as log:
        recorder = Recorder(ros.node, recorded, serve.output_types, on_message=on_message)
        result.recorded = recorded
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def alive() -> bool:
                if proc.poll() is not None:
                    raise BagError(f"the server exited with code {proc.returncode} before the check finished; "
                                   f"its log ({log_path}):\n{_tail(log_path)}")
                return True

            up = wait_until(lambda: alive() and state["serving"] and all(
                sub.get_publisher_count() > 0 for t, sub in recorder.subscriptions.items()
                if t in chunk_topic or t == serve.telemetry_topic),
                min(options.start_timeout_s, deadline - time.monotonic()))
            if not up:
                raise BagError(f"the server did not report 'serving' with its outputs matched within "
                               f"{options.start_timeout_s:.0f} s; its log ({log_path}):\n{_tail(log_path)}")
            result.seconds["server_start"] = round(time.monotonic() - t0, 2)

            def on_publish(p) -> None:
                published[(p.bag_topic, p.bag_stamp_ns)] = (p.stamp_ns, p.wall_ns)

            replayer = Replayer(options.bag, ros.node, ReplayOptions(
                rate=options.rate, topics=inputs_topics, restamp=not options.sim_time,
                clock_hz=100.0 if options.sim_time else None, wait_for=inputs_topics,
                # serving: every config stream's subscriptions exist (or it was not admitted); discovery is quick
                wait_timeout_s=max(1.0, min(options.subscriber_timeout_s, deadline - time.monotonic())),
                delay_s=0.5, progress=options.verbose, reliable=options.server_cmd is None),
                on_publish=on_publish)
            t_replay = time.monotonic()
            try:
                replay = replayer.run()
            except BagError as exc:
                if "no subscriber" not in str(exc):
                    raise
                raise BagError(f"the server does not take the bag's inputs: {exc} (a stream not admitted?); "
                               f"its log ({log_path}):\n{_tail(log_path)}") from None
            result.replay = {"messages": replay.messages, "counts": replay.counts, "timing": replay.timing(), "unacked": replay.unacked,
                             "wall_s": round(replay.wall_s, 3)}
            result.seconds["replay"] = round(time.monotonic() - t_replay, 2)
            total = sum(expected.values())
            done = wait_until(lambda: alive() and (
                all(received[n] >= expected[n] for n in expected) and state["telemetry"] >= total
                or time.monotonic() - state["last_output"] > options.idle_timeout_s
                or time.monotonic() > deadline), max(0.0, deadline - time.monotonic()) + 1.0)
            time.sleep(0.3)      # stragglers (diagnostics, duplicates) before closing
            result.seconds["drain"] = round(time.monotonic() - t_replay - result.seconds["replay"], 2)
            if not done:
                result.analysis.add("finished in time", False, f"overall timeout {options.timeout_s:.0f} s")
        finally:
            code = stop_process(proc)
            recorder.close()
    result.server = {"exit": code, "command": " ".join(cmd)}
    if summary_json.exists():
        try:
            summary = json.loads(summary_json.read_text())
            result.server["rejected"] = {n: s.get("rejected", {}) for n, s in summary.get("streams", {}).items()}
        except (OSError, ValueError):
            pass
    if options.verbose:
        print(log_path.read_text(errors="replace"), file=sys.stderr)

    image_topic = {s.name: s.topics["image"] for s in serve.streams}

    def published_stamp(stream: str, bag_ns: int) -> int | None:
        return published.get((image_topic[stream], bag_ns), (None, 0))[0]

    def completed_wall_ns(obs) -> int | None:
        walls = [published.get(part) for part in obs.parts()]
        return max(w[1] for w in walls) if all(walls) else None

    t_an = time.monotonic()
    outputs = load_outputs(recorded, serve)
    try:
        analysis = analyse(inputs, outputs, serve, published_stamp=published_stamp,
                           completed_wall_ns=completed_wall_ns, reference=options.reference,
                           server_rejected=result.server.get("rejected"))
    except Exception as exc:      # e.g. the reference cannot load the config's checkpoint
        raise BagError(f"cannot analyse the run: {type(exc).__name__}: {exc}") from exc
    result.analysis.items = analysis.items + result.analysis.items
    result.analysis.stats = analysis.stats
    result.analysis.add("server stopped cleanly", code == 0,
                        f"exit code {code}" + ("" if code == 0 else f"; log {log_path}:\n{_tail(log_path, 10)}"))
    result.seconds["analysis"] = round(time.monotonic() - t_an, 2)
    if options.report and options.out:
        from physis_ros.bags.report import write_report
        write_report(recorded, workdir / "report")
