"""A Wan directory served by the engine and real worker processes (issue 55): each worker builds diffusers'
own blocks for the stages placed on it; chunks under ``same_step`` (stage plan, 2 workers) and ``clean``
(block plan, 2 workers) and on one worker equal the sequential reference bit for bit, which equals
diffusers' forward for chunk 0 and the full recompute after (tests/model/test_wan_model.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from physis_ros.model import build_model, load_model_config
from physis_ros.reference import reference_rollout
from physis_ros.runtime.offline import run_chunks
from physis_ros.runtime.settings import EngineConfig

from tiny_wan import save_tiny_wan

pytestmark = pytest.mark.slow   # starts worker processes: not in `make test-fast`

STREAMS = ["robot0", "robot1"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    model = save_tiny_wan(root / "tiny")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")     # an index and its shards
    return root / "tiny"


def source(stream: str, chunk: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([STREAMS.index(stream), chunk])
    return {"prompt_embeds": rng.standard_normal((5, 16)).astype(np.float32)}


@pytest.mark.parametrize("rule, plan, workers, layout", [("same_step", "sequential", 1, "tiny"),
                                                         ("same_step", "stage", 2, "sharded"),
                                                         ("clean", "block", 2, "sharded")])
def test_served_bit_for_bit_as_the_reference(directory, rule, plan, workers, layout):
    directory = directory.parent / layout
    (directory / "physis_model.yaml").write_text(yaml.safe_dump({
        "steps": 2, "window": 1, "history": rule, "wan": {"frames": 1, "height": 4, "width": 4, "text_tokens": 5}}))
    cfg = load_model_config(directory)
    chunks = 3
    out = run_chunks(cfg, EngineConfig(plan=plan, workers=workers, heartbeat_timeout_s=20.0), STREAMS, chunks,
                     source)
    ref = {(r.stream, r.index): r.output.numpy()
           for r in reference_rollout(build_model(cfg), source, STREAMS, chunks)}
    for s in STREAMS:
        assert [o.chunk for o in out[s]] == list(range(chunks))
        for o in out[s]:
            assert o.output.shape == (4, 1, 4, 4)
            assert np.array_equal(o.output, ref[(s, o.chunk)]), (s, o.chunk)
            assert len(o.record.stage_ms) == (cfg.steps + int(rule == "clean")) * cfg.blocks


def test_physis_rollout_plan_and_workers_write_what_the_reference_writes(directory, tmp_path):
    """physis-rollout --plan stage --workers 2 (issue 55 item 3): the tensors file equals the reference's."""
    from safetensors.torch import load_file, save_file

    from physis_ros.cli.rollout import main

    (directory / "physis_model.yaml").unlink(missing_ok=True)
    save_file({"prompt_embeds": torch.randn(1, 6, 16)}, tmp_path / "prompt.safetensors")
    common = ["--model", str(directory), "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--chunks", "3",
              "--frames", "2", "--height", "4", "--width", "4", "--steps", "2", "--window", "1"]
    assert main([*common, "--tensors", str(tmp_path / "ref.safetensors")]) == 0
    assert main([*common, "--plan", "stage", "--workers", "2", "--tensors", str(tmp_path / "served.safetensors")]) == 0
    ref, served = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "served.safetensors")
    assert set(ref) == set(served) == {"sigmas"} | {f"{k}.{c}" for k in ("noise", "output") for c in range(3)}
    for name in ref:
        assert torch.equal(ref[name], served[name]), name


def test_wan_wam_streams_of_one_checkpoint_share_batched_forwards(tmp_path):
    """Three streams of one Wan world-action model on one worker with batching on: their stages run in
    batched forwards of one block's weights (same-weight batching across streams), and every chunk equals the
    sequential reference within the fp32 tolerance of a batch (1e-5 of the largest value)."""
    cfg = load_model_config("tiny-wan-wam")
    streams = ["a", "b", "c"]

    def robots(stream: str, chunk: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([streams.index(stream), chunk, 9])
        return {"image": rng.random((3, 32, 32), dtype=np.float32), "state": rng.standard_normal(7).astype(np.float32)}

    chunks = 4
    out = run_chunks(cfg, EngineConfig(plan="sequential", workers=1, batching="on", heartbeat_timeout_s=20.0),
                     streams, chunks, robots)
    ref = {(r.stream, r.index): r.output.numpy()
           for r in reference_rollout(build_model(cfg), robots, streams, chunks)}
    batched = 0
    for s in streams:
        assert [o.chunk for o in out[s]] == list(range(chunks))
        for o in out[s]:
            want = ref[(s, o.chunk)]
            assert o.output.shape == want.shape == (16 * 7 + 4 * 2 * 8 * 8,)
            assert np.abs(o.output - want).max() <= 1e-5 * np.abs(want).max(), (s, o.chunk)
            batched += sum(b > 1 for b in o.record.batch_sizes)
    assert batched > 0, "no stage ran in a batch of more than one stream"
