"""The history rules (issue 54, docs/history.md): the cached reference (what every server plan equals bit for
bit) against the full recompute (every chunk's whole history run again as one masked sequence, no cache), for
both rules, windows with and without a sink, and both built-in heads."""

from dataclasses import replace

import pytest
import torch

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.recompute import RecomputeRollout, chunk_mask, visible
from physis_ros.reference import ReferenceRollout

CHUNKS = 5
TOL = 1e-5      # float rounding only (2.4e-7 measured): attention reduces over another key order and length


def small(name: str, **changes):
    """A preset made small enough to recompute its whole history within the suite's budget."""
    return build_model(replace(load_model_config(name), blocks=3, steps=3, **changes))


def rollouts(model, history=None, chunks=CHUNKS):
    if history is not None:
        model.config = replace(model.config, history=history)
    scene = SyntheticScene(model.config.observation_shapes)
    ref, full = ReferenceRollout(model, seed=3), RecomputeRollout(model, seed=3, stream="r0")
    cached, recomputed = [], []
    for c in range(chunks):
        obs = scene.observation("r0", c)
        cached.append(ref.step("r0", obs).output)
        recomputed.append(full.step(model.observation_tensors(obs)))
    return cached, recomputed


@pytest.mark.parametrize("rule", ["same_step", "clean"])
@pytest.mark.parametrize("name, window, sink", [("tiny-wam", 1, False), ("tiny-wam", 2, True),
                                                ("tiny-acwm", 2, False)])
def test_the_cached_reference_equals_the_full_recompute(rule, name, window, sink):
    cached, recomputed = rollouts(small(name, window=window, sink=sink, history=rule))
    for c, (a, b) in enumerate(zip(cached, recomputed)):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (rule, c, (a - b).abs().max().item())


def test_the_rule_decides_what_later_chunks_compute():
    """Chunk 0 reads no history and is the same under both rules; every later chunk differs (by ~1e-3 in this
    random-init model, 100 times TOL), and a recompute
    under the other rule (or another window) does not match the cache: the comparison above can fail."""
    model = small("tiny-wam", window=2, sink=True)
    same, _ = rollouts(model, "same_step")
    clean, _ = rollouts(model, "clean")
    assert torch.equal(same[0], clean[0])
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(same[1:], clean[1:]))
    scene = SyntheticScene(model.config.observation_shapes)
    for rule, window in (("same_step", 2), ("clean", 1)):
        wrong = RecomputeRollout(model, seed=3, stream="r0", history=rule)
        wrong.model.config = replace(model.config, window=window)
        outs = [wrong.step(model.observation_tensors(scene.observation("r0", c))) for c in range(4)]
        model.config = replace(model.config, window=2)
        assert (outs[3] - clean[3]).abs().max() > 1e-4


def test_the_clean_rule_writes_history_only_in_its_clean_pass():
    model = small("tiny-wam", window=2, sink=False, history="clean")
    scene = SyntheticScene(model.config.observation_shapes)
    ref = ReferenceRollout(model, seed=0)
    for c in range(3):
        ref.step("r0", scene.observation("r0", c))
    tables = ref._stream_tables("r0")  # noqa: the reference's own state, read by its test
    assert [t.slots for t in tables] == [1] * 3
    assert [t.chunks_written[0] for t in tables] == [3] * 3         # one clean pass per chunk, nothing per step
    assert [t.length[0] for t in tables] == [2 * model.config.tokens_per_chunk] * 3      # the window of 2


def test_masks_say_which_chunks_each_chunk_reads():
    assert [j for j in range(6) if visible(5, j, 2, False)] == [3, 4, 5]
    assert [j for j in range(6) if visible(5, j, 2, True)] == [0, 3, 4, 5]
    assert [j for j in range(2) if visible(1, j, 2, True)] == [0, 1]
    mask = chunk_mask(3, 2, 1, False, torch.device("cpu"))[0, 0]
    assert mask.int().tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                   [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]


def test_an_unknown_rule_is_refused_naming_the_field(tmp_path):
    text = (load_model_config.__globals__["presets_dir"]() / "tiny-wam.yaml").read_text()
    path = tmp_path / "m.yaml"
    path.write_text(text + "history: noisy\n")
    with pytest.raises(ConfigError) as exc:
        load_model_config(path)
    assert exc.value.key == "history" and "same_step" in str(exc.value) and "clean" in str(exc.value)



def test_a_schedule_is_data_an_explicit_grid_or_shift_and_steps():
    """issue 54 item 3: ``sigmas`` lists each step's noise level; the shifted uniform grid written out as a list
    is the same model bit for bit, another grid (WaveServe-like: shift 5, ending near 0.024) another one."""
    from physis_ros.model.timesteps import FlowMatchingTimesteps

    base = replace(load_model_config("tiny-wam"), blocks=2, timestep_shift=3.0)
    written = [float(x) for x in reversed(FlowMatchingTimesteps(base.steps, 3.0).t[1:].tolist())]
    listed = replace(base, timestep_shift=1.0, sigmas=written)
    wave = replace(base, timestep_shift=1.0, sigmas=[1.0, 0.8, 0.35, 0.024])
    outs = {}
    for name, cfg in (("shift", base), ("listed", listed), ("wave", wave)):
        scene = SyntheticScene(cfg.observation_shapes)
        ref = ReferenceRollout(build_model(cfg), seed=1)
        outs[name] = [ref.step("r0", scene.observation("r0", c)).output for c in range(3)]
    assert build_model(wave).timesteps.t.tolist() == pytest.approx([0.0, 0.024, 0.35, 0.8, 1.0])
    assert all(torch.equal(a, b) for a, b in zip(outs["shift"], outs["listed"]))
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(outs["shift"], outs["wave"]))


@pytest.mark.parametrize("sigmas, key, words", [([1.0, 0.5], "sigmas", "2 noise levels for 4 steps"),
                                                ([1.0, 0.5, 0.6, 0.1], "sigmas", "must decrease strictly"),
                                                ([1.5, 0.5, 0.3, 0.1], "sigmas", "within (0, 1]"),
                                                ([1.0, 0.5, 0.3, 0.0], "sigmas", "within (0, 1]")])
def test_a_bad_grid_is_refused_naming_the_field(tmp_path, sigmas, key, words):
    text = (load_model_config.__globals__["presets_dir"]() / "tiny-wam.yaml").read_text()
    path = tmp_path / "m.yaml"
    path.write_text(text + f"sigmas: {sigmas}\n")
    with pytest.raises(ConfigError) as exc:
        load_model_config(path)
    assert exc.value.key == key and words in str(exc.value)


@pytest.mark.parametrize("name, window, groups", [("tiny-wam", 3, 1), ("tiny-wam", 3, 2), ("tiny-acwm", 2, 1)])
def test_latest_the_cached_reference_equals_the_recompute_of_each_version(name, window, groups):
    """The latest rule (issue 54): the reference's per-step slots and gathered (slot, back) reads against the
    recompute, which derives every chunk's version at every step again from its state then (no cache)."""
    cached, recomputed = rollouts(small(name, window=window, history="latest", history_groups=groups))
    for c, (a, b) in enumerate(zip(cached, recomputed)):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (c, (a - b).abs().max().item())


def test_latest_reads_the_same_step_for_one_chunk_back_and_later_steps_further_back():
    """latest_version: chunk c-1 at the same step; with G = 1 chunk c-2 one step later (less noisy), and past
    the last step the clean pass (0); G = 2 keeps c-2 at the same step. With a window of one chunk latest is
    same_step (the rules agree); with three they differ from chunk 2 on, and from clean from chunk 1 on."""
    cfg = replace(load_model_config("tiny-wam"), steps=4, window=3, history="latest")
    assert [cfg.latest_version(4, j) for j in (1, 2, 3)] == [4, 3, 2]
    assert [cfg.latest_version(1, j) for j in (1, 2, 3)] == [1, 0, 0]
    assert [replace(cfg, history_groups=2).latest_version(4, j) for j in (1, 2, 3)] == [4, 4, 3]
    one = small("tiny-wam", window=1)
    latest, _ = rollouts(one, "latest")
    same, _ = rollouts(one, "same_step")
    assert all(torch.equal(a, b) for a, b in zip(latest, same))
    three = small("tiny-wam", window=3)
    latest, _ = rollouts(three, "latest")
    same, _ = rollouts(three, "same_step")
    clean, _ = rollouts(three, "clean")
    assert torch.equal(latest[1], same[1]) and not torch.equal(latest[2], same[2])
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(latest[1:], clean[1:]))


def test_latest_takes_no_sink():
    with pytest.raises(ConfigError) as err:
        from physis_ros.config import from_mapping, to_mapping
        from physis_ros.model.spec import ModelConfig

        from_mapping(ModelConfig, {**to_mapping(load_model_config("tiny-wam")), "history": "latest", "sink": True})
    assert err.value.key == "sink"

