"""ROS 2 parameters of physis_server: every config key declared with its default, description and
range or choices; runtime-changeable ones validated and applied, everything else read-only; foreign
keys of a shared parameters file tolerated; qos_overrides.* honoured.

The first tests build the node in this process (no engine is started before configure); the live
ones share one server process and talk to it through the standard parameter services.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest
import yaml
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

from physis_ros.config import ConfigError, repo_config_dir, to_mapping
from physis_ros.launcher import Child, serve_command, synthetic_command

from rosprobe import DOMAIN, JOINTS, NODE, NODE_ARGS, TAG, Probe, admitted_stream, child_env, write_config

pytestmark = pytest.mark.slow   # starts programs, workers or ROS nodes: not in `make test-fast`

SERVE_YAML = repo_config_dir() / "serve.yaml"
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
BEST_EFFORT = QoSProfile(depth=100, reliability=ReliabilityPolicy.BEST_EFFORT)
RUNTIME = {"slo_interval_ms", "trajectory_start", "trajectory_start_offset_s", "seam_blend_steps", "image.preprocess",
           "image.pad_value", "max_future_s", "max_age_s"}
START_TIMEOUT = 90.0


@contextlib.contextmanager
def server_node(*ros_args: str, file_mapping=None, overrides=None, **kw):
    import rclpy

    from physis_ros.ros.node import PhysisServer

    context = rclpy.Context()
    rclpy.init(args=["physis-serve", "--ros-args", *ros_args] if ros_args else ["physis-serve"],
               context=context, domain_id=DOMAIN)
    try:
        node = PhysisServer(file_mapping, overrides, context=context, **kw)
        try:
            yield node
        finally:
            node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


def ros_sides(node) -> None:
    """The config streams' ROS side, as admission makes it once the node is configured (no engine here)."""
    for name, s in node.config.streams.items():
        node.streams[name] = admitted_stream(node, name, s)


def flat_leaves(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_leaves(value, name + "."))
        else:
            out[name] = value
    return out


def describe(node, name):
    return node.describe_parameter(name)


# ---- declarations (in process) -------------------------------------------------------------------
def test_every_config_key_is_declared_with_its_value_description_and_range():
    with server_node("--params-file", str(SERVE_YAML)) as node:
        declared = set(node._parameters)
        leaves = flat_leaves(to_mapping(node.config))
        expected = {k for k, v in leaves.items() if k != "streams.robot0.qos.input" and k != "streams.robot1.qos.input"}
        for s in ("robot0", "robot1"):  # an unset optional section: its keys are declared, unset
            expected |= {f"streams.{s}.qos.input.{k}" for k in ("reliability", "depth", "durability")}
        missing = sorted(expected - declared)
        assert not missing, f"not declared: {missing}"
        # values are the config's
        for name, value in leaves.items():
            if name in declared and value is not None:
                got = node.get_parameter(name).value
                got = list(got) if isinstance(value, list) else got
                assert got == value, name
        # Issue 48 item 2: every declared parameter has a value (`get` of an unset slo_interval_ms printed none);
        # an unset optional key holds the value that means unset, said in its description
        unset = sorted(n for n in declared if node.get_parameter(n).type_ == Parameter.Type.NOT_SET)
        assert unset == [], unset
        assert node.get_parameter("engine.profile").value == ""
        assert node.get_parameter("streams.robot0.slo_interval_ms").value == 0.0
        assert node.get_parameter("streams.robot0.qos.input.depth").value == 0
        assert "0.0 means unset" in describe(node, "streams.robot0.slo_interval_ms").additional_constraints
        d = describe(node, "engine.workers")
        assert d.read_only and d.integer_range[0].from_value == 1 and d.integer_range[0].to_value == 64
        d = describe(node, "streams.robot0.control_rate_hz")
        r = d.floating_point_range[0]
        # a stream's fixed keys leave with it, and ROS 2 cannot undeclare a read-only parameter: our check refuses
        assert not d.read_only and "fixed while the stream is served" in d.additional_constraints
        assert (r.from_value, r.to_value) == (0.1, 10_000.0)
        assert d.description
        d = describe(node, "streams.robot0.image.preprocess")
        assert not d.read_only and "resize" in d.additional_constraints and "center_crop" in d.additional_constraints
        d = describe(node, "streams.robot0.image.pad_value")
        r = d.floating_point_range[0]
        assert not d.read_only and (r.from_value, r.to_value) == (0.0, 1.0)
        for s in ("robot0", "robot1"):
            for key in RUNTIME:
                assert not describe(node, f"streams.{s}.{key}").read_only, key
        assert not describe(node, "warn_throttle_s").read_only
        for name in ("model", "engine.plan", "deterministic", "telemetry_topic", "diagnostics_period_s"):
            assert describe(node, name).read_only, name
        for name in ("streams.robot0.joint_names", "streams.robot0.namespace", "streams.robot0.topics.joint_trajectory",
                     "streams.robot0.qos.action_chunk.reliability"):
            d = describe(node, name)
            assert not d.read_only and "fixed while the stream is served" in d.additional_constraints, name


def test_every_parameter_read_back_and_passed_in_again_gives_the_same_config(tmp_path):
    """Issue 48 item 2: what `ros2 param get` returns for every key (an unset one reads as its unset value) can
    be given back as a parameter and means the same: a params file of every declared value read from one node
    starts a second node on the same config (unset QoS sections stay unset, unset SLOs stay unset)."""
    from physis_ros.serving.config import unflatten

    with server_node("--params-file", str(SERVE_YAML)) as node:
        values = {n: node.get_parameter(n).value for n in node.params.types}
        first = node.config
    values = {n: list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else v for n, v in values.items()}
    assert values["streams.robot0.slo_interval_ms"] == 0.0 and values["streams.robot0.qos.input.depth"] == 0
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": unflatten(values)}}))
    with server_node("--params-file", str(path)) as node:
        assert node.config == first
        assert node.config.streams["robot0"].qos.input is None and node.config.streams["robot0"].slo_interval_ms is None


def _described(node, prefix: str) -> list[str]:
    names = [n for n in node._parameters if n.startswith(prefix)]
    assert names
    return [n for n in names if not describe(node, n).description]


def test_every_serve_parameter_has_a_description():
    with server_node("--params-file", str(SERVE_YAML)) as node:
        assert _described(node, "streams.") == []
        top = [n for n in node._parameters
               if "." not in n and n not in ("use_sim_time", "start_type_description_service")]
        assert [n for n in top if not describe(node, n).description] == []


def test_every_engine_parameter_has_a_description():
    with server_node("--params-file", str(SERVE_YAML)) as node:
        assert _described(node, "engine.") == []


def test_config_file_values_become_the_declared_parameters():
    """--config FILE: the node declares parameters whose values are the merged config."""
    mapping = {"streams": {"arm": {"joint_names": JOINTS, "slo_interval_ms": 40.0, "namespace": f"{TAG}_arm"}},
               "engine": {"workers": 2}}
    with server_node("-p", "streams.arm.max_age_s:=3.0", file_mapping=mapping,
                     overrides={"engine": {"workers": 1}}) as node:
        assert node.get_parameter("streams.arm.slo_interval_ms").value == 40.0
        assert node.get_parameter("streams.arm.max_age_s").value == 3.0       # ROS parameter over the file
        assert node.get_parameter("engine.workers").value == 1                # command line over both
        assert node.get_parameter("streams.arm.joint_names").value == JOINTS
        assert node.config.engine.workers == 1


# ---- changing parameters (in process) ------------------------------------------------------------
def test_read_only_parameters_refuse_changes_with_a_reason():
    """The defect: set_parameters reported success for control_rate_hz:=-1.0 or engine.workers:=7 and
    nothing changed."""
    with server_node("--params-file", str(SERVE_YAML)) as node:
        for param in (Parameter("engine.workers", value=7), Parameter("model", value="tiny-acwm")):
            (result,) = node.set_parameters([param])
            assert not result.successful, param.name
            assert param.name in result.reason and "read-only" in result.reason
        for param, why in ((Parameter("streams.robot0.control_rate_hz", value=-1.0), "out of range"),
                           (Parameter("streams.robot0.control_rate_hz", value=25.0), "cannot change while the "
                                                                                      "stream is served")):
            (result,) = node.set_parameters([param])
            assert not result.successful and param.name in result.reason and why in result.reason, result.reason
        assert node.get_parameter("streams.robot0.control_rate_hz").value == 50.0
        assert node.get_parameter("engine.workers").value == 2


def test_runtime_parameters_are_validated_like_the_config_and_applied():
    with server_node("--params-file", str(SERVE_YAML)) as node:
        ros_sides(node)
        # Ranges are checked by rclpy from the descriptor ("out of range Min: 0.0, Max: 1.0"), the rest by
        # the config's own validation ("must be > 0.0", "allowed values: ...").
        bad = [(Parameter("streams.robot0.slo_interval_ms", value=-5.0), "Min: 0.0"),
               (Parameter("streams.robot0.slo_interval_ms", value=500.0), "longer than the control timeline"),
               (Parameter("streams.robot0.image.preprocess", value="zoom"), "'resize', 'center_crop', 'pad'"),
               (Parameter("streams.robot0.trajectory_start", value="later"), "'observation', 'emit'"),
               (Parameter("streams.robot0.image.pad_value", value=2.0), "Max: 1.0"),
               (Parameter("streams.robot0.max_age_s", value="old"), "Wrong parameter type"),
               (Parameter("warn_throttle_s", value=-1.0), "Min: 0.0")]
        for param, fix in bad:
            (result,) = node.set_parameters([param])
            assert not result.successful, param.name
            assert fix in result.reason, result.reason
            assert param.name in result.reason or fix == "Wrong parameter type", result.reason
        assert node.config.streams["robot0"].slo_interval_ms is None     # unset: the timeline's 160 ms
        # Valid values take effect: the config the node runs on changes; integers are taken as floats.
        results = node.set_parameters([Parameter("streams.robot0.slo_interval_ms", value=40),
                                       Parameter("streams.robot0.image.preprocess", value="pad"),
                                       Parameter("streams.robot1.max_age_s", value=2.5),
                                       Parameter("streams.robot0.trajectory_start_offset_s", value=0.1),
                                       Parameter("warn_throttle_s", value=1.0)])
        assert all(r.successful for r in results), [r.reason for r in results]
        cfg = node.config
        assert cfg.streams["robot0"].slo_interval_ms == 40.0 and cfg.streams["robot0"].image.preprocess == "pad"
        assert cfg.streams["robot0"].trajectory_start_offset_s == 0.1 and cfg.warn_throttle_s == 1.0
        assert cfg.streams["robot1"].max_age_s == 2.5
        assert node.streams["robot0"].config == cfg.streams["robot0"]          # what the callbacks read
        assert node.streams["robot1"].input.max_age_s == 2.5
        assert node.get_parameter("streams.robot0.slo_interval_ms").value == 40.0
        (result,) = node.set_parameters([Parameter("streams.robot0.slo_interval_ms", value=0.0)])
        assert result.successful, result.reason                                 # 0: unset again, the timeline's
        assert node.config.streams["robot0"].slo_interval_ms is None and node.streams["robot0"].slo_interval_ms == 160.0
        # All or nothing: one bad value in an atomic set changes nothing.
        result = node.set_parameters_atomically([Parameter("streams.robot0.max_future_s", value=1.0),
                                                 Parameter("streams.robot0.max_age_s", value=-1.0)])
        assert not result.successful and "streams.robot0.max_age_s" in result.reason
        assert node.config.streams["robot0"].max_future_s == 0.5


# ---- foreign keys and QoS overrides (in process) -------------------------------------------------
def shared_params_file(tmp_path, extra: dict) -> str:
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": extra}}))
    return str(path)


def test_foreign_keys_in_a_shared_parameters_file_are_ignored(tmp_path):
    """The defect: automatically declared overrides + strict validation made any key another node
    reads from a shared '/**' file fatal."""
    shared = shared_params_file(tmp_path, {"controller_frequency": 100.0, "robot_description": "<robot/>",
                                           "engine": {"workers": 1, "speed": 3},
                                           "streams": {"robot0": {"slo_interval_ms": 80.0, "gain": 2.0}}})
    with server_node("--params-file", str(SERVE_YAML), "--params-file", shared) as node:
        assert node.config.engine.workers == 1 and node.config.streams["robot0"].slo_interval_ms == 80.0
        assert node.ignored_parameters == ["controller_frequency", "engine.speed", "robot_description",
                                           "streams.robot0.gain"]
        assert not node.has_parameter("controller_frequency")


def test_unknown_key_in_the_config_file_itself_stays_an_error(tmp_path, capsys):
    from physis_ros.cli.serve import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "streams": {"robot0": {"joint_names": JOINTS, "gain": 2.0}}}}}))
    assert main(["--config", str(bad)]) == 2
    assert "streams.robot0.gain" in capsys.readouterr().err
    # A wrongly typed value of a known key in ROS parameters is a config error too (no --config).
    with pytest.raises(ConfigError) as err:
        with server_node("--params-file", str(SERVE_YAML), "-p", "deterministic_queue:=many"):
            pass
    assert err.value.key == "deterministic_queue"


def test_qos_overrides_apply_to_the_output_publishers():
    with server_node("--params-file", str(SERVE_YAML),
                     "-p", "qos_overrides./robot0/action_chunk.publisher.reliability:=best_effort",
                     "-p", "qos_overrides./robot0/action_chunk.publisher.depth:=3",
                     "-p", "qos_overrides./robot1/joint_trajectory.publisher.durability:=transient_local") as node:
        ros_sides(node)
        q = node.streams["robot0"].pub_chunk.qos_profile
        assert q.reliability == ReliabilityPolicy.BEST_EFFORT and q.depth == 3
        assert node.streams["robot0"].pub_traj.qos_profile.reliability == ReliabilityPolicy.RELIABLE
        from rclpy.qos import DurabilityPolicy
        assert node.streams["robot1"].pub_traj.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL
        assert node.get_parameter("qos_overrides./robot0/action_chunk.publisher.reliability").value == "best_effort"
        assert node.has_parameter("qos_overrides./telemetry.publisher.reliability")
        assert node.ignored_parameters == []


# ---- live: one server process, the standard parameter services -----------------------------------
class Live:
    def __init__(self, tmp):
        from diagnostic_msgs.msg import DiagnosticArray
        from trajectory_msgs.msg import JointTrajectory

        from physis_ros.msg import ActionChunk, ChunkTelemetry

        self.marker = uuid.uuid4().hex
        self.ns = f"{TAG}_p0"
        self.telemetry = f"/{TAG}_ptelemetry"
        self.config = write_config(tmp / "serve.yaml", {
            "p0": {"namespace": self.ns, "joint_names": JOINTS, "max_age_s": 5.0}},
            telemetry_topic=self.telemetry, diagnostics_period_s=0.5, engine={"workers": 1, "plan": "sequential"})
        shared = tmp / "shared.yaml"
        shared.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
            "controller_frequency": 100.0, "base_frame": "base_link",
            f"qos_overrides./{self.ns}/action_chunk.publisher.reliability": "best_effort"}}}))
        self.probe = Probe("physis_param_probe")
        self.probe.subscribe("chunk_be", ActionChunk, f"/{self.ns}/action_chunk", BEST_EFFORT)
        self.probe.subscribe("chunk_rel", ActionChunk, f"/{self.ns}/action_chunk", RELIABLE)
        self.probe.subscribe("traj", JointTrajectory, f"/{self.ns}/joint_trajectory", RELIABLE)
        self.probe.subscribe("telemetry", ChunkTelemetry, self.telemetry, RELIABLE)
        self.probe.subscribe("diagnostics", DiagnosticArray, "/diagnostics", QoSProfile(depth=50))
        env = child_env(self.marker)
        self.synthetic = Child("synthetic", synthetic_command(self.config, "--rate", "20", "--width", "40",
                                                              "--height", "30"), env=env, log=tmp / "synthetic.log")
        self.server = Child("server", serve_command(self.config, "--duration", "120", *NODE_ARGS,
                                                    "--params-file", str(shared)), env=env, log=tmp / "serve.log")
        from rclpy.parameter_client import AsyncParameterClient
        self.params = AsyncParameterClient(self.probe.node, NODE)

    def call(self, future, timeout=10.0):
        self.probe.wait(future.done, timeout, "a parameter service reply")
        return future.result()

    def set(self, **values):
        params = [Parameter(k.replace("__", "."), value=v) for k, v in values.items()]
        return self.call(self.params.set_parameters(params)).results

    def stop(self):
        return self.server.stop(30.0), self.synthetic.stop(10.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("params"))
    try:
        try:
            live.probe.wait(lambda: live.probe.count("telemetry") >= 5 or live.server.poll() is not None,
                            START_TIMEOUT, "5 chunks")
        except AssertionError:
            raise AssertionError(f"server log:\n{live.server.tail(40)}") from None
        assert live.server.poll() is None, f"server exited:\n{live.server.tail(40)}"
        assert live.params.wait_for_services(10.0)
        yield live
    finally:
        live.stop()
        live.probe.close()


def test_live_parameter_services_list_and_describe_every_key(live):
    names = set(live.call(live.params.list_parameters()).result.names)
    for key in ("model", "engine.workers", "engine.plan", "streams.p0.slo_interval_ms", "streams.p0.joint_names",
                "streams.p0.image.preprocess", "streams.p0.qos.input.depth", "diagnostics_miss_rate_warn",
                f"qos_overrides./{live.ns}/action_chunk.publisher.reliability"):
        assert key in names, key
    assert "controller_frequency" not in names and "base_frame" not in names
    values = live.call(live.params.get_parameters(sorted(n for n in names if not n.startswith("qos_overrides")))).values
    assert all(v.type != 0 for v in values), "a declared parameter with no value"      # 0: PARAMETER_NOT_SET
    descs = live.call(live.params.describe_parameters(["engine.workers", "streams.p0.slo_interval_ms"])).descriptors
    assert descs[0].read_only and descs[0].integer_range[0].from_value == 1
    assert not descs[1].read_only and descs[1].description
    log = live.server.log_path.read_text()
    assert log.count("ignoring parameters not known to physis_server") == 1, log
    assert "base_frame, controller_frequency" in log


def test_live_qos_override_makes_action_chunk_best_effort(live):
    infos = live.probe.node.get_publishers_info_by_topic(f"/{live.ns}/action_chunk")
    assert len(infos) == 1 and infos[0].qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT
    live.probe.wait(lambda: live.probe.count("chunk_be") >= 3, 20, "best-effort action chunks")
    assert live.probe.count("chunk_rel") == 0   # a RELIABLE subscriber cannot match a best-effort publisher
    assert live.probe.count("traj") >= 3         # the trajectory publisher kept its RELIABLE default


def test_live_bad_values_are_refused_with_the_key_and_the_fix(live):
    (r,) = live.set(streams__p0__control_rate_hz=-1.0)
    assert not r.successful and "streams.p0.control_rate_hz" in r.reason
    (r,) = live.set(engine__workers=7)
    assert not r.successful and "engine.workers" in r.reason
    (r,) = live.set(streams__p0__image__preprocess="zoom")
    assert not r.successful and "streams.p0.image.preprocess" in r.reason and "center_crop" in r.reason
    # Bug found: 1e308 was taken, and every publish of the stream then failed, uncounted
    (r,) = live.set(streams__p0__trajectory_start_offset_s=1e308)
    assert not r.successful and "streams.p0.trajectory_start_offset_s" in r.reason
    got = live.call(live.params.get_parameters(["streams.p0.control_rate_hz", "engine.workers",
                                                "streams.p0.trajectory_start_offset_s"])).values
    assert (got[0].double_value, got[1].integer_value, got[2].double_value) == (50.0, 1, 0.0)


def test_live_slo_change_takes_effect_in_telemetry_and_diagnostics(live):
    (r,) = live.set(streams__p0__slo_interval_ms=1.0)   # far below what a CPU pipeline can do
    assert r.successful, r.reason
    start = live.probe.count("telemetry")
    live.probe.wait(lambda: live.probe.count("telemetry") >= start + 6, 20, "more telemetry")
    after = [m for m, _ in live.probe.get("telemetry")[start + 2:]]
    assert after and all(m.deadline_miss for m in after), [m.output_interval_ms for m in after]
    live.probe.wait(lambda: live.probe.status("p0").get("slo_interval_ms") == "1.000", 10,
                    "/diagnostics to show the new SLO")
    live.probe.wait(lambda: live.probe.status("p0").get("_level") == 1, 10, "a WARN for the missed SLO")
    (r,) = live.set(streams__p0__slo_interval_ms=500.0)   # longer than its control timeline allows: refused
    assert not r.successful and "control timeline" in r.reason and "160 ms" in r.reason, r.reason
    (r,) = live.set(streams__p0__slo_interval_ms=160.0)   # back to its timeline (it is paced 5 % faster)
    assert r.successful
    start = live.probe.count("telemetry")
    live.probe.wait(lambda: live.probe.count("telemetry") >= start + 8, 20, "more telemetry")
    assert sum(m.deadline_miss for m, _ in live.probe.get("telemetry")[start + 2:]) <= 1


def test_live_trajectory_start_offset_takes_effect(live):
    for r in live.set(streams__p0__trajectory_start="observation", streams__p0__trajectory_start_offset_s=0.25):
        assert r.successful, r.reason
    start = live.probe.count("traj")
    live.probe.wait(lambda: live.probe.count("traj") >= start + 4, 20, "more trajectories")
    chunks = {m.chunk_index: m for m, _ in live.probe.get("chunk_be")}
    checked = 0
    for traj, info in live.probe.get("traj")[start + 1:]:
        chunk = chunks.get(info["publication_sequence_number"] - 1)
        if chunk is None:
            continue
        obs = chunk.header.stamp.sec + chunk.header.stamp.nanosec * 1e-9
        got = traj.header.stamp.sec + traj.header.stamp.nanosec * 1e-9
        assert got == pytest.approx(obs + 0.25 + chunk.late_points * 0.02, abs=1e-6)   # row 0 due at obs + offset
        checked += 1
    assert checked >= 2
    assert live.server.poll() is None
