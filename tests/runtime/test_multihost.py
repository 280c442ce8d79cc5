"""Workers on another host: two network namespaces linked by a veth pair (the project's own test
hosts, link-local addresses), CurveZMQ on, engine in one, workers in the other."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from physis_ros.model import build_model, load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.reference import reference_rollout
from physis_ros.runtime.security import generate_keys

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

HERE = Path(__file__).resolve().parent
ENGINE_IP, WORKER_IP, PORT = "169.254.77.1", "169.254.77.2", 47123


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = str(os.getpid() % 100000)
    ns_e, ns_w, veth_e, veth_w = f"physis-e{tag}", f"physis-w{tag}", f"pe{tag}", f"pw{tag}"
    try:
        sh("ip", "netns", "add", ns_e)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns not permitted here: {exc.stderr.decode().strip()}")
    try:
        sh("ip", "netns", "add", ns_w)
        sh("ip", "link", "add", veth_e, "type", "veth", "peer", "name", veth_w)
        sh("ip", "link", "set", veth_e, "netns", ns_e)
        sh("ip", "link", "set", veth_w, "netns", ns_w)
        for ns, dev, ip in ((ns_e, veth_e, ENGINE_IP), (ns_w, veth_w, WORKER_IP)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_e, ns_w
    finally:
        for ns in (ns_e, ns_w):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_workers_on_another_host_match_the_reference(hosts, tmp_path):
    ns_e, ns_w = hosts
    keys = generate_keys(tmp_path / "keys")
    out = tmp_path / "chunks.npz"
    chunks = 7
    engine = subprocess.Popen(["ip", "netns", "exec", ns_e, sys.executable, str(HERE / "multihost_engine.py"),
                               ENGINE_IP, str(PORT), str(keys), str(out), str(chunks)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    workers = [subprocess.Popen(["ip", "netns", "exec", ns_w, sys.executable, "-m", "physis_ros.cli.worker",
                                 "--connect", f"tcp://{ENGINE_IP}:{PORT}", "--id", f"w{i}",
                                 "--bind-host", WORKER_IP, "--curve-keys", str(keys)]) for i in range(2)]
    try:
        log, _ = engine.communicate(timeout=180)
        assert engine.returncode == 0, log.decode()[-3000:]
        for w in workers:
            assert w.wait(timeout=30) == 0  # the engine shut them down
    finally:
        for p in [engine, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    got = np.load(out)
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    for r in reference_rollout(build_model(cfg), scene.observation, ["robot0"], chunks):
        assert np.array_equal(got[str(r.index)], r.output.numpy()), r.index
    assert len(got["hops"]) == 3 * chunks  # engine -> w0 -> w1 -> engine, across the veth link


def test_a_worker_without_keys_cannot_join(hosts, tmp_path):
    ns_e, ns_w = hosts
    keys = generate_keys(tmp_path / "keys")
    engine = subprocess.Popen(["ip", "netns", "exec", ns_e, sys.executable, str(HERE / "multihost_engine.py"),
                               ENGINE_IP, str(PORT), str(keys), str(tmp_path / "x.npz"), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    intruder = subprocess.Popen(["ip", "netns", "exec", ns_w, sys.executable, "-m", "physis_ros.cli.worker",
                                 "--connect", f"tcp://{ENGINE_IP}:{PORT}", "--id", "w0", "--transport", "ipc"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            engine.wait(timeout=8)  # still waiting for a worker: the keyless one was never let in
    finally:
        for p in (engine, intruder):
            p.kill()
            p.wait()
    assert not (tmp_path / "x.npz").exists()
