"""The simulator: joint never admits fewer streams than the equal split; report24 targets; physis-sim."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from physis_ros.cli.sim import main as sim_main
from physis_ros.scheduling.settings import load_scheduling
from physis_ros.scheduling.simulator import REPORT24_MODELS, Workload, compare

from sched_helpers import make_config


def test_report24_cli_meets_targets(tmp_path, capsys):
    out = tmp_path / "r24.json"
    assert sim_main(["--scenario", "report24", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["model"]: r for r in data["scenarios"]}
    assert set(REPORT24_MODELS) <= set(rows) and any(m.startswith("mixed:") for m in rows)
    for r in data["scenarios"]:
        assert {"model", "devices", "slo_ms", "admitted", "placement_ms_p99"} <= set(r)
        assert r["devices"] == 24
        assert r["admitted"]["joint"] >= r["admitted"]["equal"] > 0, r["model"]
        assert r["joint"]["all_meet_slo"] and r["joint"]["cluster"]["utilisation_max"] <= 1 - r["headroom"] + 1e-9
    for m in REPORT24_MODELS:
        assert rows[m]["equal_group_size"] > 1                      # the SLOs leave joint room to pack
        assert rows[m]["profile_source"][m] == "roofline-model:h200"
    for m in ("wan2.1-1.3b", "wan2.2-5b"):
        assert rows[m]["admitted"]["joint"] >= 1.7 * rows[m]["admitted"]["equal"]
    assert "wan2.1-14b" in capsys.readouterr().out                  # the table


@settings(max_examples=25, deadline=None)
@given(models=st.lists(st.sampled_from(REPORT24_MODELS), min_size=1, max_size=3, unique=True),
       xs=st.lists(st.floats(0.2, 4.5), min_size=3, max_size=3),
       devices=st.integers(1, 16), seed=st.integers(0, 100),
       headroom=st.sampled_from([0.0, 0.1, 0.2]), split=st.booleans())
def test_joint_never_admits_fewer_than_equal(h200_profiles, models, xs, devices, seed, headroom, split):
    """Every joint placement opens at most the equal split's group of fresh devices, and the
    split's own placement is the fallback, so joint admits at least every stream the split does."""
    dev, profiles = h200_profiles
    slos = {m: profiles[m].chunk_ms() / ((1 - headroom) * x) for m, x in zip(models, xs)}
    config = make_config(headroom, discrepancies=2, split=split)
    r = compare(dev, devices, profiles, Workload(models, slos, seed=seed), config, arrivals=60, patience=8)
    assert r["admitted"]["joint"] >= r["admitted"]["equal"]
    assert r["joint"]["all_meet_slo"]


def test_custom_setting_cli_and_tiny_cpu_profile(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert sim_main(["--devices", "8", "--models", "wan2.1-1.3b,ltx-22b", "--slo-ms", "185,590",
                     "--arrivals", "40", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["scenarios"]
    assert row["model"].startswith("mixed:") and row["admitted"]["joint"] >= row["admitted"]["equal"]
    assert sim_main(["--device", "cpu", "--devices", "2", "--models", "tiny-wam", "--slo-ms", "60",
                     "--policy", "joint", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "measured:" in text and "REJECT" in text


def test_shipped_config_drives_the_scenarios():
    cfg = load_scheduling()
    assert cfg.device == "h200" and cfg.equal_fallback
