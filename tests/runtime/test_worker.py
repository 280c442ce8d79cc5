"""A worker in-process (no serve loop): slots, placement checks, the bounded ready queue, lost-task
reports, fault injection, and headers with fields of the wrong type (which once crashed a worker)."""

import time

import msgpack
import pytest
import torch
import zmq

from physis_ros.config import to_mapping
from physis_ros.model import load_model_config
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.worker import Worker

CFG = load_model_config("tiny-wam")


class EngineEnd:
    """The engine's side of the worker's control socket: what the worker reports."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"

    def received(self, timeout_ms: int = 300) -> list:
        out = []
        while self.router.poll(timeout_ms):
            _, *frames = self.router.recv_multipart()
            out.append(wire.decode(frames, wire.TO_ENGINE).msg)
            timeout_ms = 50
        return out

    def close(self):
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engine_end():
    end = EngineEnd()
    yield end
    end.close()


MODEL = p.ModelRef(id="tiny-wam", config=to_mapping(CFG))


def make_worker(engine_end, **load) -> Worker:
    w = Worker(engine_end.addr, "w0", forward_logs=False)
    w.cmd_load(p.Load(req=0, **load))
    w.start_stream_now(p.StartStream(req=0, stream="robot0", epoch=0, model=MODEL, stages=[(4, 0), (4, 1)],
                                     routes=[p.Route((4, 0), w.data_addr), p.Route((4, 1), "tcp://127.0.0.1:9")]))
    return w


@pytest.fixture
def worker(engine_end):
    w = make_worker(engine_end)
    yield w
    w.close()


def task(stream="robot0", chunk=0, stage=(4, 0), epoch=0):
    obs = {"obs/image": torch.zeros(1, 3, 32, 32), "obs/state": torch.zeros(1, 7)}
    return wire.encode(p.Task(stream=stream, chunk=chunk, stage=stage, epoch=epoch, order=float(chunk)), obs)


def test_tasks_are_checked_against_the_streams_placement(worker, engine_end):
    worker.tasks.accept_task(task(stage=(3, 0)))  # not hosted here for this stream
    worker.tasks.accept_task(task(stream="nobody"))  # a stream that was never started (or was stopped)
    worker.tasks.accept_task(task(epoch=1))  # from an incarnation the worker has not seen: reported lost
    worker.tasks.accept_task(task())
    assert worker.stats.bad_messages == 1 and worker.stats.stale == 1
    assert [j.chunk for j in worker.tasks.ready] == [0]
    assert set(worker.tasks.ready[0].state) == {"obs/image", "obs/state", "x"}  # the noise is made here
    lost = [m for m in engine_end.received() if isinstance(m, p.TaskLost)]
    assert [(m.stream, m.chunk, m.epoch, m.reason) for m in lost] == [("robot0", 0, 1, "epoch_ahead")]


def test_a_payload_of_the_wrong_shape_is_reported_not_run(worker, engine_end):
    bad = wire.encode(p.Task(stream="robot0", chunk=4, stage=(4, 0), epoch=0),
                      {"obs/image": torch.zeros(1, 3, 16, 16), "obs/state": torch.zeros(1, 7)})
    worker.tasks.accept_task(bad)
    assert not worker.tasks.ready and worker.stats.bad_messages == 1
    lost = [m for m in engine_end.received() if isinstance(m, p.TaskLost)]
    assert lost and lost[0].chunk == 4 and "obs/image" in lost[0].detail


@pytest.mark.parametrize("field, value", [("seed", "7"), ("sent", "now"), ("hops", "x"), ("order", [1]),
                                          ("seed", 1.5), ("sent", None), ("hops", [None]), ("order", float("nan")),
                                          ("trace", [[1, 2]]), ("epoch", -1), ("chunk", 2**63 - 1)])
def test_a_header_field_of_the_wrong_type_is_dropped_and_counted(worker, field, value):
    frames = [bytes(f) for f in task()]
    header = msgpack.unpackb(frames[0])
    header[field] = value
    worker.tasks.accept_task([msgpack.packb(header), *frames[1:]])  # must not raise
    assert worker.stats.bad_messages == 1 and not worker.tasks.ready


def test_ready_queue_is_bounded_drops_the_oldest_and_reports_it(engine_end):
    worker = make_worker(engine_end, max_ready=8)
    try:
        for c in range(12):
            worker.tasks.accept_task(task(chunk=c))
        assert len(worker.tasks.ready) == 8 and worker.stats.dropped_tasks == 4
        assert sorted(j.chunk for j in worker.tasks.ready) == list(range(4, 12))
        lost = [m for m in engine_end.received() if isinstance(m, p.TaskLost)]
        assert [(m.chunk, m.reason) for m in lost] == [(c, "queue_full") for c in range(4)]
    finally:
        worker.close()


def test_fault_injection_drops_the_nth_task_silently(engine_end):
    worker = make_worker(engine_end, faults=p.FaultInjection(drop_task=3))
    try:
        for c in range(5):
            worker.tasks.accept_task(task(chunk=c))
        assert [j.chunk for j in worker.tasks.ready] == [0, 1, 3, 4] and worker.stats.injected_drops == 1
        assert not [m for m in engine_end.received() if isinstance(m, p.TaskLost)]  # silence: a lost message
    finally:
        worker.close()


def test_a_failed_send_is_reported_as_lost(worker, engine_end):
    worker.tasks.accept_task(task(chunk=2))
    worker.tasks.run_next()  # (4, 0) then (4, 1) here, back to back (the chunk is alone); its output goes to a peer
    assert not worker.tasks.ready   # that does not exist: the send is refused
    assert worker.stats.dropped_sends == 1
    lost = [m for m in engine_end.received() if isinstance(m, p.TaskLost)]
    assert [(m.chunk, m.reason) for m in lost] == [(2, "send_failed")]


def test_control_requests_are_typed_and_failures_answered(worker, engine_end):
    worker.handle_control(wire.Received(p.StartStream(req=9, stream="robot1", epoch=0, model=MODEL, stages=[(9, 0)],
                                                      routes=[])))
    worker.handle_control(wire.Received(p.Stats(req=10)))
    replies = {m.req: m for m in engine_end.received() if isinstance(m, (p.Ack, p.Failed))}
    assert isinstance(replies[9], p.Failed) and "do not exist" in replies[9].error
    assert isinstance(replies[10], p.Ack) and replies[10].stats.kv_bytes > 0


def test_a_new_models_stages_are_checked_on_the_loader_and_a_misfit_answered(worker, engine_end):
    """A model the worker does not host yet is read (its config, its family) and checked on the loader thread,
    not in the loop that runs stages and heartbeats; stages it does not have fail that stream's start."""
    other = p.ModelRef(id="tiny-wam-other", config=to_mapping(CFG))
    worker.handle_control(wire.Received(p.StartStream(req=11, stream="robot2", epoch=0, model=other, stages=[(9, 0)],
                                                      routes=[p.Route((9, 0), worker.data_addr)])))
    replies, deadline = {}, time.monotonic() + 60.0
    while 11 not in replies and time.monotonic() < deadline:
        worker.finish_starts()
        replies.update({m.req: m for m in engine_end.received(50) if isinstance(m, (p.Ack, p.Failed))})
    assert isinstance(replies[11], p.Failed) and "do not exist" in replies[11].error
    assert "robot2" not in worker.starting


def test_every_physis_logger_is_forwarded_to_the_engine_once(engine_end):
    """Spawned workers run with --no-log-stderr: physis.hops (and any physis.*) lines must reach the engine."""
    import logging
    import threading

    # setLevel (not a patched attribute): it also clears the loggers' cached isEnabledFor answers, which
    # an earlier test in this process may have left at another level.
    names = ("physis", "physis.worker", "physis.hops")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.INFO if n == "physis" else logging.NOTSET)
    physis = logging.getLogger("physis")
    try:
        w = Worker(engine_end.addr, "w0")
        try:
            engine_end.received(timeout_ms=100)  # whatever the worker said at start
            logging.getLogger("physis.hops").warning("hop to %s timed out", "w1")
            logging.getLogger("physis.worker").info("a worker line")
            logging.getLogger("physis.hops").debug("below the level: not sent")
            logs = [(m.worker, m.level, m.text) for m in engine_end.received() if isinstance(m, p.LogRecord)]
            assert logs == [("w0", "warning", "hops: hop to w1 timed out"), ("w0", "info", "a worker line")]
            # A hop thread's line is not sent from that thread (a ZeroMQ socket is one thread's): it waits
            # for the worker's loop, here its close.
            t = threading.Thread(target=lambda: logging.getLogger("physis.hops").warning("send over w0<->w1 failed"))
            t.start()
            t.join()
            assert not [m for m in engine_end.received(timeout_ms=100) if isinstance(m, p.LogRecord)]
        finally:
            w.close()
        assert w._log_handler not in physis.handlers  # removed on close
        logs = [m.text for m in engine_end.received() if isinstance(m, p.LogRecord)]
        assert logs == ["hops: send over w0<->w1 failed"]
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


# ---- a chunk alone runs its local stages back to back --------------------------------------------------
def _reference_state(chunk: int) -> dict:
    """Stages (4, 0) and (4, 1) of ``chunk`` run one by one on a worker of its own (the stage-by-stage path)."""
    from physis_ros.model import KVBatch
    from physis_ros.model.stages import run_stage

    end = EngineEnd()
    w = make_worker(end)
    try:
        w.tasks.accept_task(task(chunk=chunk))
        job = w.tasks.ready[0]
        host, slots = w.host.models["tiny-wam"], w.host.placements["robot0"].slots
        state = job.state
        for b in (0, 1):
            state = run_stage(host.model, b, [4], [state], KVBatch(host.tables[b], [slots[4]]), [None])[0]
        return state
    finally:
        w.close()
        end.close()


def _catch_output(worker) -> zmq.Socket:
    """A socket where the stream's route after (4, 1) now points: it gets what the worker sends on to (4, 2)."""
    sink = worker.ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    worker.host.placements["robot0"].routes[(4, 1)] = addr
    worker._push(addr)
    time.sleep(0.2)   # the connection is up before the send (sends use IMMEDIATE)
    return sink


def test_a_chunk_alone_runs_its_local_stages_in_one_turn_with_a_trace_entry_each(worker):
    sink = _catch_output(worker)
    try:
        worker.tasks.accept_task(task(chunk=5))
        worker.tasks.run_next()
        assert not worker.tasks.ready
        assert worker.stats.stages == 2 and worker.stats.batches == 2 and worker.stats.tasks == 1
        assert sink.poll(2000)
        rec = wire.decode(sink.recv_multipart(copy=False), wire.DATA)
        assert rec.msg.stage == (4, 2)
        trace = [(e.step, e.block, e.worker, e.batch) for e in rec.msg.trace]
        assert trace == [(4, 0, "w0", 1), (4, 1, "w0", 1)]
        assert all(e.compute_ms > 0 and e.queue_ms >= 0 for e in rec.msg.trace)
        # the second stage queued for nothing: it ran as the first ended (a bound that tells "ran next" from
        # "waited behind something", which takes a model forward; the host may preempt in between)
        assert rec.msg.trace[1].queue_ms < 50.0
        want = _reference_state(5)
        assert set(rec.tensors) == set(want)
        assert all(torch.equal(rec.tensors[k], want[k]) for k in want)   # the same forwards: bit-identical
    finally:
        sink.close(linger=0)


def test_a_chunk_alone_yields_when_a_task_arrives(worker, monkeypatch):
    from physis_ros.runtime import tasks as tasks_module

    monkeypatch.setattr(tasks_module, "RUN_ALONE_LOOK_S", 0.0)   # look after every stage
    looks = []
    worker.tasks.has_task = lambda: looks.append(1) or True
    worker.tasks.accept_task(task(chunk=1))
    worker.tasks.run_next()
    assert looks == [1] and worker.stats.stages == 1
    assert [(j.chunk, j.stage) for j in worker.tasks.ready] == [(1, (4, 1))]   # back in the queue, next stage
    assert len(worker.tasks.ready[0].task.trace) == 1


def test_a_chunk_alone_yields_to_the_loop_after_its_time(worker, monkeypatch):
    from physis_ros.runtime import tasks as tasks_module

    monkeypatch.setattr(tasks_module, "RUN_ALONE_MAX_S", 0.0)   # heartbeats and control come first
    worker.tasks.accept_task(task(chunk=1))
    worker.tasks.run_next()
    assert worker.stats.stages == 1 and [j.stage for j in worker.tasks.ready] == [(4, 1)]


def test_the_worker_looks_at_its_data_socket_for_tasks(worker):
    """``has_task`` reads the socket's event flags: true once a task waits there, without taking it."""
    assert not worker._has_task()
    push = worker.ctx.socket(zmq.PUSH)
    push.connect(worker.data_addr)
    try:
        push.send_multipart(task(chunk=3))
        deadline = time.monotonic() + 5
        while not worker._has_task() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker._has_task()
        assert worker.data_in.poll(0)   # still there for the loop
    finally:
        push.close(linger=0)


def test_with_other_tasks_ready_a_turn_runs_one_stage(worker):
    worker.tasks.accept_task(task(chunk=1))
    worker.tasks.accept_task(task(chunk=2))
    worker.tasks.run_next()   # chunk 1's (4, 0); chunk 2 waits, so no run alone
    assert worker.stats.stages == 1
    assert sorted((j.chunk, j.stage) for j in worker.tasks.ready) == [(1, (4, 1)), (2, (4, 0))]


# ---- wake-ups ahead of a message -----------------------------------------------------------------------
def test_a_wake_keeps_the_worker_polling_and_makes_its_chunks_noise_ahead(worker):
    host = worker.host.models["tiny-wam"]
    before = time.monotonic()
    worker.tasks.accept_task(wire.encode(p.Wake(stream="robot0", chunk=3, seed=7)))
    assert worker.stats.wakes == 1 and worker.stats.bad_messages == 0 and not worker.tasks.ready
    assert before < worker.tasks.spin_until <= time.monotonic() + 0.01   # polls, bounded
    worker.tasks.accept_task(wire.encode(p.Task(stream="robot0", chunk=3, stage=(4, 0), epoch=0, seed=7),
                                         {"obs/image": torch.zeros(1, 3, 32, 32), "obs/state": torch.zeros(1, 7)}))
    assert torch.equal(worker.tasks.ready[0].state["x"], host.model.noise(7, "robot0", 3))
    assert not worker.tasks._noise_ahead   # used once


@pytest.fixture
def rehearsing(engine_end):
    w = make_worker(engine_end, rehearse=True)   # EngineConfig.cpu_host (the cpu-host admission policy)
    yield w
    w.close()


def test_without_cpu_host_measures_a_wake_rehearses_nothing_and_no_frames_are_kept(worker):
    worker.tasks.accept_task(task(chunk=0))
    worker.tasks.ready.clear()
    worker.tasks.accept_task(wire.encode(p.Wake(stream="robot0", chunk=1)))
    assert worker.tasks.rehearsals == 0 and not worker.tasks._rehearsal
    worker.tasks.accept_task(task(chunk=1))
    assert [j.chunk for j in worker.tasks.ready] == [1]


def test_a_wake_rehearses_the_streams_last_first_task_and_changes_nothing(rehearsing):
    """While a chunk is on its way the worker takes its stream's previous first task in again (the path the
    new one takes, warm) and throws that away: the queue, the noise made ahead and the counters stay as they
    were, and the next task's state is exactly what it would have been."""
    worker = rehearsing
    host = worker.tasks.host.models["tiny-wam"]
    worker.tasks.accept_task(wire.encode(p.Wake(stream="robot0", chunk=0)))
    assert worker.tasks.rehearsals == 0   # no first task seen yet: nothing to rehearse
    worker.tasks.accept_task(task(chunk=0))
    worker.tasks.ready.clear()
    worker.tasks.accept_task(wire.encode(p.Wake(stream="robot0", chunk=1)))
    assert worker.tasks.rehearsals == 1 and not worker.tasks.ready
    assert worker.stats.bad_messages == 0 and worker.stats.stale == 0 and worker.tasks.accepted == 1
    obs = {"obs/image": torch.rand(1, 3, 32, 32), "obs/state": torch.rand(1, 7)}
    worker.tasks.accept_task(wire.encode(p.Task(stream="robot0", chunk=1, stage=(4, 0), epoch=0, order=1.0), obs))
    state = worker.tasks.ready[0].state
    assert torch.equal(state["x"], host.model.noise(0, "robot0", 1)) and not worker.tasks._noise_ahead
    assert all(torch.equal(state[k], v) for k, v in obs.items())


def test_a_rehearsal_that_fails_is_dropped_and_the_next_task_is_served(rehearsing):
    worker = rehearsing
    worker.tasks.accept_task(task(chunk=0))
    worker.tasks.ready.clear()
    worker.tasks._rehearsal["robot0"] = [b"\x93garbage"]   # (as if the stream's model had changed since)
    worker.tasks.accept_task(wire.encode(p.Wake(stream="robot0", chunk=1)))
    assert "robot0" not in worker.tasks._rehearsal and worker.stats.bad_messages == 0
    worker.tasks.accept_task(task(chunk=1))
    assert [j.chunk for j in worker.tasks.ready] == [1]
    worker.tasks.drop_stream("robot0")   # a stopped stream's frames are let go
    assert not worker.tasks._rehearsal


@pytest.mark.parametrize("wake", [p.Wake(stream="robot0", chunk=4, seed=0), p.Wake(stream="robot0", chunk=3, seed=1),
                                  p.Wake(stream="nobody", chunk=3)])
def test_a_wake_for_another_chunk_or_stream_changes_no_noise(worker, wake):
    """The noise made ahead is used only by the chunk (and seed) it was made for; a wake that announced another
    one (a reset, a stream that is not here) costs a spin, nothing else."""
    host = worker.host.models["tiny-wam"]
    worker.tasks.accept_task(wire.encode(wake))
    worker.tasks.accept_task(task(chunk=3))
    assert torch.equal(worker.tasks.ready[0].state["x"], host.model.noise(0, "robot0", 3))
    assert worker.stats.bad_messages == 0 and worker.stats.stale == 0


@pytest.mark.parametrize("wake_ahead_us, wakes", [(0, 0), (1000, 1)])
def test_a_chunk_leaving_the_worker_wakes_its_next_stage_first(engine_end, wake_ahead_us, wakes):
    worker = make_worker(engine_end, wake_ahead_us=wake_ahead_us)
    sink = _catch_output(worker)
    try:
        worker.tasks.accept_task(task(chunk=5))
        worker.tasks.run_next()
        got = []
        while sink.poll(500):
            got.append(wire.decode(sink.recv_multipart(copy=False), wire.DATA).msg)
        assert [type(m).__name__ for m in got] == ["Wake"] * wakes + ["Task"]   # the wake comes first
        assert all((m.stream, m.chunk) == ("robot0", 5) for m in got)
    finally:
        sink.close(linger=0)
        worker.close()
