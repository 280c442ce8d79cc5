"""``physis-sim``: the multi-stream cluster simulator (joint scheduling versus the equal split).

Named scenarios::

    physis-sim --scenario report24 --json out.json   # 24 H200s, each backbone alone: the report's own
                                                     # setting (SLO 1600 ms, its groups), then ours (+ mixed)
    physis-sim --scenario sweep                      # joint vs equal over a range of SLOs per backbone
    physis-sim --scenario timing1024                 # placement decision time at 1024 devices
    physis-sim --scenario all --json out.json        # the three above in one JSON

Other settings::

    physis-sim --devices 64 --models wan2.1-1.3b,ltx-22b --slo-ms 185,590 --arrivals 200
    physis-sim --device cpu --devices 2 --models tiny-wam --slo-ms 12 --verbose

Paper-size presets use the roofline-modelled H200 profile (labelled
``roofline-model:h200``); tiny presets on ``--device cpu`` use the measured
profile shipped in ``config/profiles/`` (``measured:<host>``), a
``physis-profile`` JSON given with ``--profile MODEL=PATH``, or ``--measure``.
Admission is decided on those profiles; only placement time is measured here.

Exit status: 0 success; 2 usage or input error (bad flag or value, e.g. --devices 0 or
a negative SLO; unknown preset or device; unreadable/empty/binary/invalid scheduling
or device YAML or profile JSON; unwritable --json); 70 internal error (a bug;
PHYSIS_DEBUG=1 shows the traceback); 130 interrupted. Errors are one line on stderr:
'physis-sim: error: <what and the fix>'.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from physis_ros.console import (ArgumentParser, check_json_file, check_writable, check_yaml_file, cli_main, fail,
                                   nonneg_float, nonneg_int, positive_float, positive_int, write_json)

SWEEP_X = (0.3, 0.45, 0.55, 0.7, 0.9, 1.05, 1.1, 1.25, 1.4, 1.6, 1.9, 2.1, 2.4, 2.6, 3.1, 3.4, 3.6, 4.2)


def _table(rows: list[dict]) -> None:
    print(f"{'model':<16} {'dev':>5} {'slo_ms':>9} {'W_ms':>8} {'x':>6} {'group':>5} {'equal':>6} {'joint':>6} "
          f"{'ratio':>6} {'p99_ms':>7} {'vs_BF':>6} {'report':>8}")
    for r in rows:
        name = r["model"] if not r["model"].startswith("mixed:") else f"mixed({r['model'].count(',') + 1})"
        slo = r["slo_ms"]
        slo_s = f"{slo:g}" if isinstance(slo, (int, float)) else "mixed"
        x = r.get("devices_of_compute_per_stream")
        paper = r.get("report_paper")
        w = r.get("stream_compute_ms")
        print(f"{name:<16} {r['devices']:>5} {slo_s:>9} {f'{w:.1f}' if w is not None else '':>8} "
              f"{x if x is not None else '':>6} "
              f"{r['equal_group_size'] or '-':>5} {r['admitted']['equal']:>6} {r['admitted']['joint']:>6} "
              f"{(r['ratio'] if r['ratio'] is not None else '-'):>6} {r['placement_ms_p99']:>7.3f} "
              f"{_vs_best_fit(r):>6} "
              f"{(str(paper['equal']) + '->' + str(paper['joint'])) if paper else '':>8}")


def _vs_best_fit(row: dict) -> str:
    """The decision's p99 over the simplest Best-Fit's on the same cluster states, flagged past the limit."""
    from physis_ros.scheduling.simulator import PLACEMENT_VS_BEST_FIT_LIMIT

    v = row.get("placement_vs_best_fit_p99")
    if v is None:
        return "-"
    return f"{v:g}" + ("!" if v > PLACEMENT_VS_BEST_FIT_LIMIT else "")


def _implied(setting: dict) -> None:
    """What per-chunk workload W the report's own counts imply (simulator.implied_workload), per backbone."""
    def span(v):
        return f"({v[0]:g}, {v[1]:g}]" if v else "none"

    for key in setting["scenarios"][0]["report_implies"]:
        print(f"W the report's counts imply ({key}; ms per chunk on one device; '(lo, hi]', 'none' = no W):")
        print(f"{'model':<14} {'our W':>7} {'equal: g by need':>17} {'joint: firm':>16} {'both':>12} "
              f"{'g dedicated, joint at bound':>28}")
        for r in setting["scenarios"]:
            imp = r["report_implies"][key]
            print(f"{r['model']:<14} {r['stream_compute_ms']:>7.1f} {span(imp['equal']['by_need']):>17} "
                  f"{span(imp['joint']['firm']):>16} {span(imp['both']['by_need']):>12} "
                  f"{span(imp['both']['dedicated_at_packing_bound']):>28}")


def _parse_profiles(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        model, sep, path = item.partition("=")
        if not sep or not model or not path:
            fail(f"--profile wants MODEL=PATH, got {item!r}")
        check_json_file(path, f"--profile {model}")
        out[model] = path
    return out


def timing1024(config, device, profiles=None, devices: int = 1024) -> dict:
    """All five backbones mixed (report24 SLOs) on ``devices`` devices until saturation."""
    from physis_ros.scheduling.simulator import REPORT24_MODELS, Workload, compare, load_profiles

    slos = dict(config.scenarios["report24"])
    profiles = profiles or load_profiles(list(slos), device)
    r = compare(device, devices, profiles, Workload(list(slos), slos, seed=3), config,
                patience=50, arrivals=20 * devices)
    m = REPORT24_MODELS[0]
    single = compare(device, devices, profiles, Workload([m], {m: slos[m]}), config)
    return {"mixed": r, "single": single}


@cli_main("physis-sim")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-sim", description=__doc__)
    parser.add_argument("--scenario", choices=("report24", "sweep", "timing1024", "all"))
    parser.add_argument("--devices", type=positive_int, default=24)
    parser.add_argument("--models", help="comma-separated presets (mixed when more than one)")
    parser.add_argument("--slo-ms", help="output-interval SLO: one value for all models, or one per model")
    parser.add_argument("--latency-slo-ms", type=positive_float, help="optional response-latency SLO for every stream")
    parser.add_argument("--arrivals", type=positive_int, default=100000, help="most streams to offer")
    parser.add_argument("--patience", type=positive_int, default=None,
                        help="stop after this many rejections in a row (default 1 for one model, 20 mixed)")
    parser.add_argument("--policy", choices=("joint", "equal", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0, help="arrival order of a mixed workload")
    parser.add_argument("--device", help="device kind (config/devices/NAME.yaml) or a YAML path")
    parser.add_argument("--config", help="scheduling YAML (default config/scheduling.yaml)")
    parser.add_argument("--headroom", type=nonneg_float, help="override the config's headroom")
    parser.add_argument("--discrepancies", type=nonneg_int, help="override the LDS discrepancy budget")
    parser.add_argument("--no-split", action="store_true", help="whole virtual ranks only (no gap filling)")
    parser.add_argument("--profile", action="append", default=[], metavar="MODEL=PATH",
                        help="a physis-profile JSON for MODEL (repeatable)")
    parser.add_argument("--measure", action="store_true",
                        help="measure tiny presets in-process when no profile file exists (CPU)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="print every admission decision")
    args = parser.parse_args(argv)
    if args.headroom is not None and args.headroom >= 1:
        parser.error(f"argument --headroom: the fraction of device time kept free must be < 1, got {args.headroom}")
    slo_values = None
    if args.slo_ms is not None:
        try:
            slo_values = [float(v) for v in args.slo_ms.split(",")]
        except ValueError:
            parser.error(f"argument --slo-ms: wants numbers (one, or one per model), got {args.slo_ms!r}")
        if not all(v > 0 and v < float("inf") for v in slo_values):
            parser.error(f"argument --slo-ms: every SLO must be a positive number of ms, got {args.slo_ms!r}")
    paths = _parse_profiles(args.profile)
    if args.config:
        check_yaml_file(args.config, "--config")
    if args.device and Path(args.device).suffix in (".yaml", ".yml"):
        check_yaml_file(args.device, "--device")
    check_writable(args.json)

    from physis_ros.config import ConfigError
    from physis_ros.model.spec import load_model_config, preset_names
    from physis_ros.runtime.costs import load_profile
    from physis_ros.scheduling.profiles import get_profile, measure_profile
    from physis_ros.scheduling.settings import load_device, load_scheduling
    from physis_ros.scheduling.simulator import (Workload, compare, load_profiles, pooled, report24, run_policy,
                                                 slo_sweep)

    try:
        config = load_scheduling(args.config)
        if args.headroom is not None:
            config = dataclasses.replace(config, headroom=args.headroom)
        if args.discrepancies is not None:
            config = dataclasses.replace(config, lds=dataclasses.replace(config.lds, discrepancies=args.discrepancies))
        if args.no_split:
            config = dataclasses.replace(config, lds=dataclasses.replace(config.lds, split=False))
        device = load_device(args.device or config.device)
    except ConfigError as exc:
        fail(str(exc))
    settings = {"device": dataclasses.asdict(device), "headroom": config.headroom,
                "lds": dataclasses.asdict(config.lds), "equal_fallback": config.equal_fallback,
                "command": "physis-sim " + " ".join(argv if argv is not None else sys.argv[1:])}
    out: dict = {"settings": settings}
    t0 = time.perf_counter()

    if args.scenario:
        if args.scenario in ("report24", "sweep", "timing1024", "all") and "report24" not in config.scenarios:
            fail("the scheduling config has no scenarios.report24 SLO table")
        profiles = load_profiles(list(config.scenarios["report24"]), device, paths)
        if args.scenario in ("report24", "all"):
            rep = report24(config, device, profiles, devices=args.devices)
            out["scenarios"] = rep["scenarios"]
            out["calibrated_setting"] = rep["calibrated_setting"]
            out["report_setting"] = stated = rep["report_setting"]
            groups = ", ".join(f"{m} {g}" for m, g in stated["equal_groups"].items())
            print(f"report24, the report's setting: {device.name} x {stated['devices']}, SLO {stated['slo_ms']:g} ms "
                  f"for every backbone, equal groups fixed to the report's ({groups}), headroom {config.headroom:g}")
            _table(stated["scenarios"])
            print(f"W_ms: {stated['workload_basis']}.")
            _implied(stated)
            print(f"\nreport24, calibrated: {device.name} x {rep['scenarios'][0]['devices']}, SLO per backbone from "
                  f"config scenarios.report24, equal group = the smallest meeting the SLO, "
                  f"headroom {config.headroom:g}")
            _table(rep["scenarios"])
        if args.scenario in ("sweep", "all"):
            rows = slo_sweep(config, device, list(config.scenarios["report24"]), SWEEP_X, args.devices, profiles)
            out["sweep"] = rows
            print(f"\nSLO sweep on {args.devices} devices (x = devices of compute one stream needs):")
            print(f"{'model':<14} {'x':>5} {'slo_ms':>10} {'group':>5} {'equal':>6} {'joint':>6} {'ratio':>6}")
            for r in rows:
                print(f"{r['model']:<14} {r['x']:>5} {r['slo_ms']:>10.1f} {r['equal_group_size'] or '-':>5} "
                      f"{r['admitted']['equal']:>6} {r['admitted']['joint']:>6} {r['ratio'] or '-':>6}")
            ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
            wall, cpu = pooled(rows), pooled(rows, "decision_cpu_ms")
            totals = {p: sum(r["admitted"][p] for r in rows) for p in ("joint", "equal")}
            out["sweep_summary"] = {"settings": len(rows), "joint_ge_equal": sum(x >= 1 for x in ratios),
                                    "min_ratio": min(ratios), "admitted_total": totals,
                                    "placement_ms": wall, "placement_cpu_ms": cpu}
            print(f"sweep: admitted in total joint {totals['joint']}, equal {totals['equal']}; "
                  f"joint >= equal in {sum(x >= 1 for x in ratios)}/{len(ratios)} settings; "
                  f"min ratio {min(ratios):.3f}; {wall['decisions']} decisions on {args.devices} devices: "
                  f"wall p99 {wall['p99']:.3f} ms (max {wall['max']:.3f}), cpu p99 {cpu['p99']:.3f} ms "
                  f"(max {cpu['max']:.3f})")
        if args.scenario in ("timing1024", "all"):
            tim = timing1024(config, device, profiles)
            out["timing1024"] = tim
            print("\n1024 devices (placement decision wall time, ms):")
            _table([tim["mixed"], tim["single"]])
            for name in ("mixed", "single"):
                j = tim[name]["joint"]
                print(f"  {name}: {j['arrivals']} decisions, p50 {j['placement_ms']['p50']:.3f}, "
                      f"p99 {j['placement_ms']['p99']:.3f}, max {j['placement_ms']['max']:.3f} ms; "
                      f"cpu p99 {j['placement_cpu_ms']['p99']:.3f} ms")
    else:
        if not args.models or not args.slo_ms:
            fail("give --scenario, or --models and --slo-ms")
        models = [m for m in args.models.split(",") if m]
        unknown = [m for m in models if m not in preset_names()]
        if unknown:
            fail(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(preset_names())}")
        if len(slo_values) not in (1, len(models)):
            fail(f"--slo-ms: give one value or one per model ({len(models)})")
        slos = {m: slo_values[0] if len(slo_values) == 1 else slo_values[i] for i, m in enumerate(models)}
        try:
            profiles = {}
            for m in dict.fromkeys(models):
                cfg = load_model_config(m)
                if m in paths:
                    profiles[m] = load_profile(paths[m], cfg)
                elif args.measure and device.name == "cpu":
                    profiles[m] = measure_profile(m)
                else:
                    profiles[m] = get_profile(cfg, device)
        except ConfigError as exc:
            fail(str(exc))
        workload = Workload(models, slos, seed=args.seed, latency_slo_ms=args.latency_slo_ms)
        patience = args.patience or (1 if len(set(models)) == 1 else 20)

        def show(d):
            if args.verbose:
                state = "admit " if d.admitted else "REJECT"
                print(f"  {state} {d.request.stream:<22} {d.decision_ms:7.3f} ms  "
                      f"{d.detail if d.admitted else d.reason + ': ' + d.detail}")

        if args.policy == "both":
            res = compare(device, args.devices, profiles, workload, config, arrivals=args.arrivals, patience=patience)
            out["scenarios"] = [res]
            _table([res])
            if args.verbose:
                print("(run with --policy joint or equal to see each decision)")
        else:
            res = run_policy(args.policy, device, args.devices, profiles, workload, config,
                             arrivals=args.arrivals, patience=patience, on_decision=show)
            out["result"] = res
            print(f"{args.policy}: admitted {res['admitted']} of {res['arrivals']} arrivals "
                  f"{res['admitted_by_model']}; rejections {res['rejections']}; placement p99 "
                  f"{res['placement_ms']['p99']:.3f} ms; utilisation mean "
                  f"{res['cluster']['utilisation_mean_used']:.3f} on {res['cluster']['devices_used']} devices")
        for m, p in profiles.items():
            print(f"  profile {m}: {p.source}, chunk {p.chunk_ms():.3f} ms, hop {p.hop_ms:.4f} ms")
    out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
