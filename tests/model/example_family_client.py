"""Run by tests/model/test_example_family.py in a fresh interpreter (so that the example package installed
into the venv is found through its entry point): a deterministic Server serves the example's gmlp-policy
model (a family of its own, from examples/physis_gmlp) to one robot on two CPU workers, and its chunks are
compared with the sequential reference of the same model. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from physis_ros.model import build_model, load_model_config
from physis_ros.reference import ReferenceRollout
from physis_ros.serving import Server
from physis_ros.serving.tensors import preprocess

JOINTS = [f"j{i}" for i in range(7)]
CHUNKS = 4


def main() -> None:
    model_yaml = sys.argv[1]
    config = {"model": model_yaml, "deterministic": True, "engine": {"workers": 2, "plan": "stage"}}
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(CHUNKS)]
    states = [rng.uniform(-1, 1, 7) for _ in range(CHUNKS)]
    out: dict = {}
    with Server.from_config(config) as server:
        session = server.join("r0", joint_names=JOINTS)
        out["workers"] = session.workers
        t0 = time.time()
        for c in range(CHUNKS):
            session.observe(images={"camera": frames[c]}, state=states[c], stamp_s=t0 + 0.01 * c)
        chunks = [session.next_chunk(timeout_s=120.0) for _ in range(CHUNKS)]
        server.leave("r0")
    cfg = load_model_config(model_yaml)
    model = build_model(cfg)
    out["family"] = type(model).__module__ + "." + type(model).__name__
    ref = ReferenceRollout(model, seed=server.config.engine.seed)
    out["equal"] = []
    for c, chunk in enumerate(chunks):
        obs = {"image": preprocess(frames[c], "rgb8", 32, 3, "center_crop"), "state": states[c].astype(np.float32)}
        out["equal"].append(bool(np.array_equal(chunk.actions, ref.step("r0", obs).output.numpy())))
    out["indices"] = [c.index for c in chunks]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
