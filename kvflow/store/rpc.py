"""The client's end of the master: one call = one round trip, over tcp
(`TcpMasterLink`) or, with the master in this process, a direct call
(`LocalMasterLink`). Both raise the master's typed errors, and
MasterUnavailableError when the master cannot be reached.

Each call owns its timeout: a call that times out or is cancelled drops
its waiter, its late reply is ignored, and the link stays usable."""
from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvflow.config import env_float
from kvflow.errors import InvalidArgumentError, KVFlowError, ProtocolError

from .errors import MasterUnavailableError, error_from_code
from .master import Master, Session
from .wire import HEAD, MAX_FRAME, FrameBuffer, decode, encode

# How long a caller's-thread call polls for its reply before it sleeps in
# recv (BlockingQuery._first); 0 turns the polling off.
_SPIN_US = env_float("KVFLOW_STORE_SPIN_US")
SPIN_S = (200.0 if _SPIN_US is None else _SPIN_US) / 1e6

__all__ = ["MasterLink", "TcpMasterLink", "LocalMasterLink", "HeartbeatThread", "BlockingQuery", "connect_master"]


class MasterLink:
    closed: bool
    #: called with (method, args) for each notice the master pushes to this
    #: client unasked (an SSD load a reader elsewhere waits for): set by the client
    on_notice: Callable[[str, list], None] | None = None

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def notify(self, method: str, *args: Any) -> None:
        """Sends a call whose answer nobody waits for (a lease release): no
        round trip, and safe from a finally block (it never awaits)."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class LocalMasterLink(MasterLink):
    """The master in this process: calls are plain function calls."""

    def __init__(self, master: Master) -> None:
        self.master = master
        self.session: Session = master.session()
        self.session.push = self._pushed
        self.closed = False

    def _pushed(self, method: str, args: list) -> None:
        if self.on_notice is not None and not self.closed:
            self.on_notice(method, args)

    def __repr__(self) -> str:
        return f"<LocalMasterLink {self.master!r}>"

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self.closed or self.session.closed:
            raise MasterUnavailableError("the link to the in-process master is closed")
        if self.master.journal is None:
            return self.master.dispatch(self.session, method, list(args))
        return await self.master.call(self.session, method, list(args))

    def notify(self, method: str, *args: Any) -> None:
        if not (self.closed or self.session.closed):
            try:
                self.master.dispatch(self.session, method, list(args))
            except KVFlowError:
                pass

    async def close(self) -> None:
        self.closed = True
        self.session.close()


class TcpMasterLink(MasterLink, asyncio.Protocol):
    """Requests pipelined on one connection; replies matched by id, in
    data_received (a protocol, not streams: no reader task hop per reply)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future] = {}
        self._frames = FrameBuffer()
        self._lost: KVFlowError | None = None
        self._transport: asyncio.Transport | None = None
        self.closed = False

    def __repr__(self) -> str:
        return f"<TcpMasterLink {self.address}{' closed' if self.closed else ''}>"

    @classmethod
    async def open(cls, address: str, *, timeout: float = 5.0) -> "TcpMasterLink":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"master address must be host:port, not {address!r}")
        link = cls(address)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().create_connection(lambda: link, host, int(port))
        except (OSError, TimeoutError) as e:
            raise MasterUnavailableError(f"master {address} unreachable: {e or 'timeout'}") from None
        return link

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            msgs = self._frames.feed(data)
            for msg in msgs:
                if not (isinstance(msg, list) and len(msg) == 3):
                    raise ProtocolError("malformed reply from the master")
                rid, failed, result = msg
                if rid == 0 and type(failed) is str:        # a notice the master pushed: [0, method, args]
                    if self.on_notice is not None:
                        self.on_notice(failed, result)
                    continue
                fut = self._waiters.pop(rid, None)
                if fut is None or fut.done():          # its caller timed out or was cancelled
                    continue
                if failed:
                    code, message, key = result
                    fut.set_exception(error_from_code(code, message, key))
                else:
                    fut.set_result(result)
        except (ProtocolError, ValueError, TypeError) as e:
            self._lost = MasterUnavailableError(f"master {self.address}: {e}")
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._lost is None:
            self._lost = MasterUnavailableError(f"connection to master {self.address} lost"
                                                + (f": {exc!r}" if exc else ""))
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(self._lost)
        self._waiters.clear()

    # -- calls -----------------------------------------------------------------
    async def call(self, method: str, *args: Any, timeout: float | None = 10.0) -> Any:
        if self.closed:
            raise self._lost or MasterUnavailableError(f"link to master {self.address} is closed")
        rid = next(self._ids)                       # from 1: id 0 is a notice
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            self._transport.write(encode([rid, method, list(args)]))
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise MasterUnavailableError(f"master {self.address}: {method} timed out after {timeout} s") from None
        finally:
            self._waiters.pop(rid, None)

    def notify(self, method: str, *args: Any) -> None:
        if not self.closed and self._transport is not None:
            self._transport.write(encode([0, method, list(args)]))     # id 0: no reply

    async def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._lost = MasterUnavailableError("link closed")
            self._transport.close()
        self.closed = True


async def connect_master(master: "str | Master", *, timeout: float = 5.0) -> MasterLink:
    if isinstance(master, Master):
        return LocalMasterLink(master)
    if isinstance(master, str):
        return await TcpMasterLink.open(master, timeout=timeout)
    raise InvalidArgumentError(f"master must be 'host:port' or a Master, not {type(master).__name__}")


class BlockingQuery:
    """Read-only calls (batch_exists) from the caller's own thread on a
    blocking socket of their own: no hop to the client's event loop and
    back, which is most of a small query's cost for a synchronous caller
    (the Mooncake API). The connection registers as no client (the master
    answers batch_exists and stats to anyone), so its closing loses no
    one. One call at a time (a lock); any failure closes the socket and
    raises MasterUnavailableError, and the caller falls back to its link."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                if self._sock is None:
                    host, _, port = self.address.rpartition(":")
                    self._sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rid = next(self._ids)
                self._sock.sendall(encode([rid, method, list(args)]))
                msg = self._read()
            except (OSError, ValueError, ProtocolError) as e:
                self.close()
                raise MasterUnavailableError(f"master {self.address}: {e or 'closed'}") from None
        if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == rid):
            self.close()
            raise MasterUnavailableError(f"master {self.address}: malformed reply")
        _, failed, result = msg
        if failed:
            code, message, key = result
            raise error_from_code(code, message, key)
        return result

    def _read(self) -> Any:
        # a small reply (a batch_exists of a few hundred keys) comes whole in
        # the first recv: decoded from it, no buffer to grow or copy
        sock = self._sock
        buf = self._first(sock)
        while len(buf) < 4:
            buf += self._more(sock)
        (n,) = HEAD.unpack_from(buf)
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        if len(buf) < 4 + n:
            parts = [buf]
            have = len(buf)
            while have < 4 + n:
                parts.append(self._more(sock, 4 + n - have))
                have += len(parts[-1])
            buf = b"".join(parts)
        if len(buf) != 4 + n:       # one call at a time: nothing may follow the reply
            raise ProtocolError("unexpected bytes after the reply")
        return decode(memoryview(buf)[4:])

    def _first(self, sock: socket.socket) -> bytes:
        # The reply of a small call comes within tens of microseconds; a
        # thread asleep in recv() takes ~60 us more to be woken on these
        # hosts (a blocking echo between two processes on loopback: 93 us
        # p50; the same while the caller polls: 30 us). So the caller polls
        # without blocking for up to SPIN_S (each recv drops the GIL: other
        # threads run meanwhile), then sleeps in recv as before.
        # (A socket with a timeout polls before each recv, whatever its flags:
        # timeout 0 for the polling, the call's timeout again for the sleep.)
        end = time.perf_counter() + SPIN_S
        sock.settimeout(0.0)
        try:
            while True:
                try:
                    chunk = sock.recv(65536)
                    break
                except BlockingIOError:
                    if time.perf_counter() >= end:
                        sock.settimeout(self.timeout)
                        chunk = sock.recv(65536)
                        break
        finally:
            sock.settimeout(self.timeout)
        if not chunk:
            raise ProtocolError("connection closed")
        return chunk

    @staticmethod
    def _more(sock: socket.socket, n: int = 65536) -> bytes:
        chunk = sock.recv(max(n, 65536))
        if not chunk:
            raise ProtocolError("connection closed")
        return chunk

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class HeartbeatThread(threading.Thread):
    """Heartbeats from a thread of their own, on a connection of their own,
    so that a client whose event loop is blocked (a long GIL-holding step of
    the host application) is not declared lost while its process lives and
    its engine's native threads still serve its segment (STYLE rule 18:
    liveness the host application cannot starve). Each beat is a one-way
    notice (`beat`, client id, the token the master gave at registration)."""

    def __init__(self, address: str, client_id: str, token: str, interval: float) -> None:
        super().__init__(name=f"kvflow-store-beat-{client_id}", daemon=True)
        self.client_id = client_id
        self._interval = interval
        self._stop_event = threading.Event()
        self._moved = False
        self.sent = 0
        self.retarget(address, token)

    def retarget(self, address: str, token: str) -> None:
        """Beats go to `address` with `token` from now on (the client
        re-registered with a new leader). Two attribute stores the thread
        reads once per beat; a beat between them goes to the old master,
        which ignores it."""
        host, _, port = address.rpartition(":")
        self._frame = encode([0, "beat", [self.client_id, token]])
        self._where = (host, int(port))
        self._moved = True

    def run(self) -> None:
        sock: socket.socket | None = None
        try:
            while not self._stop_event.wait(self._interval):
                try:
                    if self._moved and sock is not None:
                        sock.close()
                        sock = None
                    self._moved = False
                    if sock is None:
                        sock = socket.create_connection(self._where, timeout=self._interval)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(self._frame)
                    self.sent += 1
                except OSError:
                    if sock is not None:
                        sock.close()
                    sock = None            # the master is away: try again next beat
        finally:
            if sock is not None:
                sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
