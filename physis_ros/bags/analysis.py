"""Analyse a deterministic replay: inputs from the replayed bag, outputs from the recorded bag.

Deterministic mode promises that chunk ``c`` of a stream used the ``c``-th
complete observation of that stream (image + joint state paired as the node
pairs them, :func:`physis_ros.ros.inputs.pair_observations`). So from the
input bag alone we know how many chunks each stream must emit, which header
stamp each must carry, and (through the node's own preprocessing,
:func:`physis_ros.ros.conversions.observation_from_msgs`) exactly what the
sequential reference must compute for it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from physis_ros.bags.bagio import header_stamp_ns, read_all
from physis_ros.bags.serveconf import ServeInfo


@dataclass
class InputObservation:
    stream: str
    index: int
    stamp_ns: int        # header stamp in the bag (the image's)
    image_raw: bytes
    joint_raw: bytes
    image_topic: str
    joint_topic: str
    joint_stamp_ns: int


@dataclass
class OutputChunk:
    stream: str          # the ``stream`` field of the message
    index: int
    stamp_ns: int
    actions: np.ndarray  # float32 [horizon, dof]
    receive_ns: int      # recorder clock
    joint_names: list[str]


@dataclass
class Outputs:
    chunks: dict[str, list[OutputChunk]]                     # engine stream name -> in receive order
    trajectories: dict[str, list[tuple[int, int]]]           # stream -> (header stamp ns, points)
    telemetry: list[dict]
    diagnostics: int


@dataclass
class CheckItem:
    name: str
    ok: bool
    detail: str


@dataclass
class Analysis:
    items: list[CheckItem] = field(default_factory=list)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.items) and all(i.ok for i in self.items)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.items.append(CheckItem(name, bool(ok), detail))


def input_observations(bag, serve: ServeInfo) -> dict[str, list[InputObservation]]:
    """Per stream, the observations chunk 0, 1, ... must consume (bag arrival order)."""
    from physis_ros.ros.inputs import pair_observations

    images: dict[str, list] = defaultdict(list)
    joints: dict[str, list] = defaultdict(list)
    by_topic = {}
    for s in serve.streams:
        by_topic[s.topics["image"]] = (s.name, images)
        by_topic[s.topics["joint_states"]] = (s.name, joints)
    for topic, _, _, raw in read_all(bag, list(by_topic)):
        name, sink = by_topic[topic]
        sink[name].append((header_stamp_ns(raw), (topic, raw)))
    out = {}
    for s in serve.streams:
        pairs = pair_observations(images[s.name], joints[s.name])
        out[s.name] = [InputObservation(s.name, i, header_stamp_ns(img[1]), img[1], jnt[1], img[0], jnt[0],
                                        header_stamp_ns(jnt[1]))
                       for i, (img, jnt) in enumerate(pairs)]
    return out


def _ns(t) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def load_outputs(recorded, serve: ServeInfo) -> Outputs:
    from rclpy.serialization import deserialize_message
    from trajectory_msgs.msg import JointTrajectory

    from physis_ros.msg import ActionChunk, ChunkTelemetry

    chunk_topics = {s.topics["action_chunk"]: s.name for s in serve.streams}
    traj_topics = {s.topics["joint_trajectory"]: s.name for s in serve.streams}
    outputs = Outputs({s.name: [] for s in serve.streams}, {s.name: [] for s in serve.streams}, [], 0)
    for topic, _, log_ns, raw in read_all(recorded):
        if topic in chunk_topics:
            m = deserialize_message(raw, ActionChunk)
            actions = np.frombuffer(m.actions, dtype=np.float32).copy()
            if m.horizon * m.dof == actions.size:
                actions = actions.reshape(m.horizon, m.dof)
            outputs.chunks[chunk_topics[topic]].append(
                OutputChunk(m.stream, int(m.chunk_index), _ns(m.header.stamp), actions, log_ns, list(m.joint_names)))
        elif topic in traj_topics:
            m = deserialize_message(raw, JointTrajectory)
            outputs.trajectories[traj_topics[topic]].append((_ns(m.header.stamp), len(m.points)))
        elif topic == serve.telemetry_topic:
            m = deserialize_message(raw, ChunkTelemetry)
            outputs.telemetry.append(telemetry_row(m, log_ns))
        elif topic == "/diagnostics":
            outputs.diagnostics += 1
    return outputs


TELEMETRY_FIELDS = ("response_latency_ms", "output_interval_ms", "observation_age_ms", "stage_compute_ms_min",
                    "stage_compute_ms_max", "stage_compute_ms_sum", "queue_ms", "transport_ms")


def telemetry_row(m, log_ns: int) -> dict:
    row = {"stream": m.stream, "chunk": int(m.chunk_index), "log_ns": log_ns,
           "observation_ns": _ns(m.observation_stamp), "enqueue_ns": _ns(m.enqueue_stamp),
           "emit_ns": _ns(m.emit_stamp), "batch_sizes": [int(b) for b in m.batch_sizes],
           "deadline_miss": bool(m.deadline_miss)}
    row.update({f: float(getattr(m, f)) for f in TELEMETRY_FIELDS})
    return row


def pct(values, q: float) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(values, q)) if values else float("nan")


def _describe(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50), "p99": pct(values, 99), "max": max(values) if values else float("nan")}


def analyse(inputs: dict[str, list[InputObservation]], outputs: Outputs, serve: ServeInfo, *,
            published_stamp=None, completed_wall_ns=None, reference: bool = True) -> Analysis:
    """All checks of a deterministic replay.

    ``published_stamp(stream, bag_stamp_ns)``: the stamp the observation carried on the wire (the
    replay may restamp); ``completed_wall_ns(obs)``: when its last part was published (for the
    harness-measured end-to-end latency). Both optional.
    """
    result = Analysis()
    published_stamp = published_stamp or (lambda stream, ns: ns)
    names = {s.name: s for s in serve.streams}
    for name, obs in inputs.items():
        got = outputs.chunks.get(name, [])
        indices = [c.index for c in got]
        n = len(obs)
        if n == 0:
            result.add(f"{name}: inputs", False, "the bag has no complete observation for this stream")
            continue
        missing = sorted(set(range(n)) - set(indices))
        extra = sorted(set(indices) - set(range(n)))
        dups = sorted({i for i in indices if indices.count(i) > 1})
        result.add(f"{name}: every chunk accounted for", not missing and not extra and not dups,
                   f"{len(got)} chunks for {n} observations"
                   + (f"; missing {_span(missing)}" if missing else "") + (f"; unexpected {_span(extra)}" if extra else "")
                   + (f"; duplicated {_span(dups)}" if dups else ""))
        result.add(f"{name}: indices contiguous", indices == list(range(len(indices))),
                   "0..%d in order" % (len(indices) - 1) if indices == list(range(len(indices)))
                   else f"received order {indices[:12]}{'...' if len(indices) > 12 else ''}")
        wrong = [c.index for c in got if c.index < n and c.stamp_ns != published_stamp(name, obs[c.index].stamp_ns)]
        result.add(f"{name}: chunk c used observation c", not wrong,
                   "header stamps match the observations in bag order" if not wrong
                   else f"{len(wrong)} chunk(s) carry another observation's stamp, first chunk {wrong[0]}")
        bad_meta = [c.index for c in got if c.stream != name or c.joint_names != names[name].joint_names
                    or c.actions.ndim != 2]
        result.add(f"{name}: chunk fields", not bad_meta,
                   "stream, joint_names, horizon x dof consistent" if not bad_meta
                   else f"{len(bad_meta)} chunk(s) with a wrong stream name, joint names or shape (first {bad_meta[0]})")
        trajs = outputs.trajectories.get(name, [])
        result.add(f"{name}: one joint_trajectory per chunk", len(trajs) == len(got),
                   f"{len(trajs)} trajectories for {len(got)} chunks")
        tele = [r for r in outputs.telemetry if r["stream"] == name]
        tele_idx = sorted(r["chunk"] for r in tele)
        result.add(f"{name}: one telemetry per chunk", tele_idx == sorted(indices),
                   f"{len(tele)} telemetry messages for {len(got)} chunks")
        stats = {"observations": n, "chunks": len(got)}
        for key, values in (("latency_ms", [r["response_latency_ms"] for r in tele]),
                            ("interval_ms", [r["output_interval_ms"] for r in tele if r["chunk"] > 0]),
                            ("obs_age_ms", [r["observation_age_ms"] for r in tele])):
            for q, v in _describe(values).items():
                stats[f"{key}_{q}"] = v
        if completed_wall_ns is not None:
            e2e = [(c.receive_ns - completed_wall_ns(obs[c.index])) / 1e6 for c in got
                   if c.index < n and completed_wall_ns(obs[c.index]) is not None]
            for q, v in _describe(e2e).items():
                stats[f"e2e_ms_{q}"] = v
        result.stats[name] = stats
    if reference:
        _compare_reference(result, inputs, outputs, serve)
    return result


def _span(values: list[int]) -> str:
    return ", ".join(map(str, values[:10])) + (f" ... ({len(values)} in all)" if len(values) > 10 else "")


def reference_outputs(inputs: dict[str, list[InputObservation]], serve: ServeInfo) -> dict[str, list[np.ndarray]]:
    """The sequential reference (DESIGN.md section 2) fed the same observations, per stream."""
    import torch
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import CompressedImage, Image, JointState

    from physis_ros.model import build_model, load_model_config
    from physis_ros.model.checkpoint import load_checkpoint
    from physis_ros.reference import ReferenceRollout
    from physis_ros.ros.conversions import observation_from_msgs

    torch.set_num_threads(1)
    model_config = load_model_config(serve.model)
    checkpoint = serve.config.engine.checkpoint
    model = (load_checkpoint(checkpoint, config=model_config) if checkpoint else build_model(model_config))
    ref = ReferenceRollout(model, serve.seed)
    out = {}
    for name, obs in inputs.items():
        stream_cfg = serve.config.streams[name]
        image_type = CompressedImage if stream_cfg.compressed else Image
        outs = []
        for o in obs:
            ob = observation_from_msgs(deserialize_message(o.image_raw, image_type),
                                       deserialize_message(o.joint_raw, JointState), stream_cfg, model_config)
            outs.append(ref.step(name, ob).output.numpy().astype(np.float32))
        out[name] = outs
    return out


def _compare_reference(result: Analysis, inputs, outputs: Outputs, serve: ServeInfo) -> None:
    expected = reference_outputs(inputs, serve)
    exact = serve.bit_exact
    for name, refs in expected.items():
        got = {c.index: c.actions for c in outputs.chunks.get(name, [])}
        compared = mismatched = 0
        worst = 0.0
        first = None
        for i, ref in enumerate(refs):
            if i not in got:
                continue
            compared += 1
            a = got[i]
            if a.shape != ref.shape:
                mismatched += 1
                first = first if first is not None else i
                continue
            same = (a.tobytes() == ref.tobytes()) if exact else np.allclose(a, ref, rtol=1e-5, atol=1e-6)
            if not same:
                mismatched += 1
                first = first if first is not None else i
                worst = max(worst, float(np.max(np.abs(a - ref))))
        how = "bit-for-bit" if exact else "within rtol 1e-5 (engine batching on)"
        ok = compared > 0 and mismatched == 0
        detail = (f"{compared} chunks equal the sequential reference {how}" if ok else
                  f"{mismatched} of {compared} chunks differ from the reference ({how}); first chunk {first}, "
                  f"max |diff| {worst:.3g}" if compared else "no chunk to compare")
        result.add(f"{name}: equals reference", ok, detail)
