"""Health verdicts (what ROS publishes on ``/diagnostics``: :mod:`physis_ros.ros.diagnostics`, the same concept
one layer up): one :class:`Status` per stream, one per worker and one for the engine, named ``<prefix>: <what>``
(``physis_server: robot0``, ``physis_server: worker w0``, ``physis_server: engine``). Pure functions of
snapshots: :func:`statuses` judges all of them from :meth:`Server.stats <physis_ros.serving.server.Server.stats>`
and what the front end adds of its own (:class:`Outputs`); it publishes them in its own messages.

Verdicts are over a time window (``diagnostics_window_s``), so they decay: a stream that stops
publishing falls to 0 chunks/s and turns ERROR ("no chunk for X s") once it has published nothing
for two expected intervals (its SLO interval, or its own median interval if that is longer).

- stream ERROR: failed (reset: a worker lost under it, a chunk lost or non-finite), recovering (re-admitted
  after a reset, no chunk published since: ERROR until it publishes again), starved (no fresh observation for longer than
  ``diagnostics_starved_s``) or stalled (no chunk for two expected intervals);
  WARN: interval p99 over the SLO, deadline-miss rate over ``diagnostics_miss_rate_warn``, inputs
  rejected since the last report, the engine not serving yet; else OK.
- worker ERROR: process exited or heartbeat older than the timeout.
- engine ERROR: failed, or any worker down; WARN: starting / unconfigured / stopping, or serving with
  its outputs disarmed (lifecycle inactive).

The node never reports STALE itself: that is the aggregator's word for a status that stopped coming.
``hardware_id`` is ``host:device`` (``myhost:cpu``, ``myhost:cuda:0``); a stream's is the devices its
workers run on, the engine's the host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dataclasses import dataclass, field

if TYPE_CHECKING:
    from physis_ros.serving.config import ServeConfig

OK, WARN, ERROR = 0, 1, 2       # the levels of diagnostic_msgs' status message
PREFIX = "physis_server"


@dataclass(frozen=True)
class Status:
    """One verdict: ``level`` OK, WARN or ERROR; ``name`` ``<prefix>: <what>``; ``message`` one line on why;
    ``hardware_id`` where it runs (``host:device``); ``values`` the figures behind it."""

    level: int
    name: str
    message: str
    hardware_id: str
    values: dict[str, Any]


def _status(name: str, hardware_id: str, level: int, message: str, values: dict[str, Any],
            prefix: str = PREFIX) -> Status:
    return Status(level, f"{prefix}: {name}", message, hardware_id, values)


def hardware_id(host: str, device: str) -> str:
    return f"{host}:{device}"


def stream_hardware_id(host: str, worker_ids: Iterable[str]) -> str:
    """The devices a stream's workers run on (``host:cuda:0,host:cuda:1``), or the host."""
    return ",".join(sorted(set(worker_ids))) or host


def stream_status(name: str, stats: dict[str, Any], inputs: dict[str, Any], *, slo_interval_ms: float | None,
                  new_rejects: int, engine_state: str, idle_s: float | None, armed: bool = True,
                  hardware_id: str = "", miss_rate_warn: float = 0.05, starved_s: float = 2.0,
                  since_s: float | None = None, stale_intervals: float = 1.0,
                  prefix: str = PREFIX, requests: bool = False) -> Status:
    """``stats``: :func:`~physis_ros.telemetry.window_stats` (plus the node's handover/publish times); ``inputs``:
    StreamInput.snapshot() plus the node's counters; ``new_rejects``: inputs rejected since the last
    report; ``idle_s``: seconds the stream has waited for an observation for its next chunk (None:
    not waiting); ``since_s``: seconds since the engine began serving it; ``stale_intervals``: WARN when the
    median age of the observations its chunks used exceeds this many SLO intervals. ``requests``: a stream
    of cadence request (a client waiting for the chunk of each observation it sends): it computes only when
    asked, so a silence is the client's, not a stall, and its SLO bounds each chunk's latency."""
    rate = float(stats.get("chunks_per_s", 0.0))
    p50 = float(stats.get("interval_ms_p50", math.nan))
    p99 = float(stats.get("interval_ms_p99", math.nan))
    miss_rate = float(stats.get("deadline_miss_rate", 0.0))
    age = float(stats.get("last_chunk_age_s", math.inf))
    expected_ms = float(stats.get("expected_interval_ms", math.nan))
    if math.isnan(expected_ms) and slo_interval_ms:
        expected_ms = slo_interval_ms
    rejected = inputs.get("rejected", {})
    values: dict[str, Any] = {
        "armed": armed,
        "chunks_total": stats.get("total", 0),
        "chunks_per_s": rate,
        "window_s": float(stats.get("window_s", math.nan)),
        "chunks_window": stats.get("chunks_window", 0),
        "last_chunk_age_s": age,
        "interval_ms_p50": p50,
        "interval_ms_p99": p99,
        "latency_ms_p50": float(stats.get("latency_ms_p50", math.nan)),
        "latency_ms_p99": float(stats.get("latency_ms_p99", math.nan)),
        "slo_interval_ms": float(slo_interval_ms) if slo_interval_ms else "none",
        "slo_rate_hz": float(1000.0 / slo_interval_ms) if slo_interval_ms else "none",
        "deadline_miss_rate": miss_rate,
        "deadline_misses_total": stats.get("deadline_misses_total", 0),
        # node-side: engine emit -> output callback, and callback -> ActionChunk published
        "handover_ms_p50": float(stats.get("handover_ms_p50", math.nan)),
        "handover_ms_p99": float(stats.get("handover_ms_p99", math.nan)),
        "publish_ms_p50": float(stats.get("publish_ms_p50", math.nan)),
        "publish_ms_p99": float(stats.get("publish_ms_p99", math.nan)),
        "images_received": inputs.get("received", {}).get("images", 0),
        "joint_states_received": inputs.get("received", {}).get("joints", 0),
        "observations_used": inputs.get("used", 0),
        "observations_queued": inputs.get("queued", 0),
        "waiting_for_observation_s": float(idle_s) if idle_s is not None else 0.0,
        "dropped_total": rejected.get("queue_full", 0) + rejected.get("unpaired", 0),
        "rejected_total": sum(rejected.values()),
        "failures_total": inputs.get("failures", 0),          # resets of this stream (any cause; resets.<cause>)
        "lost_chunks_total": inputs.get("lost_chunks", 0),    # in flight at a reset, or not published
        # computed, not published (unpublished.<why>)
        "unpublished_total": sum(inputs.get("unpublished", {}).values()),
        # matched subscribers (a controller connected?); a RELIABLE one is needed for ros2_control
        "action_chunk_subscribers": inputs.get("action_chunk_subscribers", 0),
        "joint_trajectory_subscribers": inputs.get("joint_trajectory_subscribers", 0),
    }
    for key in ("inference_delay_steps", "late_points_window", "late_chunks_window", "seam_blended_chunks_window"):
        values[key] = stats.get(key, 0)
    for key in ("seam_jump_p50", "seam_jump_p99", "seam_velocity_jump_p99", "tracking_error_p50",
                "observation_age_ms_p50", "observation_age_ms_p99"):
        values[key] = float(stats.get(key, math.nan))
    # what admission charges the stream beyond its jitter bound (measured; "none" until measured)
    spread = stats.get("admission_spread_ms")
    values["admission_spread_ms"] = round(float(spread), 3) if spread is not None else "none"
    values["late_points_total"] = inputs.get("late_points", 0)
    values["late_chunks_total"] = inputs.get("late_chunks", 0)
    values["seam_blended_chunks_total"] = inputs.get("blended_chunks", 0)
    late = int(stats.get("late_chunks_window", 0))
    values.update({f"rejected.{reason}": n for reason, n in sorted(rejected.items())})
    values.update({f"resets.{cause}": n for cause, n in sorted(inputs.get("resets", {}).items())})
    values.update({f"unpublished.{why}": n for why, n in sorted(inputs.get("unpublished", {}).items())})
    slo = f" (SLO {slo_interval_ms:.1f} ms)" if slo_interval_ms else ""
    stall_s = 2.0 * expected_ms / 1e3 if not math.isnan(expected_ms) else starved_s
    if engine_state != "serving":
        level, msg = (ERROR if engine_state == "failed" else WARN), f"engine {engine_state}"
    elif inputs.get("failed"):
        level, msg = ERROR, f"stream failed: {inputs['failed']}"
    elif inputs.get("recovering"):
        level, msg = ERROR, f"recovering: {inputs['recovering']}; re-admitted, waiting for its first chunk"
    elif requests:
        lat = values["latency_ms_p99"]
        if slo_interval_ms and not math.isnan(lat) and lat > slo_interval_ms:
            level, msg = WARN, f"latency p99 {lat:.1f} ms over SLO {slo_interval_ms:.1f} ms (requests)"
        elif new_rejects:
            level, msg = WARN, f"{new_rejects} observation(s) rejected since last report"
        else:
            level, msg = OK, (f"{rate:.1f} chunks/s on request, latency p50 {values['latency_ms_p50']:.1f} / p99 "
                              f"{lat:.1f} ms{slo}")
    elif idle_s is not None and idle_s > starved_s:
        level, msg = ERROR, (f"starved: no fresh observation for {idle_s:.1f} s (camera or joint_states silent "
                             f"or stale)")
    elif math.isinf(age):
        if since_s is not None and since_s > max(stall_s, starved_s):
            level, msg = ERROR, f"no chunk in {since_s:.1f} s of serving"
        else:
            level, msg = WARN, "waiting for the first chunk"
    elif age > stall_s:
        level, msg = ERROR, f"no chunk for {age:.1f} s (expected one every {expected_ms:.0f} ms)"
    elif late:
        level, msg = WARN, (f"{late} chunk(s) in the last {values['window_s']:.0f} s arrived after their last step "
                            f"was due (not sent as trajectories)")
    elif slo_interval_ms and values["observation_age_ms_p50"] > stale_intervals * slo_interval_ms:
        level, msg = WARN, (f"stale inputs: the observations its chunks used were "
                            f"{values['observation_age_ms_p50']:.0f} ms old (median) when the chunk started, over "
                            f"{stale_intervals:g} x its SLO interval {slo_interval_ms:.0f} ms: is the robot "
                            f"publishing at its rate? ({rate:.1f} chunks/s)")
    elif slo_interval_ms and not math.isnan(p99) and p99 > slo_interval_ms:
        level, msg = WARN, f"interval p99 {p99:.1f} ms over SLO {slo_interval_ms:.1f} ms ({rate:.1f} chunks/s)"
    elif slo_interval_ms and miss_rate > miss_rate_warn:
        level, msg = WARN, (f"deadline miss rate {miss_rate:.0%} over the last {values['window_s']:.0f} s "
                            f"(warn above {miss_rate_warn:.0%}){slo}")
    elif new_rejects:
        level, msg = WARN, f"{new_rejects} input message(s) rejected since last report"
    else:
        level, msg = OK, f"{rate:.1f} chunks/s, interval p50 {p50:.1f} / p99 {p99:.1f} ms{slo}"
    if not armed:
        msg += " [outputs disarmed]"
    return _status(name, hardware_id or name, level, msg, values, prefix)


def inputs_summary(inputs: dict[str, Any]) -> str:
    """What arrived on a stream's inputs, accepted and rejected with the reasons ("images 30 accepted; joint
    states 0 accepted, 700 rejected (max_age 700)"), for a log line about a stream waiting for them."""
    parts = []
    for kind, label in (("images", "images"), ("joints", "joint states"), ("actions", "actions")):
        accepted = inputs.get("received", {}).get(kind, 0)
        refused = inputs.get("refused", {}).get(kind, {})
        if kind == "actions" and not accepted and not refused:
            continue
        text = f"{label} {accepted} accepted"
        if refused:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(refused.items(), key=lambda rn: -rn[1]))
            text += f", {sum(refused.values())} rejected ({reasons})"
        parts.append(text)
    return "; ".join(parts)


def pending_stream_status(name: str, verdict: str | None, engine_state: str, prefix: str = PREFIX,
                          hardware_id: str = "") -> Status:
    """A stream of the config that is not served: waiting for admission (WARN), or refused (ERROR, the reason)."""
    if verdict:
        return _status(name, hardware_id or name, ERROR, f"not admitted: {verdict}", {"admitted": False}, prefix)
    return _status(name, hardware_id or name, WARN, f"waiting for admission (engine {engine_state})",
                   {"admitted": False}, prefix)


def removed_stream_status(name: str, prefix: str = PREFIX, hardware_id: str = "") -> Status:
    """A stream that left since the last /diagnostics (removed, cancelled, its client gone): said once, OK."""
    return _status(name, hardware_id or name, OK, "removed: no longer served", {"admitted": False, "removed": True},
                   prefix)


def worker_status(name: str, pid: int, last_seen: float, stats: dict[str, Any], timeout_s: float,
                  alive: bool, hardware_id: str = "", state: str = "", prefix: str = PREFIX) -> Status:
    """``state``: the engine's word for the worker (up, starting, restarting, down), if it has one."""
    age = time.monotonic() - last_seen if last_seen else math.inf
    values: dict[str, Any] = {"pid": pid, "state": state or ("up" if alive else "down"),
                              "heartbeat_age_s": float(age)}
    for key, value in sorted(stats.items()):
        if isinstance(value, (int, float, str, bool)):
            values[key] = value
    hw = hardware_id or name
    if state in ("restarting", "down"):
        return _status(f"worker {name}", hw, ERROR, f"worker {state}", values, prefix)
    if not alive:
        return _status(f"worker {name}", hw, ERROR, "worker process exited", values, prefix)
    if state == "starting":
        return _status(f"worker {name}", hw, WARN, "starting", values, prefix)
    if age > timeout_s:
        return _status(f"worker {name}", hw, ERROR, f"no heartbeat for {age:.1f} s", values, prefix)
    return _status(f"worker {name}", hw, OK, "alive", values, prefix)


def engine_status(state: str, model: str, plan: str, workers: int, failure: str | None,
                  telemetry_subscribers: int = 0, *, armed: bool = True, lifecycle: str = "",
                  workers_down: Sequence[str] = (), hardware_id: str = "", prefix: str = PREFIX,
                  rss_mb: float | None = None) -> Status:
    """``state``: unconfigured, starting, serving, failed, stopping, stopped; ``armed``: the outputs
    (ActionChunk, JointTrajectory) are published (lifecycle active); ``rss_mb``: the server process's resident
    memory (each worker's is its status's ``rss_bytes``)."""
    values = {"state": state, "lifecycle": lifecycle or ("active" if armed else "inactive"), "armed": armed,
              "model": model, "plan": plan, "workers": workers,
              "workers_down": ",".join(workers_down) or "none", "telemetry_subscribers": telemetry_subscribers}
    if rss_mb is not None:
        values["rss_mb"] = round(rss_mb, 1)
    hw = hardware_id or "engine"
    if failure:
        return _status("engine", hw, ERROR, failure, values, prefix)
    if workers_down:
        return _status("engine", hw, ERROR, f"worker(s) {', '.join(workers_down)} down", values, prefix)
    if state == "serving":
        if armed:
            return _status("engine", hw, OK, "serving", values, prefix)
        return _status("engine", hw, WARN, "serving, outputs disarmed (lifecycle inactive)", values, prefix)
    if state == "unconfigured":
        return _status("engine", hw, WARN, "unconfigured: waiting for the lifecycle configure transition",
                       values, prefix)
    return _status("engine", hw, ERROR if state == "failed" else WARN, state, values, prefix)


# ---- every status at once, from the server's figures --------------------------------------------------
@dataclass(frozen=True)
class Reporter:
    """The front end that publishes the statuses, as it says of itself: ``prefix`` of the statuses' names,
    ``host`` (the engine's hardware id), ``state`` the engine's in its words (unconfigured, starting, serving,
    failed, stopping, stopped), ``armed`` and ``lifecycle`` its outputs', ``telemetry_subscribers``, and
    ``serving_s`` seconds since the engine began serving (None: not yet)."""

    prefix: str = PREFIX
    host: str = ""
    state: str = "serving"
    armed: bool = True
    lifecycle: str = ""
    telemetry_subscribers: int = 0
    serving_s: float | None = None


@dataclass(frozen=True)
class Outputs:
    """What a front end adds to a stream it publishes itself: ``figures`` beside the server's (its handover and
    publish times, ms), ``counters`` among the inputs' (late rows, subscribers), ``new_rejects`` (inputs
    rejected since its last report) and ``idle_s`` (seconds the stream has waited for an observation; None:
    not waiting). A stream without them (another front end's, an openpi client's) is judged on the server's
    figures alone, its outputs armed."""

    figures: Mapping[str, Any] = field(default_factory=dict)
    counters: Mapping[str, Any] = field(default_factory=dict)
    new_rejects: int = 0
    idle_s: float | None = None


def statuses(figures: Mapping[str, Any], config: ServeConfig, reporter: Reporter, outputs: Mapping[str, Outputs],
             pending: Mapping[str, str | None] | None = None, departed: Iterable[str] = ()) -> list[Status]:
    """The engine's, every stream's and every worker's status from the server's figures
    (:meth:`Server.stats <physis_ros.serving.server.Server.stats>`; ``config`` its ServeConfig), the front end's
    ``outputs`` of its own streams, the config streams not served (``pending``: stream -> its rejection, None
    while it waits) and the streams that left since the last report (``departed``, said once)."""
    ecfg, prefix, host = config.engine, reporter.prefix, reporter.host
    mono = time.monotonic()
    worker_hw, down, workers = {}, [], []
    for wname, w in figures["workers"].items():
        stats = dict(w["stats"])
        if w.get("admission_load_factor") is not None:    # admission's load calibration (the server feeds it)
            stats["admission_load_factor"] = w["admission_load_factor"]
        worker_hw[wname] = hardware_id(w["host"] or host, str(w["device"]))
        stale = w["state"] == "up" and w["last_seen"] and mono - w["last_seen"] > ecfg.heartbeat_timeout_s
        if not w["alive"] or stale:
            down.append(wname)
        workers.append(worker_status(wname, w["pid"], w["last_seen"], stats, ecfg.heartbeat_timeout_s, w["alive"],
                                     hardware_id=worker_hw[wname], state=w["state"], prefix=prefix))
    engine = engine_status(reporter.state, figures["engine"].get("model", ""), "admission", ecfg.workers,
                           figures["engine"]["failure"], telemetry_subscribers=reporter.telemetry_subscribers,
                           armed=reporter.armed, lifecycle=reporter.lifecycle, workers_down=sorted(down),
                           hardware_id=host, prefix=prefix, rss_mb=figures["engine"]["rss_mb"])
    streams = []
    for name, stats in figures["streams"].items():
        stats, out = dict(stats), outputs.get(name)
        inputs = {**stats.pop("inputs"), "failed": stats["failed"], "recovering": stats["recovering"],
                  "failures": stats["failures"], "lost_chunks": stats["lost_chunks"],
                  "unpublished": stats["undelivered"], "resets": stats["resets"], **(out.counters if out else {})}
        stats.update(out.figures if out else {})
        since = reporter.serving_s
        streams.append(stream_status(
            name, stats, inputs, slo_interval_ms=stats["slo_interval_ms"], new_rejects=out.new_rejects if out else 0,
            engine_state=reporter.state, idle_s=out.idle_s if out else None, armed=reporter.armed if out else True,
            hardware_id=stream_hardware_id(host, [worker_hw[w] for w in stats["workers"] if w in worker_hw]),
            miss_rate_warn=config.diagnostics_miss_rate_warn, starved_s=config.diagnostics_starved_s,
            stale_intervals=config.diagnostics_stale_intervals, prefix=prefix,
            since_s=None if since is None else min(since, stats["serving_s"]),
            requests=out is None and stats["cadence"] == "request"))
    streams += [removed_stream_status(name, prefix=prefix, hardware_id=host) for name in departed]
    streams += [pending_stream_status(name, verdict, reporter.state, prefix=prefix, hardware_id=host)
                for name, verdict in (pending or {}).items()]
    return [engine, *streams, *workers]
