"""physis-serve serves a tiny Wan directory as a stream beside tiny-wam (issue 55): the Wan stream's prompt
embeddings come from a file named in the serve config, its chunks are published as PredictedFrames [F, C, H,
W], each equal to the sequential reference's chunk of the same index; the tiny-wam robot beside it gets its
action chunks."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
import yaml
from rclpy.qos import QoSProfile, ReliabilityPolicy
from safetensors.torch import save_file

from physis_ros.launcher import Child, serve_command, synthetic_command

from tiny_wan import save_tiny_wan

from rosprobe import JOINTS, NODE_ARGS, TAG, Probe, child_env, write_config

pytestmark = pytest.mark.slow

RELIABLE = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)


def test_physis_serve_publishes_a_wan_streams_frames_beside_tiny_wam(tmp_path):
    from physis_ros.model import build_model, load_model_config
    from physis_ros.msg import ActionChunk, PredictedFrames
    from physis_ros.reference import ReferenceRollout

    directory = tmp_path / "tiny-wan"
    save_tiny_wan(directory, num_layers=2)
    (directory / "physis_model.yaml").write_text(yaml.safe_dump({
        "steps": 2, "window": 1, "wan": {"frames": 2, "height": 4, "width": 4, "text_tokens": 5}}))
    embeds = torch.randn(1, 5, 16)
    save_file({"prompt_embeds": embeds}, tmp_path / "prompt.safetensors")
    names = {"r0": f"{TAG}_wr0", "wan0": f"{TAG}_wan0"}
    config = write_config(tmp_path / "serve.yaml", {
        "r0": {"namespace": names["r0"], "joint_names": JOINTS, "max_age_s": 5.0},
        "wan0": {"namespace": names["wan0"], "model": str(directory), "joint_names": ["j0"], "control_rate_hz": 4.0,
                 "inputs": {"prompt_embeds": str(tmp_path / "prompt.safetensors")}}},
        engine={"workers": 2}, deterministic=False)
    probe = Probe()
    probe.subscribe("frames", PredictedFrames, f"/{names['wan0']}/predicted_frames", RELIABLE)
    probe.subscribe("chunk", ActionChunk, f"/{names['r0']}/action_chunk", RELIABLE)
    env = child_env(uuid.uuid4().hex)
    synthetic = Child("synthetic", synthetic_command(config, "--rate", "20", "--width", "40", "--height", "30"),
                      env=env, log=tmp_path / "synthetic.log")
    server = Child("server", serve_command(config, "--duration", "120", *NODE_ARGS), env=env, log=tmp_path / "serve.log")
    try:
        try:
            probe.wait(lambda: (len(probe.get("frames")) >= 3 and len(probe.get("chunk")) >= 3)
                       or server.poll() is not None, 120.0, "3 frames chunks and 3 action chunks")
        except AssertionError:
            raise AssertionError(f"server log:\n{server.tail(40)}") from None
        assert server.poll() is None, server.tail(40)
        frames = [m for m, _ in probe.get("frames")]
    finally:
        server.stop(30.0)
        synthetic.stop(10.0)
        probe.close()
    ref = ReferenceRollout(build_model(load_model_config(directory)), seed=0)
    expected = [ref.step("wan0", {"prompt_embeds": embeds[0].numpy()}).output.numpy()
                for _ in range(frames[-1].chunk_index + 1)]
    for m in frames:
        assert m.stream == "wan0" and (m.frames, m.channels, m.height, m.width) == (2, 4, 4, 4)
        got = np.frombuffer(m.latents, np.float32).reshape(2, 4, 4, 4)
        assert np.array_equal(got, expected[m.chunk_index].swapaxes(0, 1)), m.chunk_index
