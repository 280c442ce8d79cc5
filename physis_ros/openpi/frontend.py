"""The openpi front end: openpi clients (``openpi_client.WebsocketClientPolicy``) served by a
:class:`~physis_ros.serving.Server`, many at once, each connection a stream of its own.

::

    from physis_ros.openpi import OpenpiFrontEnd
    with Server.from_config("config/serve.yaml") as server, OpenpiFrontEnd(server, port=8000) as front:
        ...   # clients: WebsocketClientPolicy("ws://127.0.0.1:8000/?name=r0&slo_ms=150").infer(obs)

A connection joins the server when it opens, with the keywords of its URI's query string
(:func:`~physis_ros.openpi.codec.join_request`); the first message it receives is the metadata of what was
admitted. A refused connection is closed with the rejection as the close reason (code 1013 when asking
again later may help: capacity, busy, not serving; 1008 otherwise), which the real client raises as
``ConnectionClosedError: received 1013 (try again later) capacity: ...``. Each observation it sends
becomes exactly one chunk, computed from that observation (the engine takes it through the session's
``source`` when the stream's next chunk may start), and the reply is openpi's dict: ``actions``
(float32 ``[horizon, dof]``; a world model's ``frames`` instead) and ``server_timing`` (``infer_ms``,
``prev_total_ms`` as openpi's server gives them, plus ``queue_ms``, ``pipeline_ms``, ``chunk`` and
``epoch``). A bad observation is answered by a text frame naming the key, which the client raises as
``RuntimeError("Error in inference server: ...")``; the connection and every other stream go on.
Closing the connection (or the client dying) leaves the stream and frees its capacity at once.

Threads: the websocket server runs an asyncio loop in a thread of its own; joining and leaving (which
wait for the engine) run in its executor; the engine's thread hands over observations and chunks under
each connection's lock.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import itertools
import logging
import os
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from physis_ros.config import ConfigError
from physis_ros.openpi.codec import MalformedMessage, join_request, observation_parts, pack, unpack
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.openpi_config import OpenpiConfig, is_loopback
from physis_ros.serving.server import Server, ServerEvent
from physis_ros.serving.session import Chunk, Session
from physis_ros.serving.tensors import InputRejected

RETRY_LATER = ("capacity", "busy", "not-serving", "slo-unreachable")   # close 1013: asking again may succeed
CLOSE_REASON_BYTES = 123   # the most a websocket close frame's reason holds (RFC 6455)
PART_PREFIXES = ("images: ", "state: ", "actions: ")


def close_reason(text: str) -> str:
    """``text`` cut to what a close frame carries (UTF-8 bytes), marked when cut."""
    data = text.encode()
    if len(data) <= CLOSE_REASON_BYTES:
        return text
    return data[:CLOSE_REASON_BYTES - 3].decode(errors="ignore") + "..."


class Connection:
    """One client's stream: the observation the engine takes next and the reply waiting for its chunk."""

    def __init__(self, front: OpenpiFrontEnd, name: str, loop: asyncio.AbstractEventLoop):
        self.front, self.name, self.loop = front, name, loop
        self.session: Session | None = None
        self.ws: ServerConnection | None = None
        self.lock = threading.Lock()
        self.pending: tuple[dict[str, np.ndarray], float] | None = None   # (tensors, stamp) not taken yet
        self.waiting: tuple[float, asyncio.Future] | None = None          # (stamp, its reply's future)
        self.prev_total_ms: float | None = None

    # ---- the engine's thread -------------------------------------------------------------------------
    def source(self, chunk: int) -> tuple[dict[str, np.ndarray], float] | None:
        """The observation for the stream's next chunk: the one the client sent, once."""
        with self.lock:
            taken, self.pending = self.pending, None
        return taken

    def on_chunk(self, chunk: Chunk) -> None:
        self.loop.call_soon_threadsafe(self._resolve, chunk)

    # ---- the loop's thread -------------------------------------------------------------------------
    def _resolve(self, chunk: Chunk) -> None:
        waiting = self.waiting
        if waiting is None or waiting[0] != chunk.stamp_s or waiting[1].done():
            self.front.counts["chunks_unclaimed"] += 1   # its request timed out, or was failed by a reset
            return
        waiting[1].set_result(chunk)

    def fail(self, text: str) -> None:
        """The chunk the client waits for will not come (a reset lost it): answer with ``text`` now."""
        waiting = self.waiting
        if waiting is not None and not waiting[1].done():
            waiting[1].set_exception(RuntimeError(text))

    async def infer(self, message: bytes | str) -> bytes | str:
        """The reply to one observation message: openpi's dict (bytes) or an error (a text frame)."""
        t0 = time.monotonic()
        session = self.session
        try:
            obs = unpack(message)
            tensors = self.tensors(session, obs)
        except MalformedMessage as exc:
            self.front.counts["malformed"] += 1
            return f"malformed: {exc}"
        except InputRejected as exc:
            self.front.counts["rejected_observations"] += 1
            return f"{exc.reason}: {exc.detail}"
        stamp = self.front.server.clock()
        future = self.loop.create_future()
        with self.lock:
            self.waiting = (stamp, future)
            self.pending = (tensors, stamp)
        session.announce()
        timeout = self.front.config.infer_timeout_s
        try:
            chunk = await asyncio.wait_for(future, timeout)
        except (TimeoutError, RuntimeError) as exc:
            with self.lock:
                self.pending = None
            self.front.counts["infer_failed"] += 1
            if isinstance(exc, TimeoutError):
                state = "resetting" if session.health.failed else "serving"
                return (f"timeout: no chunk within openpi.infer_timeout_s={timeout:g} s (stream '{self.name}' is "
                        f"{state}); send the observation again")
            return str(exc)
        finally:
            self.waiting = None
        rec = chunk.telemetry
        timing = {"infer_ms": (time.monotonic() - t0) * 1e3, "queue_ms": (rec.enqueue - rec.obs_stamp) * 1e3,
                  "pipeline_ms": rec.pipeline_ms, "chunk": chunk.index, "epoch": chunk.epoch}
        if self.prev_total_ms is not None:
            timing["prev_total_ms"] = self.prev_total_ms
        out: dict[str, Any] = {"server_timing": timing}
        if chunk.actions is not None:
            out["actions"] = np.ascontiguousarray(chunk.actions, dtype=np.float32)
        if chunk.frames is not None:
            out["frames"] = np.ascontiguousarray(chunk.frames, dtype=np.float32)
        self.front.counts["infers"] += 1
        return pack(out)

    def tensors(self, session: Session, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        """The model's input tensors of ``obs``; InputRejected names the openpi key of a bad part."""
        cfg = self.front.config
        try:
            parts = observation_parts(obs, cfg, session.model.observation_shapes)
        except InputRejected as exc:
            session.input.reject(exc.reason)
            raise
        out: dict[str, np.ndarray] = {}
        for key, kwargs in ((next(iter(parts.images)) if parts.images else "", {"images": parts.images}),
                            (cfg.state_key, {"state": parts.state}), (cfg.actions_key, {"actions": parts.actions})):
            if next(iter(kwargs.values())) is None:
                continue
            try:
                out.update(session.tensors(**kwargs))
            except InputRejected as exc:
                detail = exc.detail
                for prefix in PART_PREFIXES:
                    detail = detail.removeprefix(prefix)
                raise InputRejected(exc.reason, f"{key}: {detail}") from None
        return out


class OpenpiFrontEnd:
    """openpi's websocket protocol on a :class:`Server` (see the module's docstring). ``config``: the
    ``openpi:`` section (default: the server's); ``port`` overrides its port (0: any free one; the bound
    one is :attr:`port` once started). ConfigError (naming the key) if it binds a non-loopback address
    without an API key."""

    def __init__(self, server: Server, config: OpenpiConfig | None = None, *, port: int | None = None,
                 log: logging.Logger | None = None):
        self.server = server
        self.config = config or server.config.openpi
        self.log = log or logging.getLogger("physis.openpi")
        self.requested_port = self.config.port if port is None else port
        if self.requested_port is None:
            raise ConfigError("openpi.port", "unset; give the port to listen on (0: any free one)")
        self.api_key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
        if not is_loopback(self.config.host) and not self.api_key:
            raise ConfigError("openpi.api_key_env", f"openpi.host {self.config.host} is not loopback: set the API "
                                                    f"key clients must send in ${self.config.api_key_env or '...'}, "
                                                    f"or bind 127.0.0.1")
        self.port: int | None = None
        self.counts: Counter = Counter()
        self.connections: dict[str, Connection] = {}
        self._names = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._unsubscribe = None

    # ---- life ------------------------------------------------------------------------------------------
    def __enter__(self) -> OpenpiFrontEnd:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, timeout_s: float = 10.0) -> int:
        """Listen (in a thread of its own); returns the bound port. OSError if the address cannot be bound."""
        self._unsubscribe = self.server.subscribe(self._on_server_event)
        self._thread = threading.Thread(target=self._run, name="physis-openpi", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"the openpi front end did not start listening within {timeout_s:g} s")
        if self._failure is not None:
            raise self._failure
        self.log.info(f"openpi front end on ws://{self.config.host}:{self.port} "
                      f"({'API key required' if self.api_key else 'no API key'})")
        return self.port

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop listening, close every connection (its stream leaves) and end the thread."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 (reported to start(), or logged once serving)
            self._failure = exc
            if self._started.is_set():
                self.log.exception("the openpi front end failed")
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        cfg = self.config
        async with serve(self._handle, cfg.host, self.requested_port, compression=None,
                         max_size=cfg.max_message_bytes, process_request=self._process_request) as ws_server:
            self.port = ws_server.sockets[0].getsockname()[1]
            self._started.set()
            await self._stop.wait()
            ws_server.close()
            await ws_server.wait_closed()

    # ---- connections -------------------------------------------------------------------------------
    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Before the handshake: /healthz, the API key, the connection limit."""
        if urlsplit(request.path).path == "/healthz":
            state = self.server.state
            ok = state == "serving"
            return connection.respond(http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                                      "OK\n" if ok else f"{state}\n")
        if self.api_key:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Api-Key {self.api_key}".encode()):
                self.counts["unauthorized"] += 1
                return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                          "an API key is required: header 'Authorization: Api-Key <key>'\n")
        if len(self.connections) >= self.config.max_connections:
            self.counts["over_limit"] += 1
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"openpi.max_connections={self.config.max_connections} connections are open\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        loop = asyncio.get_running_loop()
        try:
            name, fields = join_request(urlsplit(ws.request.path).query, self.config, f"openpi_{next(self._names)}")
        except ValueError as exc:
            self.counts["refused"] += 1
            await ws.close(1008, close_reason(f"invalid-request: {exc}"))
            return
        conn = Connection(self, name, loop)
        try:
            session = await loop.run_in_executor(None, self._join, conn, fields)
        except Rejected as exc:
            self.counts["refused"] += 1
            await ws.close(1013 if exc.reason in RETRY_LATER else 1008, close_reason(f"{exc.reason}: {exc.detail}"))
            return
        conn.ws = ws
        self.connections[name] = conn
        self.counts["connections"] += 1
        try:
            await ws.send(pack(self.metadata(session)))
            while True:
                started = time.monotonic()
                try:
                    message = await asyncio.wait_for(ws.recv(), self.config.idle_timeout_s)
                except TimeoutError:
                    await ws.close(1000, close_reason(f"idle for openpi.idle_timeout_s="
                                                      f"{self.config.idle_timeout_s:g} s; the stream left"))
                    break
                await ws.send(await conn.infer(message))
                conn.prev_total_ms = (time.monotonic() - started) * 1e3
        except ConnectionClosed:
            pass
        finally:
            self.connections.pop(name, None)
            await loop.run_in_executor(None, self._leave, name)

    def _join(self, conn: Connection, fields: dict[str, Any]) -> Session:
        fields = dict(fields)
        model, slo = fields.pop("model"), fields.pop("slo_ms", None)
        if fields.get("joint_names") is None:   # openpi sends a state vector: its columns need no names
            try:
                shapes = self.server.catalog.config_of(model).observation_shapes
            except Rejected:
                shapes = {}
            fields["joint_names"] = [f"joint_{i}" for i in range(shapes["state"][0] if "state" in shapes else 1)]
        session = self.server.join(conn.name, model, slo, on_chunk=conn.on_chunk, source=conn.source, **fields)
        conn.session = session
        return session

    def _leave(self, name: str) -> None:
        try:
            self.server.leave(name)
        except KeyError:
            pass   # the server ended it already (shutdown, engine failure)

    def metadata(self, session: Session) -> dict[str, Any]:
        """The first frame of a connection: what was admitted."""
        m, s = session.model, session.config
        out: dict[str, Any] = {"server": "physis_ros", "stream": session.name, "model": m.name,
                               "produces": m.produces, "control_rate_hz": s.control_rate_hz,
                               "slo_ms": session.slo_interval_ms, "workers": list(session.workers),
                               "joint_names": list(s.joint_names), "inputs": {k: list(v) for k, v in
                                                                               m.observation_shapes.items()}}
        if m.produces == "actions":
            horizon, dof = m.spec.actions_shape
            out.update(action_horizon=horizon, action_dim=dof)
        if m.spec.has_frames:
            out.update(frames_shape=list(m.spec.frames_shape))
        return out

    def _on_server_event(self, event: ServerEvent) -> None:
        """A reset loses the chunk a client waits for: tell it now instead of at its timeout. A stream the
        server ended (its engine failed, it is stopping) closes its connection (1011), saying why."""
        conn = self.connections.get(event.stream)
        if conn is None or self._loop is None:
            return
        if event.kind == "reset":
            self._loop.call_soon_threadsafe(conn.fail, f"reset ({event.reason}): the chunk of this observation "
                                                       f"was lost ({event.detail}); send the observation again")
        elif event.kind == "ended" and event.reason != "left" and conn.ws is not None:
            reason = close_reason(f"ended ({event.reason}): {event.detail}")
            asyncio.run_coroutine_threadsafe(conn.ws.close(1011, reason), self._loop)

    def stats(self) -> dict[str, Any]:
        """Connections open, and counts: connections, refused, unauthorized, over_limit, infers, malformed,
        rejected_observations, infer_failed, chunks_unclaimed."""
        return {"port": self.port, "open": sorted(self.connections), "counts": dict(self.counts)}
