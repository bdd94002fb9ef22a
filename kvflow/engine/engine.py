"""Engine: this process's end of kvflow, composed of its parts: the native
core, the control server (peer-to-peer metadata: each engine serves its own
descriptor), the providers (local, rdma, tcp), registered memory, peers,
the batch table and notifications. It decides nothing a part can decide:
it walks its providers in preference order and asks them."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from kvflow import _core
from kvflow.control.client import dial
from kvflow.control.descriptor import Descriptor, regions_to_wire
from kvflow.control.server import ControlServer
from kvflow.control.wire import encode
from kvflow.engine.blocks import Blocks
from kvflow.engine.metrics import engine_metrics
from kvflow.engine.context import INLINE_TURN_NS, PeerContext  # noqa: F401 (INLINE_TURN_NS: re-exported)
from kvflow.engine.peer import Peer
from kvflow.engine.options import EngineOptions, is_address, split_address
from kvflow.engine.router import INBOX_REPLIES, PathContext, Router
from kvflow.engine.transfer import DRAIN_GRACE, BatchTable
from kvflow.errors import InvalidArgumentError, KVFlowError, PeerLostError, PeerUnreachableError, \
    ProviderUnavailableError, RegionBusyError
from kvflow.memory import CUDA, LOCAL_WRITE, Access, Region, RemoteRegion, buffer_span
from kvflow.metadata import EngineRecord, MetadataClient, open_store
from kvflow.providers.base import Provider, ProviderContext
from kvflow.providers.local import LocalProvider
from kvflow.providers.rdma.provider import RdmaProvider
from kvflow.providers.tcp import TcpProvider
from kvflow.regions import RegionTable, host_table
from kvflow.schedule.credits import window_bytes
from kvflow.schedule.qos import aging_ns
from kvflow.topology import Topology, cached_host_topology
from kvflow.tasks import retrieve

__all__ = ["Engine", "PROVIDERS"]

log = logging.getLogger("kvflow")

# The providers, in the order protocols=None tries them: same host first
# (memcpy or cross-memory attach beat any NIC loopback), then rdma, then tcp.
_PROVIDER_CLASSES: tuple[type[Provider], ...] = (LocalProvider, RdmaProvider, TcpProvider)
PROVIDERS = tuple(c.name for c in _PROVIDER_CLASSES)
# every reply type a provider's request() may get back
_REPLIES = frozenset().union(*(c.replies for c in _PROVIDER_CLASSES), INBOX_REPLIES)
# (INLINE_TURN_NS, imported above from kvflow.engine.context, was defined here:
# awaited batches that finish inline yield at least this often.)
# How long deregister() waits for a same-host peer's copy still inside the
# region (local provider: a copy cannot be cut off, as tcp cuts a stalled
# payload's connection). A copy holds the region for one run of slices
# (about a MiB: well under a millisecond); only a copier process stopped,
# or not scheduled, in the middle of one is still inside after this, and
# then deregister() raises RegionBusyError instead of blocking the loop.
LOCAL_FENCE_WAIT = 1.0

# This process's running engines by address (for the same-process check).
_live_engines: "weakref.WeakValueDictionary[str, Engine]" = weakref.WeakValueDictionary()


def _process_core(address: str) -> Any:
    """The native core of this process's running engine at `address`
    (None: none): a same-process local channel enters its region fence."""
    other = _live_engines.get(address)
    return other._core if other is not None and not other._closed else None


def _same_process(address: str, desc: Descriptor) -> bool:
    """True only if `address` is an engine of this very process: decided
    from our own registry, never from what the descriptor claims (a peer
    could replay another engine's identity)."""
    other = _live_engines.get(address)
    return other is not None and not other._closed and other._incarnation == desc.incarnation


class Engine:
    """kvflow's engine. Use as `async with Engine(...) as engine:`.

    listen: "host:port" of the handshake server (port 0 picks one);
    options: an EngineOptions (kvflow.engine.options, where every option is
    told), or its fields as keyword arguments (`Engine(protocols=["tcp"],
    keepalive=2)`), or both (the keywords on top of `options`). Raises
    InvalidArgumentError for a value that is wrong, TypeError for a keyword
    that is no option.
    """

    def __init__(self, listen: str = "127.0.0.1:0", *, options: EngineOptions | None = None,
                 **kwargs: Any) -> None:
        o = EngineOptions.of(options, kwargs)
        protocols = o.protocols
        if protocols is not None:
            protocols = tuple(protocols)
            unknown = [p for p in protocols if p not in PROVIDERS]
            if unknown or not protocols:
                raise InvalidArgumentError(
                    f"unknown protocol(s) {unknown or protocols!r}; available: {', '.join(PROVIDERS)}")
        o = self.options = o.resolved()
        self._tcp_options = o.tcp()
        self._rdma_options = o.rdma()
        assert o.keepalive is not None
        self.keepalive = o.keepalive
        self._store = open_store(o.metadata)
        self.name = o.name
        self._metadata_ttl = float(o.metadata_ttl)
        self._metadata: MetadataClient | None = None
        self._listen = listen
        self.protocols = protocols
        self._secret = o.secret
        self.location: str = o.location or "cpu"
        self.topology: Topology | None = None
        self._local_workers = o.local_workers
        self._qos_aging_ns = aging_ns(o.qos_aging)
        self.scheduling = o.scheduling
        self.receive_window = window_bytes(o.receive_window)
        self._inline_limit = o.inline_limit
        self._advertise = o.advertise
        self._local: LocalProvider | None = None
        self._tcp: TcpProvider | None = None
        self._rdma: RdmaProvider | None = None
        self._providers: dict[str, Provider] = {}      # running, by name, in preference order
        self._unavailable: dict[str, str] = {}         # name -> why it does not run here
        self._core: Any = None
        self._batches: BatchTable | None = None
        self._completion_fd = -1
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: ControlServer | None = None
        self._regions: dict[int, Region] = {}
        self._host_table = RegionTable()      # _regions' host ones, by address (_regions_changed)
        # deregistered regions a same-host peer's copy was still inside
        # when deregister() gave up waiting (RegionBusyError): their
        # buffers are kept referenced until a later deregister() finds
        # them quiet
        self._draining: dict[int, Region] = {}
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Task[Peer]] = {}
        self._notifications: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        self._generation = 0
        self._incarnation = int.from_bytes(os.urandom(8), "little") >> 1
        self.address = ""
        self.data_address = ""
        self._staging_bytes = int(o.staging_bytes)
        self._relay_group = o.relay
        # each batch's path (kvflow.engine.router): it makes and holds the
        # GPU memory (when GPU memory is first registered) and the relay
        # member, giving them what they may use of this engine
        rw = Access.READ | Access.WRITE
        paths = PathContext(
            register_host=lambda a, n, nm, access=rw: self._register_host(a, n, nm, access, True, None),
            deregister=self.deregister, holds_host=self._holds_host,
            host_spans=lambda: [(r.addr, r.end) for r in self._host_table],
            gpu_regions=lambda: self._gpu.local if self._gpu is not None else None,
            # not register(): the engine is not running until start() returns
            register_device=lambda a, n, nm: self._register((a, n), nm, Access(0)), connect=self.connect)
        self._router = Router(paths, _same_process, self._staging_bytes)
        self._peer_ctx: PeerContext | None = None      # what peers may use of this engine (start())
        self._started = False
        self._closed = False

    @property
    def _gpu(self) -> Any:
        """The GPU memory (kvflow.paths.staged.GpuMemory), or None: the router's."""
        return self._router.gpu

    @_gpu.setter
    def _gpu(self, gpu: Any) -> None:
        self._router.gpu = gpu

    @property
    def _relay(self) -> Any:
        """The relay membership (kvflow.paths.relay.Relay), or None: the router's."""
        return self._router.relay

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Starts the native core, the control server, the providers (the
        tcp data listeners, the rdma devices) and the metadata client."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        host, port = split_address(self._listen)
        auto = self._tcp_options.auto
        self.topology = cached_host_topology(fresh_addresses=auto)
        self._core = _core.Core(self._local_workers)
        self._core.set_incarnation(self._incarnation)
        self._core.set_sched_age(self._qos_aging_ns)
        self._core.set_sched_fifo(self.scheduling == "fifo")
        self._core.set_liveness_grace(self.keepalive)
        if self.receive_window and not self._core.set_receive_window(self.receive_window):
            raise MemoryError("kvflow: cannot allocate the receive window's pool")
        self._batches = BatchTable(self._core, self._loop, self._abort_batch, self._device_names)
        self._peer_ctx = PeerContext(self._loop, self._core, self._batches, self._router, self.keepalive,
                                     redial=self._redial, forget=self._forget_peer, connect=self.connect)
        ctx = ProviderContext(self._core, self._loop, self._batches, self._deliver, self._rekeyed,
                              self.topology, self.location, self.keepalive, _same_process,
                              process_core=_process_core, receive_window=self.receive_window)
        self._local = LocalProvider(ctx, inline_limit=self._inline_limit)
        self._tcp = TcpProvider(ctx, self._tcp_options, host=host, advertise=self._advertise)
        self._providers = {self._local.name: self._local, self._tcp.name: self._tcp}
        self._server = ControlServer(secret=self._secret, describe=self.descriptor, add_token=self._core.add_token,
                                     remove_token=self._remove_token, deliver=self._deliver, handlers={},
                                     drop_session=self._drop_session)
        try:
            bound = await self._server.start(host, port)
            adv = self._advertise or (host if host not in ("0.0.0.0", "::") else socket.gethostname())
            self.address = f"{adv}:{bound}"
            await self._tcp.start()
            self.data_address = "%s:%d" % self._tcp.endpoints[0]
            _live_engines[self.address] = self
            self._completion_fd = self._core.fileno()
            self._loop.add_reader(self._completion_fd, self._batches.on_completions)
            self._rdma = self._start_optional(RdmaProvider, lambda: RdmaProvider(ctx, self._rdma_options))
            if self._rdma is not None:
                running = {**self._providers, self._rdma.name: self._rdma}
                self._providers = {n: running[n] for n in PROVIDERS if n in running}
            if self._relay_group is not None:
                self._router.join(self._relay_group, self.address)
            self._server.handlers.update(self._control_handlers())
        except OSError as e:
            await self._teardown()
            raise KVFlowError(f"cannot listen on {self._listen}: {e}", errno=e.errno) from e
        except BaseException:                # e.g. a bad KVFLOW_RDMA_ACK_TIMEOUT
            await self._teardown()
            raise
        self._started = True
        if self._store is not None:
            self.name = self.name or self.address
            self._metadata = MetadataClient(self._store, self.name, self._metadata_ttl, self._record)
            await self._metadata.start()

    def _start_optional(self, cls: type[Provider], make: Callable[[], Any]) -> Any:
        """A provider that may be absent (not among `protocols`, not built,
        no device): the provider, or None with the reason kept."""
        if self.protocols is not None and cls.name not in self.protocols:
            self._unavailable[cls.name] = f"{cls.name} is not among this engine's protocols"
            return None
        try:
            return make()
        except ProviderUnavailableError as e:
            self._unavailable[cls.name] = str(e)
            level = logging.WARNING if self.protocols is not None else logging.DEBUG
            log.log(level, "kvflow: %s unavailable: %s", cls.name, e)
            return None

    def _control_handlers(self) -> dict[str, Callable[[str, Any, dict[str, Any]], dict[str, Any]]]:
        """Providers' control messages: answered by the provider where it
        runs, else with its error reply saying why it does not."""
        handlers = {}
        for cls in _PROVIDER_CLASSES:
            provider = self._providers.get(cls.name)
            for kind, error in cls.control.items():
                if provider is not None:
                    handlers[kind] = provider.on_control
                else:
                    why = f"no {cls.name} on {self.address}: {self._unavailable.get(cls.name, 'not started')}"
                    handlers[kind] = lambda peer, session, msg, error=error, why=why: {"t": error, "message": why}
        handlers.update(self._router.control_handlers(self.address))    # staging, the relay
        return handlers

    def _device_names(self) -> list[str] | None:
        for p in self._providers.values():
            names = p.device_names()
            if names is not None:
                return names
        return None

    async def close(self) -> None:
        """Closes peers (their in-flight transfers fail with PeerLostError),
        servers and the native core. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._peer_ctx is not None:
            self._peer_ctx.closed = True     # a peer lost from now on is not dialled again
        if _live_engines.get(self.address) is self:
            del _live_engines[self.address]
        if self._metadata is not None:
            await self._metadata.close()     # first: nobody should resolve to a closing engine
        for task in list(self._connecting.values()):
            task.cancel()
        for peer in list(self._peers.values()):
            await peer.close()
        await self._teardown()
        self._notifications.put_nowait(None)

    async def _teardown(self) -> None:
        await self._router.stop()               # first: no member routes through us any more
        if self._server is not None:
            await self._server.close()
        if self._tcp is not None:
            await self._tcp.close()
        if self._core is not None:
            # (close() has closed the peers already.) Unregister before the eventfd is closed: a closed descriptor
            # silently leaves epoll, and the next engine's eventfd may reuse
            # its number while the selector still maps it to us.
            if self._completion_fd >= 0:
                self._loop.remove_reader(self._completion_fd)
                self._completion_fd = -1
            if self._rdma is not None:
                # after the peers (their QPs) and before the core: the
                # device workers complete batches in the core's pool
                rdma, self._rdma = self._rdma, None
                self._providers.pop(rdma.name, None)
                await rdma.close()
            self._core.close()      # closes channels: their batches complete with errors
        if self._batches is not None:
            self._batches.fail_all(lambda peer: PeerLostError(f"engine {self.address} closed", peer=peer))
        # The staging and relay memory last: until the core closed, its
        # channels could be receiving into it or sending from it.
        self._router.close()

    def _remove_token(self, token: bytes) -> None:
        if self._core is not None:
            self._core.remove_token(token)

    def _drop_session(self, session: Any) -> None:
        for p in self._providers.values():
            p.drop_session(session)
        self._router.drop_session(session)

    def _deliver(self, peer: str, data: bytes) -> None:
        self._notifications.put_nowait((peer, data))

    # ------------------------------------------------------------ memory
    def register(self, buffer: Any, *, name: str | None = None,
                 access: Access = Access.READ | Access.WRITE) -> Region:
        """Makes `buffer` reachable by peers (with `access`) and usable as
        the local side of transfers. Raises InvalidArgumentError for a buffer
        that is not contiguous memory, overlaps a registered region, or is
        read-only while WRITE access is asked."""
        self._check_open()
        return self._register(buffer, name, access)

    def _register(self, buffer: Any, name: str | None, access: Access) -> Region:
        """register() without the running check: for what the engine
        registers of its own while it starts (a relay member's device lanes)."""
        span = buffer_span(buffer)
        addr, length, writable, keep = span.addr, span.length, span.writable, span.keep
        access = Access(access)
        if (access & Access.WRITE) and not writable:
            raise InvalidArgumentError("buffer is read-only: register it with access=Access.READ")
        if name is not None and any(r.name == name for r in self._regions.values()):
            raise InvalidArgumentError(f"a region named {name!r} is already registered")
        if span.kind == CUDA:
            return self._register_gpu(span, name, access)
        return self._register_host(addr, length, name, access, writable, keep)

    def _register_host(self, addr: int, length: int, name: str | None, access: Access, writable: bool,
                       keep: Any) -> Region:
        rid = self._core.add_region(addr, length, int(access) | (LOCAL_WRITE if writable else 0))
        if not rid:
            raise InvalidArgumentError(
                f"region {addr:#x}+{length} overlaps a registered region or overflows")
        rkeys: tuple[int, ...] = ()
        took = 0.0
        done: list[Provider] = []
        try:
            for p in self._providers.values():
                keys = p.register(rid, addr, length, access, writable)
                done.append(p)
                if keys is not None:
                    self._core.set_keys(rid, list(keys.lkeys))
                    rkeys, took = tuple(keys.rkeys), keys.seconds
        except BaseException:
            for p in done:
                p.deregister(rid)
            self._core.remove_region(rid, LOCAL_FENCE_WAIT)     # no peer knew of it: nobody inside
            raise
        region = Region(addr, length, name, access, rid, keep, rkeys, took)
        self._regions[rid] = region
        self._regions_changed()
        return region

    def _register_gpu(self, span: Any, name: str | None, access: Access) -> Region:
        """GPU memory: kept out of the native core's tables (no CPU path may
        touch it); transfers that reach it are staged or copied (kvflow.paths)."""
        self._gpu_ids -= 1
        region = self._router.add_gpu_region(span, name, access, self._gpu_ids)
        self._regions[region.id] = region
        self._regions_changed()
        return region

    _gpu_ids = 0        # GPU regions' ids: negative, apart from the native core's

    def relay_stats(self) -> dict[str, int] | None:
        """Bytes this engine's writes sent through other members of its
        relay group, bytes it forwarded for them, leases it lends now; None
        without a relay group."""
        return self._router.relay_stats()

    def staging_stats(self) -> dict[str, dict[str, int] | None]:
        """The host bounce slots of the staged paths, per pool: "outgoing"
        (the slots this engine's staged transfers from or into GPU memory
        fill and drain), "inbox" (the slots it lends peers that write into
        or read from its GPU memory), "relay_inbox" (the slots a relay
        member lends the other members); None for a pool this engine has
        not made (no GPU memory yet, no relay group). Each: slot_bytes,
        slots, free and in_use (now; they add up to slots), max_in_use,
        allocations (of its memory: 1 once made), fills and drains (slots
        the pipeline filled and drained), and for the inboxes leases (held
        now). Raises nothing; engine.metrics()["staging"] is the same."""
        return self._router.staging_stats()

    def _holds_host(self, addr: int, n: int) -> bool:
        """Whether [addr, addr+n) lies in one of this engine's host regions."""
        return self._host_table.holds(addr, n)

    def deregister(self, region: Region) -> None:
        """Removes a region; returns once no peer writes into it or reads
        from it any more (its memory may be reused or freed then): a tcp
        payload still moving after 20 ms has its connection cut off, an
        rdma NIC refuses its keys, and a same-host peer's copy (local
        provider) is waited for, up to LOCAL_FENCE_WAIT.

        Raises InvalidArgumentError when the region is not registered, and
        RegionBusyError when a same-host peer's copy was still inside after
        the wait (a process stopped in the middle of one): the region is
        deregistered all the same, but its memory is not free; the engine
        keeps the buffer referenced, and calling deregister(region) again
        waits again (returning once the copier left, or its process is
        gone)."""
        self._check_open()
        if region.id in self._draining:
            self._wait_quiet(region, self._core.quiesce_region(region.id, LOCAL_FENCE_WAIT))
            return
        if self._regions.pop(region.id, None) is None:
            raise InvalidArgumentError(f"region {region.addr:#x}+{region.length} is not registered")
        if region.kind == CUDA:
            self._router.remove_gpu_region(region)
            self._regions_changed()
            return
        inside = self._core.remove_region(region.id, LOCAL_FENCE_WAIT)
        for p in self._providers.values():
            p.deregister(region.id)     # the NICs refuse its keys from now on
        self._regions_changed()
        self._wait_quiet(region, inside)

    def _wait_quiet(self, region: Region, inside: list[int]) -> None:
        """After a deregister's wait: `inside` are the processes whose
        copies were still in the region (RegionBusyError; the region is
        kept in _draining until a wait finds none)."""
        if not inside:
            self._draining.pop(region.id, None)
            return
        self._draining[region.id] = region
        raise RegionBusyError(
            f"region {region.addr:#x}+{region.length} is deregistered, but a same-host peer's copy "
            f"(pid {', '.join(map(str, inside))}) was still inside it after {LOCAL_FENCE_WAIT:g} s: "
            "do not reuse its memory before deregister(region) returns", pids=inside)

    def blocks(self, addrs: Any, lengths: Any) -> Blocks:
        """A list of blocks of this engine's registered memory (for
        peer.prepare(); kvflow.engine.blocks), each checked once to lie
        inside one region (UnregisteredMemoryError naming the first that
        does not). `lengths`: one per block, or one int for all."""
        return Blocks.local(self._regions.values(), addrs, lengths)

    @property
    def regions(self) -> list[Region]:
        return sorted(self._regions.values(), key=lambda r: r.addr)

    def _remote_regions(self) -> list[RemoteRegion]:
        return [RemoteRegion(r.addr, r.length, r.name, r.access, r.rkeys, r.kind, r.device, r.ipc)
                for r in self.regions]

    def _regions_changed(self) -> None:
        # every change of _regions ends here, on the loop thread, before
        # anything else on it may look a region up
        self._host_table = host_table(self._regions.values())
        self._generation += 1
        if self._metadata is not None:
            self._metadata.changed()
        # Peers in this process copy with memcpy: update their copy of our
        # table now, not when the pushed frame arrives, so that a batch
        # submitted after deregister() returns is refused whole at once
        # (what is already queued meets the region fence instead).
        mine = None
        for other in list(_live_engines.values()):
            peer = other._peers.get(self.address)
            if peer is not None and other._router.reach(peer._provider, self.address, peer.descriptor) == "process":
                mine = mine if mine is not None else self._remote_regions()
                peer._set_regions(mine)
        if self._server is None or not self._server.sessions:
            return
        msg = {"t": "regions", "generation": self._generation,
               "regions": regions_to_wire(self._remote_regions())}
        for p in self._providers.values():
            if p.pushed:
                # its part changes at run time (rdma: the devices in service
                # and the probe keys, when a device comes back;
                # Peer._on_regions; absent: unchanged)
                msg[p.name] = p.part()
        self._server.push(encode(msg))

    def _rekeyed(self, keys: dict[int, tuple[list[int], list[int]]]) -> None:
        """A provider registered every region again on a device that came
        back: region id -> (lkeys, rkeys) per device. The native table gets
        the lkeys, the regions the rkeys, and peers both (pushed)."""
        for rid, (lkeys, rkeys) in keys.items():
            region = self._regions.get(rid)
            if region is not None:
                self._core.set_keys(rid, lkeys)
                self._regions[rid] = replace(region, rkeys=tuple(rkeys))
        self._regions_changed()

    def descriptor(self) -> Descriptor:
        """What this engine tells its peers about itself: every running
        provider's part, its regions and its topology."""
        fields: dict[str, Any] = {}
        parts: dict[str, Any] = {}
        for p in self._providers.values():
            fields.update(p.describe())
            if (part := p.part()) is not None:
                parts[p.name] = part
        return Descriptor(address=self.address, incarnation=self._incarnation, regions=self._remote_regions(),
                          generation=self._generation, topology=self.topology, location=self.location,
                          relay=self._relay.describe() if self._relay is not None else None, providers=parts,
                          **fields)

    def _record(self) -> EngineRecord:
        return EngineRecord(self.name or self.address, self.address, self._incarnation, self.descriptor())

    # ------------------------------------------------------------ metadata
    def _metadata_client(self) -> MetadataClient:
        self._check_open()
        if self._metadata is None:
            raise InvalidArgumentError("this engine has no metadata server (Engine(metadata=...))")
        return self._metadata

    async def lookup(self, name: str) -> EngineRecord:
        """The record `name` published on the metadata server. Raises
        PeerUnreachableError (no such name, or the server unreachable: within
        kvflow.metadata.STORE_TIMEOUT), ProtocolError (a malformed record),
        InvalidArgumentError (no metadata server configured)."""
        return await self._metadata_client().lookup(name)

    async def directory(self) -> dict[str, EngineRecord]:
        """Every engine published on the metadata server, by name (malformed
        records are logged and left out). Raises as lookup() does."""
        return await self._metadata_client().directory()

    async def _connect_by_name(self, name: str, timeout: float) -> Peer:
        deadline = self._loop.time() + timeout
        try:
            record = await asyncio.wait_for(self._metadata_client().lookup(name), timeout)
        except asyncio.TimeoutError:
            raise PeerUnreachableError(f"resolving {name!r} timed out after {timeout:g} s", peer=name) from None
        # The record only says where to go: a cached peer whose handshake
        # saw another incarnation belongs to an engine that has restarted
        # since (its memory is gone), so it is dropped, not reused. The new
        # handshake's descriptor is the one transfers use.
        cached = self._peers.get(record.address)
        if cached is not None and cached.descriptor.incarnation != record.incarnation:
            log.info("kvflow: %s (%s) has restarted (incarnation %x, was %x): reconnecting",
                     name, record.address, record.incarnation, cached.descriptor.incarnation)
            await cached.close()
        peer = await self.connect(record.address, timeout=max(0.0, deadline - self._loop.time()))
        if peer.descriptor.incarnation != record.incarnation:
            log.info("kvflow: %s (%s): the handshake says incarnation %x, the record %x; "
                     "using the handshake's", name, record.address, peer.descriptor.incarnation,
                     record.incarnation)
        return peer

    # ------------------------------------------------------------ completions
    def _abort_batch(self, peer: str, batch_id: int) -> None:
        """A cancelled batch still on the wire after the drain grace: the
        peer's provider makes sure none of its bytes can land after the
        caller was told it failed (tcp resets the connections holding it;
        the other providers finish or fail their slices in bounded time)."""
        p = self._peers.get(peer)
        if p is not None and p._abort_batch(batch_id):
            log.warning("kvflow: %s: a cancelled batch was still on the wire after %g s: reset the "
                        "connections carrying it", peer, DRAIN_GRACE)

    def pending_batches(self) -> int:
        """Batches awaited through a Transfer now (the BatchTable: submitted
        and not finished, or finished and not reaped yet)."""
        return len(self._batches) if self._batches is not None else 0

    def devices(self) -> list[dict[str, Any]]:
        """The devices the providers opened, one row each with its
        provider's name (rdma: index, name, state "up"/"down"/"gone", why,
        down_since, errors, probe_rkey, worker_posts, software); [] for an
        engine with none."""
        return [{"provider": p.name, **row} for p in self._providers.values() for row in p.device_rows()]

    def counters(self) -> dict[str, int]:
        """Live native resources (sockets, threads, slices, batches in flight)."""
        return self._core.counters() if self._core is not None else {}

    def metrics(self) -> dict[str, Any]:
        """Engine-level numbers (kvflow.engine.metrics; docs/metrics.md):
        per peer, its provider and per operation batches, bytes, failures
        by kind and latency (mean, p50, p99, the histogram), its tcp
        connections (bytes, slices moved when one failed, rebuilds); what
        is in flight; the native resources; the receive window's pool; the
        staged paths' host slots (staging_stats()). Batches are counted by
        the native core as they finish, so the numbers cost no Python per
        batch; `kvflow.metrics` exports them to Prometheus."""
        return engine_metrics(self)

    def receive_window_stats(self) -> dict[str, int] | None:
        """The receive window's pool (None without one, or before start()):
        window, free, held (granted to initiators and not landed or handed
        back yet), max_held (the most held at once: never above the
        window), grants, granted_bytes, recalls, returned_bytes, asks,
        holders (data connections), waiting, and violations (payload bytes
        that landed without credit covering them: 0 unless a peer ignores
        credits)."""
        return self._core.receive_window_stats() if self._core is not None else None

    # ------------------------------------------------------------ notifications
    async def notifications(self) -> AsyncIterator[tuple[str, bytes]]:
        """Yields (peer_address, data) for every peer.notify(); ends when the
        engine closes."""
        while True:
            item = await self._notifications.get()
            if item is None:
                self._notifications.put_nowait(None)   # let other iterators end too
                return
            yield item

    # ------------------------------------------------------------ peers
    async def connect(self, address: str, *, timeout: float = 10.0) -> Peer:
        """Connects to the engine at `address` ("host:port"); cached per
        address. With a metadata server, anything not of the form host:port
        is a name, resolved there first (host:port never is: connecting by
        address needs no server). Raises PeerUnreachableError (also for an
        unpublished name or an unreachable metadata server),
        AuthenticationError, ProtocolError, ProviderUnavailableError."""
        self._check_open()
        if self._metadata is not None and not is_address(address):
            return await self._connect_by_name(address, timeout)
        peer = self._peers.get(address)
        if peer is not None and peer.alive:
            return peer
        if peer is not None and peer._lapsed:
            try:
                await asyncio.wait_for(peer._resumed(), timeout)
                return peer
            except (PeerLostError, asyncio.TimeoutError):
                pass                 # gone, or restarted: a new Peer below
        if peer is not None:
            await peer.close()
        # One connection attempt per address, shared by every caller: it
        # runs as its own task so that a caller that is cancelled (a request
        # aborted mid-connect) does not cancel it for the others.
        pending = self._connecting.get(address)
        if pending is None:
            pending = self._loop.create_task(self._connect_shared(address, timeout))
            pending.add_done_callback(retrieve)      # every waiter may have gone
            self._connecting[address] = pending
        return await asyncio.shield(pending)

    def peer(self, address: str) -> Peer | None:
        """The connected peer at `address` (as connect() was given it), or
        None when there is none or it was lost: no connection is made."""
        peer = self._peers.get(address)
        return peer if peer is not None and peer.alive else None

    @property
    def peers(self) -> list[Peer]:
        """The peers this engine is connected to (live or not yet closed)."""
        return list(self._peers.values())

    async def _connect_shared(self, address: str, timeout: float) -> Peer:
        try:
            peer = await asyncio.wait_for(self._connect(address), timeout)
        except asyncio.TimeoutError:
            raise PeerUnreachableError(f"connect to {address} timed out after {timeout:g} s",
                                       peer=address) from None
        finally:
            self._connecting.pop(address, None)
        if self._closed:
            await peer.close()
            raise PeerLostError(f"engine {self.address} closed while connecting to {address}", peer=address)
        self._peers[address] = peer
        return peer

    async def _connect(self, address: str) -> Peer:
        host, port = split_address(address)
        reader, writer, desc, token = await dial(address, host, port, secret=self._secret, me=self.address,
                                                 keepalive=self.keepalive)
        peer = None
        try:
            assert self._peer_ctx is not None
            peer = Peer(self._peer_ctx, address, reader, writer, desc, _REPLIES)
            provider, channel = await self._open_channel(peer, desc, token)
            peer._start(provider, channel)
            log.info("kvflow: connected to %s via %s", address, provider.name)
            return peer
        except BaseException:
            if peer is not None:
                peer._session.close_now()     # its reader too
            writer.close()
            raise

    async def _redial(self, peer: Peer) -> bool:
        """Dials a lapsed peer again (Peer._resume): True when the same
        incarnation answered and the peer has its new session and channel;
        False when another incarnation did (nothing of it kept). Raises what
        dial() and _open_channel() raise."""
        host, port = split_address(peer.address)
        reader, writer, desc, token = await dial(peer.address, host, port, secret=self._secret, me=self.address,
                                                 keepalive=self.keepalive)
        if desc.incarnation != peer.descriptor.incarnation or desc.pid != peer.descriptor.pid:
            writer.close()
            return False
        try:
            peer._rebind(reader, writer, desc)
            provider, channel = await self._open_channel(peer, desc, token)
            peer._start(provider, channel)
        except BaseException:
            peer._session.close_now()
            writer.close()
            raise
        return True

    async def _open_channel(self, peer: Peer, desc: Descriptor, token: bytes) -> tuple[Provider, Any]:
        """The first allowed provider (in preference order) that reaches
        the peer, and its channel to it."""
        allowed = [n for n in PROVIDERS if self.protocols is None or n in self.protocols]
        reason = ""
        for k, name in enumerate(allowed):
            provider = self._providers.get(name)
            if provider is None:
                reason = f"{name} unavailable here: {self._unavailable.get(name, 'not started')}"
            else:
                reason = provider.reaches(peer.address, desc) or ""
                if not reason:
                    try:
                        return provider, await provider.connect(peer.link, desc, token)
                    except ProviderUnavailableError as e:
                        reason = str(e)
            if k + 1 < len(allowed):
                log.info("kvflow: %s: %s provider unavailable (%s); trying %s", peer.address, name, reason,
                         allowed[k + 1])
        raise ProviderUnavailableError(
            f"{peer.address}: no allowed provider reaches the peer ({reason})", peer=peer.address)

    def _forget_peer(self, peer: Peer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]

    def _check_open(self) -> None:
        if not self._started or self._closed:
            raise KVFlowError("engine is not running (use `async with Engine(...)` or await start())")

    def __repr__(self) -> str:
        return f"<kvflow.Engine {self.address or self._listen} peers={len(self._peers)}>"
