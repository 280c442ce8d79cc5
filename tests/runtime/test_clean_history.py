"""The clean and latest history rules served by the engine and real workers (issue 54): a row 0 of clean-pass stages
after each chunk's last step writes the K/V every later chunk reads; one chunk in flight per stream; a
block's stages on one worker. Bit for bit the sequential reference (physis_ros/reference.py, itself held to
the full recompute in tests/model/test_history.py)."""

from dataclasses import replace

import numpy as np
import pytest

from physis_ros.config import ConfigError
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout
from physis_ros.runtime.offline import run_chunks
from physis_ros.runtime.planner import choose_plan, predict, resolve_plan
from physis_ros.runtime.plans import make_plan, pipeline_order
from physis_ros.runtime.profiler import measure_profile
from physis_ros.runtime.settings import EngineConfig

pytestmark = pytest.mark.slow   # starts worker processes: not in `make test-fast`

STREAMS = ["robot0", "robot1"]


def clean_model(name: str = "tiny-wam"):
    return replace(load_model_config(name), history="clean")


@pytest.mark.parametrize("rule", ["clean", "latest"])
@pytest.mark.parametrize("name, plan, workers", [("tiny-wam", "sequential", 1), ("tiny-wam", "block", 2),
                                                 ("tiny-acwm", "block", 3), ("tiny-wam", "step", 1),
                                                 ("tiny-wam", "stage", 1)])
def test_served_bit_for_bit_as_the_reference(rule, name, plan, workers):
    """clean: a row 0 of clean-pass stages writes the one slot per block every step reads; latest (window 3):
    each step writes its own slot, the clean pass slot 0, and a stage reads chunk c-j from the slot of the step
    latest_version names. Both bit for bit as the reference; their chunks differ from same_step's after the
    first (clean) or once chunk c-2 is read a step later (latest)."""
    cfg = clean_model(name) if rule == "clean" else replace(load_model_config(name), history="latest", window=3,
                                                                 sink=False)
    chunks = 5
    scene = SyntheticScene(cfg.observation_shapes)
    out = run_chunks(cfg, EngineConfig(plan=plan, workers=workers, heartbeat_timeout_s=20.0), STREAMS, chunks,
                     scene.observation)
    ref = {(r.stream, r.index): r.output.numpy()
           for r in reference_rollout(build_model(cfg), scene.observation, STREAMS, chunks)}
    same = {(r.stream, r.index): r.output.numpy() for r in reference_rollout(
        build_model(replace(cfg, history="same_step")), scene.observation, STREAMS, chunks)}
    first_different = 1 if rule == "clean" else 2
    for s in STREAMS:
        assert [o.chunk for o in out[s]] == list(range(chunks))
        for o in out[s]:
            assert np.array_equal(o.output, ref[(s, o.chunk)]), (s, o.chunk)
            assert o.chunk < first_different or not np.array_equal(o.output, same[(s, o.chunk)])   # the rule served
            assert len(o.record.stage_ms) == (cfg.steps + 1) * cfg.blocks          # the clean pass ran too


def test_plans_that_split_a_block_are_refused_naming_the_plan():
    """On one worker the step and stage plans keep every block together (served above); on two they split one."""
    cfg = clean_model()
    for plan in ("step", "stage"):
        with pytest.raises(ConfigError) as exc:
            resolve_plan(cfg, EngineConfig(plan=plan, workers=2))
        assert exc.value.key == "engine.plan" and "clean history rule" in str(exc.value)
        assert f"plan '{plan}' puts block 0 on workers [0, 1]" in str(exc.value)


def test_the_planner_predicts_one_chunk_in_flight_over_every_stage_and_the_clean_row():
    """Chunk c cannot start before chunk c-1's clean pass wrote what it reads: the interval is a whole chunk's
    stages, the clean row included ((steps + 1) x blocks forwards), whatever the plan."""
    cfg = clean_model()
    profile = measure_profile(cfg, "cpu")
    assert profile.clean and len(profile.order) == (cfg.steps + 1) * cfg.blocks == len(pipeline_order(
        cfg.steps, cfg.blocks, True))
    one = predict(make_plan("sequential", cfg.steps, cfg.blocks, 1, clean=True), profile)
    assert one.plan.in_flight(False, 4) == 1
    assert one.interval_ms == pytest.approx(sum(profile.time_ms(s) for s in profile.order) + profile.engine_ms,
                                            rel=0.05)
    best = choose_plan(cfg.steps, cfg.blocks, 2, profile)
    assert best.plan.clean and best.plan.name == "block"
    same = predict(make_plan("sequential", cfg.steps, cfg.blocks, 1), replace(profile, clean=False))
    assert one.interval_ms > same.interval_ms     # the clean row costs a step's worth more


@pytest.mark.parametrize("rule", ["clean", "latest"])
def test_a_clean_model_is_admitted_on_one_worker_and_served_through_the_server_api(tmp_path, rule):
    """Admission places a clean (or latest) model's chunk as one rank on one worker (its stages run one after
    another), sizes its K/V one slot per block (latest: per step and the clean pass's), and the Server API serves
    it bit for bit as the reference."""
    import time

    import yaml

    from physis_ros.model.spec import presets_dir
    from physis_ros.reference import ReferenceRollout
    from physis_ros.serving import Server
    from physis_ros.serving.tensors import preprocess

    data = yaml.safe_load((presets_dir() / "tiny-wam.yaml").read_text())
    path = tmp_path / f"tiny-wam-{rule}.yaml"
    path.write_text(yaml.safe_dump({**data, "name": f"tiny-wam-{rule}", "history": rule, "sink": False}))
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(5)]
    states = [rng.uniform(-1, 1, 7) for _ in range(5)]
    config = {"model": str(path), "deterministic": True, "engine": {"workers": 2}}
    with Server.from_config(config) as server:
        session = server.join("r0", joint_names=[f"j{i}" for i in range(7)])
        placed = server.streams()["r0"]
        t0 = time.time()
        for c in range(5):
            session.observe(images={"camera": frames[c]}, state=states[c], stamp_s=t0 + 0.01 * c)
        chunks = [session.next_chunk(timeout_s=60.0) for _ in range(5)]
        seed = server.config.engine.seed
    assert len(placed["workers"]) == 1, placed
    ref = ReferenceRollout(build_model(str(path)), seed=seed)
    for c, chunk in enumerate(chunks):
        obs = {"image": preprocess(frames[c], "rgb8", 32, 3, "center_crop"), "state": states[c].astype(np.float32)}
        assert chunk.index == c and np.array_equal(chunk.actions, ref.step("r0", obs).output.numpy()), c


def test_an_explicit_noise_grid_reaches_the_workers():
    """A model's sigmas travel with its config to every worker: two workers on a block plan, same_step, equal
    to the reference bit for bit (and not to the default grid)."""
    cfg = replace(load_model_config("tiny-wam"), sigmas=[1.0, 0.8, 0.35, 0.024])
    scene = SyntheticScene(cfg.observation_shapes)
    out = run_chunks(cfg, EngineConfig(plan="block", workers=2, heartbeat_timeout_s=20.0), STREAMS[:1], 3,
                     scene.observation)
    ref = [r.output.numpy() for r in reference_rollout(build_model(cfg), scene.observation, STREAMS[:1], 3)]
    plain = [r.output.numpy() for r in reference_rollout(build_model(replace(cfg, sigmas=None)), scene.observation,
                                                         STREAMS[:1], 3)]
    assert all(np.array_equal(o.output, ref[o.chunk]) for o in out["robot0"])
    assert not np.array_equal(out["robot0"][1].output, plain[1])
