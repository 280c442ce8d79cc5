"""What an input bag obliges the server to do: per stream, the observations chunk 0, 1, ... must consume,
and the inputs it must reject, with the node's reason.

Every message goes through the node's own acceptance rule (:mod:`physis_ros.ros.acceptance`: encoding,
sizes, finite joint positions, every configured joint present; for a world model's actions,
:func:`~physis_ros.ros.acceptance.accept_actions`) and the node's pairing rule
(:func:`physis_ros.serving.intake.match_observations`: exact stamp, else the latest at or before), so what the
checker expects is what the node does, not a copy of it. :mod:`physis_ros.bags.analysis` compares a
recorded run against this.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from physis_ros.bags.bagio import read_all
from physis_ros.cdr import header_stamp_ns
from physis_ros.bags.serveconf import OBSERVATION_TOPIC, ServeInfo, StreamInfo

# What a role's message is called in reports (the node's wording).
ROLE_WORDS = {"image": "camera image", "joint_states": "joint state", "actions": "actions"}


@dataclass
class PairedInput:
    """One message paired to an observation's image (its joint state, its actions)."""
    topic: str
    raw: bytes
    stamp_ns: int
    data: np.ndarray | None = None     # the accepted model input (what the node stores), if computed


@dataclass
class InputObservation:
    stream: str
    index: int
    stamp_ns: int        # header stamp in the bag (the image's)
    image_raw: bytes
    image_topic: str
    image: np.ndarray | None = None    # the accepted model input (what the node stores), if computed
    paired: dict[str, PairedInput] = field(default_factory=dict)   # state / actions -> the message it used

    def _part(self, name: str, attr: str):
        part = self.paired.get(name)
        return None if part is None else getattr(part, attr)

    @property
    def joint_raw(self) -> bytes | None:
        return self._part("state", "raw")

    @property
    def joint_topic(self) -> str | None:
        return self._part("state", "topic")

    @property
    def joint_stamp_ns(self) -> int | None:
        return self._part("state", "stamp_ns")

    @property
    def state(self) -> np.ndarray | None:
        return self._part("state", "data")

    @property
    def actions(self) -> np.ndarray | None:
        return self._part("actions", "data")

    def parts(self) -> list[tuple[str, int]]:
        """(topic, bag header stamp) of every message this observation is made of, image first."""
        return [(self.image_topic, self.stamp_ns)] + [(p.topic, p.stamp_ns) for p in self.paired.values()]


@dataclass
class Rejection:
    """An input message the server must not use, and why (the node's counter name)."""
    stream: str
    topic: str
    kind: str            # image | joint_states | actions
    stamp_ns: int
    reason: str          # a node reason (serving.decode.REASONS: encoding, size, too_large, ...), unpaired; undecodable
    detail: str


# Not a counter of the node: CDR that rclpy cannot decode never reaches the node's callbacks.
UNDECODABLE = "undecodable"


@dataclass
class Inputs:
    observations: dict[str, list[InputObservation]]
    rejected: dict[str, list[Rejection]]
    missing: dict[str, list[str]] = field(default_factory=dict)   # stream -> input topics the bag lacks

    def expected_rejections(self, stream: str) -> Counter:
        """Per reason, what the node's counters must show for this stream (undecodable messages aside)."""
        return counted_by_node(self.rejected.get(stream, []))


def counted_by_node(rejected: list[Rejection]) -> Counter:
    """Per reason, what the node's counters show for these rejections (it never sees undecodable ones)."""
    return Counter(r.reason for r in rejected if r.reason != UNDECODABLE)


def input_observations(bag, serve: ServeInfo) -> dict[str, list[InputObservation]]:
    """Per stream, the observations chunk 0, 1, ... must consume (bag arrival order)."""
    return collect_inputs(bag, serve).observations


def message_class(stream: StreamInfo, role: str):
    from physis_ros.bags.bagio import rclpy_class

    return rclpy_class(stream.types[role])


def accept_input(msg, stream: StreamInfo, role: str, serve: ServeInfo) -> np.ndarray:
    """The model input the node stores for one message of ``role`` (image, joint_states, actions), by the
    node's own acceptance rule; InputRejected with the node's reason if it refuses it."""
    from physis_ros.ros.acceptance import accept_actions, accept_image, accept_joints

    cfg = serve.config.streams[stream.name]
    if role == "image":
        return accept_image(msg, cfg, stream.model_config)
    if role == "joint_states":
        return accept_joints(msg, cfg, model=stream.model_config)
    return accept_actions(msg, cfg, stream.model_config)


def collect_inputs(bag, serve: ServeInfo) -> Inputs:
    """The bag's inputs of every stream (camera frames, joint states, a world model's actions) through the
    server's acceptance rule and pairing rule: per stream the observations chunk 0, 1, ... must consume,
    and the inputs the server must reject."""
    from rclpy.serialization import deserialize_message

    from physis_ros.bags.bagio import bag_info
    from physis_ros.ros.acceptance import InputRejected
    from physis_ros.serving.intake import match_observations

    received: dict[tuple[str, str], list] = defaultdict(list)    # (stream, role) -> [(stamp, PairedInput)]
    rejected: dict[str, list[Rejection]] = {s.name: [] for s in serve.streams}
    by_topic: dict[str, list[tuple[StreamInfo, str]]] = defaultdict(list)
    for s in serve.streams:
        for role in s.input_roles:
            by_topic[s.topics[role]].append((s, role))
    present = {t.topic for t in bag_info(bag).topics}
    missing = {s.name: [s.topics[r] for r in s.input_roles if s.topics[r] not in present] for s in serve.streams}
    for topic, _, _, raw in read_all(bag, list(by_topic)):
        for s, role in by_topic[topic]:
            name = s.name
            try:
                stamp = header_stamp_ns(raw)
            except Exception as exc:  # struct.error: fewer bytes than a header
                rejected[name].append(Rejection(name, topic, role, -1, UNDECODABLE, f"no header stamp: {exc}"))
                continue
            try:
                msg = deserialize_message(raw, message_class(s, role))
            except Exception as exc:  # rclpy raises several types for bytes it cannot decode
                rejected[name].append(Rejection(name, topic, role, stamp, UNDECODABLE,
                                                f"CDR does not decode ({type(exc).__name__}: {exc})"))
                continue
            try:
                data = accept_input(msg, s, role, serve)
            except InputRejected as exc:
                rejected[name].append(Rejection(name, topic, role, stamp, exc.reason, exc.detail))
                continue
            received[(name, role)].append((stamp, PairedInput(topic, raw, stamp, data)))
    out = {}
    for s in serve.streams:
        roles = [OBSERVATION_TOPIC[o] for o in s.paired]
        observations = []
        for image, items, k in match_observations(received[(s.name, "image")],
                                                  *(received[(s.name, r)] for r in roles)):
            if items is None:
                rejected[s.name].append(Rejection(s.name, image.topic, "image", image.stamp_ns, "unpaired",
                                                  f"no accepted {ROLE_WORDS[roles[k]]} at or before its stamp"))
                continue
            observations.append(InputObservation(s.name, len(observations), image.stamp_ns, image.raw, image.topic,
                                                 image.data, dict(zip(s.paired, items))))
        out[s.name] = observations
    return Inputs(out, rejected, {n: m for n, m in missing.items() if m})
