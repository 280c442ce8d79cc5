"""Admission policies as plug-ins (physis_ros.serving.policies, issue 52 part 3 of the plan: item 3): the base
policy and named checks; cpu-host only for CPU workers (auto picks it there, base for GPU workers, cpu-host on
a GPU refused by its dotted key); what each policy builds; a check and a policy registered by a package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from physis_ros.config import ConfigError
from physis_ros.model.spec import load_model_config
from physis_ros.runtime.settings import EngineConfig
from physis_ros.runtime.streams import ServedModel
from physis_ros.serving import Rejected, Server
from physis_ros.serving import policies
from physis_ros.serving.config import serve_config
from physis_ros.serving.policies import AdmissionPolicy, Check, register_check, register_policy, server_admission

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduling"))
from sched_helpers import make_profile  # noqa: E402

WAM = load_model_config("tiny-wam")
GPUS = {"workers": 2, "devices": ["cuda:0", "cuda:1"]}


def cfg(engine: dict | None = None, **admission):
    return serve_config({"engine": {"workers": 2, **(engine or {})}, "admission": admission})


def wam(stage_ms: float = 0.5) -> ServedModel:
    return ServedModel(WAM, None, make_profile("tiny-wam", steps=WAM.steps, blocks=WAM.blocks, stage_ms=stage_ms,
                                                  weight_gb=0.001))


def test_auto_is_cpu_host_for_cpu_workers_and_base_for_gpu_workers_and_cpu_host_never_runs_on_a_gpu():
    cpu, _, cpu_policy = server_admission(cfg(), cores=2)
    gpu, device, gpu_policy = server_admission(cfg(GPUS), cores=2)
    assert (cpu_policy.name, gpu_policy.name, device) == ("cpu-host", "base", "h200")
    # cpu-host: the host budget (host-cpu), the cores shared in the jitter bound, measured spreads, a host
    # share per worker (2 cores - 0.75 reserve: at most 1 core each, so the configured 0.1 headroom stays)
    assert cpu.host is not None and cpu.cluster.jitter.shared_cores == pytest.approx(1.25)
    assert cpu.intervals is not None and cpu.calibration is not None and cpu.bound_jitter
    # base on GPUs: none of the host's parts; the named checks of admission.checks still apply
    assert gpu.host is None and gpu.cluster.jitter.shared_cores is None and gpu.intervals is None
    assert gpu.calibration is not None and gpu.bound_jitter
    with pytest.raises(ConfigError) as exc:
        cfg(GPUS, policy="cpu-host")
    assert exc.value.key == "admission.policy" and "cpu workers only" in str(exc.value), exc.value
    with pytest.raises(ConfigError) as exc:     # the runtime part alone cannot be forced onto a GPU either
        EngineConfig(workers=1, devices=["cuda:0"], cpu_host="on").validate()
    assert "cpu_host" in str(exc.value)
    assert EngineConfig(workers=1, devices=["cuda:0"]).host_measures is False
    assert EngineConfig(workers=1).host_measures is True


def test_base_on_cpu_workers_books_the_cost_model_alone_and_admits_what_cpu_host_refuses():
    """Each stream 16 ms of work per 100 ms plus the node's 0.08 core: under cpu-host the 2-core host's budget
    (workers + 0.75 + 0.08 per stream within 1.8 cores) refuses what the workers' time alone would take."""
    host, _, _ = server_admission(cfg(checks=[]), cores=2)
    base, _, _ = server_admission(cfg(policy="base", checks=[]), cores=2)
    assert base.host is None and base.cluster.jitter.shared_cores is None and base.intervals is None
    admitted = {"cpu-host": 0, "base": 0}
    for name, adm in (("cpu-host", host), ("base", base)):
        for i in range(20):
            try:
                adm.admit(f"r{i}", wam(), 100.0)
            except Rejected as exc:
                assert exc.reason == "capacity", exc
                break
            admitted[name] += 1
    assert admitted["cpu-host"] < admitted["base"], admitted
    with pytest.raises(Rejected) as exc:
        host.admit("one-more", wam(), 100.0)
    assert exc.value.cause == "host-cpu"


def test_checks_are_named_validated_and_each_one_installs_its_part():
    none, _, _ = server_admission(cfg(policy="base", checks=[]), cores=2)
    assert not none.bound_jitter and none.calibration is None and none.intervals is None
    # cpu-host's measured-spread works through jitter-bound and load-calibration: without them it is left out
    bare, _, policy = server_admission(cfg(checks=[]), cores=2)
    assert policy.name == "cpu-host" and bare.host is not None and bare.intervals is None
    spread, _, _ = server_admission(cfg(GPUS, checks=["jitter-bound", "load-calibration", "measured-spread"]), cores=2)
    assert spread.intervals is not None and spread.host is None
    det = serve_config({"engine": {"workers": 2}, "deterministic": True})
    fixed, _, _ = server_admission(det, cores=2)   # deterministic serving: decided from the profiles alone
    assert fixed.calibration is None and fixed.intervals is None and fixed.bound_jitter
    for admission, key, words in (
            ({"checks": ["jitter-bound", "nope"]}, "admission.checks", "'nope' is not an admission check"),
            ({"checks": ["measured-spread"]}, "admission.checks", "needs jitter-bound, load-calibration"),
            ({"policy": "fastest"}, "admission.policy", "'fastest' is not an admission policy")):
        with pytest.raises(ConfigError) as exc:
            cfg(**admission)
        assert exc.value.key == key and words in str(exc.value), exc.value


def test_engine_cpu_host_follows_the_policy_and_a_contradiction_is_refused_by_its_key():
    with pytest.raises(ConfigError) as exc:
        cfg({"cpu_host": "on"}, policy="base")
    assert exc.value.key == "engine.cpu_host" and "admission.policy base" in str(exc.value), exc.value
    cfg({"cpu_host": "on"})          # the same as auto's cpu-host: fine
    server = Server(cfg(policy="base"))
    assert server.policy.name == "base" and server.catalog.corun_slowdown == 1.0
    server = Server(cfg(corun_slowdown=1.3))
    assert server.policy.cpu_host and server.catalog.corun_slowdown == 1.3


@pytest.fixture
def plugin():
    """A package's own check and policy, registered by name (and taken out again after the test)."""
    def install(parts):
        def veto(admission, stream, factors):
            if len(admission.admitted) >= 1:
                raise Rejected("capacity", f"one robot per server here, {stream} is the second", cause="solo")
        parts.vetoes.append(veto)

    check = register_check(Check("solo", "one stream per server", install))
    policy = register_policy(AdmissionPolicy("solo-gpu", "base plus solo", checks=("solo",), devices=("cuda",)))
    yield check, policy
    policies.CHECKS.pop("solo")
    policies.POLICIES.pop("solo-gpu")


def test_a_check_and_a_policy_registered_by_a_package_are_served_by_name(plugin):
    adm, _, policy = server_admission(cfg(GPUS, policy="solo-gpu"), cores=2)
    assert policy is plugin[1]
    adm.admit("a", wam(), 100.0)
    before = adm.utilisation()
    with pytest.raises(Rejected) as exc:
        adm.admit("b", wam(), 100.0)
    assert exc.value.cause == "solo" and "b is the second" in exc.value.detail
    assert adm.utilisation() == before and set(adm.admitted) == {"a"}   # the veto's placement undone
    listed, _, _ = server_admission(cfg(checks=["solo"]), cores=2)      # or named in admission.checks
    listed.admit("a", wam(), 100.0)
    with pytest.raises(Rejected):
        listed.admit("b", wam(), 100.0)
    with pytest.raises(ConfigError) as exc:                             # its devices are kept to
        cfg(policy="solo-gpu")
    assert exc.value.key == "admission.policy"
    with pytest.raises(ValueError):
        register_check(Check("solo", "another solo", lambda parts: None))
    with pytest.raises(ValueError):
        register_policy(AdmissionPolicy("ghost", "names a check nobody registered", checks=("ghost-check",)))
