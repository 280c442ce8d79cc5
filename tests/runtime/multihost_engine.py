"""Engine side of the multi-host test: run inside the engine's network namespace.

Waits for externally started workers (CurveZMQ on), runs one stream and saves
its chunks to an .npz file for the test to compare with the reference.
"""

import sys

import numpy as np
import torch

from physis_ros.runtime.settings import EngineConfig
from physis_ros.model import load_model_config
from physis_ros.observations import SyntheticScene
from physis_ros.runtime.offline import run_chunks


def main() -> None:
    bind_host, port, keys, out, chunks = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    torch.set_num_threads(1)
    cfg = load_model_config("tiny-wam")
    scene = SyntheticScene(cfg.observation_shapes)
    engine_cfg = EngineConfig(workers=2, plan="stage", bind_host=bind_host, ctrl_port=port, curve_keys=keys,
                              spawn_workers=False, start_timeout_s=60)
    outputs = run_chunks(cfg, engine_cfg, ["robot0"], chunks, scene.observation)["robot0"]
    np.savez(out, **{str(o.chunk): o.output for o in outputs},
             hops=np.array([h for o in outputs for h in o.record.hops_ms]))


if __name__ == "__main__":
    main()
