"""A Session without an engine: observations checked as a strict robot would send them wrong, chunks
queued, dropped when unread and counted, readers told when the stream ends."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from physis_ros.config import from_mapping
from physis_ros.model.spec import load_model_config
from physis_ros.runtime.streams import ChunkOutput, ServedModel, StreamEvent
from physis_ros.serving.config import StreamConfig
from physis_ros.serving.intake import StreamInput
from physis_ros.serving.session import QUEUED_CHUNKS, Session
from physis_ros.serving.tensors import InputRejected, preprocess
from physis_ros.telemetry import ChunkRecord

JOINTS = [f"j{i}" for i in range(7)]
NOW = 1_700_000_000.0


def session(model: str = "tiny-wam", on_chunk=None, deterministic: bool = False, **fields) -> Session:
    cfg = load_model_config(model)
    stream = from_mapping(StreamConfig, {"joint_names": JOINTS, **fields})
    paired = [k for k in cfg.observation_shapes if k != "image"]
    clock = lambda: NOW   # noqa: E731
    return Session("r0", stream, ServedModel(cfg, None, None), "api", ["w0"], 160.0,
                   StreamInput(deterministic, 100, 0.5, stream.max_age_s, clock, paired), clock, on_chunk)


def output(s: Session, chunk: int, stamp: float = NOW) -> ChunkOutput:
    rec = ChunkRecord(s.name, chunk, obs_stamp=stamp, enqueue=NOW, emit=NOW + 0.1, interval_ms=100.0,
                      stage_ms=[1.0], queue_ms=0.0, hops_ms=[], batch_sizes=[1])
    return ChunkOutput(s.name, chunk, np.full(s.model.output_shape, chunk, np.float32), rec, tag=stamp)


def rejected(s: Session, **kwargs) -> InputRejected:
    with pytest.raises(InputRejected) as exc:
        s.observe(**kwargs)
    return exc.value


def test_an_observation_is_resampled_as_the_ros_path_resamples_it_and_taken_whole():
    s = session()
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    state = np.linspace(-1, 1, 7)
    s.observe(images={"front": frame}, stamp_s=NOW - 0.01)
    assert s.take(0) is None, "an image without its joint state is no observation yet"
    s.observe(state=state, stamp_s=NOW - 0.01)
    obs = s.take(0)
    expected = preprocess(frame, "rgb8", 32, 3, "center_crop")
    assert obs is not None and np.array_equal(obs.data["image"], expected)
    assert obs.data["state"].dtype == np.float32 and np.array_equal(obs.data["state"], state.astype(np.float32))
    assert obs.stamp == pytest.approx(NOW - 0.01) and obs.tag == pytest.approx(NOW - 0.01)


@pytest.mark.parametrize("kwargs, reason, names", [
    ({"images": {"cam": np.zeros((48, 64, 3), np.float32)}}, "encoding", "images"),
    ({"images": {"cam": np.zeros((48, 64, 2), np.uint8)}}, "encoding", "images"),
    ({"images": {"cam": np.zeros((0, 64, 3), np.uint8)}}, "size", "images"),
    ({"images": {"a": np.zeros((8, 8, 3), np.uint8), "b": np.zeros((8, 8, 3), np.uint8)}}, "malformed", "images"),
    ({"images": np.zeros((8, 8, 3), np.uint8)}, "malformed", "images"),
    ({"state": np.zeros(6)}, "size", "state"),
    ({"state": np.array(["a"] * 7)}, "size", "state"),
    ({"state": np.array([0, 0, 0, np.nan, 0, 0, 0])}, "nonfinite", "state"),
    ({"state": np.full(7, 1e12)}, "nonfinite", "state"),
    ({"actions": np.zeros((8, 7))}, "malformed", "actions"),
    ({"state": np.zeros(7), "stamp_s": NOW + 10.0}, "future_stamp", "stamp"),
    ({"state": np.zeros(7), "stamp_s": NOW - 10.0}, "stale_stamp", "stamp"),
    ({"state": np.zeros(7), "stamp_s": float("nan")}, "malformed", "stamp_s"),
    ({"state": np.zeros(7), "stamp_s": "now"}, "malformed", "stamp_s"),
    ({}, "malformed", "observe"),
])
def test_a_bad_observation_is_refused_naming_the_field_and_counted(kwargs, reason, names):
    s = session()
    exc = rejected(s, **kwargs)
    assert exc.reason == reason and names in str(exc), str(exc)
    assert s.input.snapshot()["rejected"] == {reason: 1}
    assert s.take(0) is None


def test_an_oversized_frame_is_refused_before_it_is_resampled():
    s = session(image={"max_bytes": 1000})
    exc = rejected(s, images={"cam": np.zeros((100, 100, 3), np.uint8)})
    assert exc.reason == "too_large" and "image.max_bytes" in str(exc)


def test_a_world_model_takes_the_actions_it_imagines_and_refuses_the_wrong_shape():
    s = session("tiny-acwm")
    exc = rejected(s, actions=np.zeros((4, 7)))
    assert exc.reason == "size" and "actions" in str(exc)
    s.observe(images={"cam": np.zeros((32, 32, 3), np.uint8)}, state=np.zeros(7), actions=np.ones((10, 7)))
    obs = s.take(0)
    assert obs is not None and obs.data["actions"].shape == (8, 7)


def test_chunks_queue_in_order_and_the_oldest_unread_are_dropped_and_counted():
    s = session()
    for c in range(QUEUED_CHUNKS + 3):
        s.deliver(output(s, c))
    assert s.dropped_unread == 3 and s.delivered == QUEUED_CHUNKS + 3
    first = s.next_chunk(timeout_s=0.0)
    assert first.index == 3 and first.epoch == 0 and first.actions.shape == (16, 7) and first.frames is None
    assert first.stamp_s == NOW


def test_next_chunk_times_out_with_the_builtin_error_and_wakes_for_a_chunk():
    s = session()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        s.next_chunk(timeout_s=0.05)
    assert time.monotonic() - started >= 0.05
    threading.Timer(0.05, s.deliver, args=(output(s, 0),)).start()
    assert s.next_chunk(timeout_s=10.0).index == 0


def test_a_reset_starts_a_new_epoch_and_an_ended_stream_says_why():
    s = session()
    s.on_event(StreamEvent("r0", "failed", "worker w0 lost", lost_chunks=2, cause="worker-lost"))
    assert s.health.failed and s.health.lost_chunks == 2 and dict(s.health.resets) == {"worker-lost": 1}
    s.on_event(StreamEvent("r0", "readmitted", "fresh KV"))
    s.deliver(output(s, 5))
    chunk = s.next_chunk(0.0)
    assert chunk.epoch == 1 and chunk.index == 5 and s.health.recovering is None
    waiting = threading.Timer(0.05, s.end, args=("left",))
    waiting.start()
    with pytest.raises(RuntimeError, match="ended \\(left\\)"):
        s.next_chunk(timeout_s=10.0)
    with pytest.raises(RuntimeError, match="ended"):
        s.observe(state=np.zeros(7))


def test_a_reader_callback_that_fails_costs_its_chunk_only_and_is_said_once_per_period(caplog):
    got = []

    def reader(chunk):
        if chunk.index % 2:
            raise ValueError("the reader's own bug")
        got.append(chunk.index)

    s = session(on_chunk=reader)
    with caplog.at_level("ERROR", logger="physis.serving"):
        for c in range(6):
            s.deliver(output(s, c))
    assert got == [0, 2, 4] and s.health.lost_chunks == 3 and dict(s.health.undelivered) == {"ValueError": 3}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "chunk 1 not delivered (ValueError: the reader's own bug)" in lines[0], lines


def test_the_resampling_agrees_with_opencvs_area_resize():
    """An independent implementation: where the crop is a whole number of pixels per output cell,
    cv2.INTER_AREA is the same box average (within float32 rounding)."""
    import cv2

    frame = np.random.default_rng(3).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    s = session()
    s.observe(images={"cam": frame}, state=np.zeros(7), stamp_s=NOW)
    got = s.take(0).data["image"]
    crop = frame[:, 80:560]
    expected = cv2.resize(crop.astype(np.float32), (32, 32), interpolation=cv2.INTER_AREA).transpose(2, 0, 1) / 255.0
    assert got.shape == (3, 32, 32)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_source_renders_the_observation_when_its_chunk_is_due_and_a_bad_one_is_counted():
    calls = []

    def source(chunk):
        calls.append(chunk)
        if chunk == 1:
            raise RuntimeError("the simulator's own bug")
        if chunk == 2:
            return {"image": np.zeros((3, 16, 16), np.float32), "state": np.zeros(7, np.float32)}, NOW
        if chunk == 3:
            return None
        return {"image": np.full((3, 32, 32), 0.5), "state": np.arange(7.0)}, NOW - 0.02

    cfg = load_model_config("tiny-wam")
    stream = from_mapping(StreamConfig, {"joint_names": JOINTS})
    s = Session("r0", stream, ServedModel(cfg, None, None), "api", ["w0"], 160.0,
                StreamInput(False, 100, 0.5, 1.0, lambda: NOW, ["state"]), lambda: NOW, source=source)
    obs = s.take(0)
    assert obs.data["image"].dtype == np.float32 and obs.data["state"][6] == 6.0 and obs.stamp == NOW - 0.02
    assert s.take(1) is None and s.take(2) is None and s.take(3) is None and calls == [0, 1, 2, 3]
    assert s.input.snapshot()["rejected"] == {"source_error": 1, "size": 1}
    with pytest.raises(RuntimeError, match="source"):
        s.observe(state=np.zeros(7))
