"""Cost profiles: the roofline model (labelled modelled) and the physis-profile JSON (measured)."""

import json

import pytest

from physis_ros.config import ConfigError
from physis_ros.model import load_model_config
from physis_ros.runtime.costs import load_profile
from physis_ros.scheduling.profiles import get_profile, roofline_ms, roofline_profile, shipped_profile_path
from physis_ros.scheduling.settings import load_device, load_scheduling


def test_roofline_is_labelled_modelled_and_follows_the_formula():
    dev = load_device("h200")
    cfg = load_model_config("wan2.1-1.3b")
    prof = roofline_profile(cfg, dev)
    assert prof.source == "roofline-model:h200" and prof.modelled
    t = cfg.tokens_per_chunk
    video, text, d = 3 * 30 * 52, 512, cfg.hidden      # Wan2.1 1.3B: 3 latent frames of 60x104, patch 2
    assert t == video + text and cfg.block_params() == 46_440_704
    cross_kv = 2 * (d * d + d)                          # the text's K and V projections, over the text tokens
    flops = (2 * (cfg.block_params() - cross_kv) * video + 2 * cross_kv * text
             + 4 * video * (video + 2 * video) * d + 4 * video * text * d)   # window 2, no sink; cross-attention
    assert cfg.spec.block_flops == flops
    expected = flops / (989e12 * 0.6) * 1e3 + 0.030  # compute-bound at 4680 video tokens, + launch overhead
    assert prof.time_ms((4, 0), 1) == pytest.approx(expected, rel=1e-9)
    assert prof.notes["bound_at_batch_1"] == "compute"
    # memory from the shape: bf16 weights of one block, one KV slot per stage
    assert prof.block_weight_bytes == cfg.block_params() * 2
    assert prof.kv_bytes == cfg.kv_slot_bytes()
    assert prof.hop_ms == pytest.approx(t * cfg.hidden * 2 / 450e9 * 1e3 + 0.010)


def test_batching_reads_weights_once():
    """Memory-bound (tiny) blocks gain from batching in the roofline; compute-bound ones scale ~linearly."""
    dev = load_device("h200")
    tiny = load_model_config("tiny-wam")
    assert roofline_ms(tiny, dev, 4) < 2 * roofline_ms(tiny, dev, 1)
    big = load_model_config("wan2.1-14b")
    assert roofline_ms(big, dev, 4) == pytest.approx(4 * roofline_ms(big, dev, 1), rel=0.02)


def test_physis_profile_json_is_accepted(tmp_path):
    cfg = load_model_config("tiny-wam")
    data = {"model": "tiny-wam", "device": "cpu", "source": "measured:host1", "batch_sizes": [1, 2],
            "stage_ms": {f"{k},{b}": {"1": 0.5, "2": 0.7} for k in range(1, 5) for b in range(8)},
            "hop_ms": 0.2, "hidden_bytes": 1000, "overhead_ms_per_call": 0.05}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    prof = load_profile(path, cfg)
    assert prof.source == "measured:host1" and not prof.modelled
    assert prof.time_ms((4, 0), 1) == pytest.approx(0.55)   # loop overhead per forward included
    assert prof.time_ms((4, 0), 2) == pytest.approx(0.75)
    assert prof.time_ms((4, 0), 3) == pytest.approx(0.95)   # interpolated
    assert prof.hidden_bytes == 1000 and prof.kv_bytes == cfg.kv_slot_bytes()


@pytest.mark.parametrize("change, key", [
    ({"model": "tiny-acwm"}, "model"),
    ({"source": "guess"}, "source"),
    ({"stage_ms": {"4,0": {"1": 0.5}}}, "stage_ms"),
    ({"stage_ms": {"x": {"1": 0.5}}}, "stage_ms.x"),
])
def test_bad_profiles_name_the_key(tmp_path, change, key):
    data = {"model": "tiny-wam", "source": "measured:h", "hop_ms": 0.1,
            "stage_ms": {f"{k},{b}": {"1": 0.5} for k in range(1, 5) for b in range(8)}}
    data.update(change)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_profile(path, load_model_config("tiny-wam"))
    assert info.value.key == key


def test_shipped_tiny_profile_is_measured_and_paper_presets_are_modelled():
    cpu = load_device("cpu")
    path = shipped_profile_path("tiny-wam", "cpu")
    assert path.is_file()
    prof = get_profile(load_model_config("tiny-wam"), cpu)
    assert prof.source.startswith("measured:")
    assert get_profile(load_model_config("h3-33b"), load_device("h200")).source == "roofline-model:h200"


def test_scheduling_config_loads_and_validates(tmp_path):
    cfg = load_scheduling()
    assert 0 <= cfg.headroom < 1 and cfg.lds.discrepancies >= 1
    assert set(cfg.scenarios["report24"]) == {"wan2.1-1.3b", "wan2.2-5b", "wan2.1-14b", "ltx-22b", "h3-33b"}
    bad = tmp_path / "s.yaml"
    bad.write_text("headroom: 0.1\nlds:\n  discrepancis: 2\n")
    with pytest.raises(ConfigError) as info:
        load_scheduling(bad)
    assert info.value.key == "lds.discrepancis"
    bad.write_text("headroom: 1.5\n")
    with pytest.raises(ConfigError) as info:
        load_scheduling(bad)
    assert info.value.key == "headroom"
