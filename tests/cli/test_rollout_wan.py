"""physis-rollout --model DIR (issue 55 item 3) on a tiny Wan transformer diffusers writes in the test: the
tensors file lets anyone recompute a chunk with diffusers' own forward and the documented sampler, bit for
bit; the cached rollout equals the full recompute; bad inputs are one-line errors naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from physis_ros.cli.rollout import main

from tiny_wan import save_tiny_wan


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_rollout")
    model = save_tiny_wan(root / "model", seed=3, num_layers=2, rope_max_seq_len=16)
    save_file({"prompt_embeds": torch.randn(1, 5, 16)}, root / "prompt.safetensors")
    return model, root


def run(root, name, *flags):
    out, js = root / f"{name}.safetensors", root / f"{name}.json"
    assert main(["--model", str(root / "model"), "--prompt-embeds", str(root / "prompt.safetensors"), "--chunks", "3",
                 "--frames", "2", "--height", "4", "--width", "6", "--steps", "3", "--shift", "3",
                 "--tensors", str(out), "--json", str(js), *flags]) == 0
    return load_file(out), json.loads(js.read_text())


def test_a_chunk_recomputes_from_the_tensors_file_with_diffusers_forward(wan):
    model, root = wan
    tensors, meta = run(root, "cached", "--history", "clean", "--window", "1")
    assert set(tensors) == {"sigmas"} | {f"{k}.{c}" for k in ("noise", "output") for c in range(3)}
    assert tensors["noise.0"].shape == (1, 4, 2, 4, 6) and tensors["noise.0"].dtype == torch.float32
    sigmas = tensors["sigmas"].tolist()
    assert len(sigmas) == 4 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert meta["history"] == "clean" and len(meta["chunks"]) == 3
    prompt = load_file(root / "prompt.safetensors")["prompt_embeds"]
    x = tensors["noise.0"]
    with torch.no_grad():                     # the sampler as docs/models.md states it, on diffusers' forward
        for k in range(len(sigmas) - 1):
            t = torch.full((1,), 1000.0 * sigmas[k])
            x = x + (sigmas[k + 1] - sigmas[k]) * model(x, t, prompt, return_dict=False)[0]
    assert torch.equal(x, tensors["output.0"])
    full, _ = run(root, "full", "--history", "clean", "--window", "1", "--recompute")
    for c in range(3):
        assert torch.equal(full[f"noise.{c}"], tensors[f"noise.{c}"])
        assert torch.allclose(full[f"output.{c}"], tensors[f"output.{c}"], rtol=0, atol=2e-6)
    same, _ = run(root, "same")
    assert torch.equal(same["output.0"], tensors["output.0"]) and not torch.equal(same["output.1"], tensors["output.1"])


@pytest.mark.parametrize("flags, says", [
    ([], "--prompt-embeds: a Wan model needs its prompt embeddings"),
    (["--prompt-embeds", "{root}/bad.safetensors"], "prompt_embeds is torch.float32 [1, 5, 8]; the model takes"),
    (["--prompt-embeds", "{root}/prompt.safetensors", "--height", "5"], "--height 5: 5 is not a multiple of the trunk's patch 2"),
    (["--prompt-embeds", "{root}/prompt.safetensors", "--chunks", "9", "--frames", "2", "--recompute"], "past the model's RoPE table"),
    (["--prompt-embeds", "{root}/prompt.safetensors", "--window", "20"], "--window 20: 20 chunks of history"),
    (["--prompt-embeds", "{root}/prompt.safetensors", "--streams", "2"], "one stream"),
])
def test_bad_inputs_are_one_line_errors_naming_the_flag(wan, capsys, flags, says):
    _, root = wan
    save_file({"prompt_embeds": torch.randn(1, 5, 8)}, root / "bad.safetensors")
    argv = ["--model", str(root / "model"), "--chunks", "2", *[f.format(root=root) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("physis-rollout: error:") and says in err[0], err


def test_a_directory_that_is_not_a_wan_transformer_is_refused(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--prompt-embeds", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
