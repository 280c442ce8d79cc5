"""Admission policies: how a server decides whether a stream fits, as a base policy plus checks by name.

The **base** policy is the cost model's capacity and the SLO: each stream's ranks placed by Best-Fit + LDS
on its model's cost profile, every worker kept ``admission.headroom`` free, the stream's stages within its
SLO (:class:`~physis_ros.serving.capacity.ServerAdmission`). **Checks** add refusals by name
(``admission.checks``, from :data:`CHECKS`; a package may :func:`register_check` its own):

- ``jitter-bound``: no placement may delay a stream's chunk by more than its SLO leaves over its release
  interval (``latency-jitter``), counting the chunks that share its workers;
- ``load-calibration``: a worker measured busier than its profiles say books that much less
  (:class:`~physis_ros.serving.calibration.LoadCalibration`; never in deterministic serving);
- ``measured-spread``: each stream is also charged what its published intervals were measured to vary
  beyond its jitter bound (:class:`~physis_ros.serving.calibration.IntervalCalibration`; needs the two above);
- ``host-cpu``: CPU workers and the node share one host's cores (:class:`HostBudget`).

A **policy** (``admission.policy``, from :data:`POLICIES`) is the base plus the checks it always applies and
what it changes in the runtime. ``cpu-host`` is what a host whose workers are its own CPU cores needs and a
GPU worker pool never runs (``auto`` picks it for CPU workers, ``base`` for GPU workers; ``cpu-host`` on a
GPU is refused): ``host-cpu`` and ``measured-spread``; each worker at most ``cores - host_reserve_cores`` of
a core (:func:`worker_headroom`); workers busy at once sharing the cores (the jitter bound's
``shared_cores``); profiles measured here slowed by ``admission.corun_slowdown`` (co-run contention); and
in the runtime ``engine.cpu_host`` (a worker rehearses a stream's first task on its Wake, the engine polls
for an announced output). docs/scheduling.md has the measurements behind each.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from physis_ros.config import ConfigError
from physis_ros.serving.calibration import IntervalCalibration, LoadCalibration
from physis_ros.serving.capacity import HostBudget, ServerAdmission, host_memory_bytes
from physis_ros.scheduling.settings import load_device, load_scheduling

if TYPE_CHECKING:
    from physis_ros.serving.config import ServeConfig


@dataclass
class AdmissionParts:
    """What a server's admission is built from (:class:`ServerAdmission`'s arguments), as the policy and its
    checks fill them in. ``cores``: the host's CPU cores; ``device``: the device spec name admitted on."""

    config: ServeConfig
    device: str
    cores: int
    headroom: float
    host: HostBudget | None = None
    calibration: LoadCalibration | None = None
    intervals: IntervalCalibration | None = None
    bound_jitter: bool = False
    vetoes: list[Callable] = field(default_factory=list)   # (admission, stream, factors) -> None or raise Rejected

    def build(self) -> ServerAdmission:
        cfg = self.config
        scheduling = dataclasses.replace(load_scheduling(), headroom=self.headroom)
        max_batch = cfg.engine.max_batch if cfg.engine.batching != "off" and not cfg.deterministic else 1
        return ServerAdmission(cfg.engine.workers, load_device(self.device), scheduling, max_batch, self.host,
                               self.calibration, deadline_order=cfg.engine.policy == "edf",
                               bound_jitter=self.bound_jitter, intervals=self.intervals,
                               enforce=cfg.admission.enforce, vetoes=self.vetoes)


@dataclass(frozen=True)
class Check:
    """A named admission check: ``install`` adds it to the parts of a server's admission; ``needs``: the
    checks it works through (listed before it)."""

    name: str
    doc: str
    install: Callable[[AdmissionParts], None]
    needs: tuple[str, ...] = ()


def _jitter_bound(parts: AdmissionParts) -> None:
    parts.bound_jitter = True


def _load_calibration(parts: AdmissionParts) -> None:
    # Deterministic serving (bag checks) decides from the profiles alone: its decisions must not depend on timing.
    if not parts.config.deterministic:
        parts.calibration = LoadCalibration()


def _measured_spread(parts: AdmissionParts) -> None:
    if parts.calibration is not None:
        parts.intervals = IntervalCalibration()


def _host_cpu(parts: AdmissionParts) -> None:
    adm = parts.config.admission
    parts.host = HostBudget(parts.cores, adm.host_reserve_cores, adm.host_cores_per_stream, adm.headroom,
                            host_memory_bytes())


CHECKS: dict[str, Check] = {}


def register_check(check: Check) -> Check:
    """Make ``check`` available to ``admission.checks`` and to policies by its name (a package's own check
    registers before its server is built)."""
    if check.name in CHECKS and CHECKS[check.name] != check:
        raise ValueError(f"an admission check named {check.name!r} is registered already")
    CHECKS[check.name] = check
    return check


for _check in (
        Check("jitter-bound", "refuse placements that could delay a stream's chunk past what its SLO leaves over "
                              "its release interval (latency-jitter)", _jitter_bound),
        Check("load-calibration", "book each worker at its measured busy / booked factor (never in deterministic "
                                  "serving)", _load_calibration),
        Check("measured-spread", "charge each stream what its published intervals were measured to vary beyond "
                                 "its jitter bound", _measured_spread, needs=("jitter-bound", "load-calibration")),
        Check("host-cpu", "CPU workers' load plus host_reserve_cores plus host_cores_per_stream per stream within "
                          "the host's cores; workers busy at once share them", _host_cpu)):
    register_check(_check)


@dataclass(frozen=True)
class AdmissionPolicy:
    """A base policy with what it adds. ``checks``: applied always, after ``admission.checks``;
    ``devices``: the worker devices it may serve (``cpu``, ``cuda``; empty: any); ``host_share``: each
    worker may use at most ``cores - host_reserve_cores`` of a core; ``corun``: profiles measured here are
    slowed by ``admission.corun_slowdown``; ``cpu_host``: the runtime's ``engine.cpu_host``."""

    name: str
    doc: str
    checks: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    host_share: bool = False
    corun: bool = False
    cpu_host: bool = False

    def corun_slowdown(self, config: ServeConfig) -> float:
        """What a profile measured on one busy process is slowed by when served under this policy."""
        return config.admission.corun_slowdown if self.corun else 1.0


POLICIES: dict[str, AdmissionPolicy] = {}


def register_policy(policy: AdmissionPolicy) -> AdmissionPolicy:
    """Make ``policy`` available to ``admission.policy`` by its name (its checks registered before it)."""
    unknown = [c for c in policy.checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"admission policy {policy.name!r} names unregistered checks: {', '.join(unknown)}")
    if policy.name in POLICIES and POLICIES[policy.name] != policy:
        raise ValueError(f"an admission policy named {policy.name!r} is registered already")
    POLICIES[policy.name] = policy
    return policy


BASE = register_policy(AdmissionPolicy("base", "the cost model's capacity and the SLO, plus admission.checks"))
CPU_HOST = register_policy(AdmissionPolicy(
    "cpu-host", "base plus what CPU workers sharing one host need: host-cpu, measured-spread, a host share per "
                "worker, co-run contention, and the runtime's cpu_host measures",
    checks=("host-cpu", "measured-spread"), devices=("cpu",), host_share=True, corun=True, cpu_host=True))


def worker_devices(config: ServeConfig) -> set[str]:
    """The kinds of device the workers run on (``cpu``, ``cuda``)."""
    return {"cpu" if config.engine.device_of(i) == "cpu" else "cuda" for i in range(config.engine.workers)}


def resolve_policy(config: ServeConfig) -> AdmissionPolicy:
    """The policy ``admission.policy`` names for these workers (``auto``: cpu-host when every worker is a CPU,
    else base); ConfigError naming ``admission.policy`` or ``admission.checks`` when it cannot serve them."""
    name = config.admission.policy
    kinds = worker_devices(config)
    if name == "auto":
        name = CPU_HOST.name if kinds == {"cpu"} else BASE.name
    policy = POLICIES.get(name)
    if policy is None:
        raise ConfigError("admission.policy", f"{name!r} is not an admission policy; use auto or one of "
                                              f"{', '.join(sorted(POLICIES))}")
    if policy.devices and not kinds <= set(policy.devices):
        raise ConfigError("admission.policy", f"{name} serves {'/'.join(policy.devices)} workers only and these "
                                              f"run on {'/'.join(sorted(kinds))}: use auto or base")
    listed = config.admission.checks
    for i, check in enumerate(listed):
        if check not in CHECKS:
            raise ConfigError("admission.checks", f"{check!r} is not an admission check; use any of "
                                                  f"{', '.join(sorted(CHECKS))}")
        missing = [n for n in CHECKS[check].needs if n not in listed[:i]]
        if missing:
            raise ConfigError("admission.checks", f"{check} needs {', '.join(missing)} before it in the list")
    return policy


def policy_checks(config: ServeConfig, policy: AdmissionPolicy) -> list[str]:
    """The checks a server applies, in order: ``admission.checks``, then the policy's own that are not
    listed, each where the checks it needs are (``measured-spread`` works through ``jitter-bound`` and
    ``load-calibration``: with either left out of ``admission.checks`` the policy does without it)."""
    out = list(config.admission.checks)
    for name in policy.checks:
        if name not in out and all(n in out for n in CHECKS[name].needs):
            out.append(name)
    return out


def worker_headroom(headroom: float, reserve_cores: float, cores: int) -> float:
    """The fraction of each CPU worker's time admission keeps free when the workers share the host's
    ``cores`` with the node (ROS callbacks, image conversion, publishing) and whatever else runs there:
    one may use at most ``cores - reserve_cores`` of a core (and a worker process runs on one core),
    however fast one stage is alone. What they may use together is the host budget's (``host-cpu``), and
    what two busy at once cost each other is the jitter bound's (``JitterBound.shared_cores``); an equal
    split of the cores would refuse the third robot a worker holds staggered while the other worker idles."""
    share = min(1.0, max(0.0, cores - reserve_cores))
    return max(headroom, 1.0 - share)


def server_admission(config: ServeConfig, cores: int | None = None) -> tuple[ServerAdmission, str, AdmissionPolicy]:
    """The admission of a server with config ``config``: (it, the device spec name it admits on, its policy).
    ``cores``: the host's (default: this one's)."""
    policy = resolve_policy(config)
    adm = config.admission
    device = adm.device or ("cpu" if config.engine.device_of(0) == "cpu" else "h200")
    cores = cores or os.cpu_count() or 1
    headroom = worker_headroom(adm.headroom, adm.host_reserve_cores, cores) if policy.host_share else adm.headroom
    parts = AdmissionParts(config, device, cores, headroom)
    for name in policy_checks(config, policy):
        CHECKS[name].install(parts)
    return parts.build(), device, policy
