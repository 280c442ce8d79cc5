"""Workers as Ray actors (``engine.launcher: ray``): Ray places them and watches them, ZeroMQ carries the data.

The engine reserves a placement group with one bundle per worker (``{"GPU": 1, "CPU": c}`` for a GPU worker,
``{"CPU": c}`` otherwise; PACK or SPREAD, ``engine.ray``), and runs each worker as an actor pinned to its
bundle. The actor runs the same worker loop as a ``physis-worker`` process (:class:`~physis_ros.runtime.worker.
Worker.serve`), bound on its node's routable address and connected back to the engine, with CurveZMQ on
every socket: the engine makes a fresh key pair per worker at start (:func:`~physis_ros.runtime.security.
ephemeral_keys`) and hands it to the actor as a constructor argument. That, the engine's address and the
actor's own pid/node/memory are all Ray ever carries for us: no task, tensor or observation goes through Ray
(vLLM's Ray executor does the same: placement groups and liveness only).

To the worker pool an actor looks like a process (:class:`RayWorker` has Popen's ``poll``/``wait``/``kill``/
``pid``/``returncode``), so it is watched twice: by heartbeats as any worker, and through Ray: the actor's
long-running ``serve`` call is an ObjectRef that resolves with an error the moment Ray knows the actor is
dead (node lost, OOM-killed, killed). Either way the pool takes the lost-worker path: its streams reset,
the worker is re-created in the same bundle (Ray re-places a bundle whose node died), streams re-admitted
with fresh KV under a new epoch.

GPUs: an actor asks for its bundle's one GPU (``num_gpus=1``); Ray sets the actor process's
``CUDA_VISIBLE_DEVICES`` to that GPU, so the worker always runs on ``cuda:0`` and the physical id is in its
:attr:`RayWorker.info` (``gpus``). Ray is imported only here and only when the launcher is ray.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from physis_ros.heap import rss_mb
from physis_ros.runtime.security import CurveKeys, ephemeral_keys, is_loopback
from physis_ros.runtime.settings import EngineConfig, RayConfig
from physis_ros.runtime.workers import EngineError

log = logging.getLogger("physis.engine")


def _ray():
    try:
        import ray
    except ImportError as exc:  # make setup installs it; a hand-made environment may lack it
        raise EngineError(f"engine.launcher ray needs the 'ray' package ({exc}); run make setup") from None
    return ray


class _NoSigtermNote(logging.Filter):
    """ray.init off the main thread (the engine's loop runs it in a thread) warns that it set no SIGTERM
    handler: the server handles its own signals, so the note would only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def connect(rc: RayConfig, cpus_needed: float = 0.0) -> bool:
    """Join the cluster ``rc`` names, or start a local one; True if this call started Ray here (and should
    shut it down). Blocking (seconds): call it off the event loop."""
    ray = _ray()
    if ray.is_initialized():
        return False
    common: dict[str, Any] = {"namespace": rc.namespace, "logging_level": logging.WARNING,
                              "include_dashboard": False}
    note, quiet = logging.getLogger("ray._private.worker"), _NoSigtermNote()
    note.addFilter(quiet)
    try:
        if rc.address:
            ray.init(address=rc.address, **{k: v for k, v in common.items() if k != "include_dashboard"})
        else:  # "local": a new cluster even if 'ray start' runs on this host (that one is address: auto)
            num_cpus = rc.num_cpus or max(os.cpu_count() or 1, math.ceil(cpus_needed))
            store = rc.object_store_mb * 1024 * 1024 or None
            ray.init(address="local", num_cpus=num_cpus, object_store_memory=store, **common)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"at {rc.address!r}" if rc.address else "locally"
        hint = " (start one with 'ray start --head', see README)" if rc.address else ""
        raise EngineError(f"cannot start or join a Ray cluster {where}: {exc}{hint}") from None
    finally:
        note.removeFilter(quiet)
    return True


@dataclass(frozen=True)
class ActorSpec:
    """What one worker actor is told at creation (Ray's control plane: a few values and its keys)."""

    name: str
    ctrl_addr: str
    device: str              # cpu, or cuda:0 = the bundle's GPU, the only one Ray lets the actor see
    threads: int
    max_message_bytes: int
    keys: CurveKeys
    bind_host: str = ""      # empty: this node's routable address


class WorkerActor:
    """The actor's body; ``ray.remote`` wraps it at launch (so importing this module never needs Ray).

    It runs with two threads: ``serve`` holds one for the worker's life, ``info`` answers on the other."""

    def __init__(self, spec: ActorSpec):
        self.spec = spec

    def info(self) -> dict:
        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "rss_mb": rss_mb(os.getpid())}

    def serve(self) -> int:
        import ray
        import torch

        from physis_ros.runtime.worker import Worker

        spec = self.spec
        logging.getLogger("physis").setLevel(logging.INFO)  # what physis-worker does: lines go to the engine
        torch.set_num_threads(spec.threads)
        worker = Worker(spec.ctrl_addr, spec.name, device=spec.device,
                        bind_host=spec.bind_host or ray.util.get_node_ip_address(), transport="tcp",
                        max_message_bytes=spec.max_message_bytes, curve_keys=spec.keys)
        worker.serve()  # until the engine says Shutdown
        return 0


class RayWorker:
    """A worker actor as the pool sees a process. ``poll`` asks Ray, without blocking, whether the actor's
    ``serve`` call has ended: it ends with an error as soon as Ray knows the actor died."""

    def __init__(self, ray, name: str, actor, serve_ref, info_ref):
        self._ray, self.name, self.actor = ray, name, actor
        self._serve, self._info_ref = serve_ref, info_ref
        self.info: dict | None = None
        self.returncode: int | None = None
        self.exit_reason = ""

    @property
    def pid(self) -> int | None:
        """The actor's pid once Ray has told us (None until then: a hello is then taken on its name)."""
        if self.info is None and self._ready(self._info_ref, 0):
            try:
                self.info = self._ray.get(self._info_ref, timeout=0)
            except Exception:  # the actor died first: poll() says so
                self.info = {}
        return (self.info or {}).get("pid")

    def _ready(self, ref, timeout: float | None) -> bool:
        ready, _ = self._ray.wait([ref], timeout=timeout, fetch_local=False)
        return bool(ready)

    def _ended(self) -> None:
        try:
            self._ray.get(self._serve, timeout=0)
            self.returncode, self.exit_reason = 0, "its worker loop returned"
        except Exception as exc:
            text = str(exc).strip()
            first = (text.splitlines()[0] if text else type(exc).__name__)[:300]
            if isinstance(exc, self._ray.exceptions.RayActorError):  # node lost, OOM-killed, killed
                self.returncode, self.exit_reason = 1, f"Ray reports the actor dead ({type(exc).__name__}: {first})"
            else:
                self.returncode, self.exit_reason = 1, f"its worker loop raised ({type(exc).__name__}: {first})"
        # An actor outlives its method: end it, so that the bundle is free for the worker's next incarnation.
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:
            pass

    def poll(self) -> int | None:
        if self.returncode is None and self._ready(self._serve, 0):
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ready(self._serve, timeout):
                raise subprocess.TimeoutExpired(f"ray actor {self.name}", timeout)
            self._ended()
        return self.returncode

    def kill(self) -> None:
        """Never blocks the engine's loop: Ray frees the bundle when the process is gone, and a re-created
        actor waits for it there."""
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass
        if self.returncode is None:
            self.returncode, self.exit_reason = -9, "killed by the engine"

    def send_signal(self, sig: int) -> None:
        self.kill()

    terminate = kill


class RayLauncher:
    """One engine's placement group and worker actors."""

    def __init__(self, config: EngineConfig):
        config.validate()  # ray's constraints hold for configs built in code too, not only loaded ones
        self.config = config
        self.engine_keys, self.worker_keys = ephemeral_keys(config.workers)
        self.bind_host = ""
        self.owns_ray = False
        self.pg = None
        self.handles: dict[int, RayWorker] = {}
        self.timings: dict[str, float] = {}
        self._actor_cls = None

    def bundle(self, index: int) -> dict[str, float]:
        cpus = self.config.ray.cpus_per_worker
        return {"GPU": 1, "CPU": cpus} if self.config.device_of(index).startswith("cuda") else {"CPU": cpus}

    def open(self) -> None:
        """Join or start the cluster, reserve the bundles, pick the engine's routable address. Blocking."""
        ray = _ray()
        from ray.util.placement_group import placement_group

        rc, n = self.config.ray, self.config.workers
        t0 = time.perf_counter()
        self.owns_ray = connect(rc, n * rc.cpus_per_worker)
        t1 = time.perf_counter()
        bundles = [self.bundle(i) for i in range(n)]
        try:
            self.pg = placement_group(bundles, strategy=rc.strategy)
            if not self._wait_pg(ray, rc.placement_timeout_s):
                raise EngineError(f"Ray could not reserve {n} bundle(s) {bundles} ({rc.strategy}) within "
                                  f"{rc.placement_timeout_s:g} s; the cluster has {ray.cluster_resources()} "
                                  f"(engine.ray.strategy, engine.ray.cpus_per_worker, engine.devices)")
            host = self.config.bind_host
            # Workers on other nodes connect back here: loopback or a wildcard would not be reachable.
            self.bind_host = ray.util.get_node_ip_address() if is_loopback(host) or host in ("0.0.0.0", "::") \
                else host
        except BaseException:
            self.close()
            raise
        self.timings = {"ray_connect_s": t1 - t0, "placement_group_s": time.perf_counter() - t1}
        log.info("Ray placement group of %d bundles ready (%s); engine at %s", n, rc.strategy, self.bind_host)

    def _wait_pg(self, ray, timeout: float) -> bool:
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        return bool(ready)

    def actor(self, index: int, ctrl_addr: str) -> tuple[ActorSpec, dict[str, float]]:
        """Worker ``w<index>``'s spec and the resources its actor asks of its bundle. A GPU worker asks for
        the bundle's one GPU; Ray then sets the actor's CUDA_VISIBLE_DEVICES to it, so it runs on cuda:0."""
        cfg = self.config
        cuda = cfg.device_of(index).startswith("cuda")
        spec = ActorSpec(f"w{index}", ctrl_addr, "cuda:0" if cuda else "cpu", cfg.threads_per_worker,
                         cfg.max_message_mb * 1024 * 1024, self.worker_keys[index])
        return spec, {"num_cpus": cfg.ray.cpus_per_worker, "num_gpus": 1 if cuda else 0}

    def start(self, index: int, ctrl_addr: str) -> RayWorker:
        """Create worker ``w<index>``'s actor in bundle ``index`` and start its loop (returns at once)."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._actor_cls is None:
            self._actor_cls = ray.remote(WorkerActor)
        spec, resources = self.actor(index, ctrl_addr)
        actor = self._actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=index),
            **resources,
            max_restarts=0,      # the pool re-creates workers itself (hello, load, streams re-admitted)
            max_concurrency=2,   # serve() holds one thread for the worker's life; info() uses the other
        ).remote(spec)
        handle = RayWorker(ray, spec.name, actor, actor.serve.remote(), actor.info.remote())
        self.handles[index] = handle
        return handle

    def memory_mb(self, timeout: float = 10.0) -> dict[str, float | None]:
        """Resident memory of each live worker actor, MiB (asks the actors: blocking)."""
        ray = _ray()
        out = {}
        for i, h in sorted(self.handles.items()):
            try:
                out[h.name] = ray.get(h.actor.info.remote(), timeout=timeout)["rss_mb"]
            except Exception:
                out[h.name] = None
        return out

    def close(self) -> None:
        """Kill the actors, free the bundles, stop Ray if this engine started it. Blocking."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for h in self.handles.values():
            h.kill()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.pg)
            except Exception:  # the cluster may be gone already
                pass
            self.pg = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
