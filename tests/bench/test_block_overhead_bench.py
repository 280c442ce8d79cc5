"""physis-bench block-overhead (issue 56) on a tiny random-init Wan trunk: our stage path and diffusers' own
block give the same fp32 output bit for bit, and the JSON holds every row with its pairs, ratio and spread;
bad flags are one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from physis_ros.cli.bench import main


@pytest.fixture()
def tiny(tmp_path):
    path = tmp_path / "tiny-random-wan.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny-random-wan", "kind": "wan", "steps": 2, "wan": {
        "frames": 2, "height": 4, "width": 4, "text_tokens": 3,
        "trunk": {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2, "ffn_dim": 24, "text_dim": 12,
                  "in_channels": 4}}}))
    return path


def test_the_stage_path_equals_diffusers_block_and_the_json_has_each_row(tiny, tmp_path):
    out = tmp_path / "bo.json"
    assert main(["block-overhead", "--presets", str(tiny), "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["fp32_equal"] is True and data["target"]["ratio_max"] == 1.05
    assert [(r["preset"], r["dtype"]) for r in data["rows"]] == [("tiny-random-wan", "fp32"), ("tiny-random-wan", "bf16")]
    for row in data["rows"]:
        assert row["video_tokens"] == 2 * 2 * 2 and row["text_tokens"] == 3 and row["frames"] == 2
        assert len(row["pairs"]) == 2 and all(o > 0 and d > 0 for o, d in row["pairs"])
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert row["h200_roofline_ms"] > 0
    assert data["rows"][0]["max_abs_diff"] == 0.0


@pytest.mark.parametrize("flags, says", [(["--dtypes", "fp64"], "--dtypes: fp64"),
                                         (["--presets", "tiny-wam"], "not a Wan trunk"),
                                         (["--repeats", "0"], "--repeats")])
def test_bad_flags_are_one_line_errors(tiny, capsys, flags, says):
    argv = ["block-overhead", "--presets", str(tiny), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("physis-bench: error:") and says in err[0], err


def test_the_benchmark_leaves_the_callers_torch_threads_as_they_were(tiny):
    import torch

    before = torch.get_num_threads()
    main(["block-overhead", "--presets", str(tiny), "--repeats", "1", "--threads", str(before + 1), "--dtypes", "fp32"])
    main(["block-overhead", "--presets", "tiny-wam", "--threads", str(before + 1)])     # refused after the set-up
    assert torch.get_num_threads() == before
