"""Analyse a deterministic replay: inputs from the replayed bag, outputs from the recorded bag.

Deterministic mode promises that chunk ``c`` of a stream used the ``c``-th
complete observation of that stream: of the messages the node accepts
(:mod:`physis_ros.ros.acceptance`, the node's own rule: encoding, sizes,
finite joint positions, every configured joint present), the image plus the
joint state paired as the node pairs them
(:func:`physis_ros.ros.inputs.pair_observations`). So from the input bag alone
we know which inputs the server must reject (and why: its counters must agree),
how many chunks each stream must emit, which header stamp each must carry, and,
from the accepted tensors, exactly what the sequential reference must compute
for it. Whatever the reference says, an output with a NaN or infinite value
(ActionChunk actions, JointTrajectory positions or velocities) fails the check.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
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
    image: np.ndarray | None = None    # the accepted model inputs (what the node stores), if computed
    state: np.ndarray | None = None


@dataclass
class Rejection:
    """An input message the server must not use, and why (the node's counter name)."""
    stream: str
    topic: str
    kind: str            # image | joint_states
    stamp_ns: int
    reason: str          # a node reason (conversions.REASONS: encoding, size, too_large, ...), unpaired; undecodable
    detail: str


# Not a counter of the node: CDR that rclpy cannot decode never reaches the node's callbacks.
UNDECODABLE = "undecodable"


@dataclass
class Inputs:
    observations: dict[str, list[InputObservation]]
    rejected: dict[str, list[Rejection]]

    def expected_rejections(self, stream: str) -> Counter:
        """Per reason, what the node's counters must show for this stream (undecodable messages aside)."""
        return Counter(r.reason for r in self.rejected.get(stream, []) if r.reason != UNDECODABLE)


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
    nonfinite_trajectories: dict[str, list[int]] = field(default_factory=dict)  # stream -> receive positions


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
    return collect_inputs(bag, serve).observations


def collect_inputs(bag, serve: ServeInfo) -> Inputs:
    """The bag's camera frames and joint states through the server's acceptance rule and pairing rule:
    per stream the observations chunk 0, 1, ... must consume, and the inputs the server must reject."""
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import CompressedImage, Image, JointState

    from physis_ros.model import load_model_config
    from physis_ros.ros.acceptance import InputRejected, accept_image, accept_joints
    from physis_ros.ros.inputs import pair_observations

    model = load_model_config(serve.model)
    images: dict[str, list] = defaultdict(list)
    joints: dict[str, list] = defaultdict(list)
    rejected: dict[str, list[Rejection]] = {s.name: [] for s in serve.streams}
    by_topic = {}
    for s in serve.streams:
        by_topic[s.topics["image"]] = (s.name, "image")
        by_topic[s.topics["joint_states"]] = (s.name, "joint_states")
    for topic, _, _, raw in read_all(bag, list(by_topic)):
        name, kind = by_topic[topic]
        cfg = serve.config.streams[name]
        try:
            stamp = header_stamp_ns(raw)
        except Exception as exc:  # struct.error: fewer bytes than a header
            rejected[name].append(Rejection(name, topic, kind, -1, UNDECODABLE, f"no header stamp: {exc}"))
            continue
        try:
            if kind == "image":
                msg = deserialize_message(raw, CompressedImage if cfg.compressed else Image)
            else:
                msg = deserialize_message(raw, JointState)
        except Exception as exc:  # rclpy raises several types for bytes it cannot decode
            rejected[name].append(Rejection(name, topic, kind, stamp, UNDECODABLE,
                                            f"CDR does not decode ({type(exc).__name__}: {exc})"))
            continue
        try:
            data = accept_image(msg, cfg, model) if kind == "image" else accept_joints(msg, cfg)
        except InputRejected as exc:
            rejected[name].append(Rejection(name, topic, kind, stamp, exc.reason, exc.detail))
            continue
        (images if kind == "image" else joints)[name].append((stamp, (topic, raw, data)))
    out = {}
    for s in serve.streams:
        pairs = pair_observations(images[s.name], joints[s.name])
        paired = {id(img) for img, _ in pairs}
        for ns, img in images[s.name]:
            if id(img) not in paired:
                rejected[s.name].append(Rejection(s.name, img[0], "image", ns, "unpaired",
                                                  "no accepted joint state at or before its stamp"))
        out[s.name] = [InputObservation(s.name, i, header_stamp_ns(img[1]), img[1], jnt[1], img[0], jnt[0],
                                        header_stamp_ns(jnt[1]), image=img[2], state=jnt[2])
                       for i, (img, jnt) in enumerate(pairs)]
    return Inputs(out, rejected)


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
            name = traj_topics[topic]
            values = [v for p in m.points for v in (*p.positions, *p.velocities)]
            if not np.all(np.isfinite(np.asarray(values, dtype=np.float64))):
                outputs.nonfinite_trajectories.setdefault(name, []).append(len(outputs.trajectories[name]))
            outputs.trajectories[name].append((_ns(m.header.stamp), len(m.points)))
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


def _counts(counter) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counter.items()) if n) or "none"


def _check_rejections(result: Analysis, name: str, rejected: list[Rejection],
                      server_rejected: dict[str, dict[str, int]] | None) -> None:
    """The inputs the checker excluded, by reason, beside the server's own counters."""
    expected = Counter(r.reason for r in rejected if r.reason != UNDECODABLE)
    undecodable = [r for r in rejected if r.reason == UNDECODABLE]
    examples = {}
    for r in rejected:
        examples.setdefault(r.reason, f"{r.kind} {r.stamp_ns}: {r.detail}")
    listing = f"excluded {len(rejected)} input(s): {_counts(Counter(r.reason for r in rejected))}"
    if examples:
        listing += " (" + "; ".join(f"{k}: {v}" for k, v in sorted(examples.items())) + ")"
    if undecodable:
        listing += f"; {len(undecodable)} undecodable message(s) the server never sees"
    if server_rejected is None:
        result.add(f"{name}: rejected inputs", True, f"{listing}; server's counters not available "
                                                     f"(it wrote no --summary-json): not compared")
        return
    server = Counter({k: int(v) for k, v in server_rejected.get(name, {}).items() if int(v)})
    if server == expected:
        result.add(f"{name}: rejected inputs", True, f"{listing}; the server counted the same: {_counts(server)}")
    else:
        result.add(f"{name}: rejected inputs", False,
                   f"the checker and the server disagree: checker expects {_counts(expected)}, server counted "
                   f"{_counts(server)}; {listing}")


def _check_finite(result: Analysis, name: str, got: list[OutputChunk], outputs: Outputs) -> None:
    bad_chunks = [c.index for c in got if not np.all(np.isfinite(c.actions))]
    bad_traj = outputs.nonfinite_trajectories.get(name, [])
    parts = []
    if bad_chunks:
        parts.append(f"{len(bad_chunks)} action_chunk(s) with NaN/inf actions (chunks {_span(bad_chunks)})")
    if bad_traj:
        parts.append(f"{len(bad_traj)} joint_trajectory message(s) with NaN/inf positions or velocities "
                     f"(received {_span(bad_traj)})")
    result.add(f"{name}: outputs finite", not parts,
               "; ".join(parts) if parts else f"{len(got)} chunks and their trajectories hold finite values only")


def analyse(inputs: dict[str, list[InputObservation]] | Inputs, outputs: Outputs, serve: ServeInfo, *,
            published_stamp=None, completed_wall_ns=None, reference: bool = True,
            server_rejected: dict[str, dict[str, int]] | None = None) -> Analysis:
    """All checks of a deterministic replay.

    ``inputs``: :func:`collect_inputs` (or only its observations); ``server_rejected``: the server's
    rejected-input counters per stream (``physis-serve --summary-json``), compared with the inputs
    the checker excluded; None: not available. ``published_stamp(stream, bag_stamp_ns)``: the stamp
    the observation carried on the wire (the replay may restamp); ``completed_wall_ns(obs)``: when its
    last part was published (for the harness-measured end-to-end latency). Both optional.
    """
    result = Analysis()
    rejected = inputs.rejected if isinstance(inputs, Inputs) else None
    inputs = inputs.observations if isinstance(inputs, Inputs) else inputs
    published_stamp = published_stamp or (lambda stream, ns: ns)
    names = {s.name: s for s in serve.streams}
    for name, obs in inputs.items():
        got = outputs.chunks.get(name, [])
        indices = [c.index for c in got]
        n = len(obs)
        if rejected is not None:
            _check_rejections(result, name, rejected.get(name, []), server_rejected)
        _check_finite(result, name, got, outputs)
        if n == 0:
            result.add(f"{name}: inputs", False, "the bag has no complete observation the server accepts for "
                                                 "this stream")
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
    from physis_ros.ros.acceptance import accept_image, accept_joints

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
            image = o.image if o.image is not None else accept_image(
                deserialize_message(o.image_raw, image_type), stream_cfg, model_config)
            state = o.state if o.state is not None else accept_joints(
                deserialize_message(o.joint_raw, JointState), stream_cfg)
            outs.append(ref.step(name, {"image": image, "state": state}).output.numpy().astype(np.float32))
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
                diff = np.abs(a.astype(np.float64) - ref)
                worst = max(worst, float(np.max(np.where(np.isnan(diff), np.inf, diff))))   # NaN: inf
        how = "bit-for-bit" if exact else "within rtol 1e-5 (engine batching on)"
        ok = compared > 0 and mismatched == 0
        detail = (f"{compared} chunks equal the sequential reference {how}" if ok else
                  f"{mismatched} of {compared} chunks differ from the reference ({how}); first chunk {first}, "
                  f"max |diff| {worst:.3g}" if compared else "no chunk to compare")
        result.add(f"{name}: equals reference", ok, detail)
