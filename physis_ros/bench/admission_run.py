"""One run of the admission benchmark: one server (one batching mode) and the join / reject / second model /
leave / join sequence of ServeStream goals, measured phase by phase (see physis_ros.bench.admission_goals)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from physis_ros.bench.admission_observe import (Mirror, Recorder, _cpu_delta, _cpu_snapshot, _gaps, _r,
                                                  stream_window)
from physis_ros.serving.capacity import CAUSES
from physis_ros.timeline import release_pace_ms

JOINTS = [f"joint{i}" for i in range(1, 8)]
SECOND = "wm0"


class Interrupted(Exception):
    pass


class RunFailed(Exception):
    pass


def _say(text: str) -> None:
    print(f"physis-bench admission: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- one run
class Run:
    """One server (one batching mode): the join / reject / second model / leave / join sequence."""

    def __init__(self, args, st: dict, node, executor, stop, mode: str, round_: int, config_path: Path, cfg,
                 profiles: dict, synthetic, logs: Path):
        from rclpy.action import ActionClient

        from physis_ros.action import ServeStream
        from physis_ros.srv import ListStreams

        self.args, self.st, self.node, self.executor, self.stop = args, st, node, executor, stop
        self.mode, self.round, self.cfg, self.logs = mode, round_, cfg, logs
        self.config_path = config_path
        self.rec = Recorder(node)
        self.mirror = Mirror(cfg, profiles)
        self.client = ActionClient(node, ServeStream, "/physis_server/serve_stream")
        self.lister = node.create_client(ListStreams, "/physis_server/list_streams")
        self.ServeStream, self.ListStreams = ServeStream, ListStreams
        self.goals: dict[str, dict] = {}     # active stream -> {handle, result future, model, slo, pace, ...}
        self.ended: dict[str, dict] = {}     # stream -> its goal's result
        self.meta: dict[str, dict] = {}      # stream -> model, slo, pace, placement (latest incarnation)
        self.events: list[dict] = []
        self.phases: list[dict] = []
        self.synthetic = synthetic
        self.server = None
        self.exit: int | None = None
        self.t0 = time.monotonic()

    # ---- spinning ------------------------------------------------------------------------------------
    def spin_until(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.stop.is_set():
                raise Interrupted()
            if self.server is not None and self.server.poll() is not None:
                raise RunFailed(f"the server exited ({self.server.poll()}):\n{self.server.tail()}")
            if self.synthetic.poll() is not None:
                raise RunFailed(f"physis-synthetic exited ({self.synthetic.poll()}):\n{self.synthetic.tail()}")
            if time.monotonic() >= deadline:
                return False
            self.executor.spin_once(timeout_sec=0.02)
        return True

    def spin_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.spin_until(lambda: time.monotonic() >= end, seconds + 1.0)

    # ---- the sequence ------------------------------------------------------------------------------
    def execute(self) -> dict:
        from physis_ros.launcher import Child, serve_command

        a, st = self.args, self.st
        _say(f"[{self.mode}, round {self.round}] starting physis-serve ({a.workers} workers, batching {self.mode})")
        self.server = Child("physis-serve", serve_command(self.config_path),
                            log=self.logs / f"serve_{self.mode}_{self.round}.log")
        try:
            if not self.spin_until(self.client.server_is_ready, a.start_timeout):
                raise RunFailed(f"no serve_stream action within {a.start_timeout:g} s:\n{self.server.tail()}")
            if not self.spin_until(lambda: self.lister.service_is_ready(), a.start_timeout):
                raise RunFailed("no list_streams service")
            if not self.spin_until(lambda: self.rec.engine_state == "serving", a.start_timeout):
                raise RunFailed(f"the engine is not serving within {a.start_timeout:g} s (/diagnostics: "
                                f"{self.rec.engine_state}):\n{self.server.tail()}")
            first = 0
            for i in range(st["max_streams"]):
                ev = self.join(f"robot{i}", a.model, a.slo_ms, a.control_rate_hz)
                first = i + 1
                if not ev["admitted"]:
                    break
                self.measure(f"+robot{i}", ev)
            self.join_second_model()
            robots = [s for s in self.goals if s.startswith("robot")]
            if robots:
                leaving = "robot1" if "robot1" in robots else robots[0]
                self.measure(f"-{leaving}", self.leave(leaving))
                # where no capacity remained for the world model, the leave frees some: it asks again first
                self.join_second_model(" (after the leave)")
                name = f"robot{first}"
                ev = self.join(name, a.model, a.slo_ms, a.control_rate_hz)
                if ev["admitted"]:
                    self.measure(f"+{name} (after the leave)", ev)
        finally:
            self.finish()
        return self.result()

    def join_second_model(self, label: str = "") -> None:
        """The world model asks to join, at each SLO of ``second_slo_tries`` until admitted (it imagines what
        robot0's policy commands); nothing if it is served already or robot0 is not."""
        a = self.args
        if not a.second_model or "robot0" not in self.goals or SECOND in self.goals:
            return
        for slo in self.st["second_slo_tries"]:
            ev = self.join(SECOND, a.second_model, slo, a.second_control_rate_hz, "/robot0/action_chunk")
            if ev["admitted"]:
                self.measure(f"+{SECOND} ({a.second_model}, SLO {slo:g} ms){label}", ev)
                return

    def join(self, name: str, model: str, slo: float, rate: float, actions_topic: str = "") -> dict:
        goal = self.ServeStream.Goal(stream=name, topic_namespace=name, model=model, joint_names=JOINTS,
                                     slo_interval_ms=slo, control_rate_hz=rate, actions_topic=actions_topic)
        self.rec.watch(name, self.mirror.model(model).config.produces)
        pace = release_pace_ms(slo, self.cfg.admission.pace_margin, rate)   # as the server paces it (ros/hub.py)
        fb: dict = {}
        t_sent, wall = time.monotonic(), time.time()
        sent = self.client.send_goal_async(goal, feedback_callback=lambda m: fb.setdefault("workers",
                                                                                          list(m.feedback.workers)))
        if not self.spin_until(sent.done, self.args.start_timeout):
            raise RunFailed(f"goal for {name} not answered within {self.args.start_timeout:g} s")
        handle = sent.result()
        result = handle.get_result_async()
        if not self.spin_until(lambda: "workers" in fb or result.done(), self.args.start_timeout):
            raise RunFailed(f"no admission decision for {name} within {self.args.start_timeout:g} s")
        decision_s = time.monotonic() - t_sent
        ev = {"index": len(self.events), "t_s": round(t_sent - self.t0, 3), "wall": wall, "kind": "join",
              "stream": name, "model": model, "slo_ms": slo, "pace_ms": round(pace, 3),
              "decision_s": round(decision_s, 3)}
        self.mirror.follow(self.rec.load_factors(), self.rec.spreads())
        ok, reason, placement = self.mirror.admit(name, model, pace, slo)
        if "workers" in fb:
            self.goals[name] = {"handle": handle, "result": result}
            self.meta[name] = {"model": model, "slo_ms": slo, "pace_ms": pace, "placement": placement}
            self.spin_until(lambda: self.rec.server_util(name, "admitted") is not None, 3.0)
            ev.update(admitted=True, workers=fb["workers"], placement=placement, mirror_agrees=bool(
                ok and sorted(placement["workers"]) == sorted(fb["workers"])))
            ev["server_utilisation"] = self.rec.server_util(name, "admitted")
        else:
            r = result.result().result
            got, _, detail = r.reason.partition(": ")
            ev.update(admitted=False, reason=got, detail=detail, outcome=r.outcome,
                      mirror_agrees=bool(not ok and CAUSES.get(reason, reason) == got))
            if ok:  # the replay would have admitted it: keep it in step with the server
                self.mirror.remove(name)
        ev["predicted_utilisation"] = self.mirror.utilisation()
        ev["load_factors"] = self.mirror.load_factors()
        ev["spreads_ms"] = {s: round(v, 3) for s, v in self.mirror.spreads().items()}
        ev["list_streams"] = self.list_streams()
        self.events.append(ev)
        if ev.get("reason") == "not-serving":   # the server cannot serve anyone: nothing to measure
            raise RunFailed(f"{name}: {ev['reason']}: {ev['detail']}")
        verdict = (f"admitted on {','.join(ev['workers'])}" if ev["admitted"]
                   else f"REJECTED ({ev['reason']}: {ev['detail']})")
        _say(f"[{self.mode}] {name} ({model}, SLO {slo:g} ms, paced {pace:g}) {verdict}; predicted utilisation "
             f"{ev['predicted_utilisation']} (server {ev.get('server_utilisation')}); spreads {ev['spreads_ms']} ms; "
             f"{decision_s:.2f} s")
        wait = min(self.args.start_timeout, 30.0)
        if ev["admitted"] and not self.spin_until(lambda: self.rec.rows.get(name), wait):
            raise RunFailed(f"{name} was admitted but sent no chunk within {wait:g} s; the server's log:\n"
                            f"{self.server.tail()}")
        return ev

    def leave(self, name: str) -> dict:
        g = self.goals.pop(name)
        t, wall = time.monotonic(), time.time()
        g["handle"].cancel_goal_async()
        if not self.spin_until(g["result"].done, 20.0):
            raise RunFailed(f"cancelling {name}'s goal got no result")
        self.ended[name] = self._result(g["result"])
        self.mirror.remove(name)
        self.spin_until(lambda: self.rec.server_util(name, "removed") is not None, 3.0)
        ev = {"index": len(self.events), "t_s": round(t - self.t0, 3), "wall": wall, "kind": "leave",
              "stream": name, "result": self.ended[name], "decision_s": round(time.monotonic() - t, 3),
              "predicted_utilisation": self.mirror.utilisation(),
              "server_utilisation": self.rec.server_util(name, "removed"), "list_streams": self.list_streams()}
        self.events.append(ev)
        _say(f"[{self.mode}] {name} left ({ev['result']['outcome']}); predicted utilisation "
             f"{ev['predicted_utilisation']} (server {ev['server_utilisation']})")
        return ev

    def list_streams(self) -> dict | None:
        future = self.lister.call_async(self.ListStreams.Request())
        if not self.spin_until(future.done, 5.0):
            return None
        r = future.result()
        return {s: w.split(",") for s, w in zip(r.streams, r.workers)}

    @staticmethod
    def _result(future) -> dict:
        r = future.result().result
        return {"outcome": r.outcome, "reason": r.reason, "chunks_emitted": int(r.chunks_emitted),
                "chunks_lost": int(r.chunks_lost), "workers": list(r.workers)}

    # ---- one measured phase ---------------------------------------------------------------------------
    def measure(self, label: str, ev: dict) -> None:
        start = ev["wall"]   # the settle time runs from the goal (or the cancel) to the window
        self.spin_for(self.st["settle_s"])
        pids = {"server": self.server.pid, "synthetic": self.synthetic.pid, "bench": os.getpid(),
                **self.rec.worker_pids()}
        lo, c0 = time.time(), _cpu_snapshot(pids)
        self.spin_for(self.st["window_s"])
        hi, c1 = time.time(), _cpu_snapshot(pids)
        self.spin_for(0.5)  # the window's last chunks and counters arrive
        streams, settle = {}, {}
        for name in self.goals:
            m = self.meta[name]
            rows = self.rec.rows.get(name, [])
            s = stream_window(rows, self.rec.received[name], lo, hi, m["slo_ms"])
            pred = (m["placement"] or {}).get("compute_ms", {})
            total = sum(pred.values())
            s["measured_compute_ms"] = ({w: _r(s["compute_ms_p50"] * ms / total, 3) for w, ms in pred.items()}
                                        if total and s["compute_ms_p50"] is not None else {})
            s.update(model=m["model"], slo_ms=m["slo_ms"], pace_ms=round(m["pace_ms"], 3),
                     workers=sorted(pred), predicted_compute_ms=pred,
                     compute_split="exact" if len(pred) == 1 else "apportioned by predicted compute")
            streams[name] = s
            pre = stream_window(rows, self.rec.received[name], start, lo, m["slo_ms"])
            settle[name] = {"interval_ms_max": pre["interval_ms"]["max"],
                            "interval_ms_p99": pre["interval_ms"]["p99"], "deadline_misses": pre["deadline_misses"],
                            "gaps": pre["gaps"], "chunks": pre["chunks"]}
        util = ev.get("predicted_utilisation") or self.mirror.utilisation()
        server_util = ev.get("server_utilisation")
        cpu = _cpu_delta(c0, c1)
        workers = {}
        for i in range(self.cfg.engine.workers):
            w = f"w{i}"
            workers[w] = {"predicted_utilisation": util[i] if i < len(util) else None,
                          "server_utilisation": server_util[i] if server_util and i < len(server_util) else None,
                          **self.rec.worker_window(w, lo, hi), "cpu": cpu["cores_used"].get(w)}
        phase = {"index": len(self.phases), "label": label, "event": ev["index"],
                 "window": {"start": round(lo, 3), "end": round(hi, 3), "s": round(hi - lo, 3)},
                 "load_avg_1m": round(os.getloadavg()[0], 2), "cpu": cpu, "streams": streams, "settle": settle,
                 "workers": workers, "all_meet_slo": all(s["meets_slo"] for s in streams.values()),
                 "gaps": sum(s["gaps"] for s in streams.values())}
        self.phases.append(phase)
        _print_phase(self.mode, phase)

    # ---- the end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        for name in list(self.goals):
            g = self.goals.pop(name)
            try:
                g["handle"].cancel_goal_async()
                if self.spin_until(g["result"].done, 10.0):
                    self.ended[name] = self._result(g["result"])
            except (Interrupted, RunFailed):
                break
        self.exit = self.server.stop() if self.server is not None else None
        self.rec.close()
        self.node.destroy_client(self.lister)
        self.client.destroy()

    def result(self) -> dict:
        streams = {}
        for name, rows in self.rec.rows.items():
            idx = [r[1] for r in rows]
            streams[name] = {"model": self.meta.get(name, {}).get("model"), "chunks": len(rows),
                             "first_chunk": min(idx), "last_chunk": max(idx), "gaps": _gaps(idx),
                             "deadline_misses": int(sum(r[5] for r in rows)),
                             "received_by_robot": len(self.rec.received[name]),
                             "goal": self.ended.get(name),
                             "raw": [[round(r[0] - self.t0_wall, 4), *[_r(x, 3) if isinstance(x, float) else x
                                                                     for x in r[1:]]] for r in rows]}
        admitted = [e for e in self.events if e["kind"] == "join" and e["admitted"]]
        before_leave = []
        for e in self.events:
            if e["kind"] == "leave":
                break
            if e["kind"] == "join" and e["admitted"] and e["model"] == self.args.model:
                before_leave.append(e["stream"])
        second = next((e["slo_ms"] for e in admitted if e["stream"] == SECOND), None)
        return {"mode": self.mode, "round": self.round, "config": self.config_path.read_text(),
                "server_exit": self.exit, "max_batch_credited": self.mirror.max_batch,
                "events": self.events, "phases": self.phases, "streams": streams,
                "admitted": {"first_model": len(before_leave), "second_model_slo_ms": second,
                             "rejections": [{k: e[k] for k in ("stream", "model", "slo_ms", "reason", "detail")}
                                            for e in self.events if e["kind"] == "join" and not e["admitted"]]},
                "slo_held": bool(self.phases) and all(p["all_meet_slo"] for p in self.phases),
                "gaps": sum(s["gaps"] for s in streams.values()),
                "mirror_agrees": all(e.get("mirror_agrees", True) for e in self.events)}

    @property
    def t0_wall(self) -> float:
        return time.time() - (time.monotonic() - self.t0)


def _f(x, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _print_phase(mode: str, ph: dict) -> None:
    cpu = ph["cpu"]
    verdict = "all meet SLO" if ph["all_meet_slo"] else "SLO MISSED"
    print(f"[{mode}] phase {ph['index']} {ph['label']}: load {ph['load_avg_1m']}, cores used: ours "
          f"{_f(cpu['ours_cores'], 2)}, others {_f(cpu['others_cores'], 2)}; {verdict}, gaps {ph['gaps']}", flush=True)
    print(f"  {'stream':<8} {'model':<9} {'workers':<7} {'compute/chunk pred->meas ms':<28} "
          f"{'interval p50/p99/max':<20} {'SLO':>5} {'latency p50/p99':<15} {'misses':>6} {'gaps':>4} {'batch':>5}")
    for name, s in ph["streams"].items():
        comp = " ".join(f"{w} {_f(s['predicted_compute_ms'][w])}->{_f(s['measured_compute_ms'].get(w))}"
                        for w in s["workers"])
        iv, lat = s["interval_ms"], s["latency_ms"]
        print(f"  {name:<8} {s['model']:<9} {','.join(s['workers']):<7} {comp:<28} "
              f"{_f(iv['p50'])}/{_f(iv['p99'])}/{_f(iv['max']):<8} {s['slo_ms']:>5g} "
              f"{_f(lat['p50'])}/{_f(lat['p99']):<9} {s['deadline_misses']:>6} {s['gaps']:>4} "
              f"{_f(s['mean_batch'], 2):>5}")
    print("  workers: " + "; ".join(f"{w} predicted {_f(v['predicted_utilisation'], 3)} (server "
                                     f"{_f(v['server_utilisation'], 3)}) measured busy {_f(v['measured_busy'], 3)} "
                                     f"cpu {_f(v['cpu'], 2)} batch {_f(v.get('mean_batch'), 2)}"
                                     for w, v in ph["workers"].items()), flush=True)
