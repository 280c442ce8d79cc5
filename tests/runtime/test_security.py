"""CurveZMQ: authenticated peers work, unauthenticated and wrong-key peers are refused; no pickle."""

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import uvloop
import zmq

from physis_ros.config import ConfigError, from_mapping
from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import ReferenceRollout
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.engine import Engine, Observation, ServedModel
from physis_ros.runtime.plans import make_plan
from physis_ros.runtime.security import CurveKeys, generate_keys, is_loopback

REPO = Path(__file__).resolve().parents[2]


def rogue_task(stream: str) -> list:
    obs = {"obs/image": torch.zeros(1, 3, 32, 32), "obs/state": torch.zeros(1, 7)}
    return wire.encode(p.Task(stream=stream, chunk=0, stage=(4, 0), epoch=0), obs)


@pytest.mark.slow
def test_curve_engine_serves_and_refuses_strangers(tmp_path):
    keys_dir = generate_keys(tmp_path / "keys")
    stranger_dir = generate_keys(tmp_path / "other")  # a valid key pair, but not authorized here
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)

    async def main():
        engine = Engine(EngineConfig(workers=2, curve_keys=str(keys_dir)))
        await engine.start()
        try:
            got = []
            await engine.add_stream("robot0", lambda c: Observation(scene.observation("robot0", c), engine.clock()),
                                    got.append, chunks=4, model=ServedModel(cfg), plan=make_plan("stage", 4, 8, 2))
            await engine.wait_stream("robot0")
            ctx = zmq.Context()
            attempts = {"plain": None, "wrong key": CurveKeys.load(stranger_dir)}
            for label, keys in attempts.items():
                for target in (engine.pool.workers["w0"].data_addr, engine.out_addr):
                    sock = ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    if keys is not None:
                        keys.client(sock)
                    sock.connect(target)
                    try:
                        sock.send_multipart(rogue_task("robot0"), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # never connected: exactly what refusal looks like from outside
                    await asyncio.sleep(0.3)
                    sock.close()
            ctx.term()
            stats = (await engine.pool.request("w0", p.Stats(req=0))).stats
            return got, stats, engine.streams["robot0"].next_emit
        finally:
            await engine.stop()

    got, stats, emitted = uvloop.run(main())
    ref = ReferenceRollout(build_model(cfg))
    for o in got:
        assert np.array_equal(o.output, ref.step("robot0", scene.observation("robot0", o.chunk)).output.numpy())
    assert stats.tasks == 4 and stats.bad_messages == 0 and stats.stale == 0
    assert emitted == 4


@pytest.mark.slow
def test_non_loopback_binding_requires_keys():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with pytest.raises(ConfigError, match="curve_keys.*requires CurveZMQ keys"):
        from_mapping(EngineConfig, {"bind_host": "0.0.0.0"})
    proc = subprocess.run([sys.executable, "-m", "physis_ros.cli.worker", "--connect", "tcp://127.0.0.1:1",
                           "--bind-host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--curve-keys" in proc.stderr


def test_missing_keys_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="physis-keys"):
        CurveKeys.load(tmp_path)


def test_nothing_is_pickled():
    pattern = re.compile(r"^\s*(import pickle|from pickle|import cloudpickle|import dill)|pickle\.loads?\(|"
                         r"torch\.load\(|allow_pickle=True", re.M)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "physis_ros").rglob("*.py")
                 if "/msg/" not in str(p) and pattern.search(p.read_text())]
    assert offenders == []
