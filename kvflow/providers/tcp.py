"""The tcp provider: data connections opened with the session token's
hello, tuned so that a dead rail is noticed by the kernel's timers, bound to
the local rail they were paired with (kvflow.schedule.rails: RailPlan), and
rebuilt when they fail (RailWatcher); the data listeners of the target side."""
from __future__ import annotations

import asyncio
import errno as errno_mod
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any

from kvflow import _core
from kvflow.control.descriptor import Descriptor
from kvflow.control.wire import (
    DATA_HEADER,
    DATA_HELLO,
    DATA_HELLO_ACK,
    DATA_MAGIC,
    DATA_ROLE_ACK,
    DATA_ROLE_DATA,
    DATA_WIRE_VERSION,
)
from kvflow.errors import InvalidArgumentError, PeerUnreachableError, ProtocolError, ProviderUnavailableError
from kvflow.providers import congestion as cc
from kvflow.providers.base import Caps, PeerLink, Provider, ProviderContext
from kvflow.schedule.rails import MAX_CONNECTIONS, DataConn, RailPlan, RailWatcher, check_rails
from kvflow.control.liveness import keep_probing
from kvflow.tasks import cancel_and_wait

__all__ = ["TcpOptions", "TcpProvider", "bind_source", "control_addresses", "hello_frame", "open_data_connection",
           "open_data_socket", "tune_data_socket"]

log = logging.getLogger("kvflow")

CONNECT_TIMEOUT = 3.0       # a rail whose SYN goes unanswered this long is down
MAX_BUSY_POLL = 0.01        # TcpOptions.busy_poll: longer would be a core spent, not a wake-up saved


def tune_data_socket(s: socket.socket, keepalive: float) -> None:
    """No Nagle; and with keepalive > 0 the kernel's keepalive probes, so
    that an idle connection whose peer's host is gone fails with ETIMEDOUT
    after about `keepalive` seconds. A busy one is watched by
    RailWatcher (TcpChannel.check_reach: sent bytes unanswered for
    `keepalive`). No TCP_USER_TIMEOUT: it also ends a connection whose peer
    keeps its receive window closed that long (a stopped or starved process
    that is not reading), which is slow, not gone."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive > 0:
        keep_probing(s, keepalive)


# struct linger {l_onoff 1, l_linger 0}: close() resets the connection
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)

# Linux 4.2+; the socket module names it from Python 3.12 on
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def bind_source(s: socket.socket, source: str) -> None:
    """Binds an unconnected socket to local address `source` for its
    connect(). On IPv4 the port is left to connect() (IP_BIND_ADDRESS_NO_PORT):
    a plain bind((source, 0)) reserves a port for `source` whatever the
    destination, so all rails together could hold only the ~28k ephemeral
    ports, where connect() may reuse one per (destination, port)."""
    if s.family == socket.AF_INET:
        try:
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        except OSError:         # an older kernel: a port per bind, as before
            pass
    s.bind((source, 0))


def hello_frame(token: bytes, role: int, index: int) -> bytes:
    """A data connection's first frame: the session token proves it belongs
    to an authenticated handshake; `index` names the connection in acks."""
    return DATA_HEADER.pack(DATA_MAGIC, DATA_HELLO, index, role, int.from_bytes(token[:8], "little"),
                            DATA_WIRE_VERSION, int.from_bytes(token[8:], "little"))


async def open_data_socket(loop: asyncio.AbstractEventLoop, host: str, port: int, token: bytes,
                           role: int, index: int, *, keepalive: float, peer: str,
                           timeout: float = CONNECT_TIMEOUT, source: str | None = None,
                           send_buffer: int = 0, congestion: str = cc.SYSTEM) -> socket.socket:
    """Connects (from local address `source` when given: the rail it was
    paired with), sends the hello and waits for its acceptance. Returns the
    non-blocking socket; raises PeerUnreachableError (or ProtocolError when
    the target refuses the hello). `congestion`: its TCP congestion
    control (kvflow.providers.congestion)."""
    s, _ = await open_data_connection(loop, host, port, token, role, index, keepalive=keepalive,
                                      peer=peer, timeout=timeout, source=source, send_buffer=send_buffer,
                                      congestion=congestion)
    return s


async def open_data_connection(loop: asyncio.AbstractEventLoop, host: str, port: int, token: bytes,
                               role: int, index: int, *, keepalive: float, peer: str,
                               timeout: float = CONNECT_TIMEOUT, source: str | None = None,
                               send_buffer: int = 0, congestion: str = cc.SYSTEM) -> tuple[socket.socket, int]:
    """open_data_socket, and the target's receive window from its hello
    acceptance (0: none; otherwise write payloads go only against the
    credit it grants)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setblocking(False)
        tune_data_socket(s, keepalive)
        # Ended with a reset, never an orderly close, also when this process
        # dies and its kernel closes the socket: what is still queued to
        # send is dropped, and the target drops what it has received and
        # not landed (sockio.c: sk_not_reset). An orderly close would send
        # the queue on after the process is gone, and a stopped target would
        # land it when it runs again, on memory given to someone else since
        # (tests/test_store_late_bytes.py: a killed writer's 1 MiB). The
        # native side resets a connection it ends already (conn_reset).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        if send_buffer:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)

        async def handshake() -> bytes:
            if source is not None:
                bind_source(s, source)
            cc.before_connect(s, host, port, congestion)
            await loop.sock_connect(s, (host, port))
            await loop.sock_sendall(s, hello_frame(token, role, index))
            ack = b""
            while len(ack) < DATA_HEADER.size:
                chunk = await loop.sock_recv(s, DATA_HEADER.size - len(ack))
                if not chunk:
                    raise ConnectionError("data connection closed during hello")
                ack += chunk
            return ack

        try:
            ack = await asyncio.wait_for(handshake(), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            why = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)
            via = f" from {source}" if source is not None else ""
            raise PeerUnreachableError(f"cannot open a data connection to {host}:{port}{via}: {why}",
                                       peer=peer) from None
        magic, kind, status, _tag, _addr, _len, window = DATA_HEADER.unpack(ack)
        if magic != DATA_MAGIC or kind != DATA_HELLO_ACK or status != 0:
            raise ProtocolError(f"{peer}: data connection to {host}:{port} refused", peer=peer)
        return s, window
    except BaseException:
        s.close()
        raise


async def control_addresses(host: str, advertise: str | None) -> list[str]:
    """The addresses the control connection may arrive on, for rails="auto"
    to leave their links out: the listen host (a literal, or what its name
    resolves to) and the advertised host (likewise). A wildcard listen host
    is none of them: with no `advertise`, nothing is left out (peers may
    come in by any link; the engine cannot tell which)."""
    found: list[str] = []
    for name in (host, advertise):
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


@dataclass
class TcpOptions:
    """The tcp provider's options (Engine(tcp_connections=, rails=, slice_size=)).

    connections: data connections per peer and rail (1..64 in all);
    rails: local rail addresses, or "auto" (from the topology at start);
    slice_size: bytes per slice (a slice is one frame on the wire);
    send_buffer, receive_buffer: SO_SNDBUF of the data connections this
    engine opens and SO_RCVBUF of those it accepts (0: the kernel's
    autotuning, up to several MiB each). A small send buffer keeps what the
    kernel holds ahead of a HIGH slice small, so the scheduler's order is
    what the wire sees; 512 KiB carry a link of 100 us round trip at 5+
    GB/s per connection. The receive side stays autotuned by default: a
    fixed 1 MiB one made the kernel prune (drop) queued data under load,
    a 200 ms retransmission stall (docs/qos.md);
    express: one more connection per peer for HIGH batches: a HIGH batch
    goes whole on it while the other connections have slices of a lower
    class on the wire, so that it never waits behind their bytes in the
    kernel's socket buffers, and spreads over every connection otherwise;
    batches below HIGH never use it (Engine(tcp_express=), env
    KVFLOW_TCP_EXPRESS; on by default);
    busy_poll: seconds a served data connection's thread that finds no
    frame keeps looking (yielding the CPU) before it sleeps (0: at once).
    The next small write after an ack then finds it awake: a wake-up from
    poll() is a cross-CPU interrupt, 20 us and more in a VM (docs/results.md);
    congestion: the data connections' TCP congestion control: "auto"
    (a pacing one such as BBR is replaced by cubic on connections within
    this host, where its pacing only costs), "system" (the host's), or an
    algorithm name (kvflow.providers.congestion; Engine(tcp_congestion=),
    env KVFLOW_TCP_CONGESTION)."""

    connections: int = 2
    rails: list[str] | str | None = None
    slice_size: int = 1 << 20
    express: bool = True
    send_buffer: int = 512 << 10
    receive_buffer: int = 0
    busy_poll: float = 50e-6
    congestion: str = cc.AUTO

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= MAX_CONNECTIONS or self.slice_size < 4096:
            raise InvalidArgumentError(f"tcp_connections must be 1..{MAX_CONNECTIONS} and slice_size >= 4096")
        for name in ("send_buffer", "receive_buffer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (v == 0 or 4096 <= v <= 1 << 30):
                raise InvalidArgumentError(f"tcp {name} must be 0 (the kernel's) or 4 KiB..1 GiB, not {v!r}")
        v = self.busy_poll
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BUSY_POLL:
            raise InvalidArgumentError(f"tcp_busy_poll must be 0..{MAX_BUSY_POLL:g} seconds, not {v!r}")
        self.congestion = cc.check_congestion(self.congestion)
        if self.rails is not None and not isinstance(self.rails, str):
            self.rails = list(self.rails)       # once: a generator would be spent by the "auto" test
        if self.auto:
            return
        self.rails = check_rails(self.rails)

    @property
    def auto(self) -> bool:
        """rails="auto": resolved at start, from the topology."""
        return self.rails == "auto" or self.rails == ["auto"]


class TcpProvider(Provider):
    """tcp: data connections per peer (tcp_connections per rail), slices
    spread over all of them, sent straight from registered memory and
    received straight into it; write acks on the loop (one rail: an ack
    connection of their own). The target side is a data listener per rail
    whose connections the native core serves once their hello shows a
    session token of an authenticated handshake."""

    name = "tcp"
    caps = Caps(remote=True, same_host=True, detached=True)
    # an idle loopback link, for estimate(): a round trip and the stream's rate
    LATENCY_S = 40e-6
    BYTES_PER_S = 3e9

    def __init__(self, ctx: ProviderContext, options: TcpOptions, *, host: str, advertise: str | None) -> None:
        self.ctx = ctx
        self.options = options
        self._host = host
        self._advertise = advertise
        self.rails = RailPlan([] if options.auto else list(options.rails or []))
        self._socks: list[socket.socket] = []
        self.endpoints: list[tuple[str, int]] = []
        self._accepts: list[asyncio.Task[None]] = []
        self._watchers: dict[int, RailWatcher] = {}     # id(channel) -> its watcher
        self._acks: dict[int, int] = {}                 # id(channel) -> its ack fd, read by the loop

    # ------------------------------------------------------------ lifecycle
    def use_topology(self, control_hosts: list[str]) -> None:
        """Takes the context's topology for the rails: their NICs, and with
        rails="auto" the rails themselves (Topology.tcp_rails for the
        location, the links of the control addresses left out)."""
        topology = self.ctx.topology
        assert topology is not None
        if self.options.auto:
            found = topology.tcp_rails(self.ctx.location, exclude=control_hosts)[:MAX_CONNECTIONS]
            if not found:
                log.warning("kvflow: rails=auto: the topology has no netdev with an IPv4 address for %s; "
                            "one rail on the listen host", self.ctx.location)
            else:
                log.info("kvflow: tcp rails for %s from the topology: %s", self.ctx.location,
                         ", ".join(f"{a} ({n})" for n, a in found))
            self.rails = RailPlan([str(ipaddress.ip_interface(a).ip) for _, a in found])
        self.rails.use_topology(topology, self.ctx.location)

    async def start(self) -> None:
        """The rails (use_topology), then a data listener per rail (one on
        the listen host without rails)."""
        self.use_topology(await control_addresses(self._host, self._advertise) if self.options.auto else [])
        self.ctx.core.set_tcp_busy_poll(int(self.options.busy_poll * 1e9))
        adv = self._advertise or (self._host if self._host not in ("0.0.0.0", "::") else socket.gethostname())
        for rail in self.rails.rails or [self._host]:
            ds = socket.socket(socket.AF_INET6 if ":" in rail else socket.AF_INET)
            self._socks.append(ds)
            ds.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.options.receive_buffer:
                # before listen(): accepted connections inherit it, and the
                # window scale they offer in the handshake matches it
                ds.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.options.receive_buffer)
            # before listen(): what it accepts starts with it (kvflow.providers.congestion)
            host_cc = cc.listener(ds, self.options.congestion)
            ds.bind((rail, 0))
            ds.listen(256)
            ds.setblocking(False)
            self.endpoints.append((rail if self.rails.rails else adv, ds.getsockname()[1]))
            self._accepts.append(self.ctx.loop.create_task(self._accept(ds, host_cc)))

    async def close(self) -> None:
        await cancel_and_wait(self._accepts)
        self._accepts = []
        for ds in self._socks:
            ds.close()
        for w in self._watchers.values():
            w.stop()
        self._watchers.clear()
        for fd in self._acks.values():
            self.ctx.loop.remove_reader(fd)
        self._acks.clear()

    async def _accept(self, listener: socket.socket, host_cc: str) -> None:
        loop = self.ctx.loop
        where = "%s:%d" % listener.getsockname()[:2]
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
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
            tune_data_socket(conn, self.ctx.keepalive)
            cc.accepted(conn, host_cc)
            # The native thread checks the session token before touching memory.
            self.ctx.core.serve(conn.detach())

    # ------------------------------------------------------------ descriptor
    def describe(self) -> dict[str, Any]:
        return {"data": list(self.endpoints),
                "rail_nics": list(self.rails.nics) if self.rails.rails else None}

    def reaches(self, address: str, remote: Descriptor) -> str | None:
        return None if remote.data else f"{address} publishes no tcp endpoint"

    def estimate(self, nbytes: int, entries: int) -> float:
        return self.LATENCY_S + nbytes / self.BYTES_PER_S

    # ------------------------------------------------------------ peers
    async def connect(self, link: PeerLink, remote: Descriptor, token: bytes) -> Any:
        if not remote.data:
            raise ProviderUnavailableError(f"{link.address} publishes no tcp endpoint", peer=link.address)
        # tcp_connections per rail (at most 64 in all); with one rail the
        # target sends write acks on an extra connection that this loop
        # reads directly, with several each connection carries its own (a
        # rail that dies takes its acks with it, nobody else's).
        groups = self.rails.plan(remote)
        per_rail = max(1, min(self.options.connections, MAX_CONNECTIONS // len(groups)))
        lanes = [g for g in groups for _ in range(per_rail)]
        express = self.options.express and len(lanes) < MAX_CONNECTIONS
        if express:
            lanes.append(groups[0])          # the express lane: HIGH batches only (the last index)
        plan = [DataConn(i, host, port, source) for i, (source, host, port) in enumerate(lanes)]
        keepalive = self.ctx.keepalive

        windows: list[int] = []     # the target's receive window, as its hello acceptances say
        # every socket opened, as it opens: if the connect is cancelled (its
        # timeout, the engine closing) while a rail is still trying, the
        # gather's results are lost, and these are what must be closed
        opened: list[socket.socket] = []

        async def open_one(c: DataConn, role: int, index: int | None = None) -> socket.socket:
            # index: the hello's index byte (a rebuilt connection's carries its epoch)
            s, window = await open_data_connection(self.ctx.loop, c.host, c.port, token, role,
                                                   c.index if index is None else index,
                                                   keepalive=keepalive, peer=link.address, source=c.source,
                                                   send_buffer=self.options.send_buffer,
                                                   congestion=self.options.congestion)
            windows.append(window)
            return s

        async def open_tracked(c: DataConn, role: int) -> socket.socket:
            s = await open_one(c, role)
            opened.append(s)
            return s

        ack_sock: socket.socket | None = None
        got: list[Any] = []
        try:
            if len(groups) == 1:
                # the ack connection first: the target sends acks on it once it exists
                ack_sock = await open_tracked(plan[0], DATA_ROLE_ACK)
            got = await asyncio.gather(*(open_tracked(c, DATA_ROLE_DATA) for c in plan),
                                       return_exceptions=True)
            errors = [g for g in got if isinstance(g, BaseException)]
            fatal = [g for g in errors if not isinstance(g, (PeerUnreachableError, ProtocolError))]
            if fatal:
                raise fatal[0]
            if errors and (len(groups) == 1 or len(errors) == len(got)):
                raise errors[0]
        except BaseException:
            for s in opened:
                s.close()
            raise
        for c, g in zip(plan, got):
            if isinstance(g, socket.socket):
                c.local = g.getsockname()[0]
            else:
                log.warning("kvflow: %s: rail %s:%d is down at connect (%s); it is retried in the background",
                            link.address, c.host, c.port, g)
        # All stay non-blocking: the loop reads the ack socket and may splice
        # small batches into a data socket; the native threads poll().
        fds = [g.detach() if isinstance(g, socket.socket) else -1 for g in got]
        channel = _core.TcpChannel(self.ctx.core, link.table, link.address, fds,
                                   ack_sock.detach() if ack_sock is not None else -1, self.options.slice_size,
                                   len(plan) - 1 if express else -1, max(windows, default=0))
        self._watchers[id(channel)] = RailWatcher(link.address, lambda: link.alive, channel, plan,
                                                  lambda c, tag: open_one(c, DATA_ROLE_DATA, tag),
                                                  grace=keepalive)
        return channel

    def started(self, link: PeerLink, channel: Any) -> None:
        w = self._watchers.get(id(channel))
        if w is not None:
            w.start()
        if channel.ack_fd >= 0:
            self._acks[id(channel)] = channel.ack_fd
            self.ctx.loop.add_reader(channel.ack_fd, self._on_acks, channel)

    def poller(self, channel: Any) -> Any:
        # the write acks a posting thread waits for come on the ack connection
        return channel.poll_acks_here if channel.ack_fd >= 0 else None

    def _on_acks(self, channel: Any) -> None:
        # Write acks read on the loop thread; their batches finish right here.
        if not channel.poll_acks():
            self._stop_acks(channel)
        self.ctx.batches.on_completions()

    def _stop_acks(self, channel: Any) -> None:
        # before the fd closes: a reused fd must not keep our reader
        fd = self._acks.pop(id(channel), None)
        if fd is not None:
            self.ctx.loop.remove_reader(fd)

    def closed(self, channel: Any) -> None:
        self._stop_acks(channel)
        w = self._watchers.pop(id(channel), None)
        if w is not None:
            w.stop()


    def connections(self, channel: Any) -> list[dict[str, Any]]:
        w = self._watchers.get(id(channel))
        return w.stats() if w is not None else []
