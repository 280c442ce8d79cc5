"""``physis-profile --plan-workers``: the planner's partition and prediction per worker count."""

import dataclasses
import json

import yaml

from physis_ros.cli import profile as profile_cli
from physis_ros.config import to_mapping
from physis_ros.model import load_model_config
from physis_ros.runtime.plans import pipeline_order
from physis_ros.runtime.costs import CostProfile, profile_from_json


def test_plan_report_covers_every_worker_count_and_mode():
    cfg = dataclasses.replace(load_model_config("tiny-wam"), blocks=4, steps=2)
    stage_ms = {s: {1: 1.0, 2: 1.2, 4: 1.6} for s in pipeline_order(cfg.steps, cfg.blocks)}
    prof = CostProfile(cfg.name, "cuda", "measured:synthetic", cfg.steps, cfg.blocks, stage_ms, hop_ms=0.05,
                       block_weight_bytes=0, kv_bytes=0, hidden_bytes=1000)
    rows = profile_cli.plan_report(cfg, prof, [1, 3, 20], 4, "cuda")
    assert [(r["workers"], r["batching"]) for r in rows] == [
        (w, b) for w in (1, 3, 20) for b in ("off", "on", "adaptive")]
    by = {(r["workers"], r["batching"]): r for r in rows}
    assert by[(1, "off")]["predicted_interval_ms"] > by[(1, "on")]["predicted_interval_ms"]  # overhead-bound
    assert by[(20, "off")]["workers_used"] <= 8  # more workers than stages: at most one stage each
    assert by[(20, "off")]["predicted_interval_ms"] < by[(1, "off")]["predicted_interval_ms"]


def test_cli_writes_the_plans_into_the_profile_json(tmp_path):
    out, model = tmp_path / "p.json", tmp_path / "small.yaml"
    small = dataclasses.replace(load_model_config("tiny-wam"), name="small", blocks=2, steps=2)
    model.write_text(yaml.safe_dump(to_mapping(small)))
    assert profile_cli.main(["--model", str(model), "--repeats", "2", "--corun", "0", "--plan-workers", "1,2",
                             "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert profile_from_json(data, small).stage_ms.keys() == set(pipeline_order(2, 2))
    assert len(data["plans"]) == 6 and all(p["predicted_interval_ms"] > 0 for p in data["plans"])
