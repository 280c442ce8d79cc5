"""launch/serve.launch.py: executed where launch_ros imports, otherwise read (ast) and checked."""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from rosprobe import DOMAIN

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch" / "serve.launch.py"


def console_scripts() -> dict[str, str]:
    text = (ROOT / "setup.py").read_text()
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)=([A-Za-z0-9_.]+:[A-Za-z0-9_]+)"', text))


def node_call(tree: ast.AST) -> ast.Call:
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Node"]
    assert len(calls) == 1, "the launch file starts exactly one Node"
    return calls[0]


def literal_kwargs(call: ast.Call) -> dict[str, object]:
    return {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}


def test_launch_file_names_installed_executable_and_existing_config():
    tree = ast.parse(LAUNCH.read_text(), filename=str(LAUNCH))
    kwargs = literal_kwargs(node_call(tree))
    assert kwargs["package"] == "physis_ros" and kwargs["name"] == "physis_server"
    scripts = console_scripts()
    assert kwargs["executable"] in scripts, f"{kwargs['executable']} is not a console script of setup.py"
    assert scripts[kwargs["executable"]] == "physis_ros.cli.serve:main"
    # The default config: PathJoinSubstitution([FindPackageShare("physis_ros"), "config", "serve.yaml"])
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert "serve.yaml" in strings and "config" in strings
    assert (ROOT / "config" / "serve.yaml").is_file()
    declared = {c.args[0].value for c in ast.walk(tree) if isinstance(c, ast.Call)
                and getattr(c.func, "id", None) == "DeclareLaunchArgument"}
    assert {"config", "model", "workers", "namespace", "use_sim_time"} <= declared
    # The module is importable as far as its own syntax goes, and names generate_launch_description.
    assert any(isinstance(n, ast.FunctionDef) and n.name == "generate_launch_description" for n in tree.body)


def test_installed_entry_point_resolves():
    module, func = console_scripts()["physis-serve"].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_launch_description_executes_where_launch_ros_exists():
    pytest.importorskip("launch_ros", reason="launch_ros is not installable from PyPI; checked by reading instead")
    from launch import LaunchDescription
    from launch_ros.actions import Node

    spec = importlib.util.spec_from_file_location("serve_launch", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ld = module.generate_launch_description()
    assert isinstance(ld, LaunchDescription)
    nodes = [e for e in ld.entities if isinstance(e, Node)]
    assert len(nodes) == 1



def test_launch_arguments_for_lifecycle_autostart_and_trajectory_topic():
    tree = ast.parse(LAUNCH.read_text(), filename=str(LAUNCH))
    declared = {c.args[0].value: {k.arg: getattr(k.value, "value", None) for k in c.keywords}
                for c in ast.walk(tree)
                if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "DeclareLaunchArgument"}
    assert declared["autostart"]["default_value"] == "true"
    assert declared["trajectory_topic"]["default_value"] == ""
    args = next(k.value for k in node_call(tree).keywords if k.arg == "arguments")
    flags = [e.value for e in args.elts if isinstance(e, ast.Constant)]
    configs = [e.args[0].value for e in args.elts if isinstance(e, ast.Call)]
    assert flags == ["--model", "--workers", "--autostart", "--trajectory-topic"]
    assert configs == ["model", "workers", "autostart", "trajectory_topic"]
    # what those flags mean to the executable
    from physis_ros.cli.serve import build_parser
    p = build_parser()
    assert p.parse_args([]).autostart is True
    assert p.parse_args(["--autostart", "true"]).autostart is True
    assert p.parse_args(["--autostart", "false"]).autostart is False
    assert p.parse_args(["--no-autostart"]).autostart is False
    assert p.parse_args(["--autostart"]).autostart is True
    assert p.parse_args(["--trajectory-topic", ""]).trajectory_topic == ""


@pytest.mark.slow
def test_trajectory_topic_applies_to_a_single_stream_config(tmp_path, capsys):

    import rclpy
    import yaml

    from physis_ros.cli.serve import main
    from physis_ros.ros.node import PhysisServer

    # several streams: refused before ROS starts, naming the per-stream key instead
    two = str(ROOT / "config" / "serve.yaml")
    assert main(["--config", two, "--trajectory-topic", "/arm_controller/joint_trajectory"]) == 2
    assert "streams.<name>.topics.joint_trajectory" in capsys.readouterr().err
    single = {"streams": {"arm": {"joint_names": [f"joint{i}" for i in range(1, 8)]}}}
    bad = tmp_path / "one.yaml"
    bad.write_text(yaml.safe_dump(single))
    assert main(["--config", str(bad), "--trajectory-topic", "arm//jt"]) == 2
    assert "topics.joint_trajectory" in capsys.readouterr().err
    context = rclpy.Context()
    rclpy.init(args=["physis-serve"], context=context, domain_id=DOMAIN)
    try:
        node = PhysisServer(single, None, context=context, trajectory_topic="/arm_controller/joint_trajectory")
        try:
            # (streams get their topics when admitted, once configured: the config carries the remap)
            assert node.config.topic("arm", "joint_trajectory") == "/arm_controller/joint_trajectory"
            assert node.get_parameter("streams.arm.topics.joint_trajectory").value == "/arm_controller/joint_trajectory"
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)
