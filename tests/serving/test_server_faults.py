"""The Server API against a hostile caller: racing joins of one name, a burst of joins, a flood of
observations from many threads while the stream leaves, a reader left waiting when its stream ends, and
an engine that fails for good (a lost worker it may not restart)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from physis_ros.serving import Rejected, Server
from waiting import wait_for

pytestmark = pytest.mark.slow

PROFILES = str(Path(__file__).resolve().parents[2] / "config" / "profiles")
JOINTS = [f"j{i}" for i in range(7)]


def config(**engine) -> dict:
    return {"model": "tiny-wam", "engine": {"workers": 1, **engine}, "admission": {"profiles": PROFILES}}


@pytest.fixture(scope="module")
def server():
    with Server.from_config(config(max_streams=4)) as s:
        yield s


def test_eight_threads_joining_one_name_admit_it_once(server):
    def join(_):
        try:
            server.join("same", joint_names=JOINTS)
            return "admitted"
        except Rejected as exc:
            return exc.label

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(join, range(8)))
    try:
        assert answers.count("admitted") == 1 and set(answers) == {"admitted", "name-in-use"}, answers
        assert list(server.streams()) == ["same"]
    finally:
        server.leave("same")
    assert server.streams() == {} and server.admission.admitted == {}


def test_a_burst_of_joins_beyond_the_room_is_answered_and_leaves_nothing_behind(server):
    names = [f"b{i}" for i in range(10)]

    def join(name):
        try:
            server.join(name, joint_names=JOINTS)
            return "admitted"
        except Rejected as exc:
            return exc.label

    with ThreadPoolExecutor(10) as pool:
        answers = dict(zip(names, pool.map(join, names)))
    admitted = [n for n, a in answers.items() if a == "admitted"]
    try:
        assert 1 <= len(admitted) <= 4 and set(answers.values()) <= {"admitted", "capacity", "slo-too-tight",
                                                                      "busy"}, answers
        assert sorted(server.streams()) == sorted(admitted)
        assert sorted(server.admission.admitted) == sorted(admitted)
    finally:
        for name in admitted:
            server.leave(name)
    assert server.streams() == {} and server._joining == set()


def test_a_flood_of_observations_while_the_stream_leaves_ends_cleanly(server):
    session = server.join("flood", joint_names=JOINTS)
    frame = np.zeros((64, 64, 3), np.uint8)
    errors: list[str] = []
    ended = threading.Event()

    def robot():
        while not ended.is_set():
            try:
                session.observe(images={"cam": frame}, state=np.zeros(7), stamp_s=time.time())
            except RuntimeError as exc:       # the stream ended: said so, and nothing else
                if "ended" not in str(exc):
                    errors.append(repr(exc))
                return
            except Exception as exc:  # noqa: BLE001 (a test reports what went wrong)
                errors.append(repr(exc))
                return

    threads = [threading.Thread(target=robot) for _ in range(4)]
    for t in threads:
        t.start()
    assert session.next_chunk(timeout_s=30.0).index == 0
    waiting = []
    reader = threading.Thread(target=lambda: waiting.append(drain(session)))
    reader.start()
    server.leave("flood")
    ended.set()
    for t in [*threads, reader]:
        t.join(10.0)
        assert not t.is_alive()
    assert errors == [] and waiting and "ended (left)" in waiting[0]
    assert server.ended["flood"]["chunks"] >= 1 and server.ended["flood"]["ended"] == "left"


def drain(session) -> str:
    """Read chunks until the stream ends; what next_chunk said then."""
    try:
        while True:
            session.next_chunk(timeout_s=30.0)
    except (RuntimeError, TimeoutError) as exc:
        return str(exc)


def test_an_engine_that_fails_for_good_ends_every_stream_and_refuses_new_ones():
    events = []
    with Server.from_config(config(restart_workers=False)) as server:
        server.subscribe(events.append)
        session = server.join("r0", joint_names=JOINTS)
        session.observe(images={"cam": np.zeros((32, 32, 3), np.uint8)}, state=np.zeros(7))
        session.next_chunk(timeout_s=30.0)
        os.kill(server.stats()["workers"]["w0"]["pid"], signal.SIGKILL)
        wait_for(lambda: server.state == "failed", 30.0, "the engine to fail")
        wait_for(lambda: session.ended is not None, 10.0, "the stream to end")
        assert session.ended == "failed"
        with pytest.raises(RuntimeError, match="ended \\(failed\\)"):
            session.next_chunk(timeout_s=5.0)
        with pytest.raises(Rejected) as exc:
            server.join("r1", joint_names=JOINTS)
        assert exc.value.label == "not-serving" and "failed" in exc.value.detail
        assert server.stats()["engine"]["failure"]
    ended = [e for e in events if e.kind == "ended"]
    assert [(e.stream, e.reason) for e in ended] == [("r0", "failed")], events
