"""tcp data connections: opened with the session token's hello, tuned so
that a dead rail is noticed by the kernel's timers, and bound to the local
rail they were paired with. kvflow.schedule.rails rebuilds failed ones."""
from __future__ import annotations

import asyncio
import logging
import socket

from kvflow.errors import PeerUnreachableError, ProtocolError
from kvflow.control.wire import (
    DATA_HEADER,
    DATA_HELLO,
    DATA_HELLO_ACK,
    DATA_MAGIC,
    DATA_WIRE_VERSION,
)

__all__ = ["bind_source", "hello_frame", "open_data_socket", "tune_data_socket"]

log = logging.getLogger("kvflow")

CONNECT_TIMEOUT = 3.0       # a rail whose SYN goes unanswered this long is down


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
