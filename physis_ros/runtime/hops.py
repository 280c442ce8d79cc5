"""Hidden-state bytes of a hop over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on CUDA).

ZeroMQ still carries every task header. With this transport a header travels
without tensor frames: it lists the tensors (:class:`~physis_ros.runtime.protocol.TensorSpec`)
and names the link they come over (:class:`~physis_ros.runtime.protocol.HopLink`:
sender, link generation, first tag). The receiver checks the declared tensors
against what the stage expects *before* posting the matching receives, so a
header cannot make it read bytes into a tensor of another shape or dtype.

Links are pairs: each pair of workers that pass hidden states to each other
has its own two-rank process group (rank 0: the lower worker id), built from
a ``PrefixStore`` of the engine's ``TCPStore`` under ``hop/<a>/<b>/<gen>``.
The engine owns the generation: it moves on when either worker restarts or a
transfer on the pair fails, and the next ``StartStream`` carries it, so both
ends build a fresh pair and a restarted worker rejoins (no global group that
every worker would have to re-form). Pairs are built on a thread while the
worker keeps serving, exactly like block loads.

Threads, and why: gloo's ``Work.is_completed()`` stays false until ``wait()``
is called, and ``wait()`` blocks. Sends are posted on the worker's thread and
waited on a sender thread (the tensor stays referenced until then), so stage
``i+1`` computes while stage ``i``'s output moves. Receives are posted on the
worker's thread and waited on one receiver thread per sending peer (in arrival
order), which hands finished payloads back through a queue and wakes the
worker's poll through an inproc socket: a transfer that never comes (a peer
that died, a forged header) cannot stall the worker's loop, its heartbeats or
its other links, only that link, until the pair's timeout closes it.

On CUDA the pairs are NCCL's: ``wait()`` then makes the worker's current
stream wait for the transfer rather than the host, so an arrival is handed
over when the receive is enqueued, and the stage that reads it runs after it
on the same stream. NCCL keeps its own timeout (``hop_timeout_s`` applies to
gloo), and it cannot pair two ranks on one GPU: ``hops: torch`` on GPUs needs
one GPU per worker (the engine refuses otherwise).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from physis_ros.runtime import protocol as p
from physis_ros.runtime import wire

log = logging.getLogger("physis.hops")
TAG_SPACE = 2**31 - 1       # gloo and NCCL tags are C ints


class HopError(RuntimeError):
    """A hop over a link could not be made (no such link, or the link failed)."""


@dataclass(frozen=True)
class LinkId:
    """One pair of workers at one generation."""

    a: str      # lower worker id: rank 0
    b: str
    gen: int

    @staticmethod
    def of(me: str, peer: str, gen: int) -> LinkId:
        a, b = sorted((me, peer))
        return LinkId(a, b, gen)

    def rank_of(self, worker: str) -> int:
        return 0 if worker == self.a else 1

    @property
    def prefix(self) -> str:
        return f"hop/{self.a}/{self.b}/{self.gen}"


@dataclass
class Arrival:
    """A receive that finished (``tensors``) or failed (``error``), with what the caller attached."""

    context: object
    tensors: dict[str, torch.Tensor] | None
    error: str = ""


def empty_like_specs(specs: list[p.TensorSpec], device: torch.device | str, max_bytes: int) -> dict[str, torch.Tensor]:
    """Tensors to receive into, exactly as declared (on ``meta``: shapes only, nothing allocated);
    WireError if the declaration is unusable."""
    out: dict[str, torch.Tensor] = {}
    total = 0
    for spec in specs:
        if spec.name in out:
            raise wire.WireError(f"tensor '{spec.name}' appears twice")
        np_dtype, torch_dtype = wire.DTYPES[spec.dtype]
        count = 1
        for d in spec.shape:
            count *= d
        total += count * np_dtype.itemsize
        if total > max_bytes:
            raise wire.WireError(f"tensors of {total}+ bytes exceed the message limit of {max_bytes} bytes")
        out[spec.name] = torch.empty(spec.shape, dtype=torch_dtype, device=device)
    return out


class TorchHops:
    """One worker's links: pair process groups, a sender thread and a receiver thread per sending peer."""

    def __init__(self, worker_id: str, store: str, device: str, *, bind_host: str = "127.0.0.1",
                 timeout_s: float = 5.0, ctx: zmq.Context | None = None, max_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES):
        host, _, port = store.rpartition(":")
        self.me = worker_id
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.recv_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self.bind_host = bind_host
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.max_bytes = max_bytes
        self.store = dist.TCPStore(host, int(port), None, False, timeout=self.timeout, wait_for_workers=False)
        self.links: dict[str, tuple[LinkId, object]] = {}     # peer -> (link, process group)
        self.building: dict[LinkId, Future] = {}
        self._next_tag: dict[LinkId, int] = {}
        self._builder = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hop-link")
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self.arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self.ctx = ctx or zmq.Context.instance()
        self.wake_addr = f"inproc://hops-{id(self)}"
        self.wake = self.ctx.socket(zmq.PULL)         # the worker polls this: an arrival is waiting
        self.wake.bind(self.wake_addr)
        self._sender = threading.Thread(target=self._send_loop, name="hop-send", daemon=True)
        self._sender.start()
        self._receivers: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}   # one per sending peer

    # ---- links ----------------------------------------------------------------------------------
    def connect(self, peer: str, gen: int) -> Future | None:
        """Make sure the link to ``peer`` at ``gen`` exists; a future while it is being built."""
        want = LinkId.of(self.me, peer, gen)
        have = self.links.get(peer)
        if have is not None and have[0] == want:
            return None
        future = self.building.get(want)
        if future is None:
            future = self._builder.submit(self._build, want)
            self.building[want] = future
        return future

    def _build(self, link: LinkId) -> object:
        if self.backend == "nccl":
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(link.prefix, self.store), link.rank_of(self.me), 2)
        else:
            opts = dist.ProcessGroupGloo._Options()
            # Lazy: the pair connects at its first transfer, so building it never waits for the peer. (Eager
            # construction blocks until the peer builds too, and three workers each building one of their pairs
            # first could wait on each other in a cycle: seen with the block plan on 3 workers.)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_host, lazy_init=True)]
            opts._timeout = self.timeout
            pg = dist.ProcessGroupGloo(dist.PrefixStore(link.prefix, self.store), link.rank_of(self.me), 2, opts)
        return pg

    def attach_built(self) -> None:
        """Install the links whose build finished (worker thread); a failed build raises HopError."""
        for link, future in list(self.building.items()):
            if not future.done():
                continue
            del self.building[link]
            exc = future.exception()
            if exc is not None:
                raise HopError(f"link {link.a}<->{link.b} (generation {link.gen}) could not be built: {exc}")
            peer = link.b if link.a == self.me else link.a
            old = self.links.get(peer)
            if old is None or old[0].gen <= link.gen:
                self.links[peer] = (link, future.result())
                self._next_tag[link] = 0

    # ---- transfers ------------------------------------------------------------------------------
    def reserve(self, peer: str, count: int) -> p.HopLink:
        """Tags for ``count`` tensors to ``peer``: the header carries them, then :meth:`post` sends."""
        have = self.links.get(peer)
        if have is None:
            raise HopError(f"no link to worker {peer}")
        link = have[0]
        tag = self._next_tag[link]
        self._next_tag[link] = (tag + count) % (TAG_SPACE - p.MAX_TENSORS)
        return p.HopLink(sender=self.me, gen=link.gen, tag=tag)

    def post(self, peer: str, hop: p.HopLink, tensors: Mapping[str, torch.Tensor]) -> None:
        """Post the sends announced by ``hop`` (after its header went out); a sender thread waits on them.
        HopError if the pair is closed (the receiver reports the chunk; the engine rebuilds the pair)."""
        link, pg = self.links[peer]
        dst = 1 - link.rank_of(self.me)
        for i, t in enumerate(tensors.values()):
            t = t.detach().contiguous()
            try:
                work = pg.send([t], dst, hop.tag + i)
            except RuntimeError as exc:
                self._broken(peer, link)
                raise HopError(f"link {link.a}<->{link.b} (generation {link.gen}) is closed: {exc}") from None
            self._sends.put((link, t, work))

    def _broken(self, peer: str, link: LinkId) -> None:
        """Forget a closed pair: hops to ``peer`` fail at once until the engine names a new generation."""
        if self.links.get(peer, (None,))[0] == link:
            del self.links[peer]

    def receive(self, hop: p.HopLink, tensors: dict[str, torch.Tensor], context: object) -> None:
        """Post the receives into ``tensors`` (made by :func:`empty_like_specs` and checked by the caller);
        an :class:`Arrival` with ``context`` comes out of :attr:`arrivals` when they are done."""
        have = self.links.get(hop.sender)
        if have is None or have[0].gen != hop.gen:
            raise HopError(f"no link to worker {hop.sender} at generation {hop.gen}")
        link, pg = have
        src = 1 - link.rank_of(self.me)
        try:
            works = [pg.recv([t], src, hop.tag + i) for i, t in enumerate(tensors.values())]
        except RuntimeError as exc:
            self._broken(hop.sender, link)
            raise HopError(f"link {link.a}<->{link.b} (generation {link.gen}) is closed: {exc}") from None
        receiver = self._receivers.get(hop.sender)
        if receiver is None:
            items: queue.SimpleQueue = queue.SimpleQueue()
            receiver = self._receivers[hop.sender] = (items, threading.Thread(
                target=self._recv_loop, args=(items,), name=f"hop-recv-{hop.sender}", daemon=True))
            receiver[1].start()
        receiver[0].put((link, works, tensors, context))

    def _send_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            link, _tensor, work = item
            try:
                work.wait()
            except Exception as exc:  # the pair is closed; the receiver reports the chunk (link_failed)
                log.warning("hop send over %s<->%s (generation %d) failed: %s", link.a, link.b, link.gen, exc)

    def _recv_loop(self, items: queue.SimpleQueue) -> None:
        """Wait on one peer's receives in arrival order (a stuck one holds up only that peer's)."""
        wake = self.ctx.socket(zmq.PUSH)
        wake.connect(self.wake_addr)
        try:
            while True:
                item = items.get()
                if item is None:
                    return
                link, works, tensors, context = item
                try:
                    for w in works:
                        w.wait()
                    arrival = Arrival(context, tensors)
                except Exception as exc:
                    arrival = Arrival(context, None, f"receive over link {link.a}<->{link.b} failed: {exc}")
                self.arrivals.put(arrival)
                try:
                    wake.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wake-ups pile up unread: the worker is busy and drains arrivals each turn
                    pass
        finally:
            wake.close(linger=0)

    def drain_wake(self) -> None:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def take_arrivals(self, handle: Callable[[Arrival], None], limit: int) -> None:
        for _ in range(limit):
            try:
                arrival = self.arrivals.get_nowait()
            except queue.Empty:
                return
            handle(arrival)

    def close(self) -> None:
        """Stop the threads (a transfer still waiting ends at the pair's timeout) and drop the pairs."""
        for items, _ in self._receivers.values():
            items.put(None)
        self._sends.put(None)
        for t in [self._sender, *(t for _, t in self._receivers.values())]:
            t.join(timeout=self.timeout.total_seconds() + 1)
        self._builder.shutdown(wait=False, cancel_futures=True)
        self.links.clear()
        self.wake.close(linger=0)


class LinkBook:
    """The engine's side: the TCPStore where pairs meet, and each pair's generation.

    A pair's generation is the sum of both workers' incarnations and the failures reported on it, so it
    only moves forward: after a restart or a failed transfer, the next ``StartStream`` names a new one and
    both ends build a fresh pair."""

    def __init__(self, host: str | None, timeout_s: float):
        """``host``: where the TCPStore listens (hops torch); None: generations only (hops shm)."""
        self.store = None if host is None else dist.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.address = "" if self.store is None else f"{host}:{self.store.port}"
        self._incarnation: dict[str, int] = {}
        self._failures: dict[frozenset, int] = {}

    def gen(self, a: str, b: str) -> int:
        return self._incarnation.get(a, 0) + self._incarnation.get(b, 0) + self._failures.get(frozenset((a, b)), 0)

    def worker_lost(self, worker: str) -> None:
        self._incarnation[worker] = self._incarnation.get(worker, 0) + 1

    def link_failed(self, a: str, b: str) -> None:
        key = frozenset((a, b))
        self._failures[key] = self._failures.get(key, 0) + 1

    def links(self, me: str, peers: set[str]) -> list[p.Link]:
        return [p.Link(peer, self.gen(me, peer)) for peer in sorted(peers)]
