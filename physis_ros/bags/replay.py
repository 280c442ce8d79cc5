"""Replay a bag: raw CDR bytes published with the original timing (or scaled), optional /clock.

Messages are never deserialized: the bytes read from the bag go to rclpy
publishers as they are (``--restamp`` patches the 8 header-stamp bytes in place).
Topics whose message type has no rclpy type support here are skipped and
reported; everything else is replayed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from physis_ros.bags.bagio import (BagError, UnknownTypeError, bag_info, has_header, iter_messages, open_bag,
                                   rclpy_class)
from physis_ros.cdr import header_stamp_ns, with_header_stamp
from physis_ros.bags.rosnode import qos_for

CLOCK_TOPIC = "/clock"


def parse_remaps(items: list[str] | None) -> dict[str, str]:
    """``FROM:=TO`` pairs (topics or namespaces) -> dict, leading slashes normalised."""
    out = {}
    for item in items or []:
        if ":=" not in item:
            raise BagError(f"remap '{item}' is not of the form FROM:=TO")
        src, dst = (("/" + p.strip().strip("/")) for p in item.split(":=", 1))
        if src == "/" or dst == "/":
            raise BagError(f"remap '{item}' has an empty side")
        out[src] = dst
    return out


def remap_topic(topic: str, remaps: dict[str, str]) -> str:
    """Exact topic remap first, else the longest namespace prefix (``/robot0:=/arm`` moves ``/robot0/*``)."""
    if topic in remaps:
        return remaps[topic]
    best = max((src for src in remaps if topic.startswith(src + "/")), key=len, default=None)
    return topic if best is None else remaps[best] + topic[len(best):]


@dataclass
class ReplayOptions:
    rate: float = 1.0
    loop: bool = False
    start_offset_s: float = 0.0
    remaps: dict[str, str] = field(default_factory=dict)
    clock_hz: float | None = None          # publish /clock at this rate (bag time)
    topics: list[str] | None = None        # bag topics to replay (None: all)
    restamp: bool = False                  # shift header stamps to wall time of publication
    wait_for: list[str] = field(default_factory=list)   # output topics that need a subscriber first
    wait_timeout_s: float = 10.0
    delay_s: float = 0.0                   # pause before the first message (discovery); /clock holds the start
    max_loops: int | None = None           # with loop: stop after this many passes
    progress: bool = True
    reliable: bool = False                 # publish sensor topics reliable too (lossless into a reliable reader)
    ack_timeout_s: float = 5.0             # with reliable: how long the end waits for subscribers' acknowledgements

    def validate(self) -> None:
        if not self.rate > 0:
            raise BagError(f"--rate must be > 0, got {self.rate}")
        if self.start_offset_s < 0:
            raise BagError(f"--start-offset must be >= 0, got {self.start_offset_s}")
        if self.clock_hz is not None and not self.clock_hz > 0:
            raise BagError(f"--clock rate must be > 0 Hz, got {self.clock_hz}")


@dataclass
class SkippedTopic:
    topic: str
    msgtype: str
    count: int
    reason: str


@dataclass
class Published:
    """One publication, for callers that correlate inputs with outputs (the check harness)."""
    topic: str           # as published (after remap)
    bag_topic: str
    msgtype: str
    log_ns: int          # bag log time
    stamp_ns: int | None  # header stamp as published (after restamp), if the type has a header
    bag_stamp_ns: int | None
    wall_ns: int         # time.time_ns() right after publish()


@dataclass
class ReplayResult:
    counts: dict[str, int]
    skipped: list[SkippedTopic]
    lateness_us: np.ndarray          # publish instant minus scheduled instant, per message
    wall_s: float
    bag_span_s: float
    passes: int
    clock_ticks: int = 0
    interrupted: bool = False
    unacked: list[str] = field(default_factory=list)   # reliable topics a subscriber had not acknowledged at the end

    @property
    def messages(self) -> int:
        return int(sum(self.counts.values()))

    def timing(self) -> dict[str, float]:
        late = self.lateness_us
        if late.size == 0:
            return {}
        return {"p50_us": float(np.percentile(late, 50)), "p99_us": float(np.percentile(late, 99)),
                "max_us": float(late.max()), "mean_us": float(late.mean())}

    def summary(self) -> str:
        t = self.timing()
        timing = (f"; timing error p50 {t['p50_us']:.0f} us, p99 {t['p99_us']:.0f} us, max {t['max_us']:.0f} us"
                  if t else "")
        line = (f"replayed {self.messages} messages on {len(self.counts)} topics in {self.wall_s:.2f} s "
                f"({self.passes} pass{'es' if self.passes != 1 else ''}){timing}")
        if self.clock_ticks:
            line += f"; {self.clock_ticks} /clock messages"
        for s in self.skipped:
            line += f"\nskipped {s.topic} ({s.msgtype}, {s.count} messages): {s.reason}"
        if self.unacked:
            line += f"\nnot acknowledged by every subscriber: {', '.join(self.unacked)}"
        if self.interrupted:
            line += "\ninterrupted"
        return line


class Progress:
    """A one-line progress bar on stderr, redrawn at most 4 times a second (every 5 s if not a tty)."""

    def __init__(self, total_s: float, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = 0.25 if self.tty else 5.0
        self.total_s = max(total_s, 1e-9)
        self.last = 0.0

    def update(self, bag_s: float, count: int, loop: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.every):
            return
        self.last = now
        frac = min(1.0, max(0.0, bag_s / self.total_s))
        bar = "#" * int(frac * 30)
        text = (f"[{bar:<30}] {frac * 100:5.1f}%  {bag_s:7.2f}/{self.total_s:.2f} s  {count} msgs"
                + (f"  loop {loop + 1}" if loop else ""))
        self.stream.write(("\r" + text) if self.tty else (text + "\n"))
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _sleep_until(deadline: float) -> None:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(remaining)


class Replayer:
    """Publishes one bag on a node; :meth:`run` blocks until the bag (or the loop) is done."""

    def __init__(self, bag, node, options: ReplayOptions | None = None,
                 on_publish: Callable[[Published], None] | None = None):
        self.options = options or ReplayOptions()
        self.options.validate()
        self.bag = bag
        self.node = node
        self.on_publish = on_publish
        self.info = bag_info(bag)                      # BagError on missing / unreadable / truncated bag
        wanted = set(self.options.topics) if self.options.topics else None
        if wanted:
            missing = sorted(wanted - {t.topic for t in self.info.topics})
            if missing:
                raise BagError(f"topics not in bag {bag}: {', '.join(missing)}")
        self.publishers = {}
        self.headers = {}
        self.out_topic = {}
        self.skipped: list[SkippedTopic] = []
        for t in self.info.topics:
            if wanted is not None and t.topic not in wanted:
                continue
            out = remap_topic(t.topic, self.options.remaps)
            try:
                cls = rclpy_class(t.msgtype)
                self.publishers[t.topic] = node.create_publisher(cls, out,
                                                                 qos_for(t.msgtype, out, self.options.reliable))
            except UnknownTypeError as exc:
                self.skipped.append(SkippedTopic(t.topic, t.msgtype, t.count, str(exc)))
                continue
            except Exception as exc:   # type support failed to load
                self.skipped.append(SkippedTopic(t.topic, t.msgtype, t.count, f"cannot publish: {exc}"))
                continue
            self.out_topic[t.topic] = out
            self.headers[t.topic] = has_header(t.msgtype)
        if not self.publishers:
            names = ", ".join(f"{s.topic} ({s.msgtype})" for s in self.skipped) or "none"
            raise BagError(f"nothing to replay from {bag}: no topic with a known message type (skipped: {names})")
        self.clock_pub = None
        if self.options.clock_hz:
            from rosgraph_msgs.msg import Clock
            self.clock_pub = node.create_publisher(Clock, CLOCK_TOPIC, qos_for("rosgraph_msgs/msg/Clock"))
        self.types = {t.topic: t.msgtype for t in self.info.topics}

    def wait_for_subscribers(self) -> None:
        """Block until every topic in ``options.wait_for`` has a matched subscriber."""
        by_out = {self.out_topic[t]: p for t, p in self.publishers.items()}
        unknown = [t for t in self.options.wait_for if t not in by_out]
        if unknown:
            raise BagError(f"--wait-for topics are not replayed from this bag: {', '.join(unknown)}")
        deadline = time.monotonic() + self.options.wait_timeout_s
        while True:
            lonely = [t for t in self.options.wait_for if by_out[t].get_subscription_count() < 1]
            if not lonely:
                return
            if time.monotonic() > deadline:
                raise BagError(f"no subscriber on {', '.join(lonely)} after {self.options.wait_timeout_s:.0f} s")
            time.sleep(0.05)

    def _wait_acked(self) -> list[str]:
        """With ``reliable``, wait (up to ``ack_timeout_s``) until every matched subscriber has acknowledged every
        message, so that a replay that returns has delivered, not only sent; returns the topics still unacknowledged."""
        if not self.options.reliable:
            return []
        from rclpy.duration import Duration

        deadline = time.monotonic() + self.options.ack_timeout_s
        unacked = []
        for topic, pub in self.publishers.items():
            left = max(0.0, deadline - time.monotonic())
            if not pub.wait_for_all_acked(Duration(nanoseconds=int(left * 1e9))):
                unacked.append(self.out_topic[topic])
        return unacked

    def _publish_clock(self, bag_ns: int) -> None:
        from rosgraph_msgs.msg import Clock
        msg = Clock()
        msg.clock.sec, msg.clock.nanosec = divmod(int(bag_ns), 1_000_000_000)
        self.clock_pub.publish(msg)

    def run(self) -> ReplayResult:
        opts = self.options
        self.wait_for_subscribers()
        origin = self.info.start_ns + int(opts.start_offset_s * 1e9)
        if opts.delay_s > 0:
            end = time.monotonic() + opts.delay_s
            if self.clock_pub is not None:       # a paused clock at the start, so use_sim_time nodes have a time
                while time.monotonic() < end:
                    self._publish_clock(origin)
                    time.sleep(min(1.0 / opts.clock_hz, max(0.0, end - time.monotonic())))
            else:
                time.sleep(opts.delay_s)
        span_s = max(0.0, (self.info.end_ns - origin) / 1e9)
        if origin > self.info.end_ns:
            raise BagError(f"--start-offset {opts.start_offset_s} s is past the end of the bag "
                           f"({self.info.duration_s:.2f} s long)")
        counts = {self.out_topic[t]: 0 for t in self.publishers}
        late: list[float] = []
        progress = Progress(span_s / opts.rate, opts.progress)
        clock_ticks = 0
        passes = 0
        interrupted = False
        start_wall = time.monotonic()
        try:
            with open_bag(self.bag) as reader:
                while True:
                    t0 = time.monotonic()
                    wall0 = time.time_ns()
                    clock_period = 1.0 / opts.clock_hz if opts.clock_hz else None
                    next_clock = t0
                    for topic, msgtype, log_ns, raw in iter_messages(reader, list(self.publishers), origin):
                        target = t0 + (log_ns - origin) / 1e9 / opts.rate
                        while clock_period is not None and next_clock <= target:
                            _sleep_until(next_clock)
                            self._publish_clock(origin + int((next_clock - t0) * opts.rate * 1e9))
                            clock_ticks += 1
                            next_clock += clock_period
                        _sleep_until(target)
                        stamp = bag_stamp = None
                        if self.headers[topic]:
                            stamp = bag_stamp = header_stamp_ns(raw)
                            if opts.restamp:
                                stamp = wall0 + int((bag_stamp - origin) / opts.rate)
                                raw = with_header_stamp(raw, stamp)
                        late.append((time.monotonic() - target) * 1e6)
                        self.publishers[topic].publish(raw)
                        wall = time.time_ns()
                        out = self.out_topic[topic]
                        counts[out] += 1
                        if self.on_publish is not None:
                            self.on_publish(Published(out, topic, msgtype, log_ns, stamp, bag_stamp, wall))
                        progress.update((log_ns - origin) / 1e9, sum(counts.values()), passes)
                    if clock_period is not None:     # the bag's last instant
                        self._publish_clock(self.info.end_ns)
                        clock_ticks += 1
                    passes += 1
                    if not opts.loop or (opts.max_loops is not None and passes >= opts.max_loops):
                        break
        except KeyboardInterrupt:
            interrupted = True
        wall_s = time.monotonic() - start_wall
        unacked = [] if interrupted else self._wait_acked()
        progress.update(span_s, sum(counts.values()), max(passes - 1, 0), force=True)
        progress.done()
        return ReplayResult(counts, list(self.skipped), np.asarray(late, dtype=np.float64),
                            wall_s, span_s, passes, clock_ticks, interrupted, unacked)
