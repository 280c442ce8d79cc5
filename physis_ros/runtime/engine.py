"""Engine (coordinator): places streams on workers, feeds chunks, collects outputs, survives faults.

Runs on asyncio (uvloop) with zmq.asyncio. For each stream the engine sends
every chunk's input (observation tensors + noise seed) to the worker of the
stream's first stage and receives the finished chunk from the worker of its
last stage; hidden states travel worker to worker and never pass through here.

Each stream has its own placement plan, keeps at most its in-flight limit of
chunks in its pipeline, and takes its latest observation at the moment a chunk
enters. Outputs are delivered in chunk order with a
:class:`~physis_ros.telemetry.ChunkRecord`, and only if every value is finite.

Liveness is measured, not assumed (:mod:`~physis_ros.runtime.recovery`): every
chunk in flight has a bound, and a chunk that misses it or is lost for any
reason (a dropped task, a refused send, a malformed or non-finite output, a
lost worker) resets its stream: new epoch, fresh KV, lost chunks counted,
feeding resumed. Nothing stalls silently.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from physis_ros.logs import Throttle
from physis_ros.model.stages import observation_payload
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.chunk_scheduler import ChunkScheduler
from physis_ros.runtime.hops import LinkBook
from physis_ros.runtime.launchers import RayLauncher
from physis_ros.runtime.plans import Plan
from physis_ros.runtime.recovery import Recovery
from physis_ros.runtime.security import CurveKeys
from physis_ros.runtime.settings import EngineConfig
from physis_ros.runtime.streams import (ChunkOutput, EngineHealth, Observation, ObserveFn, OutputFn, ServedModel,
                                        StreamEvent, StreamState)
from physis_ros.runtime.workers import EngineError, WorkerPool, WorkerProc
from physis_ros.telemetry import ChunkRecord
from physis_ros.timeline import ControlTimeline

log = logging.getLogger("physis.engine")
__all__ = ["ChunkOutput", "Engine", "EngineError", "EngineHealth", "Observation", "ObserveFn", "OutputFn",
           "ServedModel", "StreamEvent"]
BURST = 64  # output messages handled per turn before yielding to the monitor, feeders and control plane
# EngineConfig.cpu_host: after a worker's Wake the output loop polls without sleeping at most this long
OUTPUT_SPIN_S = 0.003
# A feeder with no observation for its stream's next chunk looks again this often, or at once when its front
# end says one is ready (Engine.observed).
OBSERVE_POLL_S = 0.005


@dataclass
class StreamIO:
    """What the engine's I/O keeps for a stream beside its schedule: where its observations come from and its
    outputs go, its feeder task, and the events its feeder and its waiters wait on."""

    observe: ObserveFn
    on_output: OutputFn | None
    keep_outputs: bool = False
    outputs: list[ChunkOutput] = field(default_factory=list)
    credit: asyncio.Event = field(default_factory=asyncio.Event)   # set when a chunk in flight less may free one
    observed: asyncio.Event = field(default_factory=asyncio.Event)  # set when the front end has an observation
    waiting: bool = False               # the feeder waits for an observation (observed is worth setting)
    done: asyncio.Event = field(default_factory=asyncio.Event)     # the stream is over (ChunkScheduler.done)
    feeder: asyncio.Task | None = None
    first_addr: str = ""                # the data address of the stream's first stage's worker
    emit_scheduled: bool = False        # a held output's hand-out is on the loop's timer


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[StreamEvent], None] | None = None,
                 supervisor: Callable[[Engine], Recovery] = Recovery):
        """Workers per ``config``; streams (each with its model and placement) come with
        :meth:`add_stream`. ``on_event`` hears stream failures and re-admissions. ``supervisor`` makes the
        supervisor of faults (:class:`~physis_ros.runtime.recovery.Recovery`) for this engine."""
        self.config = config
        self.clock = clock
        self.on_event = on_event
        self.events: list[StreamEvent] = []
        self.max_bytes = config.max_message_mb * 1024 * 1024
        self.ctx = zmq.asyncio.Context()
        self.scheduler = ChunkScheduler(config)   # what each stream does next (pure: no I/O)
        self.io: dict[str, StreamIO] = {}          # each stream's I/O side
        self.failure: EngineError | None = None
        self.pool: WorkerPool | None = None
        self.dropped: Counter = Counter()   # outputs dropped: malformed, stale
        self.wakes = 0                      # Wake messages received (a chunk's output is on its way)
        self.throttle = Throttle(5.0)
        self.recovery = supervisor(self)
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._ipc_dir: tempfile.TemporaryDirectory | None = None
        self._auth = None
        self._started = False
        self.launcher: RayLauncher | None = None  # launcher ray: the placement group and actors
        self.links: LinkBook | None = None        # hops torch: where worker pairs meet, their generations
        # Release phases (add_stream's release_phase_ms) count from here: streams that admission spread over
        # their common interval meet at the relative phases it booked.
        self.phase_epoch = time.monotonic()

    @property
    def started(self) -> bool:
        """The workers are up (start() has finished)."""
        return self._started

    @property
    def streams(self) -> dict[str, StreamState]:
        """Each stream's schedule, by name (the chunk scheduler's; read only)."""
        return self.scheduler.streams

    def in_flight_limit(self, plan: Plan) -> int:
        """Chunks a stream placed by ``plan`` may have in flight (config override, else from the plan)."""
        return self.scheduler.in_flight_limit(plan)

    def health(self) -> EngineHealth:
        """The latest snapshot (refreshed several times a second on the engine's loop)."""
        return self.recovery.snapshot

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        bind_host = cfg.bind_host
        if cfg.launcher == "ray":  # cluster, bundles and the keys it hands the actors (seconds: off the loop)
            self.launcher = RayLauncher(cfg)
            await asyncio.to_thread(self.launcher.open)
            self.keys, bind_host = self.launcher.engine_keys, self.launcher.bind_host
        else:
            self.keys = CurveKeys.load(cfg.curve_keys) if cfg.curve_keys else None
        self._auth = self.keys.authenticator(self.ctx) if self.keys else None
        self.out = self.ctx.socket(zmq.PULL)
        if self.keys:
            self.keys.server(self.out)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if cfg.transport == "ipc":
            # A directory only this user can open (mkdtemp: 0700): other local users cannot reach the sockets.
            self._ipc_dir = tempfile.TemporaryDirectory(prefix="physis-")
            ctrl_base = f"ipc://{self._ipc_dir.name}/ctrl"
            self.out_addr = f"ipc://{self._ipc_dir.name}/out"
            self.out.bind(self.out_addr)
        else:
            ctrl_base = f"tcp://{bind_host}"
            self.out_addr = f"tcp://{bind_host}:{self.out.bind_to_random_port(ctrl_base)}"
        self.pool = WorkerPool(self.ctx, cfg, ctrl_base, self._ipc_dir.name if self._ipc_dir else None, self.keys,
                               self.launcher)
        if cfg.hops != "zmq":
            self.links = LinkBook(bind_host if cfg.hops == "torch" else None, cfg.hop_timeout_s)
        self.pool.on_started = self._load
        self.recovery.attach(self.pool)
        self._tasks.append(asyncio.create_task(self.pool.control_loop(), name="engine-control"))
        self._tasks.append(asyncio.create_task(self._output_loop(), name="engine-output"))
        try:
            procs = [self.pool.start(i) for i in range(cfg.workers)]
            if not cfg.spawn_workers:
                log.warning("waiting for %d workers: physis-worker --connect %s --id w<N>", cfg.workers,
                            self.pool.ctrl_addr)
            for w in procs:
                await self.pool.wait_hello(w)
            await asyncio.gather(*(self._load(w) for w in procs))
            for w in procs:
                self.pool.mark_up(w)
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self.pool.monitor_loop(), name="engine-monitor"))
        self._tasks.append(asyncio.create_task(self.recovery.watch(), name="engine-watchdog"))
        self._started = True
        log.info("engine started: %d worker(s) (%s), plan %s, %s hops", len(procs),
                 ", ".join(f"{w.name} pid {w.pid} on {w.host}:{w.device}" for w in procs), cfg.plan, cfg.hops)

    async def _load(self, w: WorkerProc) -> None:
        cfg = self.config
        faults = cfg.faults
        drop = faults.drop_task if faults.worker in ("", w.name) else 0
        await self.pool.request(w.name, p.Load(
            req=0, threads=cfg.threads_per_worker, max_ready=cfg.max_ready, batching=cfg.batching,
            max_batch=cfg.max_batch, policy=cfg.policy, faults=p.FaultInjection(drop_task=drop), hops=cfg.hops,
            hop_store=self.links.address if self.links else "", hop_timeout_s=cfg.hop_timeout_s,
            hop_ring_mb=cfg.hop_ring_mb, spin_us=cfg.spin_us, wake_ahead_us=cfg.wake_ahead_us,
            rehearse=cfg.host_measures),
            timeout=cfg.start_timeout_s)

    async def stop(self) -> None:
        """Stop streams and workers; leaves no processes or ipc files behind."""
        for io in self.io.values():
            if io.feeder is not None:
                io.feeder.cancel()
        self.recovery.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.pool is not None:
            await self.pool.stop()
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.close)
        for sock in [getattr(self, "out", None), *self._push.values()]:
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if self._ipc_dir is not None:
            self._ipc_dir.cleanup()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- streams -----------------------------------------------------------------------------
    async def add_stream(self, name: str, observe: ObserveFn, on_output: OutputFn | None = None, *,
                         model: ServedModel, plan: Plan, chunks: int | None = None,
                         slo_interval_ms: float | None = None, keep_outputs: bool = False,
                         release_interval_ms: float | None = None, emit_delay_ms: float | None = None,
                         timeline: ControlTimeline | None = None, release_phase_ms: float | None = None) -> None:
        """Start feeding a stream of ``model``: ``chunks`` chunks (None: until removed), placed by ``plan``
        (which never changes: running streams do not move). Workers load the blocks it needs first.

        ``release_interval_ms`` paces the stream: chunk c enters the pipeline no earlier than
        c intervals after the first, so it cannot run ahead of the robot's control timeline.
        ``emit_delay_ms`` (with a release interval) is a jitter buffer: chunk c is handed out no
        earlier than its release plus this delay, so outputs leave at the steady release cadence
        whenever the response latency stays under the delay (the latency is the price).
        ``timeline``: the stream's control timeline; each chunk then carries its first control step,
        the inference delay measured over the last chunks and, if asked, the hand-off to its
        predecessor (physis_ros.model.handoff). ``release_phase_ms`` (with a release interval): the phase of
        the interval, counted from :attr:`phase_epoch`, at which it is released (admission's choice,
        :meth:`physis_ros.scheduling.jitter.JitterBound.release_phase`); without one the engine spreads it
        from the streams sharing its workers itself."""
        if not self._started:
            raise EngineError("start the engine before adding streams")
        if self.failure is not None:
            raise EngineError(f"the engine has failed: {self.failure}")
        self.scheduler.check(name, model, plan)
        s = StreamState(name, model, plan, chunks, slo_interval_ms, timeline=timeline)
        io = StreamIO(observe, on_output, keep_outputs)
        # Placed first (it may load blocks: tens of ms on a slow host), anchored after: an anchor taken before
        # would put the first release late on its own grid, and the stream's timeline off it from chunk 1.
        io.first_addr = await self.place(s)
        self.scheduler.add(s, time.monotonic(), release_interval_ms, emit_delay_ms, release_phase_ms, self.phase_epoch)
        self.io[name] = io
        io.feeder = asyncio.create_task(self.feed(s), name=f"feed-{name}")

    def workers_of(self, s: StreamState) -> list[WorkerProc]:
        by_index = {w.index: w for w in self.pool.workers.values()}
        return [by_index[i] for i in s.plan.workers_used]

    async def place(self, s: StreamState) -> str:
        """Tell each of the stream's workers its stages (fresh KV, current epoch) and where to send each
        stage's output; the data address of its first stage's worker."""
        procs = self.workers_of(s)
        down = [w.name for w in procs if not w.alive]
        if down:
            raise EngineError(f"stream '{s.name}' needs worker(s) {', '.join(down)}, which are down")
        addr = {w.index: w.data_addr for w in procs}
        name = {w.index: w.name for w in procs}
        requests = []
        for w in procs:
            stages = s.plan.stages_of(w.index)
            routes = []
            for st in stages:
                nxt = s.plan.next_stage(st)
                to = None if nxt is None else s.plan.assignment[nxt]
                routes.append(p.Route(st, self.out_addr) if to is None else p.Route(st, addr[to], name[to]))
            links = self.links.links(w.name, {name[i] for i in s.plan.peers_of(w.index)}) if self.links else []
            requests.append(self.pool.request(
                w.name, p.StartStream(req=0, stream=s.name, epoch=s.epoch, model=s.model.ref(stages),
                                      stages=list(stages), routes=routes, links=links),
                timeout=self.config.start_timeout_s))  # may load blocks first (and build links)
        await asyncio.gather(*requests)
        first = addr[s.plan.assignment[s.plan.first_stage]]
        if first not in self._push:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if self.keys:
                self.keys.client(sock)
            sock.connect(first)
            self._push[first] = sock
        return first

    def pause(self, name: str) -> None:
        """Stop releasing the stream's chunks (its feeder), e.g. while recovery resets it."""
        io = self.io.get(name)
        if io is not None and io.feeder is not None:
            io.feeder.cancel()

    async def resume(self, s: StreamState) -> None:
        """Place the stream's current incarnation again (fresh KV) and release its chunks from here: recovery's
        re-admission. EngineError if a worker it needs does not take it."""
        io = self.io[s.name]
        io.first_addr = await self.place(s)
        self.scheduler.readmitted(s)
        io.credit.set()
        io.feeder = asyncio.create_task(self.feed(s), name=f"feed-{s.name}")

    def fail(self, reason: str) -> None:
        """The engine cannot serve on (a worker that cannot come back): it says so from now on."""
        if self.failure is None:
            self.failure = EngineError(reason)

    def finish(self, name: str) -> None:
        """The stream is over (emitted all its chunks, or failed for good): wake its waiters."""
        io = self.io.get(name)
        if io is not None:
            io.done.set()

    async def remove_stream(self, name: str) -> None:
        s = self.scheduler.remove(name)
        io = self.io.pop(name)
        if io.feeder is not None:
            io.feeder.cancel()
        self.recovery.forget(name)
        io.done.set()
        await asyncio.gather(*(self.pool.request(w.name, p.StopStream(req=0, stream=name))
                               for w in self.workers_of(s) if w.alive), return_exceptions=True)

    async def wait_stream(self, name: str) -> list[ChunkOutput]:
        """Wait until a finite stream has emitted all its chunks; raises if it failed for good."""
        s, io = self.streams[name], self.io[name]
        await io.done.wait()
        if s.gone:
            raise EngineError(s.failed)
        return io.outputs

    def stream_status(self, name: str) -> dict:
        return self.scheduler.status(name)

    async def feed(self, s: StreamState) -> None:
        """Release stream ``s``'s chunks when the chunk scheduler says (on its pace, each when a credit, a chunk
        in flight less, allows): the stream's feeder task (started when it is added, and again when recovery
        re-admits it)."""
        sched, io = self.scheduler, self.io[s.name]
        wake, lead_s = self._waker(s, io), self.config.wake_ahead_us * 1e-6
        while not sched.finished(s):
            while not sched.may_release(s):
                io.credit.clear()
                await io.credit.wait()
            at = sched.release_at(s, time.monotonic())
            if at is not None:
                delay = at - time.monotonic()
                if wake is not None and delay > lead_s:
                    await asyncio.sleep(delay - lead_s)
                    await wake()
                    delay = sched.release_at(s, time.monotonic()) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            obs = await self._observation(s, io)
            r = sched.release(s, time.monotonic(), self.clock(), obs.stamp, obs.tag)
            order = time.perf_counter()
            task = p.Task(stream=s.name, chunk=r.chunk, stage=s.plan.first_stage, epoch=r.epoch, seed=self.config.seed,
                          order=order, deadline=order + r.slack_s, sent=order, handoff=r.handoff)
            await self._push[io.first_addr].send_multipart(wire.encode(task, observation_payload(obs.data)),
                                                           copy=False)

    async def _observation(self, s: StreamState, io: StreamIO) -> Observation:
        """The observation for the stream's next chunk: now, or once its front end has one (it says so through
        :meth:`observed`; else the next poll finds it: a camera not publishing is polled, never spun on)."""
        obs = io.observe(s.next_chunk)
        while obs is None:
            io.observed.clear()
            io.waiting = True
            obs = io.observe(s.next_chunk)   # (it may have come between the look above and the flag)
            if obs is not None:
                break
            try:
                await asyncio.wait_for(io.observed.wait(), OBSERVE_POLL_S)
            except TimeoutError:
                pass
            obs = io.observe(s.next_chunk)
        io.waiting = False
        return obs

    def observed(self, name: str) -> None:
        """Stream ``name``'s front end has an observation for it: a feeder waiting for one takes it now."""
        io = self.io.get(name)
        if io is not None:
            io.observed.set()

    def waiting_for_observation(self, name: str) -> bool:
        """Whether stream ``name``'s feeder waits for an observation (read from any thread)."""
        io = self.io.get(name)
        return io is not None and io.waiting

    def _waker(self, s: StreamState, io: StreamIO) -> Callable[[], Awaitable[None]] | None:
        """Sends a Wake to the stream's first worker ahead of its next release (None: wake-ups are off)."""
        if not self.config.wake_ahead_us:
            return None

        async def wake() -> None:
            frames = wire.encode(p.Wake(stream=s.name, chunk=s.next_chunk, seed=self.config.seed))
            try:
                await self._push[io.first_addr].send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass   # the worker is not taking messages: the task will find out
        return wake

    # ---- outputs -----------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        # Received through a plain view of the socket: the asyncio socket's future per message costs tens of
        # microseconds on a thread that has been asleep. After a worker's Wake (a chunk's last stage there
        # has started) the loop polls without sleeping, yielding to the other tasks between polls, until
        # that chunk's output is in or OUTPUT_SPIN_S has passed: waking from epoll when the output lands
        # costs more on a virtual machine than the polls (measured: the hop out 0.39-0.43 -> 0.31-0.35 ms).
        sock = zmq.Socket.shadow(self.out.underlying)
        announced: set[tuple[str, int]] = set()
        spin_until, spin_s = 0.0, OUTPUT_SPIN_S if self.config.host_measures else 0.0
        while True:
            if not announced or time.perf_counter() >= spin_until:
                announced.clear()
                await self.out.poll(flags=zmq.POLLIN)
            for _ in range(BURST):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = self._on_output(frames)
                if isinstance(msg, p.Wake):
                    announced.add((msg.stream, msg.chunk))
                    spin_until = time.perf_counter() + spin_s
                elif msg is not None:
                    announced.discard((msg.stream, msg.chunk))
            await asyncio.sleep(0)  # a flood of outputs (or garbage) must not starve the other tasks

    def _on_output(self, frames: list) -> p.Output | p.Wake | None:
        """Take one message from the output socket; returns it (None: malformed, dropped)."""
        received, emit = time.perf_counter(), self.clock()
        try:
            rec = wire.decode(frames, wire.OUTPUT, self.max_bytes)
        except wire.WireError as exc:
            self.dropped["malformed"] += 1
            self.throttle.log(log, logging.WARNING, "malformed_output", f"malformed output message dropped: {exc}")
            return None
        msg = rec.msg
        if isinstance(msg, p.Wake):   # a chunk's last stage has started: its output follows
            self.wakes += 1
            return msg
        self._take_output(rec, received, emit)
        return msg

    def _take_output(self, rec: wire.Received[p.Output], received: float, emit: float) -> None:
        msg = rec.msg
        s = self.scheduler.owner(msg.stream, msg.epoch, msg.chunk)
        if s is None:
            self.dropped["stale"] += 1  # a removed stream, or an incarnation before a reset
            return
        try:
            wire.expect_tensors(rec, {"x": (1, *s.model.config.output_shape)})
        except wire.WireError as exc:
            self.recovery.reset(s, f"chunk {msg.chunk} arrived malformed from {msg.worker}: {exc}", "malformed_output")
            return
        output = rec.tensors["x"][0].float().numpy().copy()
        if not np.isfinite(output).all():  # never publish it; the stream's KV may be poisoned: reset
            self.recovery.reset(s, f"chunk {msg.chunk} has non-finite values ({int((~np.isfinite(output)).sum())} "
                                   f"of {output.size})", "nonfinite_output")
            return
        hops = list(msg.hops)
        if msg.sent:
            hops.append(max(0.0, (received - msg.sent) * 1e3))
        f = s.inflight[msg.chunk]
        trace = [[e.step, e.block, e.worker, e.queue_ms, e.compute_ms, e.batch] for e in msg.trace]
        record = ChunkRecord.from_trace(s.name, msg.chunk, f.obs_stamp, f.enqueue, emit, trace, hops)
        if f.slot is not None:
            record.first_step, record.delay_steps, record.shift = f.slot.first_step, f.slot.delay_steps, f.slot.shift
            record.step0 = s.timeline.emitted(f.slot, f.enqueue, emit)
        self.scheduler.take(s, ChunkOutput(s.name, msg.chunk, output, record, f.tag), time.monotonic())
        self.io[s.name].credit.set()
        self._deliver(s)

    def _deliver(self, s: StreamState) -> None:
        """Hand out the stream's outputs the chunk scheduler releases now, in order; a timer for one it holds."""
        io = self.io[s.name]
        outs, wait = self.scheduler.emit(s, time.monotonic(), self.clock())
        for out in outs:
            if io.keep_outputs:
                io.outputs.append(out)
            if io.on_output is not None:
                try:
                    io.on_output(out)
                except Exception:  # a consumer's bug must not stop the pipeline
                    self.throttle.log(log, logging.ERROR, f"on_output:{s.name}",
                                      f"output callback of stream {s.name} failed")
                    log.debug("output callback of stream %s failed", s.name, exc_info=True)
        if wait is not None and not io.emit_scheduled:   # jitter buffer: hold it until its slot on the timeline
            io.emit_scheduled = True
            asyncio.get_running_loop().call_later(wait, self._paced_deliver, s)
        if self.scheduler.done(s):
            io.done.set()

    def _paced_deliver(self, s: StreamState) -> None:
        if self.streams.get(s.name) is s:
            self.io[s.name].emit_scheduled = False
            self._deliver(s)

    def event(self, event: StreamEvent) -> None:
        event.time = self.clock()
        self.events.append(event)
        del self.events[:-1000]  # bounded
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("event callback failed")
