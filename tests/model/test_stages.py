"""Stage-by-stage execution through the interface versus the sequential reference."""

import pytest
import torch

from physis_ros.model import KVBatch
from physis_ros.model.stages import chunk_input, run_stage
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout


def stagewise(model, streams, chunks, batched=False):
    cfg = model.config
    scene = SyntheticScene(cfg.observation_shapes)
    # One table per block, one slot per (stream, step), as a worker lays it out.
    tables = [model.new_kv_table(b, cfg.steps * len(streams)) for b in range(cfg.blocks)]
    out = {s: [] for s in streams}
    for c in range(chunks):
        states = [chunk_input(model.observation_tensors(scene.observation(s, c)), model.noise(0, s, c))
                  for s in streams]
        for k in range(cfg.steps, 0, -1):
            for b in range(cfg.blocks):
                slots = [i * cfg.steps + k - 1 for i in range(len(streams))]
                if batched:
                    states = run_stage(model, b, [k] * len(streams), states, KVBatch(tables[b], slots))
                else:
                    states = [run_stage(model, b, [k], [st], KVBatch(tables[b], [slot]))[0]
                              for st, slot in zip(states, slots)]
        for s, st in zip(streams, states):
            out[s].append(st["x"][0])
    return out


@pytest.mark.parametrize("model_name", ["tiny_wam", "tiny_acwm"])
def test_stagewise_is_bit_identical_to_reference(model_name, request):
    model = request.getfixturevalue(model_name)
    chunks = 3 * model.config.window + 1
    got = stagewise(model, ["a", "b"], chunks)
    scene = SyntheticScene(model.config.observation_shapes)
    for r in reference_rollout(model, scene.observation, ["a", "b"], chunks):
        assert torch.equal(got[r.stream][r.index], r.output), (r.stream, r.index)


def test_batched_streams_match_within_tolerance(tiny_wam):
    chunks = 7
    got = stagewise(tiny_wam, ["a", "b", "c"], chunks, batched=True)
    scene = SyntheticScene(tiny_wam.config.observation_shapes)
    for r in reference_rollout(tiny_wam, scene.observation, ["a", "b", "c"], chunks):
        diff = (got[r.stream][r.index] - r.output).abs().max().item()
        assert diff <= 1e-5 * r.output.abs().max().item(), (r.stream, r.index, diff)


def test_mixed_steps_in_one_batch(tiny_wam):
    # Two tasks of block 0 at different steps (and cache lengths) in one call.
    model, cfg = tiny_wam, tiny_wam.config
    scene = SyntheticScene(cfg.observation_shapes)
    table = model.new_kv_table(0, cfg.steps)
    table_ref = model.new_kv_table(0, cfg.steps)
    for slot in (1,):
        kv = torch.randn(cfg.tokens_per_chunk, cfg.heads, cfg.head_dim)
        table.append(slot, kv, kv)
        table_ref.append(slot, kv, kv)
    states = [chunk_input(model.observation_tensors(scene.observation("a", 0)), model.noise(0, "a", 0)),
              chunk_input(model.observation_tensors(scene.observation("b", 0)), model.noise(0, "b", 0))]
    batched = run_stage(model, 0, [4, 2], states, KVBatch(table, [3, 1]))
    single = [run_stage(model, 0, [4], [states[0]], KVBatch(table_ref, [3]))[0],
              run_stage(model, 0, [2], [states[1]], KVBatch(table_ref, [1]))[0]]
    for got, want in zip(batched, single):
        assert torch.allclose(got["h"], want["h"], rtol=0, atol=1e-5 * want["h"].abs().max().item())
    assert table.length == table_ref.length
