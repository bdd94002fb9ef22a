"""Peer: a connected remote engine (its segment), and the batch API. The
peer's control connection is a kvflow.control.client.ControlSession; the
bytes move through the channel of the provider that reached it."""
from __future__ import annotations

import asyncio
import errno
import concurrent.futures
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvflow import _core
from kvflow._core import OP_READ, OP_WRITE
from kvflow.errors import (InvalidArgumentError, KVFlowError, PeerLostError, PeerUnreachableError, ProtocolError,
                           TransferTimeoutError)
from kvflow.status import EREMOTE, status_error
from kvflow.tasks import retrieve
from kvflow.arrays import entry_of, expand_strided
from kvflow.control.client import ControlSession
from kvflow.control.descriptor import Descriptor, parts_from_wire, regions_from_wire
from kvflow.control.wire import field
from kvflow.memory import HOST, Access, RemoteRegion
from kvflow.engine.blocks import Blocks, Prepared
from kvflow.engine.link import ClosedChannel, Link
from kvflow.engine.posted import COMPLETED, SPIN_BYTES, PostedTransfer
from kvflow.engine.router import NATIVE, Path, Route
from kvflow.engine.transfer import TaskTransfer, Transfer, batch_error
from kvflow.providers.base import Provider
from kvflow.regions import gpu_table, host_table
from kvflow.schedule.qos import Priority, qos_args

if TYPE_CHECKING:
    from kvflow.engine.context import PeerContext

__all__ = ["Peer"]


def _retrieve(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()

log = logging.getLogger("kvflow")

_DEFAULT_PRIORITY = Priority.NORMAL      # module globals: the enum's class attribute costs a lookup
_NORMAL_CLASS = int(Priority.NORMAL)

DETACHED_SPIN = 100e-6      # spin this long before sleeping: a small batch is done by then
# how a batch's caller takes its completion (Peer._submit)
_AWAITED, _NOWAIT, _BLOCKING, _POSTED = range(4)
CANCEL_GRACE = 5.0          # a timed-out blocking batch is waited for this long after its cancel
RESUME_BACKOFF = (0.25, 8.0)    # a lapsed peer is dialled again after these many seconds, doubling
RESUME_FOR = 60.0               # ... for this long at least (4 keepalives if longer), then it is given up
class Peer:
    """A remote engine this engine is connected to.

    `transport` names the provider that moves the bytes ("local", "tcp",
    "rdma"); `regions` lists the peer's memory as its descriptor says,
    refreshed when the peer registers or deregisters memory.
    """

    def __init__(self, ctx: "PeerContext", address: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, descriptor: Descriptor, replies: frozenset[str]) -> None:
        self._ctx = ctx
        self._router = ctx.router       # (the write path reads it on every batch)
        self.address = address
        self.descriptor = descriptor
        self._table = _core.RemoteTable()
        self._set_regions(descriptor.regions)
        self._channel: Any = ClosedChannel(address)
        self._channel_closed = False
        self._provider: Provider | None = None
        self.transport = ""
        self._refresh_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._replies = replies
        self._session = self._new_session(reader, writer)
        self.link = Link(address, descriptor=lambda: self.descriptor, table=lambda: self._table,
                         alive=lambda: not self._closed and not self._session.lost,
                         session=lambda: self._session, close=self.close)
        self._lost_callbacks: list[Callable[["Peer"], None]] = []
        # Set when the session ended while this side still wanted it: the
        # peer is dialled again in the background (_resume) and, if the same
        # incarnation answers, this Peer works again as it was.
        self._lapsed = False
        self._resume_task: asyncio.Task[bool] | None = None
        self.superseded = False      # the address now answers with another incarnation: this Peer stays lost
        self._session.listen()

    def _new_session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> ControlSession:
        return ControlSession(self.address, reader, writer, replies=self._replies, on_regions=self._on_regions,
                              on_descriptor=self._on_descriptor, on_ended=self._on_session_ended,
                              on_lost=self._on_control_lost)

    def on_lost(self, callback: Callable[["Peer"], None]) -> None:
        """Calls `callback(peer)` once, on the loop, when the peer is lost
        (its control connection ends) or closed; at once if it already is."""
        if self._closed or self._session.lost:
            self._ctx.loop.call_soon(callback, self)
        else:
            self._lost_callbacks.append(callback)

    def _fire_lost(self) -> None:
        callbacks, self._lost_callbacks = self._lost_callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:   # a user callback must not break teardown
                log.exception("kvflow: peer-lost callback for %s failed", self.address)

    def _start(self, provider: Provider, channel: Any) -> None:
        self._provider = provider
        self._channel = channel
        self._channel_closed = False
        self.transport = provider.name
        self._session.start(self._ctx.keepalive, self._close_channel)
        provider.started(self.link, channel)

    def _close_channel(self) -> None:
        """The channel ends now: in-flight batches fail (the provider lets
        go of it first: no reader left on a descriptor that closes). Once
        per channel (a lapse closes it, and so may the resumption or close())."""
        if self._channel_closed:
            return
        self._channel_closed = True
        if self._provider is not None:
            self._provider.closed(self._channel)
        self._channel.close()

    def _abort_batch(self, batch_id: int) -> bool:
        return self._provider is not None and self._provider.abort_batch(self._channel, batch_id)

    # ------------------------------------------------------------ regions
    @property
    def regions(self) -> list[RemoteRegion]:
        return list(self._regions)

    def estimate(self, nbytes: int, entries: int = 1) -> float:
        """Seconds a batch of `nbytes` in `entries` entries is expected to
        take toward this peer on an idle link (its provider's estimate)."""
        if self._provider is None:
            raise PeerLostError(f"peer {self.address} is closed", peer=self.address)
        return self._provider.estimate(nbytes, entries)

    def region(self, name: str) -> RemoteRegion:
        """The peer's region called `name`; KeyError if it has none."""
        for r in self._regions:
            if r.name == name:
                return r
        raise KeyError(f"peer {self.address} has no region named {name!r}")

    def blocks(self, addrs: Any, lengths: Any) -> Blocks:
        """A list of blocks of this peer's memory (kvflow.engine.blocks), each
        checked once to lie inside one of its regions (RemoteAccessError
        naming the first that does not). `lengths`: one per block, or one
        int for all."""
        return Blocks.remote(self.address, self._regions, addrs, lengths)

    def prepare(self, local: Blocks, remote: Blocks) -> Prepared:
        """Pairs a list of this engine's blocks (engine.blocks()) with one of
        this peer's (blocks()): its write()/read()/post_write()/... take
        indices into both lists instead of address arrays."""
        return Prepared(self, local, remote)

    def _set_regions(self, regions: list[RemoteRegion]) -> None:
        # GPU memory stays out of the native table: only staged batches reach it
        if not self._table.update([(r.addr, r.length, int(r.access), r.rkeys) for r in regions
                                   if r.kind == HOST]):
            raise ProtocolError(f"peer {self.address} described overlapping or empty regions",
                                peer=self.address)
        table = gpu_table(regions)
        if getattr(self, "_gpu_table", None) is not None and \
                [(r.addr, r.ipc) for r in self._gpu_table] != [(r.addr, r.ipc) for r in table]:
            self._ctx.router.forget_peer(self.address)     # its GPU regions changed: mappings may be stale
        self._gpu_table = table
        self._remote_gpu = bool(table)      # a plain bool: the write path tests it on every call
        self._host_table = host_table(regions)      # (checked above: none overlaps another)
        self._regions = regions

    def holds_host(self, addr: int, n: int, write: bool) -> bool:
        """Whether [addr, addr+n) lies in one of the peer's host regions with
        the access a write (or a read) needs."""
        return self._host_table.holds(addr, n, Access.WRITE if write else Access.READ)

    def _on_regions(self, msg: dict[str, Any]) -> None:
        """A "regions" push: the peer's regions (with their rkeys) and the
        parts of its descriptor that change at run time (rdma's: devices in
        service, probe keys, when one of its devices comes back), each
        checked by its provider's decoder; a part not sent is unchanged."""
        regions = regions_from_wire(field(msg, "regions", list))
        parts = parts_from_wire(msg)
        self._set_regions(regions)
        if parts:
            self.descriptor = replace(self.descriptor, providers={**self.descriptor.providers, **parts})
            if self._provider is not None and self._provider.pushed:
                self._provider.remote_changed(self.link, self._channel)

    def _on_descriptor(self, desc: Descriptor) -> None:
        self.descriptor = desc
        self._set_regions(desc.regions)
        waiters, self._refresh_waiters = self._refresh_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _on_session_ended(self) -> None:
        for w in self._refresh_waiters:
            if not w.done():
                w.set_exception(PeerLostError(f"peer {self.address} is gone", peer=self.address))
        self._refresh_waiters = []

    def _on_control_lost(self) -> None:
        # The control connection is the peer's lifeline for providers with
        # no data socket of their own to notice a death (local, rdma).
        if self._provider is not None and self._provider.caps.lifeline:
            self._close_channel()
        self._fire_lost()
        if not self._closed and not self._ctx.closed:
            self._lapsed = True
            self._resume_task = self._ctx.loop.create_task(self._resume())
            self._resume_task.add_done_callback(retrieve)

    async def _resume(self) -> bool:
        """Dials the peer again until it answers (back-off RESUME_BACKOFF,
        for RESUME_FOR seconds at most). The same incarnation: this Peer
        takes the new session and channel, its regions refreshed, and works
        again as it was (True). Another incarnation (the process restarted
        on the address), nobody listening there any more (refused: the
        process that was this peer is gone), or giving up: this Peer stays
        lost for good, and connect() makes a new one (False)."""
        loop = self._ctx.loop
        delay, until = RESUME_BACKOFF[0], loop.time() + max(RESUME_FOR, 4 * self._ctx.keepalive)
        while not self._closed:
            try:
                same = await self._ctx.redial(self)
            except PeerUnreachableError as e:
                if e.errno == errno.ECONNREFUSED:
                    log.info("kvflow: peer %s is gone (its address refuses connections)", self.address)
                    return False
                log.debug("kvflow: resuming %s: %s", self.address, e)
            except KVFlowError as e:
                log.debug("kvflow: resuming %s: %s", self.address, e)
            else:
                if same:
                    self._lapsed = False
                    log.warning("kvflow: peer %s is back (same incarnation): its session resumed", self.address)
                    return True
                log.warning("kvflow: peer %s restarted (a new incarnation): the old Peer stays lost", self.address)
                self.superseded = True
                self._ctx.forget(self)
                return False
            if loop.time() + delay > until:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESUME_BACKOFF[1])
        return False

    def _rebind(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, descriptor: Descriptor) -> None:
        """A new control session to the same incarnation (_resume): the old
        channel goes, the regions are the peer's as of now; the engine opens
        the new channel and start()s it."""
        self._close_channel()
        self._channel = ClosedChannel(self.address)
        self.descriptor = descriptor
        self._set_regions(descriptor.regions)
        self._session = self._new_session(reader, writer)
        self._session.listen()

    async def _resumed(self, timeout: float | None = None) -> None:
        """Waits for a lapsed peer's resumption: at most the engine's
        keepalive (the grace after which a host that answers nothing is
        lost: PeerLostError, while the background dialling goes on) and
        `timeout` (TransferTimeoutError); PeerLostError at once when it
        will not come back as the same incarnation."""
        task = self._resume_task
        if task is not None and not task.done():
            grace = self._ctx.keepalive or None
            wait = grace if timeout is None else timeout if grace is None else min(grace, timeout)
            try:
                await asyncio.wait_for(asyncio.shield(task), wait)
            except asyncio.TimeoutError:
                if timeout is not None and wait == timeout:
                    raise TransferTimeoutError(f"peer {self.address} was not back within {timeout} s",
                                               peer=self.address) from None
                raise PeerLostError(f"peer {self.address} is lost (not back within the {wait:g} s keepalive; "
                                    "it is dialled again in the background)", peer=self.address) from None
        if task is None or task.cancelled() or task.exception() is not None or not task.result():
            why = "restarted as a new incarnation; connect() again" if self.superseded else "is gone"
            raise PeerLostError(f"peer {self.address} {why}", peer=self.address)

    async def refresh(self, *, timeout: float = 10.0) -> None:
        """Fetches the peer's descriptor again (regions)."""
        if self._lapsed:
            await self._resumed(timeout)
        fut = self._ctx.loop.create_future()
        self._refresh_waiters.append(fut)
        self._session.send({"t": "describe"})
        await asyncio.wait_for(fut, timeout)

    # ------------------------------------------------------------ transfers
    @property
    def alive(self) -> bool:
        return not self._closed and not self._session.lost and self._channel.alive

    def connections(self) -> list[dict[str, Any]]:
        """tcp: one entry per data connection (index, endpoint: the rail,
        source: the local rail it is bound to or None, local: the address
        it left from, up, bytes sent, slices moved to other connections
        when it failed, failures, rebuilds, fences (sent for failed
        connections whose work it took: wire.h); its queue: queued_slices,
        queued_bytes, inflight_slices). rdma: one entry per QP (device,
        state, work requests and bytes posted, the same queue fields and
        inflight_bytes, failures, repairs). Empty for local."""
        return self._provider.connections(self._channel) if self._provider is not None else []

    def channel_stats(self) -> dict[str, Any] | None:
        """The native counters of the channel carrying this peer's batches
        (kvf_chan_stats: per operation batches, bytes, failed, in flight
        and the latency histogram; failures by status), or None once the
        channel is closed. engine.metrics() summarises them."""
        stats = getattr(self._channel, "stats", None)
        return stats() if stats is not None else None

    def ibgda_endpoints(self) -> list[Any]:
        """rdma with Engine(rdma_ibgda=True): one IBGDA endpoint per device
        pair of this peer's channel, a QP a GPU drives itself
        (kvflow.providers.rdma.ibgda.IbgdaEndpoint: view(), local_regions(),
        remote_key(), write_from_host()); [] for other providers. Never run
        on an mlx5 NIC."""
        return self._provider.ibgda_endpoints(self._channel) if self._provider is not None else []

    def _track(self, batch_id: int, op: int, nbytes: int, timeout: float | None) -> Transfer:
        """The Transfer of a posted batch (batch_id 0: completed inline)."""
        return self._ctx.batches.track(batch_id, self.address, op, nbytes, timeout)

    def _route(self, op: int, la: Any, ra: Any, relay: bool = True) -> Route:
        """The batch's path, as the engine's router decides it
        (kvflow.engine.router); relay=False: never through a relay member."""
        return self._ctx.router.path(op, la, ra, address=self.address, descriptor=self.descriptor,
                                     remote=self._gpu_table, provider=self._provider, relay=relay)

    def _submit(self, op: int, la: Any, ra: Any, ln: Any, mode: int, timeout: float | None = None,
                counts: Any = None, local_strides: Any = None, remote_strides: Any = None,
                priority: Any = _DEFAULT_PRIORITY, deadline: float | None = None, after: Any = None,
                route: Route | None = None, first: Any = None, refresh: bool = True) -> Any:
        """The one submission path of all eight entry points (write, read,
        their _nowait, _blocking and post_ forms), asyncpg's _execute:

        1. the path, decided once per batch: by the router where the batch
           may leave the native path (GPU memory here or there, a relay
           group: one test of two attributes otherwise), or given (the legs
           of a staged or relayed batch: NATIVE);
        2. a batch off the native path, or one that waits for `after`, runs
           as a coroutine on the loop (_routed), returned as `mode` wants it;
        3. the options, alike for every mode: priority and deadline become
           the native class and deadline, strided entries are expanded;
        4. the native submission, completed as `mode` wants it: _AWAITED
           (None when it already completed, inline or polled to completion:
           no Transfer, no wake-up; else what to await: write() and read()
           await no other coroutine on that path, which on Soft-RoCE under
           emulation costs as much as a tenth of the write), _NOWAIT (a
           Transfer), _BLOCKING (done on the calling thread, or on the loop
           while this thread waits), _POSTED (a PostedTransfer)."""
        if mode == _BLOCKING:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._ctx.loop:
                raise KVFlowError(f"{'write' if op == OP_WRITE else 'read'}_blocking() on the engine's event "
                                  "loop thread would block the loop: await write()/read() there", peer=self.address)
        if route is None:
            route = self._route(op, la, ra) if self._remote_gpu or self._router.rerouting else NATIVE
        if after is not None or route is not NATIVE:
            return self._off_native(op, la, ra, ln, mode, timeout, counts, local_strides, remote_strides,
                                    priority, deadline, after, route)
        if priority is _DEFAULT_PRIORITY and deadline is None:
            prio, deadline_ns = _NORMAL_CLASS, 0
        else:
            prio, deadline_ns = qos_args(priority, deadline)
        if counts is not None or local_strides is not None or remote_strides is not None:
            la, ra, ln, first = _expanded(la, ra, ln, counts, local_strides, remote_strides)
        if mode == _AWAITED:
            status, batch_id, aux, finished = self._channel.submit_poll(op, la, ra, ln, True, prio, deadline_ns)
            if finished:                   # status and aux are the batch's
                if status:
                    raise batch_error(self._ctx.batches, self.address, op, status, aux, first)
                return None
            if status == EREMOTE and refresh and not self._session.lost:
                return self._after_refresh(op, la, ra, ln, timeout, first, prio, deadline)
        elif mode == _NOWAIT:
            status, batch_id, aux = self._channel.submit(op, la, ra, ln, prio, deadline_ns)
        elif mode == _BLOCKING:
            provider = self._provider
            if self.alive and provider is not None and provider.caps.detached and \
                    self._detached(op, la, ra, ln, timeout, prio, deadline_ns, first):
                return None
            # the loop's path (rdma; or the peer's table lacks the range: it is asked again)
            return self._to_loop(self._on_loop(op, la, ra, ln, timeout, priority, deadline, first), mode)
        else:       # _POSTED (a NIXL agent's every transfer() comes through here: each attribute
                    # lookup and call is what it costs besides the copy)
            provider = self._provider
            if provider is not None and provider.caps.detached and not self._closed and \
                    not self._session.lost and self._channel.alive:
                try:
                    status, batch_id, aux = self._channel.submit_detached(op, la, ra, ln, prio, deadline_ns)
                except RuntimeError:
                    raise PeerLostError(f"peer {self.address}: the engine was closed", peer=self.address) from None
                if status == 0:
                    if batch_id == 0:
                        return COMPLETED                    # it completed inline
                    return PostedTransfer(self._ctx.core, batch_id, error_of=self._error_of(op, first),
                                          progress=provider.poller(self._channel), nbytes=aux)
                if status != EREMOTE:
                    raise status_error(status, peer=self.address, op=op,
                                       index=aux if first is None else entry_of(first, aux))
            # the loop's path (rdma; or the peer's table lacks the range: it is asked again)
            return self._to_loop(self._on_loop(op, la, ra, ln, None, priority, deadline, first), mode)
        if status:
            raise status_error(status, peer=self.address, op=op,
                               index=aux if first is None else entry_of(first, aux))
        if batch_id == 0 and mode == _AWAITED:
            return None
        t = self._track(batch_id, op, aux, timeout)
        t._first_piece = first
        return t

    def _error_of(self, op: int, first: Any) -> Callable[[int, int], KVFlowError]:
        """A posted batch's error, from its status and failed entry. (Made
        here, not in _submit: a closure there would make its variables
        cells on every call.)"""
        return lambda status, entry: batch_error(self._ctx.batches, self.address, op, status, entry, first)

    async def _after_refresh(self, op: int, la: Any, ra: Any, ln: Any, timeout: float | None,
                             first: Any, priority: int, deadline: float | None) -> None:
        # The peer may have registered memory we have not heard of yet.
        await self.refresh()
        t = self._submit(op, la, ra, ln, _AWAITED, timeout, priority=priority, deadline=deadline, route=NATIVE,
                         first=first, refresh=False)
        if t is not None:
            await t

    async def _on_loop(self, op: int, la: Any, ra: Any, ln: Any, timeout: float | None, priority: Any,
                       deadline: float | None, first: Any) -> None:
        """A thread's native batch that the loop must carry (_BLOCKING,
        _POSTED): as write() would, its entries expanded already."""
        if self._lapsed:
            await self._resumed(timeout)
        t = self._submit(op, la, ra, ln, _AWAITED, timeout, priority=priority, deadline=deadline, route=NATIVE,
                         first=first)
        if t is not None:
            await t

    def _to_loop(self, coro: Any, mode: int) -> Any:
        """Runs `coro` on the engine's loop for a thread: a PostedTransfer
        of it (_POSTED), or waited for here (_BLOCKING)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._ctx.loop)
        except RuntimeError:            # the loop closed under us
            coro.close()
            raise PeerLostError(f"peer {self.address}: the engine was closed", peer=self.address) from None
        if mode == _POSTED:
            return PostedTransfer(future=future)
        try:
            future.result()
        except concurrent.futures.CancelledError:      # the loop cancelled it while closing
            raise PeerLostError(f"peer {self.address}: the engine was closed", peer=self.address) from None
        return None

    def _off_native(self, op: int, la: Any, ra: Any, ln: Any, mode: int, timeout: float | None, counts: Any,
                    local_strides: Any, remote_strides: Any, priority: Any, deadline: float | None, after: Any,
                    route: Route) -> Any:
        """A batch that leaves the native path or waits for `after` first:
        _routed() as the coroutine to await (_AWAITED), a TaskTransfer
        running it (_NOWAIT), or run on the loop for a thread."""
        coro = self._routed(op, la, ra, ln, timeout, counts, local_strides, remote_strides, priority, deadline,
                            after, route, lapse=mode in (_BLOCKING, _POSTED))
        if mode == _AWAITED:
            return coro
        if mode == _NOWAIT:
            lengths = np.asarray(ln, dtype=np.uint64)
            nbytes = int((lengths * np.asarray(counts, dtype=np.uint64)).sum()) if counts is not None \
                else int(lengths.sum())
            return TaskTransfer(coro, self.address, nbytes)
        return self._to_loop(coro, mode)

    async def write(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                    timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                    remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                    deadline: float | None = None, after: Any = None) -> None:
        """Writes one batch: entry i copies lengths[i] bytes from local_addrs[i]
        (this engine's registered memory) to remote_addrs[i] (the peer's).
        Returns once every byte has landed in the peer's memory.

        Strided entries (counts, local_strides, remote_strides, all or none):
        entry i moves counts[i] pieces of lengths[i] bytes, piece k from
        local_addrs[i] + k*local_strides[i] to remote_addrs[i] +
        k*remote_strides[i] (e.g. a head slice of every token of a run of
        pages). The engine expands them (vectorised); each piece is its own
        slice on the wire, and errors name the strided entry.

        priority (kvflow.Priority: HIGH, NORMAL, LOW) and deadline (seconds
        from now, an urgency hint; None: none) order this batch's queued
        slices against every other batch's (kvflow.schedule.qos): HIGH
        before NORMAL before LOW, no class starved for longer than the
        engine's qos_aging; within a class the earliest deadline first, then
        the batch with the fewest bytes left (no batch starved longer than
        qos_aging either). timeout still fails it.

        GPU memory on either side (a CUDA region of this engine or of the
        peer) is staged through host bounce buffers (kvflow.paths.staged);
        priority and deadline order its host legs, not its copies.

        after: a CUDA event or stream (torch, cupy, cuda-python) that the
        source is written by: the batch starts once it has completed (for
        a stream, the work queued on it so far), awaited without blocking
        the event loop; a prefill layer's KV is sent when its kernel is done.
        `timeout` covers that wait and the batch together.

        Raises InvalidArgumentError, UnregisteredMemoryError, RemoteAccessError,
        PeerLostError, TransferTimeoutError (asyncio cancellation cancels the batch).
        A peer whose session lapsed (its host was unreachable for a while)
        is waited for while it is dialled again (Peer.alive); PeerLostError
        if it does not come back as the same incarnation.
        """
        if self._lapsed:
            await self._resumed(timeout)
        t = self._submit(OP_WRITE, local_addrs, remote_addrs, lengths, _AWAITED, timeout, counts, local_strides,
                         remote_strides, priority, deadline, after)
        if t is not None:
            await t
        elif self._ctx.inline_turn():
            await asyncio.sleep(0)

    async def read(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                   timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                   remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                   deadline: float | None = None, after: Any = None) -> None:
        """Reads one batch: entry i copies lengths[i] bytes from the peer's
        remote_addrs[i] into local_addrs[i]. Strided entries, priority,
        deadline, after and errors as write(); reads into this engine's GPU
        memory are staged."""
        if self._lapsed:
            await self._resumed(timeout)
        t = self._submit(OP_READ, local_addrs, remote_addrs, lengths, _AWAITED, timeout, counts, local_strides,
                         remote_strides, priority, deadline, after)
        if t is not None:
            await t
        elif self._ctx.inline_turn():
            await asyncio.sleep(0)

    async def _routed(self, op: int, la: Any, ra: Any, ln: Any, timeout: float | None, counts: Any,
                      local_strides: Any, remote_strides: Any, priority: Any, deadline: float | None,
                      after: Any, route: Route, lapse: bool = False) -> None:
        """A batch that waits for a CUDA event first, and then goes where
        `route` (the router's answer) says. lapse: a thread's batch, which
        waits for a lapsed peer as write() does."""
        if lapse and self._lapsed:
            await self._resumed(timeout)
        if after is not None:
            from kvflow.gpu.copy import wait_after
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                # the timeout covers the wait: a stream that never finishes (a
                # kernel stuck on this very transfer, say) must not hang the call
                await asyncio.wait_for(wait_after(after), timeout)
            except asyncio.TimeoutError:
                raise TransferTimeoutError(f"{'write' if op == OP_WRITE else 'read'} to {self.address}: its "
                                           f"after= was not done within {timeout} s", peer=self.address) from None
            if timeout is not None:             # and the batch gets what is left of it
                timeout = max(timeout - (loop.time() - started), 1e-3)
        if route is NATIVE:
            t = self._submit(op, la, ra, ln, _AWAITED, timeout, counts, local_strides, remote_strides, priority,
                             deadline, route=NATIVE)
            if t is not None:
                await t
            return
        if counts is not None or local_strides is not None or remote_strides is not None:
            la, ra, ln, _ = _expanded(la, ra, ln, counts, local_strides, remote_strides)
        if route.path is not Path.RELAYED:          # STAGED, IPC
            await self._staged_op(op, la, ra, ln, timeout, route.reach)
            return
        relay = self._ctx.router.relay
        assert relay is not None and route.via is not None

        async def direct(l: Any, r: Any, n: Any) -> None:      # around a member that was lost
            leg = self._route(OP_WRITE, l, r, relay=False)
            if leg is NATIVE:
                await self._host_op(OP_WRITE, l, r, n)
            else:
                await self._staged_op(OP_WRITE, l, r, n, None, leg.reach)

        try:
            await asyncio.wait_for(relay.write(self.address, route.via, la, ra, ln, direct), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"relayed write to {self.address} timed out after {timeout} s",
                                       peer=self.address) from None

    async def _host_op(self, op: int, l: Any, r: Any, n: Any) -> None:
        """One host-memory batch on the native path, no rerouting: the legs
        of a staged transfer, and a relayed write's parts written around a
        lost member."""
        t = self._submit(op, np.asarray(l, dtype=np.uint64), np.asarray(r, dtype=np.uint64),
                         np.asarray(n, dtype=np.uint64), _AWAITED, route=NATIVE)
        if t is not None:
            await t

    async def _staged_op(self, op: int, la: Any, ra: Any, ln: Any, timeout: float | None, reach: str) -> None:
        """GPU memory on either side (kvflow.paths.staged): CUDA IPC copies
        where `reach` (the router's) allows them, else staged."""
        gpu = self._ctx.router.staging()

        async def write(l: Any, r: Any, n: Any) -> None:
            await self._host_op(OP_WRITE, l, r, n)

        async def read(l: Any, r: Any, n: Any) -> None:
            await self._host_op(OP_READ, l, r, n)

        run = gpu.write(self, la, ra, ln, write, self._gpu_table, reach) if op == OP_WRITE else \
            gpu.read(self, la, ra, ln, read, self._gpu_table, reach)
        try:
            await asyncio.wait_for(run, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"staged transfer to {self.address} timed out after {timeout} s",
                                       peer=self.address) from None

    def write_nowait(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                     timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                     remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                     deadline: float | None = None, after: Any = None) -> "Transfer | TaskTransfer":
        """Starts a write and returns its Transfer (awaitable, cancellable:
        its slices still queued are dropped at once). Argument and
        validation errors raise here; transfer errors on await (for GPU
        memory, staged, and with `after`, all of them on await)."""
        return self._submit(OP_WRITE, local_addrs, remote_addrs, lengths, _NOWAIT, timeout, counts, local_strides,
                            remote_strides, priority, deadline, after)

    def read_nowait(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                    timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                    remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                    deadline: float | None = None, after: Any = None) -> "Transfer | TaskTransfer":
        """Starts a read and returns its Transfer."""
        return self._submit(OP_READ, local_addrs, remote_addrs, lengths, _NOWAIT, timeout, counts, local_strides,
                            remote_strides, priority, deadline, after)

    # ------------------------------------------------------------ blocking callers
    def write_blocking(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                       timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                       remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                       deadline: float | None = None, after: Any = None) -> None:
        """write() for a thread that is not the engine's event loop (a
        blocking API such as the Mooncake-compatible one): returns once
        every byte landed. Where the provider allows it (local, tcp) the
        batch is submitted and waited for on the calling thread, with the
        GIL released while it waits: neither the submission nor the
        completion goes through the loop. Otherwise (rdma, a range the
        peer's table does not show yet: the peer is asked again) it runs as
        write() on the loop. Raises what write() raises; TransferTimeoutError
        after `timeout` seconds (None: no limit), once the batch drained
        (at most CANCEL_GRACE more seconds); KVFlowError when called on the
        loop's own thread (it would block the loop: await write()).
        Strided entries, priority, deadline and after as write(): a batch
        with `after`, or one the router sends off the native path (GPU
        memory: staged or CUDA IPC; relayed), runs on the loop while this
        thread waits."""
        self._submit(OP_WRITE, local_addrs, remote_addrs, lengths, _BLOCKING, timeout, counts, local_strides,
                     remote_strides, priority, deadline, after)

    def read_blocking(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                      timeout: float | None = None, counts: Any = None, local_strides: Any = None,
                      remote_strides: Any = None, priority: Priority = Priority.NORMAL,
                      deadline: float | None = None, after: Any = None) -> None:
        """read() for a thread that is not the engine's event loop; as
        write_blocking()."""
        self._submit(OP_READ, local_addrs, remote_addrs, lengths, _BLOCKING, timeout, counts, local_strides,
                     remote_strides, priority, deadline, after)

    def _detached(self, op: int, la: Any, ra: Any, ln: Any, timeout: float | None, prio: int,
                  deadline_ns: int, first: Any) -> bool:
        """The calling thread's own path (write_blocking): True once done,
        False where the loop must do it (the peer's table lacks the range)."""
        core = self._ctx.core
        try:
            status, batch, aux = self._channel.submit_detached(op, la, ra, ln, prio, deadline_ns)
            if status == EREMOTE:
                return False       # the loop path refreshes the peer's regions and retries
            if status:
                raise status_error(status, peer=self.address, op=op,
                                   index=aux if first is None else entry_of(first, aux))
            if batch == 0:
                return True        # completed inline
            progress = self._provider.poller(self._channel)
            if progress is not None and aux <= SPIN_BYTES:
                # a small batch's acks are read right here (tcp: a round
                # trip away) rather than by the loop, which would then wake
                # this thread: two wake-ups saved
                progress(batch, min(timeout, DETACHED_SPIN) if timeout else DETACHED_SPIN)
            rc, status, entry = core.wait_detached(batch, timeout or 0.0, DETACHED_SPIN)
            if rc:
                core.cancel(batch)
                core.wait_detached(batch, CANCEL_GRACE)
                raise TransferTimeoutError(
                    f"{'write' if op == OP_WRITE else 'read'} to {self.address} timed out after {timeout:g} s",
                    peer=self.address)
        except RuntimeError:       # the engine closed meanwhile
            raise PeerLostError(f"peer {self.address}: the engine was closed", peer=self.address) from None
        if status:
            raise batch_error(self._ctx.batches, self.address, op, status, entry, first)
        return True

    # ------------------------------------------------------------ posted from a thread, polled there
    def post_write(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                   counts: Any = None, local_strides: Any = None, remote_strides: Any = None,
                   priority: Priority = Priority.NORMAL, deadline: float | None = None,
                   after: Any = None) -> PostedTransfer:
        """Starts a write from a thread that is not the engine's loop and
        returns at once: poll() the PostedTransfer for its completion (NIXL's
        post-then-poll; kvflow.engine.posted). Raises what write() raises
        for bad input, before anything moves. Strided entries, priority,
        deadline and after as write() (a batch with `after`, or off the
        native path, runs on the loop; the PostedTransfer follows it). No
        `timeout`: this returns before anything is waited for, and the
        thread that polls owns the waiting (PostedTransfer.wait(timeout)
        bounds it, cancel() stops the batch)."""
        return self._submit(OP_WRITE, local_addrs, remote_addrs, lengths, _POSTED, None, counts, local_strides,
                            remote_strides, priority, deadline, after)

    def post_read(self, local_addrs: Any, remote_addrs: Any, lengths: Any, *,
                  counts: Any = None, local_strides: Any = None, remote_strides: Any = None,
                  priority: Priority = Priority.NORMAL, deadline: float | None = None,
                  after: Any = None) -> PostedTransfer:
        """post_write() for a read."""
        return self._submit(OP_READ, local_addrs, remote_addrs, lengths, _POSTED, None, counts, local_strides,
                            remote_strides, priority, deadline, after)

    # ------------------------------------------------------------ notifications
    async def notify(self, data: bytes) -> None:
        """Sends `data` to the peer's engine.notifications(). Every write to
        this peer that completed before the call has landed before the peer
        sees the notification. Raises PeerLostError if the peer is gone.

        Over rdma, a notification up to 4 KiB is an RDMA SEND on the data
        path (no TCP hop); larger ones use the control connection."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError("notify() takes bytes", peer=self.address)
        if self._lapsed:
            await self._resumed()
        if self._closed or self._session.lost:
            raise PeerLostError(f"peer {self.address} is gone", peer=self.address)
        provider = self._provider
        if provider is not None and provider.caps.data_notify:
            if await provider.notify(self.link, self._channel, bytes(data)):
                return
        self._session.send({"t": "notify", "data": bytes(data)})
        try:
            await self._session.drain()
        except (ConnectionError, RuntimeError) as e:
            raise PeerLostError(f"notify to {self.address}: {e}", peer=self.address) from None

    async def close(self) -> None:
        """Closes the connection to the peer; in-flight transfers fail with
        PeerLostError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._resume_task is not None:
            self._resume_task.cancel()
        self._ctx.forget(self)
        self._ctx.router.forget_peer(self.address)      # its CUDA IPC mappings
        self._fire_lost()
        self._close_channel()
        self._channel = ClosedChannel(self.address)
        await self._session.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("alive" if self.alive else "lost")
        return f"<kvflow.Peer {self.address} via {self.transport or '?'} {state}>"


def _expanded(la: Any, ra: Any, ln: Any, counts: Any, local_strides: Any,
              remote_strides: Any) -> tuple[Any, Any, Any, Any]:
    """Strided entries (some of counts and the strides given) as plain
    columns, and the first piece of each entry (for error messages)."""
    if counts is None or local_strides is None or remote_strides is None:
        raise InvalidArgumentError("strided entries need counts, local_strides and remote_strides together")
    return expand_strided(la, ra, ln, counts, local_strides, remote_strides)
