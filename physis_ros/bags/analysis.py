"""Analyse a deterministic replay: inputs from the replayed bag, outputs from the recorded bag.

Deterministic mode promises that chunk ``c`` of a stream used the ``c``-th
complete observation of that stream (:mod:`physis_ros.bags.inputs`: the node's
own acceptance and pairing rules applied to the input bag). So from the input
bag alone we know which inputs the server must reject (and why: its counters
must agree), how many chunks each stream must emit, which header stamp each
must carry, and, from the accepted tensors, exactly what the sequential
reference must compute for it. Whatever the
reference says, an output with a NaN or infinite value (ActionChunk actions,
JointTrajectory positions or velocities, PredictedFrames latents) fails the check.

A stream's chunk is what its model produces: a world-action model's ActionChunk
(with a JointTrajectory beside it), a world model's PredictedFrames.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from physis_ros.bags.bagio import read_all
from physis_ros.bags.inputs import (UNDECODABLE, InputObservation, Inputs, Rejection, accept_input, counted_by_node,
                                    message_class)
from physis_ros.bags.serveconf import OBSERVATION_TOPIC, ServeInfo, StreamInfo


@dataclass
class OutputChunk:
    stream: str          # the ``stream`` field of the message
    index: int
    stamp_ns: int
    values: np.ndarray   # float32: a WAM's actions [horizon, dof], a world model's latents [frames, C, h, w]
    receive_ns: int      # recorder clock
    joint_names: list[str]
    kind: str = "action_chunk"   # the message: action_chunk | predicted_frames

    @property
    def actions(self) -> np.ndarray:
        return self.values


@dataclass
class Outputs:
    chunks: dict[str, list[OutputChunk]]                     # engine stream name -> in receive order
    trajectories: dict[str, list[tuple[int, int]]]           # stream -> (header stamp ns, points)
    telemetry: list[dict]
    diagnostics: int
    nonfinite_trajectories: dict[str, list[int]] = field(default_factory=dict)  # stream -> receive positions
    # The latent frames a world-action model predicts beside its actions: stream -> chunk index -> [F, C, h, w]
    frames: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)


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


def _ns(t) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def load_outputs(recorded, serve: ServeInfo) -> Outputs:
    from rclpy.serialization import deserialize_message
    from trajectory_msgs.msg import JointTrajectory

    from physis_ros.msg import ActionChunk, ChunkTelemetry, PredictedFrames

    chunk_topics = {s.topics["action_chunk"]: s.name for s in serve.streams if s.produces == "actions"}
    frame_topics = {s.topics["predicted_frames"]: s.name for s in serve.streams if "predicted_frames" in s.topics}
    beside = {s.name for s in serve.streams if s.produces == "actions"}     # frames beside a WAM's actions
    traj_topics = {s.topics["joint_trajectory"]: s.name for s in serve.streams if s.produces == "actions"}
    outputs = Outputs({s.name: [] for s in serve.streams}, {s.name: [] for s in serve.streams}, [], 0)
    for topic, _, log_ns, raw in read_all(recorded):
        if topic in chunk_topics:
            m = deserialize_message(raw, ActionChunk)
            actions = np.frombuffer(m.actions, dtype=np.float32).copy()
            if m.horizon * m.dof == actions.size:
                actions = actions.reshape(m.horizon, m.dof)
            outputs.chunks[chunk_topics[topic]].append(
                OutputChunk(m.stream, int(m.chunk_index), _ns(m.header.stamp), actions, log_ns, list(m.joint_names)))
        elif topic in frame_topics:
            m = deserialize_message(raw, PredictedFrames)
            latents = np.frombuffer(m.latents, dtype=np.float32).copy()
            shape = (int(m.frames), int(m.channels), int(m.height), int(m.width))
            if math.prod(shape) == latents.size:
                latents = latents.reshape(shape)
            if frame_topics[topic] in beside:
                outputs.frames.setdefault(frame_topics[topic], {})[int(m.chunk_index)] = latents
                continue
            outputs.chunks[frame_topics[topic]].append(
                OutputChunk(m.stream, int(m.chunk_index), _ns(m.header.stamp), latents, log_ns, [],
                            "predicted_frames"))
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
CONTROL_FIELDS = ("seam_position_jump", "seam_velocity_jump", "tracking_error")   # NaN where not known


def telemetry_row(m, log_ns: int) -> dict:
    row = {"stream": m.stream, "chunk": int(m.chunk_index), "log_ns": log_ns,
           "observation_ns": _ns(m.observation_stamp), "enqueue_ns": _ns(m.enqueue_stamp),
           "emit_ns": _ns(m.emit_stamp), "batch_sizes": [int(b) for b in m.batch_sizes],
           "deadline_miss": bool(m.deadline_miss), "first_step": int(m.first_step),
           "inference_delay_steps": int(m.inference_delay_steps), "late_points": int(m.late_points),
           "late": bool(m.late), "seam_blended_rows": int(m.seam_blended_rows)}
    row.update({f: float(getattr(m, f)) for f in TELEMETRY_FIELDS + CONTROL_FIELDS})
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
    expected = counted_by_node(rejected)
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
    bad_chunks = [c.index for c in got if not np.all(np.isfinite(c.values))]
    bad_traj = outputs.nonfinite_trajectories.get(name, [])
    frames = bool(got) and got[0].kind == "predicted_frames"
    parts = []
    if bad_chunks:
        what = "predicted_frames message(s) with NaN/inf latents" if frames else "action_chunk(s) with NaN/inf actions"
        parts.append(f"{len(bad_chunks)} {what} (chunks {_span(bad_chunks)})")
    if bad_traj:
        parts.append(f"{len(bad_traj)} joint_trajectory message(s) with NaN/inf positions or velocities "
                     f"(received {_span(bad_traj)})")
    ok_text = (f"{len(got)} predicted_frames hold finite latents only" if frames
               else f"{len(got)} chunks and their trajectories hold finite values only")
    result.add(f"{name}: outputs finite", not parts, "; ".join(parts) if parts else ok_text)


def _check_fields(result: Analysis, stream: StreamInfo, got: list[OutputChunk]) -> None:
    """Each chunk names its stream and has its model's output shape (and, for actions, the joint names)."""
    name = stream.name
    spec = stream.model_config.spec if stream.model_config is not None else None
    shape = None if spec is None else spec.actions_shape if stream.produces == "actions" else spec.frames_shape
    if stream.produces == "actions":
        bad = [c.index for c in got if c.stream != name or c.joint_names != stream.joint_names
               or c.values.ndim != 2 or (shape is not None and c.values.shape != shape)]
        ok_text, bad_text = "stream, joint_names, horizon x dof consistent", "a wrong stream name, joint names or shape"
    else:
        bad = [c.index for c in got if c.stream != name or c.values.shape != shape]
        ok_text = f"stream, frames x channels x height x width {'x'.join(map(str, shape))} consistent"
        bad_text = f"a wrong stream name or a shape other than {'x'.join(map(str, shape))}"
    result.add(f"{name}: chunk fields", not bad, ok_text if not bad else
               f"{len(bad)} chunk(s) with {bad_text} (first {bad[0]})")


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
    missing_topics = inputs.missing if isinstance(inputs, Inputs) else {}
    inputs = inputs.observations if isinstance(inputs, Inputs) else inputs
    published_stamp = published_stamp or (lambda stream, ns: ns)
    names = {s.name: s for s in serve.streams}
    for name, obs in inputs.items():
        stream = names[name]
        got = outputs.chunks.get(name, [])
        indices = [c.index for c in got]
        n = len(obs)
        if rejected is not None:
            _check_rejections(result, name, rejected.get(name, []), server_rejected)
        _check_finite(result, name, got, outputs)
        if n == 0:
            lacking = missing_topics.get(name)
            result.add(f"{name}: inputs", False, "the bag has no complete observation the server accepts for "
                                                 "this stream" + (f": it has no {', '.join(lacking)}" if lacking
                                                                  else ""))
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
        _check_fields(result, stream, got)
        tele = [r for r in outputs.telemetry if r["stream"] == name]
        if stream.produces == "actions":
            # A chunk whose every row was already due when it came out (telemetry: late; a host busier than
            # the robot's timeline) is not sent as a trajectory: that is timing, not a lost message.
            trajs = outputs.trajectories.get(name, [])
            late = sum(r["late"] for r in tele)
            result.add(f"{name}: one joint_trajectory per chunk", len(trajs) == len(got) - late,
                       f"{len(trajs)} trajectories for {len(got)} chunks"
                       + (f", {late} of them late (every row due: not sent)" if late else ""))
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


def observation_tensors(o: InputObservation, stream: StreamInfo, serve: ServeInfo) -> dict[str, np.ndarray]:
    """The model inputs of one observation (``image``, ``state``, ``actions``: what its model takes), as the
    node stores them; recomputed from the raw messages by the node's acceptance rule where not kept."""
    from rclpy.serialization import deserialize_message

    def tensor(observation: str, data, raw: bytes) -> np.ndarray:
        if data is not None:
            return data
        role = OBSERVATION_TOPIC[observation]
        return accept_input(deserialize_message(raw, message_class(stream, role)), stream, role, serve)

    out = {"image": tensor("image", o.image, o.image_raw)}
    for observation, part in o.paired.items():
        out[observation] = tensor(observation, part.data, part.raw)
    return out


def reference_outputs(inputs: dict[str, list[InputObservation]], serve: ServeInfo) -> dict[str, list[np.ndarray]]:
    """The sequential reference (DESIGN.md section 2) fed the same observations, per stream, each stream
    with its own model (the weights the server loads: its checkpoint, else the config's init)."""
    import torch

    from physis_ros.model import build_model
    from physis_ros.model.checkpoint import load_checkpoint
    from physis_ros.reference import ReferenceRollout

    torch.set_num_threads(1)
    rollouts: dict[tuple[str, str | None], ReferenceRollout] = {}
    out = {}
    for name, obs in inputs.items():
        stream = serve.stream(name)
        key = (stream.model_config.name, stream.checkpoint)
        if key not in rollouts:
            model = (load_checkpoint(stream.checkpoint, config=stream.model_config) if stream.checkpoint
                     else build_model(stream.model_config))
            rollouts[key] = ReferenceRollout(model, serve.seed)
        ref = rollouts[key]
        out[name] = [ref.step(name, observation_tensors(o, stream, serve)).output.numpy().astype(np.float32)
                     for o in obs]
    return out


def _compare_reference(result: Analysis, inputs, outputs: Outputs, serve: ServeInfo) -> None:
    expected = reference_outputs(inputs, serve)
    exact = serve.bit_exact
    for name, refs in expected.items():
        stream = serve.stream(name)
        spec = stream.model_config.spec
        got = {c.index: c.values for c in outputs.chunks.get(name, [])}
        frames = outputs.frames.get(name) if stream.produces == "actions" and spec.has_frames else None
        compared = mismatched = 0
        worst = 0.0
        first = None
        for i, full in enumerate(refs):
            if i not in got:
                continue
            compared += 1
            # what each topic carries: the actions (or a world model's frames, [F, C, h, w]), and the frames a
            # world-action model predicts beside its actions (a chunk without them differs)
            pairs = [(got[i], spec.actions_of(full) if stream.produces == "actions" else spec.frames_of(full))]
            if frames is not None:
                pairs.append((frames.get(i), spec.frames_of(full)))
            for a, ref in pairs:
                if a is None or a.shape != ref.shape:
                    mismatched += 1
                    first = first if first is not None else i
                    break
                same = (a.tobytes() == np.ascontiguousarray(ref).tobytes()) if exact else np.allclose(
                    a, ref, rtol=1e-5, atol=1e-6)
                if not same:
                    mismatched += 1
                    first = first if first is not None else i
                    diff = np.abs(a.astype(np.float64) - ref)
                    worst = max(worst, float(np.max(np.where(np.isnan(diff), np.inf, diff))))   # NaN: inf
                    break
        how = "bit-for-bit" if exact else "within rtol 1e-5 (engine batching on)"
        ok = compared > 0 and mismatched == 0
        what = " (actions and predicted frames)" if frames is not None else ""
        detail = (f"{compared} chunks{what} equal the sequential reference {how}" if ok else
                  f"{mismatched} of {compared} chunks differ from the reference ({how}); first chunk {first}, "
                  f"max |diff| {worst:.3g}" if compared else "no chunk to compare")
        result.add(f"{name}: equals reference", ok, detail)
