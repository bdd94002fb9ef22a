"""Engine: this process's end of kvflow. It owns the native core, the
handshake server (peer-to-peer metadata: each engine serves its own
descriptor), the tcp data listener, registered memory, peers and
notifications."""
from __future__ import annotations

import asyncio
import errno as errno_mod
import ipaddress
import logging
import os
import socket
import weakref
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Sequence

import numpy as np

from kvflow import _core
from kvflow.errors import (
    AuthenticationError,
    InvalidArgumentError,
    KVFlowError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    ProviderUnavailableError,
)
from kvflow.control.wire import DATA_ROLE_ACK, DATA_ROLE_DATA, clip, encode, field, read_message
from kvflow.control.auth import NONCE_BYTES, check_proof, proof
from kvflow.control.descriptor import Descriptor, regions_to_wire
from kvflow.memory import LOCAL_WRITE, Access, Region, RemoteRegion, buffer_span
from kvflow.metadata import EngineRecord, MetadataClient, check_name, open_store
from kvflow.engine.peer import Peer
from kvflow.schedule.rails import DataConn, RailWatcher
from kvflow.providers.tcp import open_data_socket, tune_data_socket
from kvflow.topology import (
    Topology,
    cached_host_topology,
    pair_tcp_rails,
    parse_location,
    rail_order,
    route_to,
)
from kvflow.engine.transfer import DRAIN_GRACE, BatchTable
from kvflow.providers.rdma import provider as rdma_provider

__all__ = ["Engine", "PROVIDERS"]

log = logging.getLogger("kvflow")

# In the order protocols=None tries them: same host first (memcpy or
# cross-memory attach beat any NIC loopback), then rdma, then tcp.
PROVIDERS = ("local", "rdma", "tcp")
HANDSHAKE_TIMEOUT = 10.0
MIN_KEEPALIVE, MAX_KEEPALIVE = 0.05, 3600.0
PRE_AUTH_FRAME = 64 << 10          # hello and auth frames are small
SESSION_BUFFER_LIMIT = 64 << 20    # unread control data after which a session is dropped


def _host_identity() -> str:
    """Same string on two engines iff they share a kernel and a pid namespace
    (so that a pid names the same process for process_vm_writev)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


class _ProcessIdentity:
    """Per-process token and a probe cookie in this process's memory: a peer
    on the same host proves it may use process_vm_readv on us by reading the
    cookie back."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = os.urandom(16)
        self.cookie = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        self.host = _host_identity()

    @property
    def probe_addr(self) -> int:
        return int(self.cookie.__array_interface__["data"][0])


_identity: _ProcessIdentity | None = None
# This process's running engines by address (for the same-process check).
_live_engines: "weakref.WeakValueDictionary[str, Engine]" = weakref.WeakValueDictionary()


def _process_identity() -> _ProcessIdentity:
    global _identity
    if _identity is None or _identity.pid != os.getpid():   # new after fork
        _identity = _ProcessIdentity()
    return _identity


def _retrieve(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(f"address {address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def _is_address(text: str) -> bool:
    try:
        _split_address(text)
    except InvalidArgumentError:
        return False
    return True


def _check_rails(rails: Sequence[str] | None) -> list[str]:
    if rails is None:
        return []
    if isinstance(rails, str):
        raise InvalidArgumentError(f"rails: a list of addresses, or 'auto' (got {rails!r})")
    out = []
    for r in rails:
        try:
            out.append(str(ipaddress.ip_address(r)))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"rail {r!r} is not an IP address of this host") from None
    if not 1 <= len(out) <= 64 or len(set(out)) != len(out):
        raise InvalidArgumentError("rails: 1..64 distinct addresses")
    return out


class Engine:
    """kvflow's engine. Use as `async with Engine(...) as engine:`.

    listen: "host:port" of the handshake server (port 0 picks one);
    protocols: provider names to allow ("local", "rdma", "tcp"); None
    chooses automatically (local where the peer is on this host and permits
    it, else rdma where both ends have devices that reach each other, else
    tcp); secret: shared secret, required of every peer when set;
    tcp_connections: data connections per tcp peer and rail;
    rails: local IP addresses of this engine's tcp rails (one per NIC;
    default: env KVFLOW_TCP_RAILS, comma-separated, else one rail on the
    listen host), or "auto" (also KVFLOW_TCP_RAILS=auto): the IPv4
    addresses of the netdevs the topology prefers for `location`, the
    links of the control addresses left out (the listen host and the
    `advertise` host, literal or resolved; a wildcard listen host leaves
    nothing out unless `advertise` names the address) (Topology.tcp_rails;
    one rail on the listen host when there are none); each gets a data
    listener, all are published with their NICs, and a peer opens
    tcp_connections to each, its slices spread over all; a peer that has
    rails too pairs its rails with these by both topologies
    (kvflow.topology.pair_tcp_rails) and binds each connection to its local
    rail where that rail reaches the peer's (same subnet, or a route that
    leaves by the rail's netdev; else the kernel picks the source); a connection
    that fails (rail down: noticed after about `keepalive` seconds without
    progress) hands its slices to the others and is rebuilt when its rail
    answers again; location: where this engine's registered memory
    lives ("cpu", "cpu:N" for a NUMA node, "cuda:N"; default: env
    KVFLOW_LOCATION, else "cpu"): the NICs near it are preferred, and
    published with the host's topology (kvflow.topology: discovered from
    sysfs, or the JSON file KVFLOW_TOPOLOGY names) so that both ends of an
    rdma connection pair matching rails; rdma_devices: RDMA
    device names to use (default: env KVFLOW_RDMA_DEVICES, else all);
    rdma_gid_index: GID index override (default: env KVFLOW_GID_INDEX, else
    a RoCE v2 IPv4-mapped GID); rdma_qps: QPs per device pair;
    rdma_ack_timeout: RC ACK timeout exponent, 1..31 (4.096 us * 2^n; default:
    env KVFLOW_RDMA_ACK_TIMEOUT, else 14 (67 ms) for hardware NICs and 17
    (537 ms) for software devices such as rxe and siw, whose ACKs can be
    late under load; InvalidArgumentError otherwise). On software devices
    the device's worker thread posts unpolled batches, not the submitting
    thread (their ibv_post_send does the transfer inside the system call);
    env KVFLOW_RDMA_WORKER_POSTS=0/1 decides for every device;
    keepalive: seconds of silence on a peer's control connection after
    which the peer is declared lost and its transfers fail with
    PeerLostError (pings go every keepalive/3; 0 disables; default: env
    KVFLOW_KEEPALIVE, else 5);
    metadata: None or "p2p" (peers connect by address only),
    "redis://[[user]:password@]host:port[/db]" or "etcd://host:port": at
    start() the engine publishes a record under kvflow/engines/<name> (name:
    default the engine's address; not of the form host:port) that expires
    metadata_ttl seconds after its last refresh (every metadata_ttl/3), and
    connect() resolves names through that server.
    """

    def __init__(self, listen: str = "127.0.0.1:0", *, protocols: Sequence[str] | None = None,
                 secret: bytes | str | None = None, tcp_connections: int = 2,
                 local_workers: int = 2, slice_size: int = 1 << 20,
                 inline_limit: int = 64 << 10, advertise: str | None = None,
                 rdma_devices: Sequence[str] | None = None, rdma_gid_index: int | None = None,
                 rdma_qps: int = 2, rdma_slice_size: int = 256 << 10, rdma_ack_timeout: int | None = None,
                 keepalive: float | None = None, metadata: str | None = None,
                 name: str | None = None, metadata_ttl: float = 10.0,
                 rails: Sequence[str] | None = None, location: str | None = None) -> None:
        if protocols is not None:
            protocols = tuple(protocols)
            unknown = [p for p in protocols if p not in PROVIDERS]
            if unknown or not protocols:
                raise InvalidArgumentError(
                    f"unknown protocol(s) {unknown or protocols!r}; available: {', '.join(PROVIDERS)}")
        if not 1 <= tcp_connections <= 64 or slice_size < 4096:
            raise InvalidArgumentError("tcp_connections must be 1..64 and slice_size >= 4096")
        if keepalive is None:
            try:
                keepalive = float(os.environ.get("KVFLOW_KEEPALIVE", "5"))
            except ValueError:
                raise InvalidArgumentError("KVFLOW_KEEPALIVE must be a number of seconds") from None
        if not (keepalive == 0 or MIN_KEEPALIVE <= keepalive <= MAX_KEEPALIVE):
            raise InvalidArgumentError(f"keepalive must be 0 (off) or {MIN_KEEPALIVE:g}..{MAX_KEEPALIVE:g} seconds")
        self.keepalive = float(keepalive)
        self._store = open_store(metadata)
        if name is not None:
            check_name(name)
            if _is_address(name):
                raise InvalidArgumentError(f"name {name!r} has the form host:port, which connect() "
                                           "takes for an address; choose another name")
        if not 0.2 <= metadata_ttl <= 86400:
            raise InvalidArgumentError("metadata_ttl must be 0.2..86400 seconds")
        self.name = name
        self._metadata_ttl = float(metadata_ttl)
        self._metadata: MetadataClient | None = None
        self._listen = listen
        self.protocols = protocols
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._tcp_connections = tcp_connections
        if rails is None and os.environ.get("KVFLOW_TCP_RAILS"):
            rails = [r.strip() for r in os.environ["KVFLOW_TCP_RAILS"].split(",") if r.strip()]
        if rails is not None and not isinstance(rails, str):
            rails = list(rails)             # once: a generator would be spent by the "auto" test
        # "auto" is resolved at start(), from the topology
        self._auto_rails = rails == "auto" or rails == ["auto"]
        self._rails = [] if self._auto_rails else _check_rails(rails)
        self._rail_nics: list[str] = []      # per rail: its netdev ("" unknown) and "ip/prefixlen"
        self._rail_ifaces: list[str] = []
        self.location = location or os.environ.get("KVFLOW_LOCATION") or "cpu"
        parse_location(self.location)
        self.topology: Topology | None = None
        self._local_workers = local_workers
        self._slice_size = slice_size
        self._inline_limit = inline_limit
        self._advertise = advertise
        self._rdma_options = {"devices": list(rdma_devices) if rdma_devices is not None else None,
                              "gid_index": rdma_gid_index, "qps_per_pair": rdma_qps,
                              "slice_size": rdma_slice_size,
                              "ack_timeout": (None if rdma_ack_timeout is None
                                              else rdma_provider.check_ack_timeout(rdma_ack_timeout))}
        self._rdma: Any = None
        self._rdma_reason = "not started"
        self._core: Any = None
        self._completion_fd = -1
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: asyncio.base_events.Server | None = None
        self._data_socks: list[socket.socket] = []
        self._data_endpoints: list[tuple[str, int]] = []
        self._accept_tasks: list[asyncio.Task[None]] = []
        self._regions: dict[int, Region] = {}
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Task[Peer]] = {}
        self._sessions: set[asyncio.StreamWriter] = set()
        self._session_tasks: set[asyncio.Task[None]] = set()
        self._batches: BatchTable | None = None
        self._notifications: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        self._generation = 0
        self._incarnation = int.from_bytes(os.urandom(8), "little") >> 1
        self.address = ""
        self.data_address = ""
        self._started = False
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Starts the native core, the handshake server and the data listener."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        host, port = _split_address(self._listen)
        self.topology = cached_host_topology(fresh_addresses=self._auto_rails)
        if self._auto_rails:
            self._rails = self._topology_rails(await self._control_addresses(host))
        self._use_topology(self.topology)
        self._core = _core.Core(self._local_workers)
        self._batches = BatchTable(self._core, self._loop, self._abort_batch, self._rdma_device_names)
        try:
            self._server = await asyncio.start_server(self._serve_control, host, port)
            bound = self._server.sockets[0].getsockname()
            adv = self._advertise or (host if host not in ("0.0.0.0", "::") else socket.gethostname())
            self.address = f"{adv}:{bound[1]}"
            for rail in self._rails or [host]:
                ds = socket.socket(socket.AF_INET6 if ":" in rail else socket.AF_INET)
                self._data_socks.append(ds)
                ds.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                ds.bind((rail, 0))
                ds.listen(256)
                ds.setblocking(False)
                self._data_endpoints.append((rail if self._rails else adv, ds.getsockname()[1]))
                self._accept_tasks.append(self._loop.create_task(self._accept_data(ds)))
            self.data_address = "%s:%d" % self._data_endpoints[0]
            _live_engines[self.address] = self
            self._completion_fd = self._core.fileno()
            self._loop.add_reader(self._completion_fd, self._batches.on_completions)
            self._start_rdma()
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

    def _use_topology(self, topology: Topology) -> None:
        """Takes `topology` as this host's: each rail's netdev ("" where
        none holds it) and "ip/prefixlen" (the bare address where unknown)
        come from it, for publishing and pairing."""
        self.topology = topology
        self._rail_nics, self._rail_ifaces = [], []
        for rail in self._rails:
            nic, iface = topology.interface_of(rail) or ("", rail)
            self._rail_nics.append(nic)
            self._rail_ifaces.append(iface)

    async def _control_addresses(self, host: str) -> list[str]:
        """The addresses the control connection may arrive on, for rails="auto"
        to leave their links out: the listen host (a literal, or what its
        name resolves to) and the advertised host (likewise). A wildcard
        listen host is none of them: with no `advertise`, nothing is left out
        (peers may come in by any link; the engine cannot tell which)."""
        found: list[str] = []
        for name in (host, self._advertise):
            if not name or name in ("0.0.0.0", "::", ""):
                continue
            try:
                found.append(str(ipaddress.ip_address(name)))
                continue
            except ValueError:
                pass
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError as e:
                log.info("kvflow: rails=auto: %s does not resolve (%s); its link is not left out", name, e)
                continue
            found += [str(info[4][0]) for info in infos]
        return list(dict.fromkeys(a.split("%")[0] for a in found))

    def _topology_rails(self, exclude: list[str]) -> list[str]:
        """rails="auto": the rail addresses Topology.tcp_rails picks for this
        engine's location, the links of `exclude` (the control addresses)
        left out; [] (one rail on the listen host, as without rails) when it
        finds none."""
        assert self.topology is not None
        found = self.topology.tcp_rails(self.location, exclude=exclude)[:64]
        if not found:
            log.warning("kvflow: rails=auto: the topology has no netdev with an IPv4 address for %s; "
                        "one rail on the listen host", self.location)
            return []
        log.info("kvflow: tcp rails for %s from the topology: %s", self.location,
                 ", ".join(f"{a} ({n})" for n, a in found))
        return [str(ipaddress.ip_interface(a).ip) for _, a in found]

    def _start_rdma(self) -> None:
        if self.protocols is not None and "rdma" not in self.protocols:
            self._rdma_reason = "rdma is not among this engine's protocols"
            return
        try:
            self._rdma = rdma_provider.RdmaProvider(self, **self._rdma_options)
            self._rdma_reason = ""
        except ProviderUnavailableError as e:
            self._rdma_reason = str(e)
            level = logging.WARNING if self.protocols is not None else logging.DEBUG
            log.log(level, "kvflow: rdma unavailable: %s", e)

    def _rdma_device_names(self) -> list[str] | None:
        return self._rdma.device_names() if self._rdma is not None else None

    async def close(self) -> None:
        """Closes peers (their in-flight transfers fail with PeerLostError),
        servers and the native core. Idempotent."""
        if self._closed:
            return
        self._closed = True
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
        if self._server is not None:
            self._server.close()
        for w in list(self._sessions):
            w.close()
        for t in list(self._session_tasks):
            t.cancel()
        if self._session_tasks:
            await asyncio.gather(*self._session_tasks, return_exceptions=True)
        for t in self._accept_tasks:
            t.cancel()
        if self._accept_tasks:
            await asyncio.gather(*self._accept_tasks, return_exceptions=True)
        for ds in self._data_socks:
            ds.close()
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
                await rdma.close()
            self._core.close()      # closes channels: their batches complete with errors
        if self._batches is not None:
            self._batches.fail_all(lambda peer: PeerLostError(f"engine {self.address} closed", peer=peer))

    # ------------------------------------------------------------ memory
    def register(self, buffer: Any, *, name: str | None = None,
                 access: Access = Access.READ | Access.WRITE) -> Region:
        """Makes `buffer` reachable by peers (with `access`) and usable as
        the local side of transfers. Raises InvalidArgumentError for a buffer
        that is not contiguous memory, overlaps a registered region, or is
        read-only while WRITE access is asked."""
        self._check_open()
        addr, length, writable, keep = buffer_span(buffer)
        access = Access(access)
        if (access & Access.WRITE) and not writable:
            raise InvalidArgumentError("buffer is read-only: register it with access=Access.READ")
        if name is not None and any(r.name == name for r in self._regions.values()):
            raise InvalidArgumentError(f"a region named {name!r} is already registered")
        rid = self._core.add_region(addr, length, int(access) | (LOCAL_WRITE if writable else 0))
        if not rid:
            raise InvalidArgumentError(
                f"region {addr:#x}+{length} overlaps a registered region or overflows")
        rkeys: tuple[int, ...] = ()
        took = 0.0
        if self._rdma is not None:
            try:
                lkeys, rk, took = self._rdma.register(rid, addr, length, access, writable)
            except BaseException:
                self._core.remove_region(rid)
                raise
            self._core.set_keys(rid, lkeys)
            rkeys = tuple(rk)
        region = Region(addr, length, name, access, rid, keep, rkeys, took)
        self._regions[rid] = region
        self._regions_changed()
        return region

    def deregister(self, region: Region) -> None:
        """Removes a region; returns once no peer is writing into it."""
        self._check_open()
        if self._regions.pop(region.id, None) is None:
            raise InvalidArgumentError(f"region {region.addr:#x}+{region.length} is not registered")
        self._core.remove_region(region.id)
        if self._rdma is not None:
            self._rdma.deregister(region.id)     # the NICs refuse its keys from now on
        self._regions_changed()

    @property
    def regions(self) -> list[Region]:
        return sorted(self._regions.values(), key=lambda r: r.addr)

    def _remote_regions(self) -> list[RemoteRegion]:
        return [RemoteRegion(r.addr, r.length, r.name, r.access, r.rkeys) for r in self.regions]

    def _regions_changed(self) -> None:
        self._generation += 1
        if self._metadata is not None:
            self._metadata.changed()
        # Peers in this process copy with memcpy and check only their copy
        # of our table: update it now, not when the pushed frame arrives, so
        # that nothing submitted after deregister() returns can reach the
        # region. (Batches already queued to their workers are not fenced.)
        mine = None
        for other in list(_live_engines.values()):
            peer = other._peers.get(self.address)
            if peer is not None and peer.transport == "local" and other._same_process(self.address, peer.descriptor):
                mine = mine if mine is not None else self._remote_regions()
                peer._set_regions(mine)
        if not self._sessions:
            return
        msg = {"t": "regions", "generation": self._generation,
               "regions": regions_to_wire(self._remote_regions())}
        if self._rdma is not None:
            # the devices in service and the probe keys: they change when a
            # device comes back (Peer._on_regions; absent: unchanged)
            msg["rdma"] = self._rdma.describe()
        frame = encode(msg)
        for w in list(self._sessions):
            if w.is_closing():
                continue
            if w.transport.get_write_buffer_size() > SESSION_BUFFER_LIMIT:
                # a peer that stopped reading its control connection
                log.warning("kvflow: dropping a control session that does not read its updates")
                w.close()
                continue
            w.write(frame)

    def _rdma_rekeyed(self, keys: dict[int, tuple[list[int], list[int]]]) -> None:
        """The rdma provider registered every region again on a device that
        came back: region id -> (lkeys, rkeys) per device. The native table
        gets the lkeys, the regions the rkeys, and peers both (pushed)."""
        for rid, (lkeys, rkeys) in keys.items():
            region = self._regions.get(rid)
            if region is not None:
                self._core.set_keys(rid, lkeys)
                self._regions[rid] = replace(region, rkeys=tuple(rkeys))
        self._regions_changed()

    def descriptor(self) -> Descriptor:
        ident = _process_identity()
        return Descriptor(
            address=self.address, incarnation=self._incarnation, host=ident.host, pid=ident.pid,
            process=ident.token, probe_addr=ident.probe_addr, probe_cookie=ident.cookie.tobytes(),
            data=list(self._data_endpoints), regions=self._remote_regions(), generation=self._generation,
            rdma=self._rdma.describe() if self._rdma is not None else None,
            topology=self.topology, location=self.location,
            rail_nics=list(self._rail_nics) if self._rails else None)

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
        """A cancelled batch still on the wire after the drain grace: reset
        the peer's connections that hold it, so that none of its bytes can
        land after the caller was told it failed (tcp; the other providers
        finish or fail their slices in bounded time)."""
        p = self._peers.get(peer)
        abort = getattr(p._channel, "abort_batch", None) if p is not None else None
        if abort is not None and abort(batch_id):
            log.warning("kvflow: %s: a cancelled batch was still on the wire after %g s: reset the "
                        "connections carrying it", peer, DRAIN_GRACE)

    def counters(self) -> dict[str, int]:
        """Live native resources (sockets, threads, slices, batches in flight)."""
        return self._core.counters() if self._core is not None else {}

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

    # ------------------------------------------------------------ server side
    async def _serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._session_tasks.add(task)
        token = b""
        try:
            hello = await asyncio.wait_for(read_message(reader, max_size=PRE_AUTH_FRAME), HANDSHAKE_TIMEOUT)
            if hello["t"] != "hello":
                raise ProtocolError(f"expected hello, got {clip(hello['t'])}")
            cnonce = field(hello, "nonce", bytes)
            peer_addr = field(hello, "address", str)
            if len(cnonce) != NONCE_BYTES:
                raise ProtocolError("hello: bad nonce")
            snonce = os.urandom(NONCE_BYTES)
            sproof = proof(self._secret, b"server", cnonce, snonce) if self._secret else b""
            writer.write(encode({"t": "challenge", "nonce": snonce, "auth": bool(self._secret),
                                 "proof": sproof}))
            auth = await asyncio.wait_for(read_message(reader, max_size=PRE_AUTH_FRAME), HANDSHAKE_TIMEOUT)
            if auth["t"] != "auth":
                raise ProtocolError(f"expected auth, got {auth['t']!r}")
            if self._secret:
                try:
                    check_proof(self._secret, b"client", snonce, cnonce, auth.get("proof"))
                except AuthenticationError:
                    writer.write(encode({"t": "error", "code": "auth", "message": "secret mismatch"}))
                    await writer.drain()
                    log.warning("kvflow: %s failed authentication", peer_addr)
                    return
            token = os.urandom(16)
            self._core.add_token(token)
            writer.write(encode({"t": "welcome", "token": token,
                                 "descriptor": self.descriptor().to_wire()}))
            self._sessions.add(writer)
            # A client that pings (keepalive > 0) and then falls silent for
            # that long is gone (stopped, crashed host): drop its session.
            # A value no engine would send (under MIN_KEEPALIVE) is ignored:
            # it would make this loop wake for nothing.
            silence = hello.get("keepalive")
            if not isinstance(silence, (int, float)) or isinstance(silence, bool) or \
                    not MIN_KEEPALIVE <= silence <= MAX_KEEPALIVE:
                silence = None
            while True:
                waited = self._loop.time()
                try:
                    msg = await read_message(reader, idle_timeout=silence)
                except asyncio.TimeoutError:
                    # Far longer than asked: this process was stopped or
                    # starved, not the client silent. Give it a new window.
                    if self._loop.time() - waited > 1.5 * silence:
                        continue
                    log.warning("kvflow: %s silent for %.3g s: dropping its session", peer_addr, silence)
                    break
                t = msg["t"]
                if t == "ping":
                    writer.write(encode({"t": "pong"}))
                elif t == "notify":
                    self._notifications.put_nowait((peer_addr, field(msg, "data", bytes)))
                elif t == "describe":
                    writer.write(encode({"t": "descriptor", "descriptor": self.descriptor().to_wire()}))
                    await writer.drain()      # a peer that asks but never reads gets no more
                elif t == "rdma_connect":
                    if self._rdma is None:
                        reply = {"t": "rdma_error", "message": f"no rdma on {self.address}: {self._rdma_reason}"}
                    else:
                        reply = self._rdma.accept(peer_addr, writer, msg)
                    writer.write(encode({**reply, "rid": msg.get("rid")}))
                    await writer.drain()
                elif t == "bye":
                    break
                else:
                    raise ProtocolError(f"unexpected message {clip(t)}")
        except ProtocolError as e:
            log.info("kvflow: dropping control connection: %s", e)
            try:
                writer.write(encode({"t": "error", "code": "protocol", "message": str(e)}))
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._session_tasks.discard(task)
            self._sessions.discard(writer)
            if self._rdma is not None:
                self._rdma.drop_session(writer)
            if token and self._core is not None:
                self._core.remove_token(token)
            writer.close()

    async def _accept_data(self, listener: socket.socket) -> None:
        where = "%s:%d" % listener.getsockname()[:2]
        while True:
            try:
                conn, _ = await self._loop.sock_accept(listener)
            except asyncio.CancelledError:
                return
            except OSError as e:
                if e.errno in (errno_mod.EBADF, errno_mod.EINVAL):
                    return                      # the listener was closed
                # out of descriptors or memory, or a connection that died in
                # the accept queue: keep serving
                log.warning("kvflow: accept on %s failed: %s", where, e)
                await asyncio.sleep(0.1 if e.errno in (errno_mod.EMFILE, errno_mod.ENFILE,
                                                       errno_mod.ENOBUFS, errno_mod.ENOMEM) else 0)
                continue
            conn.setblocking(True)
            tune_data_socket(conn, self.keepalive)
            # The native thread checks the session token before touching memory.
            self._core.serve(conn.detach())

    # ------------------------------------------------------------ client side
    async def connect(self, address: str, *, timeout: float = 10.0) -> Peer:
        """Connects to the engine at `address` ("host:port"); cached per
        address. With a metadata server, anything not of the form host:port
        is a name, resolved there first (host:port never is: connecting by
        address needs no server). Raises PeerUnreachableError (also for an
        unpublished name or an unreachable metadata server),
        AuthenticationError, ProtocolError, ProviderUnavailableError."""
        self._check_open()
        if self._metadata is not None and not _is_address(address):
            return await self._connect_by_name(address, timeout)
        peer = self._peers.get(address)
        if peer is not None and peer.alive:
            return peer
        if peer is not None:
            await peer.close()
        # One connection attempt per address, shared by every caller: it
        # runs as its own task so that a caller that is cancelled (a request
        # aborted mid-connect) does not cancel it for the others.
        pending = self._connecting.get(address)
        if pending is None:
            pending = self._loop.create_task(self._connect_shared(address, timeout))
            pending.add_done_callback(_retrieve)      # every waiter may have gone
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
        host, port = _split_address(address)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            raise PeerUnreachableError(f"cannot reach {address}: {e.strerror or e}", peer=address,
                                       errno=e.errno) from None
        try:
            desc, token = await self._handshake(address, reader, writer)
            peer = Peer(self, address, reader, writer, desc)
            channel, transport = await self._open_channel(peer, desc, token)
            peer._start(channel, transport)
            log.info("kvflow: connected to %s via %s", address, transport)
            return peer
        except BaseException:
            writer.close()
            raise

    async def _handshake(self, address: str, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[Descriptor, bytes]:
        cnonce = os.urandom(NONCE_BYTES)
        writer.write(encode({"t": "hello", "nonce": cnonce, "address": self.address,
                             "keepalive": self.keepalive}))
        try:
            ch = await read_message(reader)
            if ch["t"] == "error":
                raise ProtocolError(f"{address} refused the handshake: {ch.get('message')}", peer=address)
            if ch["t"] != "challenge":
                raise ProtocolError(f"{address}: expected challenge, got {ch['t']!r}", peer=address)
            snonce = field(ch, "nonce", bytes)
            if bool(ch.get("auth")) != bool(self._secret):
                raise AuthenticationError(
                    f"{address}: " + ("the peer requires a secret and none was set" if ch.get("auth")
                                      else "a secret is set but the peer has none"), peer=address)
            if self._secret:
                try:
                    check_proof(self._secret, b"server", cnonce, snonce, ch.get("proof"))
                except AuthenticationError:
                    raise AuthenticationError(f"{address}: secret mismatch", peer=address) from None
            writer.write(encode({"t": "auth", "proof": proof(self._secret, b"client", snonce, cnonce)
                                 if self._secret else b""}))
            welcome = await read_message(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise PeerUnreachableError(f"{address} closed the handshake ({e.__class__.__name__}); "
                                       "is it a kvflow engine?", peer=address) from None
        except ProtocolError as e:
            if e.peer is None:
                # The first reply was not a kvflow frame at all.
                raise PeerUnreachableError(f"{address} does not speak kvflow ({e})", peer=address) from None
            raise
        if welcome["t"] == "error":
            if welcome.get("code") == "auth":
                raise AuthenticationError(f"{address}: secret mismatch", peer=address)
            raise ProtocolError(f"{address} refused the handshake: {welcome.get('message')}", peer=address)
        if welcome["t"] != "welcome":
            raise ProtocolError(f"{address}: expected welcome, got {welcome['t']!r}", peer=address)
        token = field(welcome, "token", bytes)
        desc = Descriptor.from_wire(welcome.get("descriptor"))
        return desc, token

    async def _open_channel(self, peer: Peer, desc: Descriptor, token: bytes) -> tuple[Any, str]:
        allowed = self.protocols or PROVIDERS
        ident = _process_identity()
        reason = ""
        if "local" in allowed:
            if desc.host != ident.host:
                reason = "the peer is on another host"
            elif self._same_process(peer.address, desc):
                return _core.LocalChannel(self._core, peer._table, peer.address, 0, self._inline_limit), "local"
            elif desc.pid == ident.pid:
                reason = "the peer claims this process's pid but is not one of its engines"
            else:
                got = _core.probe_process(desc.pid, desc.probe_addr, len(desc.probe_cookie))
                if got == desc.probe_cookie:
                    return (_core.LocalChannel(self._core, peer._table, peer.address, desc.pid, self._inline_limit),
                            "local")
                reason = (f"process_vm_readv on pid {desc.pid} not permitted ({os.strerror(got)})"
                          if isinstance(got, int) else "cross-memory probe mismatch")
            nxt = "rdma" if "rdma" in allowed else "tcp"
            if nxt in allowed:
                log.info("kvflow: %s: local provider unavailable (%s); trying %s", peer.address, reason, nxt)
        if "rdma" in allowed:
            if self._rdma is None:
                reason = f"rdma unavailable here: {self._rdma_reason}"
            elif desc.rdma is None:
                reason = "the peer has no rdma devices"
            else:
                try:
                    return await self._rdma.connect(peer, desc.rdma, peer._first_request), "rdma"
                except ProviderUnavailableError as e:
                    reason = str(e)
            if "tcp" in allowed:
                log.info("kvflow: %s: rdma unavailable (%s); using tcp", peer.address, reason)
        if "tcp" in allowed:
            return await self._open_tcp(peer, desc, token), "tcp"
        raise ProviderUnavailableError(
            f"{peer.address}: no allowed provider reaches the peer ({reason})", peer=peer.address)

    async def _open_tcp(self, peer: Peer, desc: Descriptor, token: bytes) -> Any:
        if not desc.data:
            raise ProviderUnavailableError(f"{peer.address} publishes no tcp endpoint", peer=peer.address)
        # tcp_connections per rail (at most 64 in all); with one rail the
        # target sends write acks on an extra connection that this loop
        # reads directly, with several each connection carries its own (a
        # rail that dies takes its acks with it, nobody else's).
        rails = self._rail_plan(desc)
        per_rail = max(1, min(self._tcp_connections, 64 // len(rails)))
        plan = [DataConn(i, host, port, source)
                for i, (source, host, port) in enumerate([r for r in rails for _ in range(per_rail)])]

        def open_one(c: DataConn, role: int) -> Awaitable[socket.socket]:
            return open_data_socket(self._loop, c.host, c.port, token, role, c.index,
                                    keepalive=self.keepalive, peer=peer.address, source=c.source)

        ack_sock: socket.socket | None = None
        got: list[Any] = []
        try:
            if len(rails) == 1:
                # the ack connection first: the target sends acks on it once it exists
                ack_sock = await open_one(plan[0], DATA_ROLE_ACK)
            got = await asyncio.gather(*(open_one(c, DATA_ROLE_DATA) for c in plan),
                                       return_exceptions=True)
            errors = [g for g in got if isinstance(g, BaseException)]
            fatal = [g for g in errors if not isinstance(g, (PeerUnreachableError, ProtocolError))]
            if fatal:
                raise fatal[0]
            if errors and (len(rails) == 1 or len(errors) == len(got)):
                raise errors[0]
        except BaseException:
            for s in [ack_sock, *got]:
                if isinstance(s, socket.socket):
                    s.close()
            raise
        for c, g in zip(plan, got):
            if isinstance(g, socket.socket):
                c.local = g.getsockname()[0]
            else:
                log.warning("kvflow: %s: rail %s:%d is down at connect (%s); it is retried in the background",
                            peer.address, c.host, c.port, g)
        # All stay non-blocking: the loop reads the ack socket and may splice
        # small batches into a data socket; the native threads poll().
        fds = [g.detach() if isinstance(g, socket.socket) else -1 for g in got]
        peer._rails = RailWatcher(peer, plan, token, DATA_ROLE_DATA, self.keepalive)
        return _core.TcpChannel(self._core, peer._table, peer.address, fds,
                                ack_sock.detach() if ack_sock is not None else -1, self._slice_size)

    def _rail_plan(self, desc: Descriptor) -> list[tuple[str | None, str, int]]:
        """(local source, host, port) of each group of data connections to
        a peer. With rails on both ends (the peer publishing its rails'
        NICs): each end's rails in the order its topology prefers for its
        memory, paired by pair_tcp_rails, each group bound to its local
        rail. Otherwise one group per peer endpoint, from where the kernel
        chooses (as before rails were paired)."""
        endpoints = desc.data[:64]
        plain: list[tuple[str | None, str, int]] = [(None, h, p) for h, p in endpoints]
        if not self._rails or desc.rail_nics is None or self.topology is None:
            return plain
        topology = self.topology
        mine = rail_order(self._rail_nics, topology, self.location)
        theirs = rail_order(desc.rail_nics[:len(endpoints)], desc.topology, desc.location)
        networks = [a for n in topology.nics for a in n.addresses]
        try:
            pairs = pair_tcp_rails([self._rail_ifaces[i] for i in mine], [endpoints[j][0] for j in theirs],
                                   networks, nics=[self._rail_nics[i] for i in mine],
                                   route=lambda ip: route_to(ip, topology).netdev)
        except ValueError:          # a peer endpoint that is not an IP address: nothing to pair
            return plain
        return [(None if li is None else self._rails[mine[li]], *endpoints[theirs[rj]]) for li, rj in pairs][:64]

    @staticmethod
    def _same_process(address: str, desc: Descriptor) -> bool:
        """True only if `address` is an engine of this very process: decided
        from our own registry, never from what the descriptor claims (a
        peer could replay another engine's identity)."""
        other = _live_engines.get(address)
        return other is not None and not other._closed and other._incarnation == desc.incarnation

    def _forget_peer(self, peer: Peer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]

    def _check_open(self) -> None:
        if not self._started or self._closed:
            raise KVFlowError("engine is not running (use `async with Engine(...)` or await start())")

    def __repr__(self) -> str:
        return f"<kvflow.Engine {self.address or self._listen} peers={len(self._peers)}>"
