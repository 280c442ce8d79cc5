"""Serve config: the bundled file loads in both formats; errors name the dotted key."""

from pathlib import Path

import pytest
import yaml

from physis_ros.config import ConfigError, repo_config_dir
from physis_ros.model.spec import load_model_config
from physis_ros.serving.config import (ServeConfig, deep_merge, load_serve_config, load_serve_mapping, serve_config,
                                   unflatten, unwrap_ros_parameters)
from physis_ros.serving.catalog import model_config_of
from physis_ros.serving.fit import check_stream_model, slo_interval_ms

from rosprobe import DOMAIN

JOINTS = [f"joint{i}" for i in range(1, 8)]


def base(**stream):
    return {"streams": {"robot0": {"joint_names": JOINTS, **stream}}}


def test_bundled_serve_yaml():
    cfg = load_serve_config(repo_config_dir() / "serve.yaml")
    assert cfg.model == "tiny-wam-demo" and cfg.engine.workers == 2 and cfg.engine.plan == "stage"
    assert list(cfg.streams) == ["robot0", "robot1"]
    assert cfg.topic("robot0", "image") == "robot0/camera/image_raw"
    assert cfg.topic("robot1", "joint_trajectory") == "robot1/joint_trajectory"
    assert cfg.streams["robot0"].joint_names == JOINTS
    for name, s in cfg.streams.items():
        model, checkpoint = model_config_of(s.model or cfg.model)    # the shipped, trained checkpoint
        assert checkpoint.endswith("config/checkpoints/tiny-wam-demo.safetensors")
        check_stream_model(f"streams.{name}", s, model)
        # no SLO set: the control timeline's interval, 8 of 16 steps at 50 Hz
        assert s.slo_interval_ms is None and slo_interval_ms(s, model) == 160.0
        assert s.cadence == "timeline" and s.trajectory_start == "timeline" and s.handoff == "soft"


def test_plain_and_ros_parameter_formats_agree(tmp_path):
    data = base(slo_interval_ms=40)
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(data))
    wrapped = tmp_path / "ros.yaml"
    wrapped.write_text(yaml.safe_dump({"/**": {"ros__parameters": data}}))
    assert load_serve_config(plain) == load_serve_config(wrapped)
    assert load_serve_mapping(wrapped) == data


def test_precedence_and_unflatten():
    params = unflatten({"engine.workers": 3, "streams.robot0.slo_interval_ms": 25.0})
    assert params == {"engine": {"workers": 3}, "streams": {"robot0": {"slo_interval_ms": 25.0}}}
    merged = deep_merge(deep_merge(base(slo_interval_ms=40), params), {"engine": {"plan": "block"}})
    cfg = serve_config(merged)
    assert cfg.engine.workers == 3 and cfg.engine.plan == "block"
    assert cfg.streams["robot0"].slo_interval_ms == 25.0 and cfg.streams["robot0"].joint_names == JOINTS


def test_namespaces_and_absolute_topics():
    cfg = serve_config({"streams": {
        "a": {"joint_names": ["j"], "namespace": "/arm/left"},
        "b": {"joint_names": ["j"], "topics": {"image": "/cams/b/image"}}}})
    assert cfg.topic("a", "image") == "/arm/left/camera/image_raw"
    assert cfg.topic("b", "image") == "/cams/b/image"
    assert cfg.topic("b", "joint_states") == "b/joint_states"


@pytest.mark.parametrize("mapping, key, text", [
    (base(preprocess="crop"), "streams.robot0.preprocess", "unknown key"),
    (base(image={"preprocess": "crop"}), "streams.robot0.image.preprocess", "allowed values"),
    (base(slo_interval_ms=0), "streams.robot0.slo_interval_ms", "must be > 0"),
    (base(capture_margin_steps=1.0), "streams.robot0.capture_margin_steps", "must be <= 0.9"),
    (base(joint_names=["a", "a"]), "streams.robot0.joint_names[1]", "listed twice"),
    (base(namespace="bad ns"), "streams.robot0.namespace", "not a valid ROS namespace"),
    (base(topics={"image": "cam//x"}), "streams.robot0.topics.image", "not a valid ROS topic"),
    (base(qos={"input": {"reliability": "sometimes"}}), "streams.robot0.qos.input.reliability", "allowed"),
    ({**base(), "engine": {"workers": 0}}, "engine.workers", "must be >= 1"),
    ({**base(), "diagnostics_miss_rate_warn": 1.5}, "diagnostics_miss_rate_warn", "must be <= 1.0"),
    ({**base(), "diagnostics_starved_s": 0}, "diagnostics_starved_s", "must be > 0"),
    (base(topics={"telemetry": "t//x"}), "streams.robot0.topics.telemetry", "not a valid ROS topic"),
    (base(telemetry="yes"), "streams.robot0.telemetry", "true or false"),
    ({"streams": {"r0": {"joint_names": ["a"]}, "r1": {"joint_names": ["a"], "namespace": "r0"}}},
     "streams.r1.namespace", "already used"),
    ({"streams": {"0bad": {"joint_names": ["a"]}}}, "streams.0bad", "letters, digits and '_'"),
])
def test_errors_name_the_key(mapping, key, text):
    """(A config without streams is fine: the server waits for robots to join.)"""
    with pytest.raises(ConfigError) as err:
        serve_config(mapping)
    assert err.value.key == key, str(err.value)
    assert text in str(err.value)


def test_model_mismatch_names_the_key():
    wam, acwm = load_model_config("tiny-wam"), load_model_config("tiny-acwm")
    with pytest.raises(ConfigError) as err:
        check_stream_model("streams.robot0", serve_config(base(joint_names=["a", "b"])).streams["robot0"], wam)
    assert err.value.key == "streams.robot0.joint_names" and "takes state of 7 columns" in str(err.value)
    check_stream_model("streams.robot0", serve_config(base()).streams["robot0"], acwm)  # world models serve too
    with pytest.raises(ConfigError) as err:
        check_stream_model("streams.robot0", serve_config(base(execution_horizon=20)).streams["robot0"], wam)
    assert err.value.key == "streams.robot0.execution_horizon"


def test_the_slo_follows_the_control_timeline_and_may_not_exceed_it():
    wam = load_model_config("tiny-wam")                      # a chunk plans 16 steps
    s = serve_config(base(control_rate_hz=50.0)).streams["robot0"]
    assert slo_interval_ms(s, wam) == pytest.approx(160.0)    # s = 8 (half the horizon) at 50 Hz
    s = serve_config(base(control_rate_hz=50.0, execution_horizon=4)).streams["robot0"]
    assert slo_interval_ms(s, wam) == pytest.approx(80.0)
    too_long = serve_config(base(control_rate_hz=50.0, execution_horizon=4, slo_interval_ms=100.0)).streams["robot0"]
    with pytest.raises(ConfigError) as err:
        check_stream_model("streams.robot0", too_long, wam)
    assert err.value.key == "streams.robot0.slo_interval_ms" and "80 ms" in str(err.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base(control_rate_hz="fast")))
    with pytest.raises(ConfigError) as err:
        load_serve_config(bad)
    assert str(bad) in str(err.value) and "streams.robot0.control_rate_hz" in str(err.value)
    with pytest.raises(ConfigError):
        unwrap_ros_parameters({"a": {"ros__parameters": {}}, "b": {"ros__parameters": {}}})


@pytest.mark.parametrize("text, key", [
    ("streams:\n  robot0:\n    joint_names: [{joints}]\n    control_rate_hz: .inf\n",
     "streams.robot0.control_rate_hz"),
    ("streams:\n  robot0:\n    joint_names: [{joints}]\n    image:\n      pad_value: .nan\n",
     "streams.robot0.image.pad_value"),
    ("warn_throttle_s: -.inf\nstreams:\n  robot0:\n    joint_names: [{joints}]\n", "warn_throttle_s"),
    ("engine:\n  heartbeat_timeout_s: .NaN\n", "engine.heartbeat_timeout_s"),
    ("/**:\n  ros__parameters:\n    streams:\n      robot0:\n        joint_names: [{joints}]\n"
     "        max_abs_position: .Inf\n", "streams.robot0.max_abs_position"),
])
def test_inf_and_nan_in_a_serve_yaml_are_refused_naming_the_key(tmp_path, text, key):
    """YAML's .inf/.nan parse as floats and would pass every range check (nan compares False): a serve
    config file holding one is refused at load, naming the dotted key (plain and ROS-parameter formats)."""
    path = tmp_path / "serve.yaml"
    path.write_text(text.format(joints=", ".join(JOINTS)))
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.key == key and "finite" in str(err.value) and str(path) in str(err.value), str(err.value)


def test_cli_config_error_exit_code(tmp_path, capsys):
    from physis_ros.cli.serve import main
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base(image={"preprocess": "zoom"})))
    assert main(["--config", str(bad)]) == 2
    assert "streams.robot0.image.preprocess" in capsys.readouterr().err


def test_serve_config_is_frozen():
    cfg = serve_config(base())
    with pytest.raises(Exception):
        cfg.model = "x"  # type: ignore[misc]
    assert isinstance(cfg, ServeConfig) and Path(repo_config_dir() / "serve.yaml").is_file()


@pytest.mark.slow
def test_node_takes_its_config_from_ros_parameters(tmp_path):
    """What `ros2 launch` does: the YAML as a --params-file, overrides with -p, no --config."""

    import rclpy

    from physis_ros.ros.node import PhysisServer

    context = rclpy.Context()
    args = ["physis-serve", "--ros-args", "--params-file", str(repo_config_dir() / "serve.yaml"),
            "-p", "engine.workers:=1", "-p", "streams.robot1.slo_interval_ms:=33.0", "-p", "use_sim_time:=true"]
    rclpy.init(args=args, context=context, domain_id=DOMAIN)
    try:
        node = PhysisServer(None, {"engine": {"plan": "sequential"}}, context=context)
        try:
            cfg = node.config
            assert cfg.engine.workers == 1 and cfg.engine.plan == "sequential"
            assert cfg.streams["robot1"].slo_interval_ms == 33.0 and cfg.streams["robot0"].slo_interval_ms is None
            assert cfg.use_sim_time and node.get_parameter("use_sim_time").value is True
            assert cfg.streams["robot0"].joint_names == JOINTS
            topics = {name for name, _ in node.get_topic_names_and_types()}
            # the streams' own topics appear when they are admitted, once configured
            assert {"/telemetry", "/diagnostics", "/physis_server/serve_stream/_action/status"} <= topics
        finally:
            node.destroy_node()
        with pytest.raises(ConfigError) as err:
            PhysisServer(None, {"streams": {"robot0": {"joint_names": ["a"]}}}, context=context)
        assert err.value.key == "streams.robot0.joint_names"
    finally:
        rclpy.try_shutdown(context=context)


def test_a_config_without_streams_is_a_server_waiting_for_robots():
    assert serve_config({}).streams == {} and serve_config({"streams": {}}).streams == {}


def test_every_runtime_number_has_a_finite_range():
    """A parameter that can change while the node runs is refused outside a stated, finite range (its
    descriptor's floating_point_range / integer_range): trajectory_start_offset_s had none, and 1e308 was
    taken."""
    import math

    from rclpy.parameter import Parameter

    from physis_ros.ros.parameters import descriptor, ros_type
    from physis_ros.serving.config_keys import is_runtime, leaves

    numbers = [leaf for leaf in leaves(serve_config(base())) if is_runtime(leaf.name)
               and ros_type(leaf) in (Parameter.Type.DOUBLE, Parameter.Type.INTEGER)]
    for leaf in numbers:
        d = descriptor(leaf)
        (r,) = list(d.floating_point_range) + list(d.integer_range)
        assert math.isfinite(r.from_value) and math.isfinite(r.to_value), leaf.name
    assert "streams.robot0.trajectory_start_offset_s" in {leaf.name for leaf in numbers} and len(numbers) >= 8


def test_config_reference_is_current_and_the_bundled_config_is_short():
    """Issue 49 item 3: the bundled serve.yaml listed 31 keys with tuning notes; it sets what a user changes
    (at most 25 keys) and docs/config.md, generated from the config dataclasses, lists every key."""
    from physis_ros.serving.config_reference import reference
    from physis_ros.serving.config import StreamConfig
    from physis_ros.serving.config_keys import leaves, stream_leaves

    doc = (repo_config_dir().parent / "docs" / "config.md").read_text()
    assert doc == reference(), "docs/config.md is stale: python -m physis_ros.serving.config_reference > docs/config.md"
    for leaf in leaves(ServeConfig()):
        assert f"| `{leaf.name}` |" in doc, leaf.name
    for leaf in stream_leaves(StreamConfig(joint_names=[]), "x"):
        assert f"| `{leaf.name[len('streams.x.'):]}` |" in doc, leaf.name

    def count(d) -> int:
        return sum(count(v) if isinstance(v, dict) else 1 for v in d.values())

    raw = yaml.safe_load((repo_config_dir() / "serve.yaml").read_text())["/**"]["ros__parameters"]
    assert count(raw) <= 25, count(raw)
