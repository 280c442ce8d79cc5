"""``physis_server``: the ROS 2 action server node (DESIGN.md section 5).

Per stream (one namespace per robot) it subscribes ``camera/image_raw``
(or ``camera/image_raw/compressed``) and ``joint_states`` with sensor-data
QoS, and publishes ``action_chunk`` and ``joint_trajectory`` (RELIABLE).
Server-wide it publishes ``telemetry`` (one ChunkTelemetry per chunk) and
``/diagnostics``.

Threads: the rclpy executor runs the subscriptions (validate + preprocess each
message once, into a :class:`~physis_ros.ros.inputs.StreamInput`) and the
diagnostics timer; the engine runs on its own uvloop thread
(:class:`~physis_ros.ros.engine_thread.EngineThread`), takes observations from
the StreamInputs and publishes each finished chunk from its loop thread. All
stamps come from the node clock, so ``use_sim_time`` replay works.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rclpy.node import Node
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
from physis_ros.ros import qos
from physis_ros.ros.config import ServeConfig, StreamConfig, check_against_model, deep_merge, serve_config, unflatten
from physis_ros.ros.engine_thread import EngineThread, StreamSpec
from physis_ros.ros.inputs import Sample, StreamInput
from physis_ros.ros.raw import ActionChunkRaw, TrajectoryRaw
from physis_ros.runtime.engine import ChunkOutput, Observation, StreamEvent
from physis_ros.telemetry import RollingStats, percentile

NODE_NAME = "physis_server"
# Parameters every rclpy node declares; not part of the serve config.
_NODE_PARAMETERS = {"start_type_description_service", "use_sim_time"}


def parameters_mapping(node: Node) -> dict[str, Any]:
    """The node's (override-declared) parameters as a nested serve-config mapping."""
    flat = {}
    for name, param in node.get_parameters_by_prefix("").items():  # declared from overrides
        if name in _NODE_PARAMETERS or param.type_ == Parameter.Type.NOT_SET:
            continue
        value = param.value
        flat[name] = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else value
    return unflatten(flat)


@dataclass
class _Stream:
    name: str
    config: StreamConfig
    input: StreamInput
    pub_chunk: Publisher
    pub_traj: Publisher
    stats: RollingStats
    raw_chunk: ActionChunkRaw      # pre-serialized outputs, patched per chunk
    raw_traj: TrajectoryRaw
    stats_lock: threading.Lock = field(default_factory=threading.Lock)
    stamps: dict[int, Any] = field(default_factory=dict)   # chunk -> observation header stamp
    rejects_reported: int = 0
    published: int = 0
    failed: str | None = None      # the engine failed this stream (a worker lost); None once re-admitted
    failures: int = 0
    lost_chunks: int = 0
    last_warn: dict[str, float] = field(default_factory=dict)
    # node-side timings (ms): engine emit -> on_output (handover), on_output -> ActionChunk published
    handover_ms: deque = field(default_factory=lambda: deque(maxlen=200))
    publish_ms: deque = field(default_factory=lambda: deque(maxlen=200))


class PhysisServer(Node):
    """Build with the file mapping (``--config``) and command-line overrides; ROS parameters given to the
    node (``--params-file``, ``-p``, a launch file's ``parameters=``) sit between the two."""

    def __init__(self, file_mapping: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 *, context=None, namespace: str | None = None):
        super().__init__(NODE_NAME, context=context, namespace=namespace,
                         automatically_declare_parameters_from_overrides=True)
        mapping = deep_merge(deep_merge(file_mapping or {}, parameters_mapping(self)), overrides or {})
        if self.get_parameter("use_sim_time").value:
            mapping["use_sim_time"] = True
        self.config: ServeConfig = serve_config(mapping)
        self.model = load_model_config(self.config.model)
        check_against_model(self.config, self.model)
        for name, s in self.config.streams.items():
            missing = conv.compressed_decoder_available() if s.compressed else None
            if missing:
                raise ConfigError(f"streams.{name}.compressed", f"CompressedImage input needs {missing}")
        if self.config.use_sim_time:
            self.set_parameters([Parameter("use_sim_time", Parameter.Type.BOOL, True)])
        self.closing = False
        self.state = "starting"
        self.diag_prefix = self.get_fully_qualified_name().lstrip("/")  # physis_server unless remapped
        self.streams: dict[str, _Stream] = {}
        self.pub_telemetry = self.create_publisher(ChunkTelemetry, self.config.telemetry_topic,
                                                   qos.profile(qos.TELEMETRY))
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", qos.profile(qos.DIAGNOSTICS))
        for name, s in self.config.streams.items():
            self._add_stream(name, s)
        self.engine = EngineThread(self.model, self.config.engine, [
            StreamSpec(name, self._observer(st), self._on_output, st.config.slo_interval_ms)
            for name, st in self.streams.items()], clock=self.now, on_event=self._on_event)
        self.diagnostics_timer = self.create_timer(self.config.diagnostics_period_s, self.publish_diagnostics)

    # ---- set-up -------------------------------------------------------------------------------
    def now(self) -> float:
        """The node clock in seconds (ROS time: simulated under use_sim_time)."""
        return self.get_clock().now().nanoseconds * 1e-9

    def _add_stream(self, name: str, s: StreamConfig) -> None:
        cfg = self.config
        inp = StreamInput(cfg.deterministic, cfg.deterministic_queue, cfg.pair_timeout_s, s.max_age_s, self.now)
        st = _Stream(name, s, inp,
                     self.create_publisher(ActionChunk, cfg.topic(name, "action_chunk"),
                                           qos.profile(s.qos.action_chunk)),
                     self.create_publisher(JointTrajectory, cfg.topic(name, "joint_trajectory"),
                                           qos.profile(s.qos.joint_trajectory)),
                     RollingStats(cfg.stats_window), ActionChunkRaw(name, s, *self.model.output_shape),
                     TrajectoryRaw(s, *self.model.output_shape))
        self.streams[name] = st
        in_qos = qos.input_profile(s.qos.input, cfg.deterministic)
        image_type, image_topic = ((CompressedImage, cfg.topic(name, "compressed_image")) if s.compressed
                                   else (Image, cfg.topic(name, "image")))
        sub_img = self.create_subscription(image_type, image_topic, lambda m, st=st: self._on_image(st, m), in_qos)
        sub_js = self.create_subscription(JointState, cfg.topic(name, "joint_states"),
                                          lambda m, st=st: self._on_joints(st, m), in_qos)
        self.get_logger().info(
            f"stream {name}: {sub_img.topic_name} ({image_type.__name__}) + {sub_js.topic_name} "
            f"[{qos.describe(in_qos)}] -> {st.pub_chunk.topic_name}, {st.pub_traj.topic_name}; "
            f"joints {', '.join(s.joint_names)}; preprocess {s.image.preprocess}")

    def start_engine(self) -> None:
        c = self.config
        self.get_logger().info(f"starting engine: model {self.model.name}, {c.engine.workers} worker(s), plan "
                               f"{c.engine.plan}, {'deterministic' if c.deterministic else 'latest'} observations")
        self.engine.start()

    def close(self, timeout: float = 20.0) -> bool:
        """Stop the engine and its workers (no publishing afterwards)."""
        self.closing = True
        self.state = "stopping"
        done = self.engine.stop(timeout)
        self.state = "stopped"
        return done

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
        try:
            conv.check_stamp(msg.header.stamp, self.now(), s.max_future_s, s.max_age_s)
            data = conv.image_from_msg(msg, s, self.model)
        except conv.InputRejected as exc:
            self._reject(st, exc, "image")
            return
        st.input.put_image(Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    def _on_joints(self, st: _Stream, msg: JointState) -> None:
        s = st.config
        try:
            conv.check_stamp(msg.header.stamp, self.now(), s.max_future_s, s.max_age_s)
            data = conv.joints_from_msg(msg, s.joint_names)
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
            st.stamps[chunk] = taken.stamp
            return Observation(taken.data, taken.sec)
        return observe

    def _on_output(self, out: ChunkOutput) -> None:
        start = time.perf_counter()
        # (the node clock is the system clock unless simulated; time.time() is the cheaper read)
        handover = self.now() if self.config.use_sim_time else time.time()
        handover_ms = (handover - out.record.emit) * 1e3
        st = self.streams[out.stream]
        stamp = st.stamps.pop(out.chunk)
        rec = out.record
        if not self.closing:
            s = st.config
            # ActionChunk first: the smallest message, on the shortest path.
            st.pub_chunk.publish(st.raw_chunk.render(out.chunk, out.output, stamp))
            publish_ms = (time.perf_counter() - start) * 1e3
            st.pub_traj.publish(st.raw_traj.render(out.output, conv.trajectory_start(s, stamp, rec.emit)))
            self.pub_telemetry.publish(conv.telemetry_msg(rec, stamp, handover))
            st.published += 1
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
            st.stamps.clear()  # the lost chunks' stamps; the feeder restarts after this event
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
        failure = self.engine.failure
        if self.state == "starting" and self.engine.ready.is_set() and failure is None:
            self.state = "serving"
            self.get_logger().info("engine ready: serving " + ", ".join(self.streams))
        if failure is not None:
            self.state = "failed"
        serving = self.state == "serving"
        statuses = [diag.engine_status(self.state, self.model.name, self.config.engine.plan,
                                       self.config.engine.workers, str(failure) if failure else None,
                                       telemetry_subscribers=self.pub_telemetry.get_subscription_count(),
                                       prefix=self.diag_prefix)]
        now = time.monotonic()
        for name, st in self.streams.items():
            snap = st.input.snapshot()
            total_rejects = sum(snap["rejected"].values())
            new = total_rejects - st.rejects_reported
            st.rejects_reported = total_rejects
            waiting = snap["waiting_since"]
            idle = None if waiting is None else now - waiting
            if serving and idle is not None and idle > 2.0:
                self._warn(st, "idle", f"stream {name}: no fresh observation for {idle:.1f} s (images "
                                       f"{snap['received'].get('images', 0)}, joint states "
                                       f"{snap['received'].get('joints', 0)} received so far)")
            snap.update(failed=st.failed, failures=st.failures, lost_chunks=st.lost_chunks,
                        action_chunk_subscribers=st.pub_chunk.get_subscription_count(),
                        joint_trajectory_subscribers=st.pub_traj.get_subscription_count())
            statuses.append(diag.stream_status(name, self.stream_summary(name), snap, st.config.slo_interval_ms,
                                               new, serving, idle, prefix=self.diag_prefix))
        engine = self.engine.engine
        if engine is not None:
            for wname, w in list(engine.workers.items()):
                alive = getattr(w, "alive", True) and (w.proc is None or w.proc.poll() is None)
                stats = {**dict(w.stats), "restarts": getattr(w, "restarts", 0)}
                statuses.append(diag.worker_status(wname, w.pid, w.last_seen, stats,
                                                   self.config.engine.heartbeat_timeout_s, alive,
                                                   prefix=self.diag_prefix))
        if not self.closing:
            self.pub_diagnostics.publish(diag.diagnostic_array(self.get_clock().now().to_msg(), statuses))

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
