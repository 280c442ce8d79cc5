"""A worker's data plane: tasks in (as frames, or declared and received over a link), stages run in
batches the policy picks, hidden states out to the next stage's worker or the engine.

Nothing a peer sends can stop it: every task is decoded into its declared type or dropped and counted,
the ready queue is bounded, and a chunk that cannot be passed on (queue full, send refused, stage failed,
link closed) is reported to the engine at once (:class:`~physis_ros.runtime.protocol.TaskLost`), so that
its stream is reset rather than stalled. The process, its sockets and control plane are
:mod:`~physis_ros.runtime.worker`'s.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from physis_ros.logs import Throttle
from physis_ros.model import KVBatch, ModelConfig, ServableModel
from physis_ros.model.handoff import Handoff
from physis_ros.model.stages import check_payload, first_state, run_stage
from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire
from physis_ros.runtime.batching import BatchPolicy
from physis_ros.runtime.device import DeviceIO, StageTimer
from physis_ros.runtime.hops import Arrival, HopError, TorchHops, empty_like_specs
from physis_ros.runtime.hosting import ModelHost, Placement, StageHost
from physis_ros.runtime.plans import Stage, next_stage
from physis_ros.runtime.shm_hops import ShmError, ShmHops

log = logging.getLogger("physis.worker")
RUN_ALONE_MAX_S = 0.05   # a chunk running alone yields to the worker's loop (heartbeats, control) at least this often
RUN_ALONE_LOOK_S = 0.002  # ... and looks for other tasks arriving at least this often (after the stage that passes it)
WAKE_SPIN_S = 0.003       # a Wake keeps the worker polling without sleeping at most this long (its message is due sooner)


@dataclass
class Job:
    """A chunk's task while it is on this worker: its header, travelling state and arrival time."""

    task: p.Task
    model: str                      # ModelRef.id of the stream's model
    state: dict[str, torch.Tensor]
    received: float = field(default_factory=time.perf_counter)

    @property
    def handoff(self) -> Handoff | None:
        h = self.task.handoff
        return None if h is None else Handoff(h.mode, h.d, h.shift)

    @property
    def weights(self) -> tuple[str, int]:
        """What its next forward runs: a block of a model (only such tasks batch together)."""
        return (self.model, self.task.stage[1])

    @property
    def stream(self) -> str:
        return self.task.stream

    @property
    def chunk(self) -> int:
        return self.task.chunk

    @property
    def stage(self) -> Stage:
        return self.task.stage

    @property
    def order(self) -> float:
        return self.task.order

    @property
    def deadline(self) -> float:
        return self.task.deadline


class TaskRunner:
    """Ready queue, stage execution and forwarding for one worker (its sockets come in as callables)."""

    def __init__(self, worker_id: str, host: StageHost, io: DeviceIO, stats: p.WorkerStats, max_message_bytes: int,
                 push: Callable[[str], zmq.Socket], send_ctrl: Callable[[p.Message], None],
                 has_task: Callable[[], bool] = lambda: False):
        self.id = worker_id
        self.host = host
        self.io = io
        self.stats = stats
        self.max_message_bytes = max_message_bytes
        self._push = push
        self.send_ctrl = send_ctrl
        self.has_task = has_task            # whether a task waits on the worker's data sockets (no poll)
        self.settings = p.Load(req=0)       # set by the worker's Load
        self.policy: BatchPolicy | None = None
        self.hops: TorchHops | None = None  # hidden states over torch.distributed (Load.hops == "torch")
        self.shm: ShmHops | None = None     # hidden states through shared-memory rings (Load.hops == "shm")
        self.ready: list[Job] = []
        self.accepted = 0
        self.spin_until = 0.0               # time.monotonic(): a Wake said a message is on its way, poll until then
        self._noise_ahead: dict[str, tuple[int, int, torch.Tensor]] = {}   # stream -> (chunk, seed, its noise)
        self._rehearsal: dict[str, list] = {}   # stream -> the frames of its last first task (see _rehearse)
        self.rehearsals = 0
        self.throttle = Throttle(5.0)
        # Forwards whose time is not known yet (CUDA: their end event has not completed), oldest first: their
        # trace entries and the batching policy's observation are filled in by _settle.
        self._unsettled: deque[tuple[StageTimer, tuple[str, int], list[p.TraceEntry]]] = deque()
        # Forwards settled but not yet seen by the batching policy ((weights, batch size, ms)): it learns from
        # them once the chunks that ran them have left (:meth:`_learn`), not on their way out.
        self._unlearned: list[tuple[tuple[str, int], int, float]] = []

    def drop_stream(self, stream: str) -> None:
        """Forget a stream's queued tasks (it stops, or starts again under a new epoch)."""
        self.ready = [j for j in self.ready if j.stream != stream]
        self._noise_ahead.pop(stream, None)
        self._rehearsal.pop(stream, None)

    def warn(self, key: str, text: str) -> None:
        """A warning logged at most once per 5 s per ``key`` (a flood of bad messages cannot flood the log)."""
        self.throttle.log(log, logging.WARNING, key, f"worker {self.id}: {text}")

    def _lost(self, task: p.Task, reason: str, detail: str, peer: str = "") -> None:
        """Report a chunk this worker cannot pass on, so the engine resets its stream now."""
        self.warn(f"lost:{reason}", f"chunk {task.chunk} of stream '{task.stream}' lost ({reason}): {detail}")
        self.send_ctrl(p.TaskLost(worker=self.id, stream=task.stream, chunk=task.chunk, epoch=task.epoch,
                                  reason=reason, detail=p.clip_text(detail), peer=peer))

    def accept_task(self, frames: list) -> None:
        try:
            rec = wire.decode(frames, wire.DATA, self.max_message_bytes)
        except wire.WireError as exc:
            self.stats.bad_messages += 1
            self.warn("bad_data", f"dropped a malformed data message: {exc}")
            return
        if isinstance(rec.msg, p.Wake):
            self._woken(rec.msg)
            return
        if rec.msg.link is not None:
            self._receive(rec)
        elif rec.msg.shm is not None:
            self._read_shm(rec)
        else:
            self._admit(rec, frames)

    def _check_declared(self, task: p.Task) -> dict[str, torch.Tensor]:
        """The declared tensors (shapes only) of an out-of-band task, checked against its stage when the
        stream is current: WireError or ValueError before a byte is read."""
        declared = empty_like_specs(task.tensors, "meta", self.max_message_bytes)
        placement = self.host.placements.get(task.stream)
        if placement is not None and placement.epoch == task.epoch:
            host = self.host.models[placement.model]
            check_payload(host.config, False, task.stage[1], declared, host.model.dtype)
        return declared

    def _read_shm(self, rec: wire.Received[p.Task]) -> None:
        """Read a shm task's tensors in place from its sender's ring and admit it. Every region that is the next one
        is read, stale or malformed tasks too (then dropped), so that the ring stays in step with its sender;
        the declarations are checked against the stage before anything read is used."""
        task = rec.msg
        try:
            if self.shm is None:
                raise ShmError("this worker was not loaded with hops 'shm'")
            rec.tensors = self.shm.read(task.shm, task.tensors)   # bounded by the ring's size
            self._check_declared(task)
        except ShmError as exc:  # out of step (or forged): the engine moves the link on, both ends take a fresh ring
            self.stats.bad_messages += 1
            self._lost(task, "link_failed", f"cannot read the shared ring: {exc}", peer=self.shm.sender_of(task.shm)
                       if self.shm else "")
            return
        except (wire.WireError, ValueError) as exc:
            self.stats.bad_messages += 1
            self._lost(task, "task_failed", f"malformed shm task: {exc}")
            return
        self.stats.link_hops += 1
        self._admit(rec)

    def _receive(self, rec: wire.Received[p.Task]) -> None:
        """Post the receives a link task announces; it is admitted when they arrive (:meth:`_arrived`).
        Stale tasks are received too (and then dropped): a send left unmatched would close the link."""
        task = rec.msg
        try:
            if self.hops is None:
                raise HopError("this worker was not loaded with hops 'torch'")
            declared = self._check_declared(task)  # never receive into what the stage does not expect
            self.hops.receive(task.link, {k: torch.empty_like(v, device=self.hops.recv_device)
                                          for k, v in declared.items()}, rec)
        except HopError as exc:
            self._lost(task, "link_failed", f"cannot receive over the link from {task.link.sender}: {exc}",
                       peer=task.link.sender)
        except (wire.WireError, ValueError) as exc:  # nothing posted: the link is not at risk
            self.stats.bad_messages += 1
            self._lost(task, "task_failed", f"malformed link task: {exc}")

    def arrived(self, arrival: Arrival) -> None:
        rec = arrival.context
        if arrival.tensors is None:
            self._lost(rec.msg, "link_failed", arrival.error, peer=rec.msg.link.sender)
            return
        rec.tensors = arrival.tensors
        self.stats.link_hops += 1
        self._admit(rec)

    def _woken(self, wake: p.Wake) -> None:
        """A message for ``wake.stream`` is on its way: poll until it comes, and if it is that chunk's first
        task here, make its noise now (it is deterministic; the task then starts without that op)."""
        self.stats.wakes += 1
        self.spin_until = time.monotonic() + WAKE_SPIN_S
        placement = self.host.placements.get(wake.stream)
        if placement is None:
            return
        host = self.host.models[placement.model]
        if (host.config.steps, 0) in placement.stages:
            noise = host.model.noise(wake.seed, wake.stream, wake.chunk)
            self._noise_ahead[wake.stream] = (wake.chunk, wake.seed, noise)
            self._rehearse(wake.stream, host, noise)

    def _rehearse(self, stream: str, host: ModelHost, noise: torch.Tensor) -> None:
        """Take the stream's previous first task in again (decode, checks, first state) and throw the result
        away, while its next one is on its way (a Wake came): code that has not run for a release interval runs
        5-15x slower on this kind of host (measured: ``x.numpy()`` 92 us after 30 ms asleep, 6 us when it had
        run once just before), and this is the path the next task takes. Measured served (tiny-wam, 2 robots):
        the task's way from the socket to the ready queue 0.12 -> 0.04 ms. Pure: received tensors are never
        written, nothing is kept. Only with ``Load.rehearse`` (EngineConfig.cpu_host); not on CUDA, where the first
        state would copy to the device."""
        frames = self._rehearsal.get(stream)
        if frames is None or self.io.cuda:
            return
        self.rehearsals += 1
        try:
            rec = wire.decode(frames, wire.DATA, self.max_message_bytes)
            check_payload(host.config, True, 0, rec.tensors, host.model.dtype)
            first_state(rec.tensors, noise, lambda t: self.io.to_device(t, host.model.dtype))
        except Exception:   # (the stream's model changed since): never rehearse those frames again
            self._rehearsal.pop(stream, None)

    def _noise(self, task: p.Task, model: ServableModel) -> torch.Tensor:
        """The chunk's initial noise: made ahead on its Wake, or now."""
        ahead = self._noise_ahead.pop(task.stream, None)
        if ahead is not None and ahead[:2] == (task.chunk, task.seed):
            return ahead[2]
        return model.noise(task.seed, task.stream, task.chunk)

    def _admit(self, rec: wire.Received[p.Task], frames: list | None = None) -> None:
        """Queue a received task for its stage, or drop it (stale, not hosted here, malformed) and say why.
        ``frames``: the message's, when its tensors came in them (a first task's are kept for :meth:`_rehearse`)."""
        task = rec.msg
        placement = self.host.placements.get(task.stream)
        if placement is None or task.epoch < placement.epoch:  # a stopped stream, or an earlier incarnation
            self.stats.stale += 1
            return
        if task.epoch > placement.epoch:
            self._lost(task, "epoch_ahead", f"task of epoch {task.epoch}, this worker hosts epoch {placement.epoch}")
            return
        if task.stage not in placement.stages:
            self.stats.bad_messages += 1
            self.warn("not_hosted", f"dropped a task for stage {list(task.stage)} of stream '{task.stream}', "
                                     f"which is not hosted here")
            return
        host = self.host.models[placement.model]
        model = host.model
        first = task.stage == (host.config.steps, 0)
        try:
            check_payload(host.config, first, task.stage[1], rec.tensors, model.dtype)
        except ValueError as exc:
            self.stats.bad_messages += 1
            self._lost(task, "task_failed", f"malformed payload: {exc}")
            return
        self.accepted += 1
        drop = self.settings.faults.drop_task
        if drop and self.accepted == drop:
            self.stats.injected_drops += 1  # fault injection: vanish without a word, as a lost message would
            return
        if task.sent:
            task.hops.append(min(max(0.0, (time.perf_counter() - task.sent) * 1e3), 1e9))
        if first:  # the chunk's first stage: observation in, noise made here
            if frames is not None and self.settings.rehearse:
                self._rehearsal[task.stream] = frames
            state = first_state(rec.tensors, self._noise(task, model),
                                lambda t: self.io.to_device(t, model.dtype))
        else:
            state = {k: self.io.to_device(v) for k, v in rec.tensors.items()}
        self.ready.append(Job(task, placement.model, state))
        if len(self.ready) > self.settings.max_ready:  # bounded: a burst costs the oldest chunk, reported
            dropped = min(self.ready, key=lambda j: j.order)
            self.ready.remove(dropped)
            self.stats.dropped_tasks += 1
            self._lost(dropped.task, "queue_full", f"ready queue full ({self.settings.max_ready} tasks)")

    def run_next(self) -> None:
        """Run one stage for the task the policy picks, batched with same-block tasks if that pays (or, for a
        task that is the only work here, its following local stages too: :meth:`_run_alone`)."""
        batch = self.policy.pick(self.ready, self._slot_key)
        for j in batch:
            self.ready.remove(j)
        if len(batch) == 1 and not self.ready:
            self._run_alone(batch[0])
            return
        host = self.host.models[batch[0].model]
        b = batch[0].stage[1]
        slots = [self.host.placements[j.stream].slots[j.stage[0]] for j in batch]
        if self.settings.wake_ahead_us:
            for j in batch:
                placement = self.host.placements[j.stream]
                if self._leaves_after(j.task.stage, placement, host.config):
                    self._wake_next(j.task, placement)
        try:
            with self.io.timer() as timer:
                kv = KVBatch(host.tables[b], slots, step_slots=[self.host.placements[j.stream].slots for j in batch])
                states = run_stage(host.model, b, [j.stage[0] for j in batch], [j.state for j in batch], kv,
                                   [j.handoff for j in batch])
        except Exception as exc:  # a failing task must not take the worker down
            self._stage_failed(batch, exc)
            return
        start, end = timer.wall_start, timer.wall_end
        self.stats.stages += len(batch)
        self.stats.batches += 1
        entries = [p.TraceEntry(j.stage[0], b, self.id, round(max(0.0, start - j.received) * 1e3, 4), 0.0, len(batch))
                   for j in batch]
        self._unsettled.append((timer, batch[0].weights, entries))
        self._settle(wait=False)
        for j, state, entry in zip(batch, states, entries):
            j.task.trace.append(entry)
            j.state = state
            self._forward(j, end)
        self._learn()

    def _run_alone(self, job: Job) -> None:
        """Run ``job``'s stage and then its next ones hosted here, back to back, while it is the only work: no
        other task ready and none arrived (looked for every RUN_ALONE_LOOK_S), for at most RUN_ALONE_MAX_S. Between two stages only the forward and its timer run; the trace entries, the
        policy's observations and the stats are written when the run ends. Each bit of bookkeeping between
        stages costs microseconds once the stage before has pushed it out of the caches (measured in one
        process, tiny-wam, with a chunk's own costs spread over its stages: 26 us per stage stage by stage,
        15 us here; 12 us with no looks, 24 us with a look after every stage),
        and a chunk runs every stage of its plan. Results are the same as stage by stage: the same forwards,
        in the same order."""
        placement = self.host.placements[job.stream]
        host = self.host.models[job.model]
        steps, blocks = host.config.steps, host.config.blocks
        handoff = [job.handoff]
        task = job.task
        ran: list[tuple[Stage, StageTimer]] = []
        look = time.perf_counter()
        deadline = look + RUN_ALONE_MAX_S
        look += RUN_ALONE_LOOK_S
        try:
            while True:
                k, b = task.stage
                last = self._leaves_after(task.stage, placement, host.config)
                if last:
                    self._wake_next(task, placement)
                with self.io.timer() as timer:
                    kv = KVBatch(host.tables[b], [placement.slots[k]], step_slots=[placement.slots])
                    job.state = run_stage(host.model, b, [k], [job.state], kv, handoff)[0]
                ran.append((task.stage, timer))
                if last or timer.wall_end > deadline:
                    break
                nxt = next_stage(task.stage, steps, blocks, host.config.clean_pass)
                if timer.wall_end >= look:   # (a look costs as much as the rest of the step between two stages)
                    if self.has_task():
                        break
                    look = timer.wall_end + RUN_ALONE_LOOK_S
                task.stage = nxt
        except Exception as exc:  # a failing task must not take the worker down
            self._stage_failed([job], exc)
            return
        received = job.received
        for (k, b), timer in ran:
            entry = p.TraceEntry(k, b, self.id, round(max(0.0, timer.wall_start - received) * 1e3, 4), 0.0, 1)
            self._unsettled.append((timer, (job.model, b), [entry]))
            task.trace.append(entry)
            received = timer.wall_end
        self.stats.stages += len(ran)
        self.stats.batches += len(ran)
        self._settle(wait=False)
        self._forward(job, received)
        self._learn()

    @staticmethod
    def _leaves_after(stage: Stage, placement: Placement, config: ModelConfig) -> bool:
        """Whether a chunk leaves this worker after ``stage`` (for the next stage's worker, or the engine)."""
        nxt = next_stage(stage, config.steps, config.blocks, config.clean_pass)
        return nxt is None or nxt not in placement.stages

    def _wake_next(self, task: p.Task, placement: Placement) -> None:
        """Tell where ``task`` goes after its current stage that it is coming (it starts that stage now): a
        Wake, so the receiver is awake when the chunk arrives (if ``Load.wake_ahead_us``; never blocks)."""
        if not self.settings.wake_ahead_us:
            return
        try:
            wake = p.Wake(stream=task.stream, chunk=task.chunk, seed=task.seed)
            self._push(placement.routes[task.stage]).send_multipart(wire.encode(wake), zmq.NOBLOCK)
        except zmq.Again:
            pass   # the receiver is not taking messages: the chunk itself will find out

    def _stage_failed(self, batch: list[Job], exc: Exception) -> None:
        self.stats.errors += 1
        # throttled per stage: the first failure with its traceback, a storm of them as a count
        self.throttle.log(log, logging.ERROR, f"stage_failed:{list(batch[0].stage)}",
                          f"worker {self.id}: stage {batch[0].stage} of {len(batch)} task(s) failed: "
                          f"{type(exc).__name__}: {exc}", exc_info=True)
        for j in batch:
            self._lost(j.task, "task_failed", f"stage {list(j.stage)} raised {type(exc).__name__}: {exc}")

    def _settle(self, wait: bool) -> None:
        """Record the forwards whose time is known (all of them, waiting, if ``wait``): the trace entries'
        compute time (each chunk is charged its share of a batched forward) and stats; the batching policy
        learns them in :meth:`_learn`."""
        while self._unsettled:
            timer, weights, entries = self._unsettled[0]
            if not wait and not timer.done():
                return
            self._unsettled.popleft()
            ms = timer.ms
            self._unlearned.append((weights, len(entries), ms))
            self.stats.compute_ms += ms
            for entry in entries:
                entry.compute_ms = round(ms / len(entries), 4)

    def _learn(self) -> None:
        """The batching policy observes the settled forwards. Called once a run's chunks have been passed on:
        on their way out, the observations of a chunk run alone (32 stages) cost it 0.04-0.05 ms (served,
        tiny-wam), and the policy needs them only for its next pick."""
        for weights, n, ms in self._unlearned:
            self.policy.observe(weights, n, ms)
        self._unlearned.clear()

    def _forward(self, job: Job, now: float) -> None:
        """Queue the job's next stage here, or send it to the next worker or the engine."""
        task = job.task
        placement = self.host.placements.get(task.stream)
        if placement is None or placement.epoch != task.epoch:  # stopped or reset while this task ran
            return
        cfg = self.host.models[placement.model].config
        nxt = next_stage(task.stage, cfg.steps, cfg.blocks, cfg.clean_pass)
        if nxt is not None and nxt in placement.stages:
            task.stage, job.received = nxt, now
            self.ready.append(job)
            return
        self.stats.tasks += 1
        self._settle(wait=True)  # the chunk leaves: its trace carries every stage's time
        route, peer = placement.routes[task.stage], placement.peers.get(task.stage, "")
        sent = time.perf_counter()
        task.link, task.shm, ring_head = None, None, 0
        if nxt is None:
            out: p.Message = p.Output(stream=task.stream, chunk=task.chunk, epoch=task.epoch, worker=self.id,
                                      sent=sent, hops=task.hops, trace=task.trace)
            tensors = self.io.to_host({"x": job.state["x"]})
        elif self.hops is not None and peer:  # the hidden state goes over the link, the header over ZeroMQ
            task.stage, task.sent, out, tensors = nxt, sent, task, job.state
            try:
                task.link = self.hops.reserve(peer, len(tensors))
            except HopError as exc:
                self._lost(task, "link_failed", str(exc), peer=peer)
                return
        elif self.shm is not None and peer:  # the hidden state through the shared ring (frames if it is full)
            task.stage, task.sent, out, tensors = nxt, sent, task, job.state
            ring_head = self.shm.head(peer)
            task.shm = self.shm.write(peer, tensors)
            if task.shm is None:
                self.stats.ring_full += 1
        else:
            task.stage, task.sent, out = nxt, sent, task
            tensors = self.io.to_host(job.state)
        try:
            # Never block on a peer that is gone (a lost worker): drop, report, and let the engine recover.
            self._push(route).send_multipart(wire.encode(out, tensors), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.dropped_sends += 1
            self._lost(task, "send_failed", "the next stage's worker did not take the message")
            if task.shm is not None:
                self.shm.unwrite(peer, task.shm, ring_head)
            return
        if task.link is not None:
            try:
                self.hops.post(peer, task.link, tensors)
            except HopError as exc:  # the receiver's side reports it too; whichever comes first resets
                self._lost(task, "link_failed", str(exc), peer=peer)

    @staticmethod
    def _slot_key(job: Job) -> tuple[str, int, int]:
        return (job.stream, job.stage[0], job.stage[1])
