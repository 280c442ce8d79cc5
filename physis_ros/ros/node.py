"""``physis_server``: the ROS 2 action server node (DESIGN.md section 5).

Per stream (one namespace per robot) it subscribes ``camera/image_raw``
(or ``camera/image_raw/compressed``) and ``joint_states`` with sensor-data
QoS, and publishes ``action_chunk`` and ``joint_trajectory`` (RELIABLE).
Server-wide it publishes ``telemetry`` (one ChunkTelemetry per chunk) and
``/diagnostics`` (gathered in :mod:`physis_ros.ros.health`). It is a lifecycle
node: the outputs are published only while it is active; every config key is a
declared parameter (:mod:`physis_ros.ros.parameters`).

Threads: the rclpy executor runs the subscriptions (validate + preprocess each
message once, into a :class:`~physis_ros.ros.inputs.StreamInput`) and the
diagnostics timer; the engine runs on its own uvloop thread
(:class:`~physis_ros.ros.engine_thread.EngineThread`), takes observations from
the StreamInputs and publishes each finished chunk from its loop thread. All
stamps come from the node clock, so ``use_sim_time`` replay works.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.publisher import Publisher
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory
from diagnostic_msgs.msg import DiagnosticArray

from physis_ros.config import ConfigError
from physis_ros.model.presets import load_model_config
from physis_ros.msg import ActionChunk, ChunkTelemetry
from physis_ros.ros import conversions as conv
from physis_ros.ros import diagnostics as diag
from physis_ros.ros import acceptance, health, qos, rosout
from physis_ros.ros.config import ServeConfig, StreamConfig, check_against_model
from physis_ros.ros.engine_thread import EngineThread, StreamSpec
from physis_ros.ros.inputs import Sample, StreamInput
from physis_ros.ros.parameters import ServeParameters
from physis_ros.ros.raw import ActionChunkRaw, TrajectoryRaw
from physis_ros.runtime.engine import ChunkOutput, Observation, StreamEvent
from physis_ros.telemetry import RollingStats, percentile

NODE_NAME = "physis_server"
SUCCESS = TransitionCallbackReturn.SUCCESS


@dataclass
class _Stream:
    name: str
    config: StreamConfig
    input: StreamInput
    pub_chunk: Publisher           # lifecycle publishers: publish only while the node is active
    pub_traj: Publisher
    stats: RollingStats
    raw_chunk: ActionChunkRaw      # pre-serialized outputs, patched per chunk
    raw_traj: TrajectoryRaw
    pub_telemetry: Publisher | None = None   # <ns>/telemetry (telemetry: true)
    stats_lock: threading.Lock = field(default_factory=threading.Lock)
    rejects_reported: int = 0
    published: int = 0
    failed: str | None = None      # the engine failed this stream (a worker lost); None once re-admitted
    failures: int = 0
    lost_chunks: int = 0
    last_warn: dict[str, float] = field(default_factory=dict)
    # node-side timings (ms): engine emit -> on_output (handover), on_output -> ActionChunk published
    handover_ms: deque = field(default_factory=lambda: deque(maxlen=200))
    publish_ms: deque = field(default_factory=lambda: deque(maxlen=200))


class PhysisServer(LifecycleNode):
    """A managed (lifecycle) node. Built with the file mapping (``--config``) and command-line overrides;
    ROS parameters given to the node (``--params-file``, ``-p``, a launch file's ``parameters=``) sit
    between the two. Every config key is a declared parameter (:mod:`physis_ros.ros.parameters`).

    Lifecycle: configure starts the engine (model + workers); activate arms the outputs (ActionChunk
    and JointTrajectory are published only while active; telemetry and /diagnostics always flow);
    deactivate disarms them at once (chunks keep computing); cleanup stops the engine; shutdown
    stops everything. ``physis-serve --autostart`` (the default) configures and activates at start."""

    def __init__(self, file_mapping: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 *, context=None, namespace: str | None = None, trajectory_topic: str = ""):
        super().__init__(NODE_NAME, context=context, namespace=namespace)
        self._rosout = rosout.attach(self.get_logger())  # engine and worker log lines -> /rosout
        self.params = ServeParameters(self, file_mapping, overrides, trajectory_topic)
        self.config: ServeConfig = self.params.config
        self.model = load_model_config(self.config.model)
        check_against_model(self.config, self.model)
        for name, s in self.config.streams.items():
            missing = conv.compressed_decoder_available() if s.compressed else None
            if missing:
                raise ConfigError(f"streams.{name}.compressed", f"CompressedImage input needs {missing}")
        if self.config.use_sim_time:
            self.set_parameters([Parameter("use_sim_time", Parameter.Type.BOOL, True)])
        self.params.declare()
        self.ignored_parameters = self.params.ignored
        if self.ignored_parameters:
            self.get_logger().warning("ignoring parameters not known to physis_server (a shared parameters "
                                      "file?): " + ", ".join(self.ignored_parameters))
        self.closing = False
        self.state = "unconfigured"    # engine: unconfigured, starting, serving, failed, stopping, stopped
        self.lifecycle = "unconfigured"
        self.armed = False
        self.finalized = False
        self.engine: EngineThread | None = None
        self.engine_started: float | None = None   # time.monotonic() of configure
        self.serving_since: float | None = None
        self.hostname = socket.gethostname()
        self.diag_prefix = self.get_fully_qualified_name().lstrip("/")  # physis_server unless remapped
        self.streams: dict[str, _Stream] = {}
        self.pub_telemetry = self.create_publisher(ChunkTelemetry, self.config.telemetry_topic,
                                                   qos.profile(qos.TELEMETRY), qos_overriding_options=qos.OVERRIDES)
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", qos.profile(qos.DIAGNOSTICS))
        for name, s in self.config.streams.items():
            self._add_stream(name, s)
        self.params.attach(self._apply_config)
        self.diagnostics_timer = self.create_timer(self.config.diagnostics_period_s, self.publish_diagnostics)

    # ---- set-up -------------------------------------------------------------------------------
    def now(self) -> float:
        """The node clock in seconds (ROS time: simulated under use_sim_time)."""
        return self.get_clock().now().nanoseconds * 1e-9

    def _add_stream(self, name: str, s: StreamConfig) -> None:
        cfg = self.config
        inp = StreamInput(cfg.deterministic, cfg.deterministic_queue, cfg.pair_timeout_s, s.max_age_s, self.now)
        # Outputs: lifecycle publishers (armed while active), QoS from the config unless overridden by the
        # standard qos_overrides.<topic>.publisher.* parameters.
        st = _Stream(name, s, inp,
                     self.create_lifecycle_publisher(ActionChunk, cfg.topic(name, "action_chunk"),
                                                     qos.profile(s.qos.action_chunk),
                                                     qos_overriding_options=qos.OVERRIDES),
                     self.create_lifecycle_publisher(JointTrajectory, cfg.topic(name, "joint_trajectory"),
                                                     qos.profile(s.qos.joint_trajectory),
                                                     qos_overriding_options=qos.OVERRIDES),
                     RollingStats(cfg.stats_window), ActionChunkRaw(name, s, *self.model.output_shape),
                     TrajectoryRaw(s, *self.model.output_shape))
        if s.telemetry:
            st.pub_telemetry = self.create_publisher(ChunkTelemetry, cfg.topic(name, "telemetry"),
                                                     qos.profile(qos.TELEMETRY), qos_overriding_options=qos.OVERRIDES)
        self.streams[name] = st
        in_qos = qos.input_profile(s.qos.input, cfg.deterministic)
        image_type, image_topic = ((CompressedImage, cfg.topic(name, "compressed_image")) if s.compressed
                                   else (Image, cfg.topic(name, "image")))
        sub_img = self.create_subscription(image_type, image_topic, lambda m, st=st: self._on_image(st, m), in_qos)
        sub_js = self.create_subscription(JointState, cfg.topic(name, "joint_states"),
                                          lambda m, st=st: self._on_joints(st, m), in_qos)
        self.get_logger().info(
            f"stream {name}: {sub_img.topic_name} ({image_type.__name__}) + {sub_js.topic_name} "
            f"[{qos.describe(in_qos)}] -> {st.pub_chunk.topic_name} [{qos.describe(st.pub_chunk.qos_profile)}], "
            f"{st.pub_traj.topic_name} [{qos.describe(st.pub_traj.qos_profile)}]; "
            f"joints {', '.join(s.joint_names)}; preprocess {s.image.preprocess}")

    def _apply_config(self, old: ServeConfig, new: ServeConfig) -> None:
        """A runtime parameter change was accepted: what reads the config from now on sees the new one."""
        self.config = new
        for name, st in self.streams.items():
            s = new.streams[name]
            if s == old.streams[name]:
                continue
            st.config = s                       # read per message / per chunk by the callbacks
            st.input.max_age_s = s.max_age_s
            if s.slo_interval_ms != old.streams[name].slo_interval_ms and self.engine is not None:
                self.engine.set_slo(name, s.slo_interval_ms)

    def _make_engine(self) -> EngineThread:
        return EngineThread(self.model, self.config.engine, [
            StreamSpec(name, self._observer(st), self._on_output, st.config.slo_interval_ms)
            for name, st in self.streams.items()], clock=self.now, on_event=self._on_event)

    def start_engine(self) -> None:
        c = self.config
        self.get_logger().info(f"starting engine: model {self.model.name}, {c.engine.workers} worker(s), plan "
                               f"{c.engine.plan}, {'deterministic' if c.deterministic else 'latest'} observations")
        self.closing = False
        self.engine = self._make_engine()
        self.state = "starting"
        self.engine_started = time.monotonic()
        self.serving_since = None
        self.engine.start()

    def stop_engine(self, timeout: float = 20.0) -> bool:
        """Stop the engine and its workers (no publishing afterwards); True if it stopped in time."""
        self.closing = True
        self.state = "stopping"
        done = self.engine.stop(timeout) if self.engine is not None else True
        self.engine = None
        self.state = "stopped"
        return done

    def close(self, timeout: float = 20.0) -> bool:
        self.armed = False
        done = self.stop_engine(timeout)
        rosout.detach(self._rosout)
        return done

    # ---- lifecycle (executor thread) ----------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.start_engine()   # returns at once; /diagnostics says "starting" until the workers serve
        self.lifecycle = "inactive"
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        ret = super().on_activate(state)     # enables the lifecycle publishers
        self.armed, self.lifecycle = True, "active"
        self.get_logger().info("active: publishing action_chunk and joint_trajectory")
        return ret

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed, self.lifecycle = False, "inactive"
        ret = super().on_deactivate(state)   # disables them: nothing more goes out, chunks keep computing
        self.get_logger().info("inactive: outputs disarmed (telemetry and /diagnostics continue)")
        self.publish_diagnostics()
        return ret

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_engine()
        self.state, self.lifecycle, self.closing = "unconfigured", "unconfigured", False
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed = False
        super().on_shutdown(state)
        self.stop_engine()
        self.lifecycle, self.finalized = "finalized", True
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed = False
        self.stop_engine()
        self.state, self.lifecycle, self.closing = "unconfigured", "unconfigured", False
        return SUCCESS

    # ---- inputs (executor thread) -----------------------------------------------------------------
    def _warn(self, st: _Stream, key: str, text: str) -> None:
        """A warning throttled per (stream, key)."""
        now = time.monotonic()
        last = st.last_warn.get(key)
        if last is None or now - last >= self.config.warn_throttle_s:
            st.last_warn[key] = now
            self.get_logger().warning(text)

    def _reject(self, st: _Stream, exc: conv.InputRejected, what: str) -> None:
        n = st.input.reject(exc.reason)
        self._warn(st, exc.reason, f"stream {st.name}: rejected {what} [{exc.reason}]: {exc.detail} ({n} so far)")

    def _on_image(self, st: _Stream, msg: Image | CompressedImage) -> None:
        s = st.config
        conv.HEAP.note(len(msg.data))   # after a burst of large frames: malloc_trim once (see HeapTrimmer)
        try:
            data = acceptance.accept_image(msg, s, self.model, now=self.now())
        except conv.InputRejected as exc:
            self._reject(st, exc, "image")
            return
        st.input.put_image(Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    def _on_joints(self, st: _Stream, msg: JointState) -> None:
        s = st.config
        try:
            data = acceptance.accept_joints(msg, s, now=self.now())
        except conv.InputRejected as exc:
            self._reject(st, exc, "joint_states")
            return
        st.input.put_joints(Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    # ---- engine side (engine loop thread) ---------------------------------------------------------
    def _observer(self, st: _Stream):
        def observe(chunk: int) -> Observation | None:
            taken = st.input.take()
            if taken is None:
                return None
            return Observation(taken.data, taken.sec, tag=taken.stamp)  # the header stamp comes back on the output
        return observe

    def _on_output(self, out: ChunkOutput) -> None:
        start = time.perf_counter()
        # (the node clock is the system clock unless simulated; time.time() is the cheaper read)
        handover = self.now() if self.config.use_sim_time else time.time()
        handover_ms = (handover - out.record.emit) * 1e3
        st = self.streams[out.stream]
        stamp = out.tag
        rec = out.record
        if not self.closing:
            s = st.config
            if self.armed:  # disarmed (lifecycle inactive): chunks keep computing, nothing reaches the robot
                # ActionChunk first: the smallest message, on the shortest path.
                st.pub_chunk.publish(st.raw_chunk.render(out.chunk, out.output, stamp))
                publish_ms = (time.perf_counter() - start) * 1e3
                st.pub_traj.publish(st.raw_traj.render(out.output, conv.trajectory_start(s, stamp, rec.emit)))
            else:
                publish_ms = math.nan
            telemetry = conv.telemetry_msg(rec, stamp, handover)
            self.pub_telemetry.publish(telemetry)
            if st.pub_telemetry is not None:
                st.pub_telemetry.publish(telemetry)
            st.published += self.armed
        else:
            publish_ms = math.nan
        with st.stats_lock:
            st.stats.add(rec)
            st.handover_ms.append(handover_ms)
            st.publish_ms.append(publish_ms)

    def _on_event(self, event: StreamEvent) -> None:
        st = self.streams.get(event.stream)
        if st is None:
            return
        if event.kind == "failed":
            st.failed = event.reason
            st.failures += 1
            st.lost_chunks += event.lost_chunks
            self.get_logger().error(f"stream {st.name} failed: {event.reason}; {event.lost_chunks} chunk(s) in "
                                    f"flight lost")
        elif event.kind == "readmitted":
            st.failed = None
            self.get_logger().warning(f"stream {st.name} re-admitted: {event.reason} (chunk indices skip the "
                                      f"lost ones)")

    # ---- health (executor thread) -----------------------------------------------------------------
    def stream_summary(self, name: str) -> dict[str, Any]:
        st = self.streams[name]
        with st.stats_lock:
            out = st.stats.summary()
            handover, publish = list(st.handover_ms), list(st.publish_ms)
        out.update(handover_ms_p50=percentile(handover, 50), handover_ms_p99=percentile(handover, 99),
                   publish_ms_p50=percentile(publish, 50), publish_ms_p99=percentile(publish, 99))
        return out

    def publish_diagnostics(self) -> None:
        if self.closing and self.state == "stopped":
            return
        self._update_state()
        statuses = health.statuses(self)
        if not self.closing:
            self.pub_diagnostics.publish(diag.diagnostic_array(self.get_clock().now().to_msg(), statuses))

    def _update_state(self) -> None:
        engine = self.engine
        if engine is None:
            return
        failure = engine.failure
        if self.state == "starting" and engine.ready.is_set() and failure is None:
            self.state, self.serving_since = "serving", time.monotonic()
            self.get_logger().info("engine ready: serving " + ", ".join(self.streams))
        if failure is not None:
            self.state = "failed"

    def engine_health(self) -> dict[str, Any] | None:
        """Workers and stream placement of the running engine, as plain data: the one place that reads
        the engine (its ``health()`` snapshot, taken on its own loop)."""
        engine = self.engine.engine if self.engine is not None else None
        if engine is None:
            return None
        h = engine.health()
        workers = {w.name: {"pid": w.pid, "state": w.state, "alive": w.state in ("up", "starting"),
                            "last_seen": h.taken - w.heartbeat_age_s if math.isfinite(w.heartbeat_age_s) else 0.0,
                            "host": w.host, "device": w.device,
                            "stats": {**dict(w.stats), "restarts": w.restarts, "queue": w.queue}}
                   for w in h.workers}
        return {"workers": workers, "streams": {name: list(s.workers) for name, s in h.streams.items()}}

    def report(self) -> dict[str, Any]:
        """Totals per stream (for the exit summary and tests)."""
        out = {}
        for name, st in self.streams.items():
            snap = st.input.snapshot()
            summ = self.stream_summary(name)
            out[name] = {"chunks": st.published, "rejected": snap["rejected"], "received": snap["received"],
                         "failures": st.failures, "lost_chunks": st.lost_chunks,
                         "interval_ms_p50": summ.get("interval_ms_p50", math.nan),
                         "latency_ms_p50": summ.get("latency_ms_p50", math.nan)}
        return out
