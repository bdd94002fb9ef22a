"""tcp rails: data connections spread over several address pairs (one per
NIC), kept alive by the kernel's timers, and rebuilt when they fail.

A failed data connection hands its slices to the live ones natively
(kvflow/_native/tcp_client.c); this module opens data connections and runs
the per-peer watcher that brings a failed one back: it retries with
exponential back-off (the rail is "blacklisted" meanwhile: no slice is
placed on a dead connection) and probes the rail by connecting again.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.errors import PeerUnreachableError, ProtocolError
from kvflow.handshake import (
    DATA_HEADER,
    DATA_HELLO,
    DATA_HELLO_ACK,
    DATA_MAGIC,
    DATA_WIRE_VERSION,
)

if TYPE_CHECKING:
    from kvflow.peer import Peer

__all__ = ["DataConn", "RailWatcher", "bind_source", "open_data_socket", "tune_data_socket"]

log = logging.getLogger("kvflow")

CONNECT_TIMEOUT = 3.0       # a rail whose SYN goes unanswered this long is down
BACKOFF_MIN = 0.5
BACKOFF_MAX = 8.0
WATCH_INTERVAL = 0.5
EPOCH_SHIFT, EPOCH_MAX = 6, 3   # wire.h: a data hello's index byte is index | epoch << 6


def tune_data_socket(s: socket.socket, keepalive: float) -> None:
    """No Nagle; and with keepalive > 0, a connection whose sent bytes go
    unacknowledged (or whose peer stops answering probes) for about
    `keepalive` seconds fails with ETIMEDOUT instead of hanging, so that a
    dead rail is noticed while its slices can still move elsewhere."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive <= 0:
        return
    probe = max(1, int(keepalive / 3))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", probe), ("TCP_KEEPINTVL", probe), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(keepalive * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:
            s.setsockopt(socket.IPPROTO_TCP, opt, value)


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
                           timeout: float = CONNECT_TIMEOUT, source: str | None = None) -> socket.socket:
    """Connects (from local address `source` when given: the rail it was
    paired with), sends the hello and waits for its acceptance. Returns the
    non-blocking socket; raises PeerUnreachableError (or ProtocolError when
    the target refuses the hello)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setblocking(False)
        tune_data_socket(s, keepalive)

        async def handshake() -> bytes:
            if source is not None:
                bind_source(s, source)
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
        magic, kind, status = DATA_HEADER.unpack(ack)[:3]
        if magic != DATA_MAGIC or kind != DATA_HELLO_ACK or status != 0:
            raise ProtocolError(f"{peer}: data connection to {host}:{port} refused", peer=peer)
        return s
    except BaseException:
        s.close()
        raise


@dataclass
class DataConn:
    """Where data connection `index` of a channel goes (from which local
    rail address: None lets the kernel choose), and its rebuild state."""
    index: int
    host: str
    port: int
    source: str | None = None
    local: str | None = None       # the address it left from, last time it was opened
    backoff: float = BACKOFF_MIN
    next_try: float = 0.0
    down_since: float | None = None
    rebuilt: int = 0


@dataclass
class RailWatcher:
    """Rebuilds a tcp peer's failed data connections (see the module doc)."""
    peer: "Peer"
    conns: list[DataConn]
    token: bytes
    role: int
    keepalive: float
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def stats(self) -> list[dict[str, Any]]:
        """Per data connection: endpoint, source (the local rail it is
        bound to; None: the kernel's choice), local (the address it left
        from), up, bytes, slices moved, failures, rebuilds."""
        native = self.peer._channel.conn_stats() if hasattr(self.peer._channel, "conn_stats") else []
        out = []
        for c, n in zip(self.conns, native):
            out.append({"index": c.index, "endpoint": f"{c.host}:{c.port}", "source": c.source,
                        "local": c.local, **n,
                        "rebuilt": c.rebuilt})
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        peer = self.peer
        while not (peer._closed or peer._control_lost):
            await asyncio.sleep(WATCH_INTERVAL)
            channel = peer._channel
            if not hasattr(channel, "dead_conns"):
                return
            now = loop.time()
            for i in channel.dead_conns():
                c = self.conns[i]
                if c.down_since is None:
                    c.down_since, c.next_try, c.backoff = now, now + BACKOFF_MIN, BACKOFF_MIN
                    log.warning("kvflow: %s: data connection %d (%s:%d) failed; its slices moved to "
                                "the other connections", peer.address, i, c.host, c.port)
                if now < c.next_try:
                    continue
                c.next_try = loop.time() + c.backoff
                c.backoff = min(c.backoff * 2, BACKOFF_MAX)
                # the hello carries the connection's next epoch: the target
                # echoes it in acks, so acks of the connection it replaces
                # are told apart (wire.h, KVF_CONN_EPOCH_*)
                tag = i | (((c.rebuilt + 1) & EPOCH_MAX) << EPOCH_SHIFT)
                try:
                    s = await open_data_socket(loop, c.host, c.port, self.token, self.role, tag,
                                               keepalive=self.keepalive, peer=peer.address, source=c.source)
                except (PeerUnreachableError, ProtocolError, OSError) as e:
                    log.debug("kvflow: %s: rebuilding data connection %d: %s", peer.address, i, e)
                    continue
                if peer._closed or peer._channel is not channel:
                    s.close()
                    return
                local = s.getsockname()[0]
                if not channel.replace(i, s.detach()):
                    continue
                c.local = local
                log.warning("kvflow: %s: data connection %d (%s:%d) is back after %.1f s",
                            peer.address, i, c.host, c.port, loop.time() - c.down_since)
                c.down_since = None
                c.rebuilt += 1
