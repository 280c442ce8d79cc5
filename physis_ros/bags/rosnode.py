"""A private rclpy context with one node and an executor thread, plus QoS by message type."""

from __future__ import annotations

import threading

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from rclpy.signals import SignalHandlerOptions

from physis_ros.bags.bagio import is_sensor_type

RELIABLE_DEPTH = 1000   # outputs are few and must not be dropped when a subscriber is slow


def qos_for(msgtype: str, topic: str = "", reliable: bool = False) -> QoSProfile:
    """Publisher QoS by type: sensor types best-effort sensor-data QoS, /clock the clock QoS,
    /tf_static latched, everything else reliable. ``reliable``: every topic but /clock reliable
    with a deep queue (lossless replay into a subscriber that asks for reliable input)."""
    if msgtype == "rosgraph_msgs/msg/Clock":
        return QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
    if is_sensor_type(msgtype) and not reliable:
        return qos_profile_sensor_data
    if topic.rstrip("/").endswith("tf_static"):
        return QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.TRANSIENT_LOCAL)
    return QoSProfile(depth=RELIABLE_DEPTH, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE)


def subscription_qos(msgtype: str, topic: str, offered: list[QoSProfile]) -> QoSProfile:
    """Subscriber QoS that matches what publishers offer (as ``ros2 bag record`` adapts it).

    Best effort if any publisher (or, with none known yet, the type) is best effort;
    transient local if all publishers are; reliable otherwise, with a deep queue.
    """
    if offered:
        best_effort = any(q.reliability == ReliabilityPolicy.BEST_EFFORT for q in offered)
        latched = all(q.durability == DurabilityPolicy.TRANSIENT_LOCAL for q in offered)
    else:
        best_effort = is_sensor_type(msgtype) or msgtype == "rosgraph_msgs/msg/Clock"
        latched = topic.rstrip("/").endswith("tf_static")
    return QoSProfile(depth=RELIABLE_DEPTH, history=HistoryPolicy.KEEP_LAST,
                      reliability=ReliabilityPolicy.BEST_EFFORT if best_effort else ReliabilityPolicy.RELIABLE,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


class RosSession:
    """Own rclpy context (no global state, no signal handlers) with a node spun in a daemon thread."""

    def __init__(self, name: str, args: list[str] | None = None, spin: bool = True):
        self.context = rclpy.Context()
        rclpy.init(args=args, context=self.context, signal_handler_options=SignalHandlerOptions.NO)
        self.node = Node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._stop = threading.Event()
        self.errors: list[Exception] = []
        self._thread = None
        if spin:
            self._thread = threading.Thread(target=self._spin, name=f"{name}-spin", daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set() and self.context.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception as exc:   # a failing callback must not stop the others
                if self._stop.is_set() or not self.context.ok():
                    return
                self.errors.append(exc)
                if len(self.errors) <= 3:
                    self.node.get_logger().error(f"callback failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()
        self.context.try_shutdown()

    def __enter__(self) -> RosSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
