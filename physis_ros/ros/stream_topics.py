"""One robot on the ROS side (a stream of runtime/streams.py and serving/session.py): the subscriptions that feed
its model, the publishers of its chunks, and its statistics (:class:`RosStream`).

Inputs: every observation the model takes has its topic (``image`` <- camera, ``state`` <-
joint_states, ``actions`` <- the actions a world model imagines), validated by the server's
acceptance rule (:mod:`physis_ros.ros.acceptance`) on the executor thread and paired to the camera
image by stamp (:class:`~physis_ros.serving.intake.StreamInput`). Outputs by what the model produces:
a world-action model's chunk goes out as ``action_chunk`` and, for the rows still ahead of the robot
on its control timeline, ``joint_trajectory`` (pre-serialized, :mod:`physis_ros.ros.raw`; what is
late and how the chunk meets the previous one: :mod:`physis_ros.serving.delivery`); predicted
frames (a world model's chunk, or what a Wan WAM predicts beside its actions) as ``predicted_frames``, and,
where the model's family decodes them, a picture at most ``preview_hz`` times a second as ``predicted_image``
(:mod:`physis_ros.serving.preview`); all only while the node is armed (lifecycle active).
Telemetry always flows.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING

from rclpy.serialization import deserialize_message
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory

from physis_ros.msg import ActionChunk, ChunkTelemetry, PredictedFrames
from physis_ros.ros import acceptance, outputs, qos
from physis_ros.ros import conversions as conv
from physis_ros.serving.config import stream_namespace, stream_topic
from physis_ros.model.families import load_family
from physis_ros.serving.fit import model_label
from physis_ros.serving.delivery import Delivery
from physis_ros.serving.preview import Previews
from physis_ros.serving.intake import INPUT_KINDS, Sample
from physis_ros.ros.raw import ActionChunkRaw, TrajectoryRaw
from physis_ros.telemetry import percentile

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer
    from physis_ros.serving.session import Chunk, Session


class RosStream:
    """The ROS side of a stream the server admitted (its :class:`~physis_ros.serving.session.Session`: the
    observation buffer, statistics and health it shares with the engine)."""

    def __init__(self, node: PhysisServer, session: Session):
        self.node = node
        self.session = session
        self.name = session.name
        self.model_label = model_label(self.config.model or node.config.model, self.model)   # as configured
        self.namespace = stream_namespace(self.name, self.config)
        self.rejects_reported = 0
        # node-side timings (ms): engine emit -> on_chunk (handover), on_chunk -> first output published
        self.handover_ms: deque = deque(maxlen=200)
        self.publish_ms: deque = deque(maxlen=200)
        self.delivery = Delivery(session.timeline)   # a world-action model's chunks onto the robot's timeline
        self._publishers = []
        self._subscriptions = []
        self._make_outputs()
        self._make_inputs()

    # ---- what the session holds -------------------------------------------------------------------
    config = property(lambda self: self.session.config)          # StreamConfig (a run-time change included)
    model = property(lambda self: self.session.model)            # ModelConfig
    served = property(lambda self: self.session.served)
    origin = property(lambda self: self.session.origin)          # config | action
    workers = property(lambda self: self.session.workers)
    slo_interval_ms = property(lambda self: self.session.slo_interval_ms)
    input = property(lambda self: self.session.input)
    stats = property(lambda self: self.session.stats)
    stats_lock = property(lambda self: self.session.stats_lock)
    health = property(lambda self: self.session.health)
    admitted_mono = property(lambda self: self.session.admitted_mono)   # its health counts from here

    # ---- set-up -------------------------------------------------------------------------------------
    def topic(self, which: str) -> str:
        return stream_topic(self.name, self.config, which)

    def _publisher(self, kind, which: str, profile, lifecycle: bool = True):
        make = self.node.create_lifecycle_publisher if lifecycle else self.node.create_publisher
        pub = make(kind, self.topic(which), profile, qos_overriding_options=qos.OVERRIDES)
        if lifecycle and self.node.armed:
            pub.on_activate(None)  # a stream joining an active node: armed like the others (they start disabled)
        self._publishers.append(pub)
        return pub

    def _make_outputs(self) -> None:
        s = self.config
        self.pub_chunk = self.pub_traj = self.pub_frames = self.pub_telemetry = None
        if self.model.produces == "actions":
            horizon, dof = self.model.spec.actions_shape
            self.pub_chunk = self._publisher(ActionChunk, "action_chunk", qos.profile(s.qos.action_chunk))
            self.pub_traj = self._publisher(JointTrajectory, "joint_trajectory", qos.profile(s.qos.joint_trajectory))
            self.raw_chunk = ActionChunkRaw(self.name, s, horizon, dof)
            self.raw_traj = TrajectoryRaw(s, horizon, dof)
            self.horizon = horizon
        if self.model.spec.has_frames:
            self.pub_frames = self._publisher(PredictedFrames, "predicted_frames", qos.profile(s.qos.action_chunk))
        self.pub_image = self.previews = None
        family = load_family(self.model.kind)
        if s.preview_hz > 0 and family.preview:
            self.pub_image = self._publisher(Image, "predicted_image", qos.profile(s.qos.action_chunk))
            self.previews = Previews(self.name, lambda: family.previewer(self.model), self._publish_preview,
                                     s.preview_hz)
        if s.telemetry:
            self.pub_telemetry = self._publisher(ChunkTelemetry, "telemetry", qos.profile(qos.TELEMETRY),
                                                 lifecycle=False)

    def _subscribe(self, kind, topic: str, callback, profile, what: str) -> None:
        """Messages are taken as raw CDR and decoded here: a malformed one is counted
        (``rejected.undecodable_<what>`` on /diagnostics) and warned about at most once per throttle
        period, where rmw printed a Fast CDR exception for each one on stderr and counted nothing. One the
        acceptance rule refuses (``callback`` raises InputRejected) is counted and warned about the same way."""
        def take(data: bytes) -> None:
            try:
                msg = deserialize_message(data, kind)
            except Exception as exc:   # rclpy's RMWError (its own type) for malformed CDR, ValueError, ...
                n = self.input.reject(f"undecodable_{what}", INPUT_KINDS.get(what, ""))
                self.warn(f"undecodable_{what}", f"stream {self.name}: a message on {topic} could not be decoded "
                                                 f"as {kind.__name__} ({str(exc)[:160]}; {n} so far)")
                return
            try:
                callback(msg)
            except conv.InputRejected as exc:
                n = self.input.reject(exc.reason, INPUT_KINDS.get(what, ""))
                self.warn(exc.reason, f"stream {self.name}: rejected {what} [{exc.reason}]: {exc.detail} ({n} so far)")

        self._subscriptions.append(self.node.create_subscription(kind, topic, take, profile, raw=True))

    def _make_inputs(self) -> None:
        s, serve = self.config, self.node.config
        in_qos = qos.input_profile(s.qos.input, serve.deterministic)
        shapes = {k: v for k, v in self.model.observation_shapes.items() if k not in s.inputs}  # the files' are read
        if "image" in shapes:
            image_type, which = (CompressedImage, "compressed_image") if s.compressed else (Image, "image")
            self._subscribe(image_type, self.topic(which), self.on_image, in_qos, "image")
        if "state" in shapes:
            self._subscribe(JointState, self.topic("joint_states"), self.on_joints, in_qos, "joint_states")
        if "actions" in shapes:
            kind = JointTrajectory if s.actions_type == "joint_trajectory" else ActionChunk
            # The actions come from a policy (a command, not a sensor): reliable, as published.
            self._subscribe(kind, self.topic("actions"), self.on_actions, qos.profile(s.qos.action_chunk), "actions")
        if self.model.produces == "actions":
            self._subscribe(ActionChunk, self.topic("expert"), self.on_expert, qos.profile(s.qos.action_chunk),
                            "expert")
        self.node.get_logger().info(
            f"stream {self.name} ({self.model_label}, {self.origin}): {', '.join(sub.topic_name for sub in self._subscriptions)}"
            f" [{qos.describe(in_qos)}] -> {', '.join(p.topic_name for p in self._publishers)}; "
            f"joints {', '.join(s.joint_names)}; workers {', '.join(self.workers)}")

    def _publish_preview(self, index: int, picture, stamp) -> None:
        """A decoded picture of chunk ``index`` (the previews' thread), while the node is armed."""
        if self.node.armed and not self.node.closing:
            self.pub_image.publish(outputs.picture_msg(picture, stamp, self.config.frame_id))

    def destroy(self) -> None:
        if self.previews is not None:
            self.previews.close()
        for sub in self._subscriptions:
            self.node.destroy_subscription(sub)
        for pub in self._publishers:
            if hasattr(self.node, "destroy_lifecycle_publisher") and pub is not self.pub_telemetry:
                self.node.destroy_lifecycle_publisher(pub)
            else:
                self.node.destroy_publisher(pub)
        self._subscriptions.clear()
        self._publishers.clear()

    def subscriber_counts(self) -> dict[str, int]:
        pubs = {"action_chunk": self.pub_chunk, "joint_trajectory": self.pub_traj, "predicted_frames": self.pub_frames,
                "predicted_image": self.pub_image}
        return {f"{k}_subscribers": p.get_subscription_count() for k, p in pubs.items() if p is not None}

    # ---- inputs (executor thread; one the acceptance rule refuses raises InputRejected to _subscribe) ------
    def warn(self, key: str, text: str) -> None:
        """A warning about the stream, at most one per key per ``warn_throttle_s`` (:meth:`Session.note`)."""
        self.session.note(logging.WARNING, key, text)

    def on_image(self, msg: Image | CompressedImage) -> None:
        self.node.heap.note(len(msg.data))   # after a burst of large frames: malloc_trim once (see HeapTrimmer)
        data = acceptance.accept_image(msg, self.config, self.model, now=self.node.now())
        self.input.put_image(Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    def on_joints(self, msg: JointState) -> None:
        data = acceptance.accept_joints(msg, self.config, now=self.node.now(), model=self.model)
        self.input.put("state", Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    def on_actions(self, msg: ActionChunk | JointTrajectory) -> None:
        data = acceptance.accept_actions(msg, self.config, self.model)
        self.input.put("actions", Sample(data, msg.header.stamp, conv.stamp_ns(msg.header.stamp)))

    def on_expert(self, msg: ActionChunk) -> None:
        """An expert's chunk for the observation of the same stamp: kept (briefly) for the tracking error."""
        rows = conv.actions_from_chunk(msg, list(self.config.joint_names), self.horizon)
        self.delivery.expert(conv.stamp_ns(msg.header.stamp), rows)

    # ---- engine side (engine loop thread) -------------------------------------------------------------
    def on_chunk(self, out: Chunk) -> None:
        """Publish a chunk. One that cannot be published (any error on the way: ROS, a message field out of
        range, a bug) raises to :meth:`Session.deliver`, which counts it as lost with the reason (/diagnostics,
        the goal's chunks_lost) and says so: never a silent gap."""
        node = self.node
        start = time.perf_counter()
        # (the node clock is the system clock unless simulated; time.time() is the cheaper read)
        handover = node.now() if node.config.use_sim_time else time.time()
        stamp, rec, publish_ms = out.tag, out.telemetry, math.nan
        if isinstance(stamp, (int, float)):   # a stream whose every input is a file: stamped when released
            stamp = conv.time_msg(float(stamp))
        if node.closing:
            return
        if self.pub_chunk is not None:
            publish_ms = self._publish_actions(out, handover, start)
        if self.pub_frames is not None and node.armed:
            self.pub_frames.publish(outputs.frames_msg(self.name, self.config, out.index, out.frames, stamp))
            if self.previews is not None:
                self.previews.offer(out.index, out.frames, stamp)
            if self.pub_chunk is None:
                publish_ms = (time.perf_counter() - start) * 1e3
        telemetry = outputs.telemetry_msg(rec, stamp, handover)
        node.pub_telemetry.publish(telemetry)
        if self.pub_telemetry is not None:
            self.pub_telemetry.publish(telemetry)
        with self.stats_lock:
            self.handover_ms.append((handover - rec.emit) * 1e3)
            self.publish_ms.append(publish_ms)

    def _publish_actions(self, out: Chunk, now: float, start: float) -> float:
        """A world-action model's chunk: the ActionChunk, then the rows still ahead of the robot as a
        JointTrajectory (none if all are due: a late chunk), as :class:`~physis_ros.serving.delivery.Delivery`
        lands them. While disarmed (lifecycle inactive) chunks keep computing and nothing reaches the robot."""
        rec, stamp, delivery = out.telemetry, out.tag, self.delivery
        placement = delivery.land(rec, out.actions, conv.stamp_to_sec(stamp), conv.stamp_ns(stamp), now, self.config)
        if not self.node.armed:
            return math.nan
        # ActionChunk first: the smallest message, on the shortest path. It is the chunk as computed (a replay
        # compares it with the reference bit for bit), like the seam and tracking error in the telemetry.
        self.pub_chunk.publish(self.raw_chunk.render(out.index, out.actions, stamp, placement))
        publish_ms = (time.perf_counter() - start) * 1e3
        if not placement.late:
            rows = delivery.trajectory(rec, out.actions, placement, self.config.seam_blend_steps)
            self.pub_traj.publish(self.raw_traj.render(*rows.ahead(), conv.time_msg(placement.start)))
            delivery.executed(rows)
        else:
            self.warn("late", f"stream {self.name}: chunk {out.index} arrived after its last step was due "
                              f"({delivery.late_chunks} so far); not sent as a trajectory")
        return publish_ms

    # ---- reports (executor thread) ----------------------------------------------------------------------
    def node_figures(self) -> dict[str, float]:
        """The node's own figures: handover (engine emit -> on_chunk) and publish (on_chunk -> first output)
        p50/p99 over the last chunks (ms)."""
        with self.stats_lock:
            handover, publish = list(self.handover_ms), list(self.publish_ms)
        return dict(handover_ms_p50=percentile(handover, 50), handover_ms_p99=percentile(handover, 99),
                    publish_ms_p50=percentile(publish, 50), publish_ms_p99=percentile(publish, 99))
