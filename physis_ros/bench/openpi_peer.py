"""The peer ``physis-bench openpi`` measures against: openpi-server's own ``WebsocketPolicyServer`` wrapping
a policy that runs the same model in-process, one observation after another (the sequential reference:
full denoising with the stream's K/V history), as openpi serves a policy.

    python -m physis_ros.bench.openpi_peer --port 8000 --model tiny-wam [--threads N]

The policy resamples the camera frame as our front end does (``image.preprocess`` center_crop) so both
servers do the same work per observation."""

from __future__ import annotations

import argparse
import logging

import numpy as np


class ReferencePolicy:
    """openpi's ``BasePolicy``: ``infer(obs) -> {"actions": [horizon, dof]}`` on our sequential reference."""

    def __init__(self, model: str, image_key: str = "observation/image", state_key: str = "observation/state"):
        from physis_ros.model import build_model
        from physis_ros.reference import ReferenceRollout

        self.ref = ReferenceRollout(build_model(model))
        self.shapes = self.ref.model.config.observation_shapes
        self.image_key, self.state_key = image_key, state_key

    def infer(self, obs: dict) -> dict:
        from physis_ros.serving.tensors import preprocess

        channels, size, _ = self.shapes["image"]
        frame = np.ascontiguousarray(obs[self.image_key])
        tensors = {"image": preprocess(frame, "rgb8", size, channels, "center_crop"),
                   "state": np.asarray(obs[self.state_key], dtype=np.float32)}
        return {"actions": self.ref.step("peer", tensors).output.numpy()}

    def reset(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="tiny-wam")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    args = p.parse_args()
    import torch
    from openpi_server.websocket_policy_server import WebsocketPolicyServer

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    policy = ReferencePolicy(args.model)
    policy.infer({"observation/image": np.zeros((224, 224, 3), np.uint8),
                  "observation/state": np.zeros(policy.shapes["state"][0], np.float32)})   # warm
    WebsocketPolicyServer(policy, host="127.0.0.1", port=args.port,
                          metadata={"server": "openpi-server", "threads": torch.get_num_threads()}).serve_forever()


if __name__ == "__main__":
    main()
