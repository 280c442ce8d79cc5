"""The openpi front end with the real openpi-client over real workers: metadata, infer, /healthz, four
clients at once each with its own contiguous chunks, a client beyond capacity refused with a clear error,
a killed client's capacity freed, malformed frames and bad observations answered while other sessions lose
nothing, and the API key enforced off loopback.

Capacity the tests are sure of: ``engine.max_streams`` 4 (a fifth client is refused whatever the machine's
speed). SLOs: 400 ms per client at a 20 Hz control rate (a chunk of 16 steps executed for 8, its control
timeline's interval): admission holds four such clients on the two workers, jitter bound included;
tiny-wam's chunk takes about 20 ms of one core here."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from physis_ros.config import ConfigError
from physis_ros.openpi import OpenpiFrontEnd
from physis_ros.serving import Server
from physis_ros.serving.openpi_config import OpenpiConfig
from waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLO_MS = 400
CONFIG = {"model": "tiny-wam", "engine": {"workers": 2, "max_streams": 4},
          "admission": {"profiles": str(ROOT / "config" / "profiles")}}


@pytest.fixture(scope="module")
def server():
    with Server.from_config(CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def front(server):
    with OpenpiFrontEnd(server, port=0) as f:
        yield f


def url(front, query: str = "") -> str:
    return f"ws://127.0.0.1:{front.port}/?slo_ms={SLO_MS}&control_rate_hz=20&{query}"


def observation(seed: int = 0, size=(224, 224)) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation/image": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=7).astype(np.float32), "prompt": "stack the blocks"}


def check_reply(reply: dict, chunk: int) -> None:
    """As a strict consumer reads it: the admitted shape, float32, finite, and this request's chunk."""
    actions = reply["actions"]
    assert actions.shape == (16, 7) and actions.dtype == np.float32 and np.isfinite(actions).all()
    timing = reply["server_timing"]
    assert timing["chunk"] == chunk and timing["epoch"] == 0
    assert timing["infer_ms"] >= timing["pipeline_ms"] > 0 and timing["queue_ms"] >= 0


def close(policy: WebsocketClientPolicy) -> None:
    policy._ws.close()   # the client has no close of its own


def test_metadata_infer_and_healthz(server, front):
    policy = WebsocketClientPolicy(url(front, "name=meta&joint_names=a,b,c,d,e,f,g"))
    try:
        meta = policy.get_server_metadata()
        assert meta["stream"] == "meta" and meta["model"] == "tiny-wam" and meta["produces"] == "actions"
        assert (meta["action_horizon"], meta["action_dim"]) == (16, 7) and meta["slo_ms"] == SLO_MS
        assert meta["joint_names"] == list("abcdefg") and meta["control_rate_hz"] == 20.0
        assert set(meta["workers"]) <= {"w0", "w1"} and meta["workers"]
        assert server.streams()["meta"]["slo_interval_ms"] == SLO_MS
        for i in range(3):
            reply = policy.infer(observation(i))
            check_reply(reply, i)
            assert ("prev_total_ms" in reply["server_timing"]) == (i > 0)
    finally:
        close(policy)
    wait_for(lambda: "meta" not in server.streams(), 10, "the closed connection's stream to leave")
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=5)
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b"OK\n"


def test_each_reply_is_the_chunk_of_the_observation_it_answers_bit_for_bit(server, front):
    """Against the sequential reference fed the same observations in the same order (the stream's K/V
    history included): the reply to an observation is that observation's chunk, bit for bit."""
    from physis_ros.model import build_model
    from physis_ros.reference import ReferenceRollout
    from physis_ros.serving.tensors import preprocess

    sent = [observation(20 + k, size=(120, 160)) for k in range(4)]
    policy = WebsocketClientPolicy(url(front, "name=answers"))
    try:
        replies = [policy.infer(obs)["actions"] for obs in sent]
    finally:
        close(policy)
    ref = ReferenceRollout(build_model("tiny-wam"), seed=server.config.engine.seed)
    for obs, actions in zip(sent, replies):
        tensors = {"image": preprocess(obs["observation/image"], "rgb8", 32, 3, "center_crop"),
                   "state": obs["observation/state"]}
        assert np.array_equal(actions, ref.step("answers", tensors).output.numpy())
    assert not np.array_equal(replies[0], replies[1])


def test_four_clients_at_once_each_with_its_own_contiguous_chunks_and_a_fifth_refused(server, front):
    n, infers = 4, 12
    results: dict[int, list] = {i: [] for i in range(n)}
    errors: list[str] = []
    joined = threading.Barrier(n + 1)
    done = threading.Event()
    peak = []

    def client(i: int) -> None:
        try:
            policy = WebsocketClientPolicy(url(front, f"name=c{i}"))
        except Exception as exc:   # noqa: BLE001 (reported by the test)
            errors.append(f"c{i} join: {exc!r}")
            joined.abort()
            return
        try:
            joined.wait(60)
            for k in range(infers):
                results[i].append(policy.infer(observation(10 * i + k)))
            joined.wait(60)   # everyone done, still connected
            done.wait(60)
        except Exception as exc:   # noqa: BLE001
            errors.append(f"c{i}: {exc!r}")
        finally:
            close(policy)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        joined.wait(120)
        peak.append(len(server.streams()))
        joined.wait(120)
    except threading.BrokenBarrierError:
        done.set()
        for t in threads:
            t.join(60)
        pytest.fail(f"a client failed: {errors}")
    # a fifth client, beyond engine.max_streams: refused with the reason, never a hang
    with pytest.raises(ConnectionClosedError) as exc:
        WebsocketClientPolicy(url(front, "name=c5"))
    assert "capacity" in str(exc.value) and "engine.max_streams=4" in str(exc.value)
    assert exc.value.rcvd.code == 1013
    done.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert peak == [n]
    for i in range(n):
        assert len(results[i]) == infers
        for k, reply in enumerate(results[i]):
            check_reply(reply, k)
    wait_for(lambda: not any(name.startswith("c") for name in server.streams()), 10, "the clients to leave")


CLIENT = """
import sys, time, numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy
policy = WebsocketClientPolicy(sys.argv[1])
obs = {"observation/image": np.zeros((96, 96, 3), np.uint8), "observation/state": np.zeros(7, np.float32)}
policy.infer(obs)
print("served", flush=True)
time.sleep(600)
"""


def test_a_client_killed_mid_session_frees_its_capacity(server, front):
    holders = [WebsocketClientPolicy(url(front, f"name=h{i}")) for i in range(3)]   # 3 of the 4 streams
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, url(front, "name=victim")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "served"
        assert "victim" in server.streams()
        with pytest.raises(ConnectionClosedError, match="capacity"):
            WebsocketClientPolicy(url(front, "name=late"))
        proc.kill()
        proc.wait(10)
        wait_for(lambda: "victim" not in server.streams(), 10, "the killed client's stream to leave")
        late = WebsocketClientPolicy(url(front, "name=late"))
        check_reply(late.infer(observation(3)), 0)
        close(late)
        for policy in holders:   # the others lost nothing
            check_reply(policy.infer(observation(4)), 0)
    finally:
        proc.kill()
        for policy in holders:
            close(policy)
    assert server.ended["victim"]["ended"] == "left"


def test_malformed_frames_and_bad_observations_are_answered_while_another_session_loses_nothing(server, front):
    good = WebsocketClientPolicy(url(front, "name=good"))
    stop = threading.Event()
    replies, errors = [], []

    def steady() -> None:
        k = 0
        while not stop.is_set():
            try:
                replies.append((k, good.infer(observation(k))))
            except Exception as exc:   # noqa: BLE001
                errors.append(repr(exc))
                return
            k += 1

    thread = threading.Thread(target=steady)
    thread.start()
    before = dict(front.counts)
    bad = WebsocketClientPolicy(url(front, "name=bad&image.max_bytes=200000"))
    try:
        cases = {
            "missing": ({"observation/image": np.zeros((8, 8, 3), np.uint8)}, "observation/state: missing"),
            "dtype": ({**observation(), "observation/image": np.zeros((8, 8, 3), np.float32)},
                      "observation/image: float32 array"),
            "chw": ({**observation(), "observation/image": np.zeros((3, 224, 224), np.uint8)},
                    "observation/image:"),
            "size": ({**observation(), "observation/state": np.zeros(5)}, "observation/state: shape (5,)"),
            "nan": ({**observation(), "observation/state": np.full(7, np.nan)}, "nonfinite: observation/state"),
            "strings": ({**observation(), "observation/state": ["a"] * 7}, "observation/state"),
            "oversized": (observation(size=(300, 300)), "too_large: observation/image"),
        }
        for case, (obs, says) in cases.items():
            with pytest.raises(RuntimeError, match="Error in inference server") as exc:
                bad.infer(obs)
            assert says in str(exc.value), (case, str(exc.value))
        # frames that are not openpi's msgpack at all, on the same connection
        for frame, says in ((b"\xc1garbage", "malformed: not msgpack"), ("hello", "malformed: a text frame"),
                            (msgpack.packb([1, 2]), "malformed: the observation is a list")):
            bad._ws.send(frame)
            answer = bad._ws.recv()
            assert isinstance(answer, str) and answer.startswith(says), answer
        # and the session goes on
        check_reply(bad.infer(observation(9)), 0)
    finally:
        close(bad)
    # a message over openpi.max_message_bytes closes that connection (1009), nothing else
    with connect(url(front, "name=huge"), max_size=None) as ws:
        ws.recv()
        ws.send(b"\0" * (front.config.max_message_bytes + 1))
        with pytest.raises(ConnectionClosedError) as exc:
            ws.recv()
        assert exc.value.rcvd.code == 1009
    stop.set()
    thread.join(60)
    close(good)
    assert errors == [] and len(replies) >= 3
    for k, reply in replies:
        check_reply(reply, k)
    counts = front.counts
    assert counts["rejected_observations"] - before.get("rejected_observations", 0) == 7
    assert counts["malformed"] - before.get("malformed", 0) == 3
    assert sum(server.ended["bad"]["rejected"].values()) == 7, server.ended["bad"]   # counted in its stream too


def test_a_client_flooding_observations_is_answered_in_order_and_another_loses_nothing(server, front):
    """30 observations sent back to back without reading a reply (the protocol's one request at a time,
    broken): each is answered, in order, one chunk each; a well-behaved client beside it is served."""
    from openpi_client import msgpack_numpy

    good = WebsocketClientPolicy(url(front, "name=calm"))
    try:
        with connect(url(front, "name=flood"), max_size=None) as ws:
            ws.recv()
            packed = [msgpack_numpy.packb(observation(k, size=(64, 64))) for k in range(30)]
            for frame in packed:
                ws.send(frame)
            for k in range(3):
                check_reply(good.infer(observation(100 + k)), k)
            replies = [msgpack_numpy.unpackb(ws.recv(timeout=60)) for _ in range(30)]
        assert [r["server_timing"]["chunk"] for r in replies] == list(range(30))
        for k, reply in enumerate(replies):
            check_reply(reply, k)
        check_reply(good.infer(observation(103)), 3)
    finally:
        close(good)


def test_the_api_key_is_required_off_loopback(server, monkeypatch):
    config = OpenpiConfig(host="0.0.0.0", api_key_env="PHYSIS_TEST_OPENPI_KEY")
    monkeypatch.delenv("PHYSIS_TEST_OPENPI_KEY", raising=False)
    with pytest.raises(ConfigError, match="openpi.api_key_env.*PHYSIS_TEST_OPENPI_KEY"):
        OpenpiFrontEnd(server, config, port=0)
    monkeypatch.setenv("PHYSIS_TEST_OPENPI_KEY", "s3cret")
    with OpenpiFrontEnd(server, config, port=0) as open_front:
        target = f"ws://127.0.0.1:{open_front.port}/?name=keyed"
        for key in (None, "wrong"):
            with pytest.raises(InvalidStatus) as exc:
                WebsocketClientPolicy(target, api_key=key)
            assert exc.value.response.status_code == 401
        policy = WebsocketClientPolicy(target, api_key="s3cret")
        check_reply(policy.infer(observation()), 0)
        close(policy)
        assert open_front.counts["unauthorized"] == 2


def test_a_world_model_imagines_the_actions_it_is_sent_and_answers_frames(server, front):
    """tiny-acwm over openpi: the actions to imagine under ``actions``, the reply ``frames`` in the model's
    output shape, the metadata saying so; without the actions, an error naming the key."""
    # its chunk imagines 8 actions, executed for 4 at 20 Hz: a 200 ms interval
    policy = WebsocketClientPolicy(f"ws://127.0.0.1:{front.port}/?name=world&model=tiny-acwm&control_rate_hz=20")
    try:
        meta = policy.get_server_metadata()
        assert meta["produces"] == "frames" and meta["frames_shape"] == [2, 4, 8, 8]
        assert meta["inputs"]["actions"] == [8, 7]
        obs = {**observation(5), "actions": np.zeros((8, 7), np.float32)}
        reply = policy.infer(obs)
        assert "actions" not in reply and reply["frames"].shape == (2, 4, 8, 8)
        assert reply["frames"].dtype == np.float32 and np.isfinite(reply["frames"]).all()
        with pytest.raises(RuntimeError, match="actions: missing; the model takes actions to imagine"):
            policy.infer(observation(5))
        with pytest.raises(RuntimeError, match=r"actions: shape \(3, 7\)"):
            policy.infer({**obs, "actions": np.zeros((3, 7))})
        assert policy.infer(obs)["server_timing"]["chunk"] == 1
    finally:
        close(policy)


def test_a_wan_world_action_model_answers_its_actions_and_the_frames_it_predicts(server, front):
    """tiny-wan-wam over openpi: the reply holds ``actions`` [16, 7] and ``frames`` [F, C, H, W], the metadata
    both shapes; the actions are what a tiny-wam client reads (a strict consumer's check passes)."""
    policy = WebsocketClientPolicy(url(front, "name=wanwam&model=tiny-wan-wam"))
    try:
        meta = policy.get_server_metadata()
        assert meta["produces"] == "actions" and (meta["action_horizon"], meta["action_dim"]) == (16, 7)
        assert meta["frames_shape"] == [2, 4, 8, 8] and meta["model"] == "tiny-wan-wam"
        for k in range(2):
            reply = policy.infer(observation(k))
            check_reply(reply, k)
            assert reply["frames"].shape == (2, 4, 8, 8) and reply["frames"].dtype == np.float32
            assert np.isfinite(reply["frames"]).all() and reply["frames"].std() > 0
    finally:
        close(policy)


def test_cadence_timeline_holds_a_client_to_its_booking(server, front):
    """``cadence=timeline``: each observation waits for the stream's booked release; replies still come, one
    chunk per observation, in order."""
    policy = WebsocketClientPolicy(url(front, "name=paced&cadence=timeline"))
    try:
        replies = [policy.infer(observation(k)) for k in range(3)]
    finally:
        close(policy)
    for k, reply in enumerate(replies):
        check_reply(reply, k)


def test_a_killed_worker_answers_the_waiting_client_and_the_stream_carries_on_in_a_new_epoch(server, front):
    """Last in this module: it kills a worker (the engine restarts it)."""
    import os
    import signal

    policy = WebsocketClientPolicy(url(front, "name=victim2"))
    try:
        check_reply(policy.infer(observation(0)), 0)
        worker = policy.get_server_metadata()["workers"][0]
        os.kill(server.stats()["workers"][worker]["pid"], signal.SIGKILL)
        answers, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                reply = policy.infer(observation(1))
            except RuntimeError as exc:   # the chunk lost to the reset, said at once (or at the infer timeout)
                assert "reset" in str(exc) or "timeout" in str(exc), exc
                answers.append("error")
                continue
            answers.append(reply["server_timing"]["epoch"])
            if reply["server_timing"]["epoch"] >= 1:
                break
        assert answers and answers[-1] == 1, answers
        assert np.isfinite(reply["actions"]).all()
    finally:
        close(policy)
