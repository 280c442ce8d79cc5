"""Record topics to a rosbag2 file (mcap or sqlite3) as raw CDR, with full message definitions.

Topics whose type is known (from the serve config, :func:`server_topics`; by name, see
:data:`~physis_ros.bags.bagio.KNOWN_TOPIC_TYPES`; or given as ``TOPIC:TYPE``) are
subscribed at once, so nothing published after start is lost; other topics
are subscribed as soon as discovery shows their type (``--all`` records every
topic that appears; with ``follow``, every topic the server node publishes, or with inputs also
subscribes to, so that streams joining the running server later are recorded too). Subscriber QoS adapts
to what the publishers offer.
Messages are stamped with the recorder's node clock at reception.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from physis_ros.bags.bagio import BagError, BagWriter, UnknownTypeError, known_topic_type, rclpy_class
from physis_ros.bags.rosnode import subscription_qos

if TYPE_CHECKING:
    from physis_ros.bags.serveconf import ServeInfo

# Graph topics nobody wants in a bag.
IGNORED = {"/rosout", "/parameter_events"}


def server_topics(serve: "ServeInfo", inputs: bool = True) -> dict[str, str]:
    """The server's outputs (and inputs) with their message types: what ``physis-bag record`` takes by
    default. Per stream by its model's kind: a WAM's camera and joint states in, action_chunk and
    joint_trajectory out; a world model's (ACWM) camera, joint states and actions in, predicted_frames
    out; its own telemetry topic if it has one; the server's /telemetry and /diagnostics; with the inputs,
    a WAM stream's expert_actions (what physis-report compares the executed trajectory with)."""
    types = serve.topic_types
    topics = (serve.input_topics if inputs else []) + serve.output_topics
    return {**{t: types[t] for t in topics}, **(serve.expert_types if inputs else {})}


def parse_topic_specs(specs: list[str]) -> dict[str, str | None]:
    """``/topic`` or ``/topic:pkg/msg/Type`` -> {topic: type or None}."""
    out: dict[str, str | None] = {}
    for spec in specs:
        topic, _, msgtype = spec.partition(":")
        topic = "/" + topic.strip().strip("/")
        if topic == "/":
            raise BagError(f"empty topic name in '{spec}'")
        out[topic] = msgtype.strip() or known_topic_type(topic)
    return out


class Recorder:
    """Subscribes on ``node`` and writes every message it receives to a bag.

    Callbacks only queue (topic, bytes, stamp); one writer thread owns the bag
    (sqlite3 objects must stay in the thread that made them, and disk writes
    must not hold up the executor). ``on_message(topic, raw, receive_ns)`` is
    called from the executor thread for each message received.
    """

    def __init__(self, node, out: str | Path, topics: dict[str, str | None] | None = None,
                 storage: str = "mcap", discover_all: bool = False,
                 on_message: Callable[[str, bytes, int], None] | None = None,
                 follow: str | None = None, follow_inputs: bool = True):
        """``follow``: a node's fully qualified name (``/physis_server``): the topics it publishes (and with
        ``follow_inputs`` those it subscribes to) are recorded as they appear, beyond ``topics`` (not its
        private ``<node>/...`` topics: actions, lifecycle, leases)."""
        if not topics and not discover_all and not follow:
            raise BagError("nothing to record: give topics or discover_all")
        self.node = node
        self.path = Path(out)
        self.wanted = dict(topics or {})
        self.discover_all = discover_all
        self.follow = None if not follow else ("/" + follow.strip("/")).rpartition("/")[::2]   # (namespace, name)
        self.follow_inputs = follow_inputs
        self.on_message = on_message
        self.subscriptions = {}
        self.failed: dict[str, str] = {}
        self.received: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._writer_loop, args=(storage,), name="bag-writer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        for topic, msgtype in self.wanted.items():
            if msgtype:
                self._subscribe(topic, msgtype)
        self._discovery = node.create_timer(0.2, self._discover)

    @property
    def counts(self) -> dict[str, int]:
        """Messages received per topic (all of them are written by the time :meth:`close` returns)."""
        return dict(self.received)

    def _writer_loop(self, storage: str) -> None:
        try:
            writer = BagWriter(self.path, storage)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                if len(item) == 2:
                    writer.add_topic(*item)
                else:
                    writer.write(*item)
        except BaseException as exc:   # disk full, ...: keep the error for close()
            self._error = exc
        finally:
            writer.close()
            self.written = dict(writer.counts)

    def _subscribe(self, topic: str, msgtype: str) -> None:
        try:
            cls = rclpy_class(msgtype)
            offered = [i.qos_profile for i in self.node.get_publishers_info_by_topic(topic)]
            self._queue.put((topic, msgtype))
            self.received[topic] = 0
            self.subscriptions[topic] = self.node.create_subscription(
                cls, topic, lambda raw, t=topic: self._write(t, raw),
                subscription_qos(msgtype, topic, offered), raw=True)
        except (UnknownTypeError, BagError) as exc:
            self.failed[topic] = str(exc)
            self.node.get_logger().warning(f"not recording {topic}: {exc}")

    def _discover(self) -> None:
        if self.closed:
            return
        for topic, types in self.node.get_topic_names_and_types():
            if topic in self.subscriptions or topic in self.failed or topic in IGNORED:
                continue
            if topic in self.wanted or self.discover_all or self._followed(topic):
                self._subscribe(topic, types[0])

    def _followed(self, topic: str) -> bool:
        """The followed node publishes ``topic`` (or, with inputs, subscribes to it)."""
        if self.follow is None:
            return False
        ns, name = self.follow
        if topic.startswith(f"{ns.rstrip('/')}/{name}/") or "/_action/" in topic:
            return False
        ends = list(self.node.get_publishers_info_by_topic(topic))
        if self.follow_inputs:
            ends += self.node.get_subscriptions_info_by_topic(topic)
        return any(e.node_name == name and (e.node_namespace or "/") == (ns or "/") for e in ends)

    def _write(self, topic: str, raw: bytes) -> None:
        if self.closed:
            return
        now = self.node.get_clock().now().nanoseconds
        self._queue.put((topic, now, raw))
        self.received[topic] += 1
        if self.on_message is not None:
            self.on_message(topic, raw, now)

    def missing(self) -> list[str]:
        """Requested topics not (yet) subscribed."""
        return [t for t in self.wanted if t not in self.subscriptions]

    def settle(self, quiet_s: float = 0.25, timeout_s: float = 3.0) -> None:
        """Keep taking messages until none has arrived for ``quiet_s`` (at most ``timeout_s``): what a
        publisher sent just before the stop and the middleware already holds is written, not dropped."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while time.monotonic() < deadline:
            total = sum(self.received.values())
            if total == seen:
                return
            seen = total
            time.sleep(quiet_s)

    def close(self, settle: bool = True) -> dict[str, int]:
        """Stop recording and finish the bag (metadata, index); returns message counts per topic.
        ``settle``: first take what is still arriving (:meth:`settle`); needs the node to be spun."""
        if not self.closed:
            if settle:
                self.settle()
            self.closed = True
            self._discovery.cancel()
            for sub in self.subscriptions.values():
                self.node.destroy_subscription(sub)
            self._queue.put(None)
            self._thread.join()
            if self._error is not None:
                raise BagError(f"recording to {self.path} failed: {self._error}")
        return dict(self.written)


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
