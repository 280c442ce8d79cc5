"""Run by tests/serving/test_server.py in a process where importing rclpy or any ROS message package
raises: the Server API end to end (a deterministic server, one robot, its chunks against the sequential
reference; refusals; events; stats; leave). Prints one JSON line of what it saw."""

from __future__ import annotations

import importlib.abc
import json
import sys
import time

ROS = ("rclpy", "builtin_interfaces", "sensor_msgs", "std_msgs", "trajectory_msgs", "diagnostic_msgs",
       "rosbag2_py", "physis_ros.msg", "physis_ros.action", "physis_ros.srv", "physis_ros.ros")


class NoRos(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == r or name.startswith(r + ".") for r in ROS):
            raise ImportError(f"{name} imported by the serving core")
        return None


sys.meta_path.insert(0, NoRos())

import numpy as np  # noqa: E402

from physis_ros.serving import Rejected, Server  # noqa: E402

JOINTS = [f"j{i}" for i in range(7)]
CHUNKS = 5


def main() -> None:
    from physis_ros.model import build_model
    from physis_ros.reference import ReferenceRollout
    from physis_ros.serving.tensors import preprocess

    out: dict = {"events": [], "rejected": {}}
    config = {"model": "tiny-wam", "deterministic": True, "engine": {"workers": 1},
              "admission": {"profiles": sys.argv[1]}}
    rng = np.random.default_rng(7)
    frames = [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(CHUNKS)]
    states = [rng.uniform(-1, 1, 7) for _ in range(CHUNKS)]
    with Server.from_config(config) as server:
        server.subscribe(lambda e: out["events"].append([e.stream, e.kind, e.reason]))
        session = server.join("r0", model="tiny-wam", joint_names=JOINTS)
        try:
            session.next_chunk(timeout_s=0.3)
            out["chunk_without_observation"] = True
        except TimeoutError:
            out["chunk_without_observation"] = False
        t0 = time.time()
        for c in range(CHUNKS):
            session.observe(images={"camera": frames[c]}, state=states[c], stamp_s=t0 + 0.01 * c)
        chunks = [session.next_chunk(timeout_s=60.0) for _ in range(CHUNKS)]
        for name, kwargs in {"bad-field": dict(joint_names=JOINTS, control_rate_hz=-1.0),
                             "unknown-key": dict(joint_names=JOINTS, speed=3),
                             "in-use": dict(joint_names=JOINTS),
                             "bad-name": dict(joint_names=JOINTS),
                             "no-model": dict(model="no-such-model", joint_names=JOINTS),
                             "timeline": dict(joint_names=JOINTS, slo_ms=400.0),
                             "joints": dict(joint_names=JOINTS[:3])}.items():
            stream = {"in-use": "r0", "bad-name": "9 lives"}.get(name, "r1")
            try:
                server.join(stream, **kwargs)
                out["rejected"][name] = None
            except Rejected as exc:
                out["rejected"][name] = [exc.reason, exc.detail]
        out["streams"] = server.streams()
        stats = server.stats()
        out["stats"] = {"engine": stats["engine"]["state"], "workers": sorted(stats["workers"]),
                        "rss_bytes": stats["workers"]["w0"]["stats"].get("rss_bytes", 0),
                        "total": stats["streams"]["r0"]["total"],
                        "received": stats["streams"]["r0"]["inputs"]["received"]}
        server.leave("r0")
        try:
            session.next_chunk(timeout_s=1.0)
        except RuntimeError as exc:
            out["after_leave"] = str(exc)
        out["streams_after"] = server.streams()
    ref = ReferenceRollout(build_model("tiny-wam"), seed=server.config.engine.seed)
    out["indices"] = [c.index for c in chunks]
    out["stamps"] = [round(c.stamp_s - t0, 6) for c in chunks]
    out["equal"] = []
    for c, chunk in enumerate(chunks):
        obs = {"image": preprocess(frames[c], "rgb8", 32, 3, "center_crop"), "state": states[c].astype(np.float32)}
        expected = ref.step("r0", obs).output.numpy()
        out["equal"].append(bool(np.array_equal(chunk.actions, expected)))
    out["ros_imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ROS or m.startswith("physis_ros.ros"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
