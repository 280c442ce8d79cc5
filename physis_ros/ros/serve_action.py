"""``~/serve_stream`` (physis_ros/action/ServeStream): robots join and leave a running server.

A goal asks for one stream. Every goal is accepted as a goal, then admitted or not: when admitted,
feedback comes about once per second (chunks, interval and latency percentiles, deadline misses,
lost chunks, the workers it runs on) for as long as the goal runs; when not, the goal is aborted
and its result carries the reason (``accepted: false``, ``outcome: rejected``). So a client always
learns why. Cancelling the goal removes the stream and frees its capacity (``outcome: cancelled``);
a stream removed through ``~/remove_stream`` ends its goal with ``outcome: removed``, and one that
fails for good (a worker that cannot come back) with ``failed``.

A client that dies cannot cancel: a goal with ``lease_s > 0`` is kept only while its client publishes the
goal's id (hex, ``std_msgs/String``) on ``~/lease`` at least every ``lease_s`` seconds (physis-stream does,
every second); when the lease lapses the stream is removed and the goal ends ``client-gone``. The ROS
graph would tell too, but only after the client's DDS participant lease (about 19 s measured with Fast
DDS's defaults) and without saying which client sent which goal; the lease is the client's own bound.

``~/list_streams`` (ListStreams) names every stream the server serves, config or action, and those of its other
front ends (openpi clients); ``~/remove_stream`` (RemoveStream) removes any of them. Goals run as coroutines on the node's executor (no thread
waits on a robot).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from std_msgs.msg import String

from physis_ros.action import ServeStream
from physis_ros.config import ConfigError, from_mapping
from physis_ros.ros import qos
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import QoSConfig, StreamConfig
from physis_ros.ros.ticker import Ticker
from physis_ros.srv import ListStreams, RemoveStream

if TYPE_CHECKING:
    from physis_ros.ros.node import PhysisServer

FEEDBACK_S = 1.0
_TOPICS = {"image_topic": "image", "joint_states_topic": "joint_states", "actions_topic": "actions",
           "action_chunk_topic": "action_chunk", "joint_trajectory_topic": "joint_trajectory"}


LEASE_MAX_S = 3600.0
LEASE_QOS = QoSConfig("reliable", 100)


def lease_of(goal: ServeStream.Goal) -> float:
    """The goal's lease (s; 0: none); Rejected("invalid-request") naming ``lease_s`` if out of range."""
    lease = goal.lease_s
    if lease == 0.0:
        return 0.0
    if not (math.isfinite(lease) and 1.0 <= lease <= LEASE_MAX_S):
        raise Rejected("invalid-request", f"lease_s: {lease!r}; give 0 (no lease) or 1-{LEASE_MAX_S:g} s")
    return lease


def stream_config_of(goal: ServeStream.Goal) -> StreamConfig:
    """The StreamConfig a goal asks for (empty and zero fields: the defaults); Rejected naming a bad field."""
    fields = {"joint_names": list(goal.joint_names), "namespace": goal.topic_namespace, "model": goal.model,
              "slo_interval_ms": goal.slo_interval_ms or None, "control_rate_hz": goal.control_rate_hz or None,
              "execution_horizon": goal.execution_horizon or None, "handoff": goal.handoff,
              "actions_type": goal.actions_type,
              "topics": {key: getattr(goal, field) for field, key in _TOPICS.items() if getattr(goal, field)}}
    try:
        return from_mapping(StreamConfig, {k: v for k, v in fields.items() if v not in (None, "", {})})
    except ConfigError as exc:
        raise Rejected("invalid-request", str(exc)) from None


class ServeStreamServer:
    def __init__(self, node: PhysisServer):
        self.node = node
        self.ticker = Ticker(node)
        self.goals: dict[str, object] = {}          # stream -> its goal handle
        self.ended: dict[int, tuple[str, str]] = {}  # id(goal handle) -> (outcome, reason) set by whoever ended it
        room = qos.action_services(node.config.admission.goal_queue_depth)
        self.server = ActionServer(node, ServeStream, "~/serve_stream", self._execute,
                                   goal_callback=lambda goal: GoalResponse.ACCEPT,
                                   cancel_callback=lambda handle: CancelResponse.ACCEPT,
                                   goal_service_qos_profile=room, cancel_service_qos_profile=room,
                                   result_service_qos_profile=room)
        self.leases: dict[str, tuple[float, float]] = {}   # goal id (hex) -> (lease_s, time.monotonic() it lapses)
        self.lease_sub = node.create_subscription(String, "~/lease", self._renew, qos.profile(LEASE_QOS))
        self.list_service = node.create_service(ListStreams, "~/list_streams", self._list)
        self.remove_service = node.create_service(RemoveStream, "~/remove_stream", self._remove)

    def destroy(self) -> None:
        self.server.destroy()
        self.node.destroy_subscription(self.lease_sub)
        self.node.destroy_service(self.list_service)
        self.node.destroy_service(self.remove_service)

    # ---- the goal's life ------------------------------------------------------------------------------
    def _renew(self, msg: String) -> None:
        lease = self.leases.get(msg.data)
        if lease is not None:
            self.leases[msg.data] = (lease[0], time.monotonic() + lease[0])

    def _lapsed(self, key: str) -> bool:
        lease = self.leases.get(key)
        return lease is not None and time.monotonic() > lease[1]

    async def _execute(self, handle) -> ServeStream.Result:
        goal, node = handle.request, self.node
        name = goal.stream
        key = bytes(handle.goal_id.uuid).hex()
        try:
            lease_s = lease_of(goal)
            if lease_s:   # counted from now: the client renews while admission decides
                self.leases[key] = (lease_s, time.monotonic() + lease_s)
            st = await node.hub.join(name, stream_config_of(goal), "action", self.ticker)
        except Rejected as exc:
            self.leases.pop(key, None)
            node.get_logger().warning(f"serve_stream goal for '{name}' rejected ({exc.reason}): {exc.detail}")
            handle.abort()
            return ServeStream.Result(accepted=False, outcome="rejected", reason=f"{exc.reason}: {exc.detail}")
        except Exception as exc:  # a bug: rclpy would answer an empty result; the robot still learns why
            self.leases.pop(key, None)
            node.get_logger().error(f"serve_stream goal for '{name}' failed: {type(exc).__name__}: {exc}")
            handle.abort()
            return ServeStream.Result(accepted=False, outcome="rejected",
                                      reason=f"internal-error: {type(exc).__name__}: {exc}")
        self.goals[name] = handle
        try:
            while True:
                # Only this goal's own stream is touched: once it is gone, another goal may serve the name.
                mine = node.streams.get(name) is st
                if handle.is_cancel_requested:
                    if mine:
                        node.hub.leave(name)
                    handle.canceled()
                    return self._result(st, "cancelled", "the goal was cancelled")
                if self._lapsed(key) and mine:
                    lease_s = self.leases[key][0]
                    node.get_logger().warning(f"stream {name}: its client renewed no lease for {lease_s:g} s (it is "
                                              f"gone): removing the stream")
                    node.hub.leave(name)
                    handle.abort()
                    return self._result(st, "client-gone", f"the client renewed no lease for {lease_s:g} s")
                if id(handle) in self.ended or st.health.gone or not mine:
                    outcome, reason = self.ended.pop(id(handle), ("failed", st.health.failed or "the stream ended"))
                    if outcome == "failed" and mine:
                        node.hub.leave(name)
                    handle.abort()
                    return self._result(st, outcome, reason)
                handle.publish_feedback(self._feedback(st))
                for _ in range(int(FEEDBACK_S / 0.05)):
                    await self.ticker.sleep(0.05)
                    if handle.is_cancel_requested or id(handle) in self.ended or st.health.gone or self._lapsed(key):
                        break
        finally:
            self.leases.pop(key, None)
            if self.goals.get(name) is handle:
                del self.goals[name]
            # An end() this goal did not consume (it was cancelled at the same turn) must not outlive it.
            self.ended.pop(id(handle), None)

    def end(self, name: str, outcome: str, reason: str) -> None:
        """End a stream's goal (if it has one) with this outcome at its next turn."""
        handle = self.goals.get(name)
        if handle is not None:
            self.ended[id(handle)] = (outcome, reason)

    def _feedback(self, st) -> ServeStream.Feedback:
        w = st.session.figures(self.node.now(), self.node.config.diagnostics_window_s)
        total, misses = w["total"], w["deadline_misses_total"]
        fb = ServeStream.Feedback()
        fb.state = "resetting" if st.health.failed else "serving"
        fb.chunks = int(total)
        fb.interval_ms_p50, fb.interval_ms_p99 = _num(w.get("interval_ms_p50")), _num(w.get("interval_ms_p99"))
        fb.latency_ms_p50, fb.latency_ms_p99 = _num(w.get("latency_ms_p50")), _num(w.get("latency_ms_p99"))
        fb.deadline_misses = int(misses)
        fb.chunks_lost = int(st.health.lost_chunks)
        fb.workers = list(st.workers)
        return fb

    @staticmethod
    def _result(st, outcome: str, reason: str) -> ServeStream.Result:
        return ServeStream.Result(accepted=True, outcome=outcome, reason=reason, chunks_emitted=int(st.stats.total),
                                  chunks_lost=int(st.health.lost_chunks), workers=list(st.workers))

    # ---- services ---------------------------------------------------------------------------------------
    def _list(self, request, response: ListStreams.Response) -> ListStreams.Response:
        """Every stream the server serves: the node's (config, action) and other front ends' (an openpi client's,
        with no namespace: it has no topics)."""
        node = self.node
        streams = node.server.streams() if node.server is not None else {}
        response.streams = list(streams)
        response.models = [s["model"] for s in streams.values()]
        response.namespaces = [node.streams[n].namespace if n in node.streams else "" for n in streams]
        response.origins = [s["origin"] for s in streams.values()]
        response.slo_interval_ms = [float(s["slo_interval_ms"]) for s in streams.values()]
        response.workers = [",".join(s["workers"]) for s in streams.values()]
        return response

    def _remove(self, request, response: RemoveStream.Response) -> RemoveStream.Response:
        """Remove any stream the server serves; another front end's hears it ended (``removed``)."""
        name, node = request.stream, self.node
        if name in node.streams:
            self.end(name, "removed", "removed through remove_stream")
            node.hub.leave(name)
        else:
            try:
                if node.server is None:
                    raise KeyError(name)
                node.server.leave(name, timeout_s=None, reason="removed")
            except KeyError:
                response.ok, response.message = False, f"no stream '{name}' is served"
                return response
        response.ok, response.message = True, f"stream '{name}' removed"
        return response


def _num(value) -> float:
    return 0.0 if value is None or (isinstance(value, float) and not math.isfinite(value)) else float(value)



