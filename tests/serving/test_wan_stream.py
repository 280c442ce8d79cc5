"""A Wan directory served as a stream beside tiny-wam through the Server API (issue 55, last step): its
prompt embeddings read from a file when it joins, a chunk per control step on its timeline (every input from a
file), the frames [C, F, H, W] bit for bit the sequential reference's for the same chunks, published [F, C,
H, W]; bad files refused naming the key before any capacity is looked at."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from physis_ros.model import build_model, load_model_config
from physis_ros.reference import ReferenceRollout
from physis_ros.serving import Rejected, Server

from tiny_wan import save_tiny_wan

pytestmark = pytest.mark.slow   # starts worker processes

ROOT = Path(__file__).resolve().parents[2]
PROFILES = str(ROOT / "config" / "profiles")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_stream")
    save_tiny_wan(root / "tiny-wan", num_layers=2)
    (root / "tiny-wan" / "physis_model.yaml").write_text(yaml.safe_dump({
        "steps": 2, "window": 1, "wan": {"frames": 1, "height": 4, "width": 4, "text_tokens": 5}}))
    save_file({"prompt_embeds": torch.randn(1, 5, 16)}, root / "prompt.safetensors")
    save_file({"prompt_embeds": torch.randn(1, 6, 16)}, root / "long.safetensors")
    save_file({"other": torch.randn(1, 5, 16)}, root / "other.safetensors")
    return root


def test_a_wan_stream_beside_tiny_wam_equals_the_reference(wan):
    directory, prompt = str(wan / "tiny-wan"), str(wan / "prompt.safetensors")
    config = {"model": "tiny-wam", "engine": {"workers": 2}, "admission": {"profiles": PROFILES},
              "deterministic": True}
    with Server.from_config(config) as server:
        for inputs, words in (({"prompt_embeds": str(wan / "long.safetensors")}, "takes float [5, 16]"),
                              ({"prompt_embeds": str(wan / "other.safetensors")}, "holds no tensor 'prompt_embeds'"),
                              ({"prompt_embeds": str(wan / "missing.safetensors")}, "No such file"),
                              ({"image": prompt, "prompt_embeds": prompt}, "model 'tiny-wan' takes no input 'image'"),
                              ({}, "inputs: {prompt_embeds: FILE.safetensors}")):
            with pytest.raises(Rejected) as err:
                server.join("bad", model=directory, joint_names=["j0"], control_rate_hz=5.0, inputs=inputs)
            assert err.value.reason in ("invalid-request", "model-mismatch") and words in err.value.detail, err.value
            assert "streams.bad.inputs" in err.value.detail
        robot = server.join("r0", model="tiny-wam", joint_names=[f"j{i}" for i in range(7)])
        video = server.join("wan0", model=directory, joint_names=["j0"], control_rate_hz=5.0,
                            inputs={"prompt_embeds": prompt})
        with pytest.raises(RuntimeError, match="from its source"):
            video.observe(state=np.zeros(1))
        frame = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        robot.observe(images={"camera": frame}, state=np.zeros(7), stamp_s=time.time())
        chunks = [video.next_chunk(timeout_s=60.0) for _ in range(3)]
        assert robot.next_chunk(timeout_s=60.0).actions.shape == (16, 7)
        served = server.streams()
        assert served["wan0"]["model"] == "tiny-wan" and served["r0"]["model"] == "tiny-wam"
        assert served["wan0"]["slo_interval_ms"] == pytest.approx(200.0)   # one chunk per step at 5 Hz
        server.leave("wan0")
    model = build_model(load_model_config(directory))
    ref = ReferenceRollout(model, seed=0)
    from safetensors.numpy import load_file

    embeds = load_file(prompt)["prompt_embeds"][0]
    for got in chunks:
        expected = ref.step("wan0", {"prompt_embeds": embeds}).output.numpy()
        assert got.output.shape == (4, 1, 4, 4) and got.actions is None
        assert np.array_equal(got.output, expected), got.index
        assert np.array_equal(got.frames, expected.swapaxes(0, 1)) and got.frames.shape == (1, 4, 4, 4)
    assert [c.index for c in chunks] == [0, 1, 2]


def test_a_wan_wam_directory_joins_beside_a_robot_and_a_broken_one_is_refused(tmp_path):
    """A Wan world-action model's directory (transformer/, adapter files) through the Server API beside a
    tiny-wam robot: a directory whose adapter does not fit, and one no family reads, are refused naming the
    file; the good one's chunks carry actions [16, 7] and frames [F, C, H, W], each the sequential reference's
    part for the observations its source gave, bit for bit."""
    from physis_ros.model.wan_adapter import save_adapter

    root = tmp_path / "wam"
    save_tiny_wan(root / "transformer", num_layers=2)
    (root / "physis_model.yaml").write_text(yaml.safe_dump({
        "kind": "wan_wam", "steps": 2, "window": 2,
        "wan": {"frames": 2, "height": 4, "width": 4, "text_tokens": 0,
                "actions": {"horizon": 16, "dof": 7, "state_dim": 7, "image_size": 32, "image_patch": 8}}}))
    model = build_model(load_model_config(root))
    save_adapter(model, root)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("transformer", "physis_model.yaml", "adapter.safetensors"):
        (broken / name).symlink_to(root / name)
    (broken / "adapter.json").write_text((root / "adapter.json").read_text().replace('"dof": 7', '"dof": 6'))
    (tmp_path / "empty").mkdir()

    def source(c: int):
        rng = np.random.default_rng([c, 5])
        return {"image": rng.random((3, 32, 32), dtype=np.float32),
                "state": rng.standard_normal(7).astype(np.float32)}, time.time()

    joints = [f"j{i}" for i in range(7)]
    config = {"model": "tiny-wam", "engine": {"workers": 2}, "admission": {"profiles": PROFILES},
              "deterministic": True}
    with Server.from_config(config) as server:
        robot = server.join("r0", joint_names=joints)
        for directory, words in ((broken, "adapter.json: actions.dof is 6, but wan.actions.dof is 7"),
                                 (tmp_path / "empty", "is not a checkpoint directory")):
            with pytest.raises(Rejected) as err:
                server.join("bad", model=str(directory), joint_names=joints)
            assert err.value.reason == "unknown-model" and words in err.value.detail, err.value
        observed = {}

        def recorded(c: int):
            obs, stamp = source(c)
            observed[c] = obs
            return obs, stamp

        wam = server.join("wam", model=str(root), joint_names=joints, source=recorded)
        chunks = [wam.next_chunk(timeout_s=60.0) for _ in range(3)]
        frame = np.zeros((48, 64, 3), dtype=np.uint8)
        robot.observe(images={"camera": frame}, state=np.zeros(7), stamp_s=time.time())
        assert robot.next_chunk(timeout_s=60.0).actions.shape == (16, 7)
        assert set(server.streams()) == {"r0", "wam"}
        server.leave("wam")
    ref = ReferenceRollout(model, seed=0)
    spec = model.config.spec
    for c, got in enumerate(chunks):
        expected = ref.step("wam", observed[c]).output.numpy()
        assert got.index == c and got.actions.shape == (16, 7) and got.frames.shape == (2, 4, 4, 4)
        assert np.array_equal(got.actions, spec.actions_of(expected)), c
        assert np.array_equal(got.frames, spec.frames_of(expected)), c
