"""physis-rollout --history / --tensors / --recompute (issue 54 item 4): any model under either rule, the
chunks and their initial noise written for comparison, the cached run equal to the full recompute."""

import json

import numpy as np
from safetensors.numpy import load_file

from physis_ros.cli.rollout import main


def rollout(tmp_path, name, *flags):
    out = tmp_path / f"{name}.safetensors"
    assert main(["--chunks", "3", "--streams", "2", "--tensors", str(out), "--json", str(tmp_path / f"{name}.json"),
                 *flags]) == 0
    return load_file(out), json.loads((tmp_path / f"{name}.json").read_text())


def test_history_override_tensors_and_recompute(tmp_path):
    same, same_meta = rollout(tmp_path, "same")
    clean, clean_meta = rollout(tmp_path, "clean", "--history", "clean")
    full, _ = rollout(tmp_path, "full", "--history", "clean", "--recompute")
    names = {f"{kind}.robot{s}.{c}" for kind in ("output", "noise") for s in (0, 1) for c in range(3)}
    assert set(same) == set(clean) == set(full) == names
    assert same["output.robot0.0"].shape == (16, 7) and same["output.robot0.0"].dtype == np.float32
    assert (same_meta["history"], clean_meta["history"]) == ("same_step", "clean")
    for key in names:
        if key.startswith("noise") or key.endswith(".0"):       # same noise; chunk 0 reads no history
            assert np.array_equal(same[key], clean[key]), key
        else:
            assert np.abs(same[key] - clean[key]).max() > 1e-4, key
        assert np.allclose(clean[key], full[key], atol=1e-5, rtol=0), key
    assert not np.array_equal(same["noise.robot0.1"], same["noise.robot1.1"])


def test_an_unknown_rule_is_a_usage_error(capsys):
    assert main(["--history", "noisy"]) == 2
    err = capsys.readouterr().err
    assert "--history" in err and "same_step" in err and "latest" in err


def test_latest_rolls_out_and_its_recompute_agrees(tmp_path):
    """physis-rollout --history latest (issue 54 item 4) on tiny-wam: the cached reference and the recompute
    write the same chunks; later chunks differ from same_step's."""
    runs = {}
    for name, flags in (("latest", ["--history", "latest"]), ("full", ["--history", "latest", "--recompute"]),
                        ("same", ["--history", "same_step"])):
        out = tmp_path / f"{name}.safetensors"
        assert main([*flags, "--chunks", "3", "--tensors", str(out)]) == 0
        runs[name] = load_file(str(out))
    for c in range(3):
        key = f"output.robot0.{c}"
        assert np.allclose(runs["latest"][key], runs["full"][key], atol=1e-5, rtol=0), key
    assert np.array_equal(runs["latest"]["output.robot0.1"], runs["same"]["output.robot0.1"])   # c-1: same step
    assert not np.array_equal(runs["latest"]["output.robot0.2"], runs["same"]["output.robot0.2"])
