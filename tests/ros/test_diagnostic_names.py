"""/diagnostics status names are '<node>: <what>' with the node's own name, never its namespace
(`physis_server: engine` under `ros2 launch ... namespace:=robots`); a __node remap renames them."""

from __future__ import annotations

import pytest

from physis_ros.config import repo_config_dir

from rosprobe import DOMAIN

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`


def statuses_of(*ros_args: str, namespace: str | None = None) -> tuple[str, list[str]]:
    import rclpy

    from physis_ros.ros import diagnostics
    from physis_ros.ros.node import PhysisServer

    context = rclpy.Context()
    args = ["physis-serve", "--ros-args", "--params-file", str(repo_config_dir() / "serve.yaml"), *ros_args]
    rclpy.init(args=args, context=context, domain_id=DOMAIN)
    try:
        node = PhysisServer(None, {"engine": {"plan": "sequential"}}, context=context, namespace=namespace)
        try:
            return node.get_fully_qualified_name(), [s.name for s in diagnostics.statuses(node)]
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize("ros_args, namespace, fqn, prefix", [
    ((), None, "/physis_server", "physis_server"),
    ((), "robots", "/robots/physis_server", "physis_server"),            # a launch file's namespace=
    (("-r", "__ns:=/lab/cell1"), None, "/lab/cell1/physis_server", "physis_server"),   # ros2 run ... -r __ns:=
    (("-r", "__node:=arm_server", "-r", "__ns:=/robots"), None, "/robots/arm_server", "arm_server"),
])
def test_status_names_are_the_node_name_without_its_namespace(ros_args, namespace, fqn, prefix):
    got_fqn, names = statuses_of(*ros_args, namespace=namespace)
    assert got_fqn == fqn
    assert f"{prefix}: engine" in names and f"{prefix}: robot0" in names and f"{prefix}: robot1" in names
    assert all(n.startswith(f"{prefix}: ") and "/" not in n.split(":")[0] for n in names), names


def test_a_destroyed_node_stops_taking_physis_log_lines():
    """Each node routes physis.* lines to its logger (/rosout); destroying it must take that route away, or
    every later line goes to every node ever made in the process."""
    import logging

    from physis_ros.ros.rosout import RosoutHandler

    def routes() -> int:
        return sum(isinstance(h, RosoutHandler) for h in logging.getLogger("physis").handlers)

    before = routes()
    statuses_of()
    statuses_of(namespace="robots")
    assert routes() == before

