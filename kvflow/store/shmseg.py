"""Same-host segments in shared memory: a holder's segment is a memfd,
and a client on the same host (and of the same user) maps it read-only, so
that its get of an object held there is one memcpy per object from the
mapping into the caller's buffer, on the calling thread, instead of a
kvflow read (process_vm_readv on the engine's worker threads and a hop to
them and back).

Holder: `segment()` allocates the memfd (sealed against shrinking, so a
reader's mapping never faults past its end) and maps it read/write; it is
registered with the engine as any segment, so every other path (tcp,
local) still works on it. `serve()` listens on an abstract unix socket
named after the holder's engine address (only a process in the same
network namespace reaches it) and answers a peer of its own user
(SO_PEERCRED) with the segment's base and size and a read-only descriptor
of it (SCM_RIGHTS): the peer cannot map it writable. The connection stays
open: when the holder goes (closed, killed), the reader sees it end and
drops its mapping.

Reader: `read()` serves one holder's entries of a get from the mapping,
or declines (False: the caller moves them the kvflow way): no server for
that engine (another host, a segment not in shared memory, a holder that
went), a server of another user, a descriptor refused, a range outside
the mapped segment. It copies only what the caller's get found COMPLETE
under its read lease (the caller holds the lease until the copy returned),
as the kvflow path does; nothing here decides what may be read.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.errors import InvalidArgumentError

from .datapath import COPY_INLINE, finish_before_cancel

__all__ = ["ENABLED", "SameHost", "map_fd", "socket_name", "unmap"]

# KVFLOW_STORE_SHM=0 turns it off (segments in private memory, gets the kvflow way)
ENABLED = hasattr(os, "memfd_create") and os.environ.get("KVFLOW_STORE_SHM", "1") != "0"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
_F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)
_HELLO = b"kvflow-store-shm/1\n"
_PEERCRED = struct.Struct("3i")       # pid, uid, gid
# a loop's copy from a mapping up to this many bytes runs on the loop's
# thread (0.15-0.4 ms of memcpy here), more on a worker thread: the hop to a
# worker and back costs about 0.3 ms on a loaded host, more than the copy
# (datapath's own-segment copies stop at 1 MiB: they are not the hot path)
COPY_INLINE_MAPPED = 4 * COPY_INLINE
RETRY_AFTER = 2.0                     # seconds before asking again an engine that had no usable server


def map_fd(fd: int, size: int, *, writable: bool = True) -> int:
    """Maps `size` bytes of `fd` shared (read/write, or read-only); the
    address. The file must hold them (a descriptor from another process is
    checked: mapping past its end would fault on first touch, not here)."""
    if size <= 0:
        raise InvalidArgumentError(f"cannot map {size} bytes")
    if os.fstat(fd).st_size < size:
        raise InvalidArgumentError(f"the shared memory holds {os.fstat(fd).st_size} bytes, not {size}")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise InvalidArgumentError(f"mmap of {size} bytes: {os.strerror(ctypes.get_errno())}")
    return addr


def unmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)


def socket_name(engine_address: str) -> bytes:
    """The abstract socket a holder whose engine is at `engine_address`
    serves its segment on (the address is unique on a host while the
    engine lives)."""
    return b"\0kvflow_store_shm_" + hashlib.sha1(engine_address.encode()).hexdigest()[:24].encode()


def _peer_uid(sock: socket.socket) -> int:
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


def _runs(local: Sequence[int], remote: Sequence[int], length: Sequence[int]) -> list[tuple[int, int, int]]:
    """The entries with each run of consecutive ones (the next object
    follows the last on both sides, as a batch into one buffer from one
    put's allocations often does) joined: one copy per run, not per object
    (a ctypes call costs about 0.6 us, a tenth of a 64 KiB copy)."""
    runs = []
    d0 = s0 = n0 = -1
    for d, s, n in zip(local, remote, length):
        if d == d0 + n0 and s == s0 + n0:
            n0 += n
            continue
        if n0 >= 0:
            runs.append((d0, s0, n0))
        d0, s0, n0 = d, s, n
    runs.append((d0, s0, n0))
    return runs


class _Mapping:
    """A holder's segment mapped here: its base in the holder's address
    space, its size, where it is mapped, and the connection whose end says
    the holder went."""

    __slots__ = ("base", "size", "addr", "sock", "users", "dead")

    def __init__(self, base: int, size: int, addr: int, sock: socket.socket) -> None:
        self.base, self.size, self.addr, self.sock = base, size, addr, sock
        self.users = 0          # copies in progress (the mapping is unmapped only when none is)
        self.dead = False


class SameHost:
    """One StoreClient's side of it: its own segment (when it holds one)
    and the other holders' segments it mapped. Thread-safe: the client's
    loop and callers' threads read through it at once."""

    def __init__(self) -> None:
        self.reads = 0          # objects copied from a mapping (the metric that the path was taken)
        self.read_bytes = 0
        self.maps_dropped = 0   # mappings dropped because their holder went
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping | float] = {}     # engine -> mapping, or when to ask again
        self._fd = -1
        self._addr = 0
        self._size = 0
        self._server: _Server | None = None

    @classmethod
    def for_engine(cls, engine: Any) -> "SameHost | None":
        """One for a client of `engine`, or None: turned off, or the engine
        may not use kvflow's same-host transport (`local` not among its
        protocols: a client told to move its bytes over tcp only maps no
        other process's memory and shares none of its own)."""
        protocols = engine.protocols
        if not ENABLED or (protocols is not None and "local" not in protocols):
            return None
        return cls()

    # -- the holder ------------------------------------------------------------
    def segment(self, size: int) -> np.ndarray:
        """`size` bytes of shared memory for this client's segment (zeroed,
        pages taken on first touch): an array over them, to register with
        the engine."""
        fd = os.memfd_create("kvflow-store-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_GROW)
            addr = map_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._addr, self._size = fd, addr, size
        return np.frombuffer((ctypes.c_uint8 * size).from_address(addr), np.uint8)

    def serve(self, engine_address: str) -> bool:
        """Serves the segment to same-host readers of this user; False when
        the socket's name is taken (another client of the same engine
        serves its own: readers then read this one the kvflow way)."""
        if self._fd < 0 or self._server is not None:
            return False
        try:
            self._server = _Server(socket_name(engine_address), self._fd, self._addr, self._size)
        except OSError:
            return False
        self._server.start()
        return True

    # -- the reader ------------------------------------------------------------
    def read(self, holder: str, local: Sequence[int], remote: Sequence[int], length: Sequence[int]) -> bool:
        """Copies each (remote -> local, length) entry of `holder`'s segment
        from its mapping, on this thread: True; False (nothing copied) when
        the mapping cannot serve all of them."""
        if not local:
            return True
        m = self._acquire(holder)
        if m is None:
            return False
        try:
            runs = _runs(local, remote, length)
            base, end, delta = m.base, m.base + m.size, m.addr - m.base
            for _, src, n in runs:
                if src < base or src + n > end:
                    return False    # not this segment (another client of the same engine)
            memmove = ctypes.memmove        # releases the GIL while it copies
            for dst, src, n in runs:
                memmove(dst, src + delta, n)
            self.reads += len(local)
            self.read_bytes += sum(length)
            return True
        finally:
            self._let_go(m)

    async def read_groups(self, moves: Any, groups: dict[str, Sequence[int]]) -> None:
        """The loop's reads (datapath.Mover): each holder of `groups` (its
        rows of `moves`) this process maps is copied from the mapping and
        removed from `groups`; the rest is left to kvflow. Up to
        COPY_INLINE_MAPPED bytes on the loop's thread, more on a worker thread
        (a cancel waits for the copy, as for the own segment)."""
        for holder in list(groups):
            rows = groups[holder]
            if len(rows) == len(moves):
                cols = (moves.local, moves.remote, moves.length)
            else:
                cols = tuple([c[j] for j in rows] for c in (moves.local, moves.remote, moves.length))
            if sum(cols[2]) <= COPY_INLINE_MAPPED:
                done = self.read(holder, *cols)
            else:
                done = await finish_before_cancel(
                    asyncio.get_running_loop().run_in_executor(None, self.read, holder, *cols))
            if done:
                del groups[holder]

    def _acquire(self, holder: str) -> _Mapping | None:
        with self._lock:
            m = self._maps.get(holder)
            if type(m) is float:
                if time.monotonic() < m:
                    return None
                m = None
            if m is not None and self._gone(m):
                self._drop(holder, m)
                m = None
            if m is None:
                m = self._map(holder)
                self._maps[holder] = m if m is not None else time.monotonic() + RETRY_AFTER
                if m is None:
                    return None
            m.users += 1
            return m

    def _let_go(self, m: _Mapping) -> None:
        with self._lock:
            m.users -= 1
            if m.dead and not m.users:
                unmap(m.addr, m.size)

    @staticmethod
    def _gone(m: _Mapping) -> bool:
        """Whether the holder's end of the connection closed (it went)."""
        try:
            return m.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _drop(self, holder: str, m: _Mapping) -> None:
        """Under the lock: forgets the mapping; unmapped now, or by the last
        copy still reading it."""
        self._maps.pop(holder, None)
        m.sock.close()
        m.dead = True
        self.maps_dropped += 1
        if not m.users:
            unmap(m.addr, m.size)

    def _map(self, holder: str) -> _Mapping | None:
        """Asks `holder`'s server for its segment and maps it read-only;
        None when there is none here or it cannot be used."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(2.0)
            sock.connect(socket_name(holder))
            if _peer_uid(sock) != os.getuid():
                raise PermissionError("the segment's server is another user's")
            sock.sendall(_HELLO)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
            info = json.loads(msg)
            if len(fds) != 1 or "base" not in info:
                raise PermissionError(f"refused: {info.get('error', 'no descriptor')}")
            base, size = int(info["base"]), int(info["size"])
            if not fcntl.fcntl(fds[0], _F_GET_SEALS) & _F_SEAL_SHRINK:
                raise PermissionError("the segment could shrink under the mapping")
            addr = map_fd(fds[0], size, writable=False)
            sock.setblocking(False)
            return _Mapping(base, size, addr, sock)
        except (OSError, ValueError, KeyError, InvalidArgumentError):
            sock.close()
            return None
        finally:
            for fd in fds:          # the mapping keeps the memory; the descriptor is not needed
                os.close(fd)

    def close(self) -> None:
        """Stops serving (readers drop their mappings), drops every mapping
        here. The own segment is unmapped by `release_segment`, after the
        engine let go of it."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        with self._lock:
            for holder, m in list(self._maps.items()):
                if isinstance(m, _Mapping):
                    self._drop(holder, m)
            self._maps.clear()

    def release_segment(self) -> None:
        """Unmaps and closes the own segment (the engine no longer has it
        registered, and nothing reads or writes it)."""
        if self._fd >= 0:
            unmap(self._addr, self._size)
            os.close(self._fd)
            self._fd = -1


class _Server(threading.Thread):
    """The holder's socket: answers each peer of its own user with the
    segment (a read-only descriptor), keeps the connection open until the
    peer or this server closes it."""

    def __init__(self, name: bytes, fd: int, addr: int, size: int) -> None:
        super().__init__(name="kvflow-store-shm", daemon=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(name)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        # a read-only descriptor of the same memory: a reader cannot map it writable
        self._ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._info = json.dumps({"base": addr, "size": size}).encode()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._conns: set[socket.socket] = set()
        self.refused = 0

    def run(self) -> None:
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in self._sel.select():
                s = key.fileobj
                if s is self._wake_r:
                    return self._shut()
                if s is self._listener:
                    with contextlib.suppress(BlockingIOError):
                        self._accept(*self._listener.accept())
                    continue
                with contextlib.suppress(OSError):
                    if s.recv(4096):        # nothing more is expected: a peer that talks is let be
                        continue
                self._forget(s)             # the peer went

    def _accept(self, conn: socket.socket, _addr: object) -> None:
        try:
            conn.settimeout(1.0)
            if _peer_uid(conn) != os.getuid():
                self.refused += 1
                conn.sendall(json.dumps({"error": "another user"}).encode())
                conn.close()
                return
            if conn.recv(len(_HELLO)) != _HELLO:
                conn.close()
                return
            socket.send_fds(conn, [self._info], [self._ro])
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        self._conns.add(conn)
        self._sel.register(conn, selectors.EVENT_READ)

    def _forget(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        self._conns.discard(conn)
        conn.close()

    def _shut(self) -> None:
        for conn in list(self._conns):
            self._forget(conn)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        os.close(self._ro)

    def stop(self) -> None:
        self._wake_w.send(b"x")
        self.join(5.0)
        self._wake_w.close()
