"""physis-serve serves config/serve_wan_tiny.yaml (issue 57): tiny-wam's robot0, the tiny Wan world-action
model's wan_wam and the tiny Wan world model's wan_wm, all admitted at the file's SLOs and fed by nothing but
physis-synthetic (wan_wm imagines what wan_wam commands). wan_wam's chunks arrive as action chunks and the
latent frames it predicts (the same chunk indices on both topics), contiguous and finite; wan_wm's frames
come with pictures on predicted_image, each the VAE's decode of the frames of the chunk it shows; robot0
keeps getting its chunks."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import yaml
from rclpy.qos import QoSProfile, ReliabilityPolicy

from physis_ros.config import repo_config_dir
from physis_ros.model.families import load_family
from physis_ros.launcher import Child, serve_command, synthetic_command
from physis_ros.serving.catalog import model_config_of

from rosprobe import NODE_ARGS, TAG, Probe, child_env, write_config

pytestmark = pytest.mark.slow

RELIABLE = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)


def shipped_streams() -> tuple[dict, dict]:
    """The streams and engine of config/serve_wan_tiny.yaml, namespaced for this test process."""
    params = yaml.safe_load((repo_config_dir() / "serve_wan_tiny.yaml").read_text())["/**"]["ros__parameters"]
    streams = {name: {**s, "namespace": f"{TAG}_{s['namespace']}", "max_age_s": 5.0}
               for name, s in params["streams"].items()}
    return streams, params["engine"]


def test_the_wan_config_serves_a_wan_wam_and_a_wan_world_model_beside_tiny_wam(tmp_path):
    from sensor_msgs.msg import Image

    from physis_ros.msg import ActionChunk, PredictedFrames

    streams, engine = shipped_streams()
    assert set(streams) == {"robot0", "wan_wam", "wan_wm"} and streams["wan_wam"]["model"] == "tiny-wan-wam-demo"
    assert streams["wan_wm"]["model"] == "tiny-wan-acwm-demo"
    assert streams["wan_wm"]["topics"]["actions"] == "/wan_wam/action_chunk"
    streams["wan_wm"]["topics"]["actions"] = f"/{streams['wan_wam']['namespace']}/action_chunk"
    streams["wan_wm"]["preview_hz"] = 4.0
    config = write_config(tmp_path / "serve.yaml", streams, engine=engine, deterministic=False)
    ns = {name: s["namespace"] for name, s in streams.items()}
    probe = Probe()
    probe.subscribe("wam", ActionChunk, f"/{ns['wan_wam']}/action_chunk", RELIABLE)
    probe.subscribe("frames", PredictedFrames, f"/{ns['wan_wam']}/predicted_frames", RELIABLE)
    probe.subscribe("robot0", ActionChunk, f"/{ns['robot0']}/action_chunk", RELIABLE)
    probe.subscribe("wm", PredictedFrames, f"/{ns['wan_wm']}/predicted_frames", RELIABLE)
    probe.subscribe("picture", Image, f"/{ns['wan_wm']}/predicted_image", RELIABLE)
    env = child_env(uuid.uuid4().hex)
    synthetic = Child("synthetic", synthetic_command(config, "--rate", "30", "--width", "48", "--height", "40"),
                      env=env, log=tmp_path / "synthetic.log")
    server = Child("server", serve_command(config, "--duration", "150", *NODE_ARGS), env=env, log=tmp_path / "serve.log")
    try:
        try:
            probe.wait(lambda: (min(len(probe.get("wam")), len(probe.get("frames")), len(probe.get("robot0")),
                                     len(probe.get("wm"))) >= 6 and len(probe.get("picture")) >= 2)
                       or server.poll() is not None, 150.0,
                       "6 chunks of wan_wam (actions and frames), robot0 and wan_wm, and 2 pictures")
        except AssertionError:
            raise AssertionError(f"server log:\n{server.tail(40)}") from None
        assert server.poll() is None, server.tail(40)
        chunks = [m for m, _ in probe.get("wam")]
        frames = {m.chunk_index: m for m, _ in probe.get("frames")}
        imagined = [m for m, _ in probe.get("wm")]
        pictures = [m for m, _ in probe.get("picture")]
    finally:
        server.stop(30.0)
        synthetic.stop(10.0)
        probe.close()
    indices = [m.chunk_index for m in chunks]
    assert indices == list(range(indices[0], indices[0] + len(indices))), indices    # contiguous: no reset
    for m in chunks:
        assert (m.stream, m.horizon, m.dof) == ("wan_wam", 16, 7)
        actions = np.asarray(m.actions, np.float32)
        assert actions.shape == (16 * 7,) and np.isfinite(actions).all()
    both = [i for i in indices if i in frames]
    assert len(both) >= 5, (indices, sorted(frames))
    for i in both:
        f = frames[i]
        assert (f.stream, f.frames, f.channels, f.height, f.width) == ("wan_wam", 2, 4, 8, 8)
        latents = np.asarray(f.latents, np.float32)
        assert latents.shape == (2 * 4 * 8 * 8,) and np.isfinite(latents).all() and latents.std() > 0
    wm = [m.chunk_index for m in imagined]
    assert wm == list(range(wm[0], wm[0] + len(wm))), wm
    by_stamp = {(m.header.stamp.sec, m.header.stamp.nanosec): m for m in imagined}
    decode = load_family("wan_acwm").previewer(model_config_of(streams["wan_wm"]["model"])[0])
    shown = [p for p in pictures if (p.header.stamp.sec, p.header.stamp.nanosec) in by_stamp]
    assert shown, "no picture carries the stamp of a chunk received"
    for p in shown:
        assert (p.encoding, p.height, p.width, p.step) == ("rgb8", 64, 64, 192)
        m = by_stamp[(p.header.stamp.sec, p.header.stamp.nanosec)]
        latents = np.asarray(m.latents, np.float32).reshape(m.frames, m.channels, m.height, m.width)
        got = np.frombuffer(bytes(p.data), np.uint8).reshape(64, 64, 3).astype(int)
        assert np.abs(got - decode(latents).astype(int)).max() <= 1     # threads may round the decode apart
