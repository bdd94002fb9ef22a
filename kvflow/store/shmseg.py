"""Same-host segments in shared memory: a holder's segment is a memfd,
and a client on the same host (and of the same user) maps it, so that
its get of an object held there is one memcpy per object from the mapping
into the caller's buffer, on the calling thread, instead of a kvflow read
(process_vm_readv on the engine's worker threads and a hop to them and
back); a put's writes into it likewise.

Holder: `segment()` allocates the memfd (sealed against shrinking, so a
reader's mapping never faults past its end) and maps it read/write; it is
registered with the engine as any segment, so every other path (tcp,
local) still works on it. `serve()` hands its descriptor to same-host
peers of its own user (shmsock.py: an abstract unix socket, SO_PEERCRED,
SCM_RIGHTS; such a peer may write the holder's memory with
process_vm_writev, kvflow's `local` provider, anyway). The connection
stays open: when the holder goes (closed, killed), the reader sees it end
and drops its mapping at once (the holder's memory is freed only when no
mapping of it is left).

Opt-in: KVFLOW_STORE_SHM=1, and only where the engine picks its
transports itself (protocols=None). Not the default because a memfd's
pages are shmem pages, which most hosts (this one: shmem_enabled=never)
keep out of transparent huge pages: a 4 MiB object's get from a mapping
ran 10-13 GB/s against 14-18 from the private, huge-paged segment it
replaces, while a 64 x 64 KiB get on the caller's thread took half the
time (0.41-0.45 ms against 0.89-1.62 ms, loaded host).

Reader: `copy()` moves one holder's entries of a get (or a put) through
the mapping, or declines (False: the caller moves them the kvflow way): no
server for that engine (another host, a segment not in shared memory, a
holder that went), a server of another user, a descriptor refused, a
range outside the mapped segment. It copies what the caller's call was
given, as the kvflow path does: a get, only objects found COMPLETE under
its read lease (held until the copy returned); a put, the space its
put_start allocated, before its put_end (readers see nothing before).
Nothing here decides what may be read or written.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.config import env_bool
from kvflow.errors import InvalidArgumentError

from .datapath import COPY_INLINE, finish_before_cancel
from .shmsock import Watcher, ask, serve

__all__ = ["ENABLED", "SameHost", "map_fd", "unmap"]

# KVFLOW_STORE_SHM=1 turns it on (else segments in private memory, gets the kvflow way)
ENABLED = hasattr(os, "memfd_create") and env_bool("KVFLOW_STORE_SHM") is True

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
_F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)
# a loop's copy from a mapping up to this many bytes runs on the loop's
# thread (0.15-0.4 ms of memcpy here), more on a worker thread: the hop to a
# worker and back costs about 0.3 ms on a loaded host, more than the copy
# (datapath's own-segment copies stop at 1 MiB: they are not the hot path)
COPY_INLINE_MAPPED = 4 * COPY_INLINE
# a copy past PARALLEL_MIN bytes is split over COPY_THREADS threads
PARALLEL_MIN = 4 << 20
COPY_THREADS = min(4, os.cpu_count() or 1)
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


def _copy(pairs: list[tuple[int, int, int]], total: int) -> None:
    """memmove of each (dst, src, n): on this thread, or, past
    PARALLEL_MIN bytes, in COPY_THREADS pieces of about equal bytes at once
    (this thread copies one): one thread's memcpy is memory bound well
    below what the host's cores move together (kvflow's own transfers use
    several worker threads too)."""
    memmove = ctypes.memmove        # releases the GIL while it copies
    if total <= PARALLEL_MIN or COPY_THREADS < 2:
        for dst, src, n in pairs:
            memmove(dst, src, n)
        return
    share = -(-total // COPY_THREADS)
    pieces: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, n in pairs:
        while n:
            k = min(n, room)
            pieces[-1].append((dst, src, k))
            dst, src, n, room = dst + k, src + k, n - k, room - k
            if not room:
                pieces.append([])
                room = share

    def run(piece: list[tuple[int, int, int]]) -> None:
        for d, s, k in piece:
            memmove(d, s, k)

    pool = _pool()
    futures = [pool.submit(run, p) for p in pieces[1:] if p]
    try:
        run(pieces[0])
    finally:
        for f in futures:           # every piece done before the caller may reuse the memory
            f.result()


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The copy threads (its own pool: a copy run on the loop's default
    executor waits for them, which must not wait for that executor)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvflow-store-copy")
        return _POOL


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
        self.reads = 0          # entries copied from a mapping (the metric that the path was taken)
        self.read_bytes = 0
        self.writes = 0         # entries copied into a mapping
        self.write_bytes = 0
        self.maps_dropped = 0   # mappings dropped: their holder went (or this client closed)
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping | float] = {}     # engine -> mapping, or when to ask again
        self._fd = -1
        self._addr = 0
        self._size = 0
        self._serving = False
        self._watcher: Watcher | None = None

    @classmethod
    def for_engine(cls, engine: Any) -> "SameHost | None":
        """One for a client of `engine`, or None: turned off, or the engine
        was given its transports (`protocols`): a client told to move its
        bytes over tcp (or any named list) moves them that way, maps no
        other process's memory and shares none of its own. With
        protocols=None kvflow picks the fastest way, and so does this."""
        if not ENABLED or engine.protocols is not None:
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
        # huge pages where the host gives them to shared memory
        # (transparent_hugepage/shmem_enabled "advise" or more): a private
        # segment has them (numpy asks), and 4 KiB pages make large copies and
        # kvflow's process_vm transfers of this segment slower
        _libc.madvise(addr, size, _MADV_HUGEPAGE)
        self._fd, self._addr, self._size = fd, addr, size
        return np.frombuffer((ctypes.c_uint8 * size).from_address(addr), np.uint8)

    def serve(self, engine_address: str) -> bool:
        """Serves the segment to same-host readers of this user; False when
        the socket's name is taken (another client of the same engine
        serves its own: readers then read this one the kvflow way)."""
        if self._fd < 0 or self._serving:
            return False
        try:
            serve(self._watching(), engine_address, self._fd, self._addr, self._size)
        except OSError:
            return False
        self._serving = True
        return True

    def _watching(self) -> Watcher:
        with self._lock:
            return self._watcher_locked()

    # -- the reader ------------------------------------------------------------
    def copy(self, op: str, holder: str, local: Sequence[int], remote: Sequence[int],
             length: Sequence[int]) -> bool:
        """Copies each (local, remote, length) entry, remote being in
        `holder`'s segment, through its mapping on this thread (op "read":
        remote -> local, "write": local -> remote): True; False (nothing
        copied) when the mapping cannot serve all of them."""
        if not local:
            return True
        m = self._acquire(holder)
        if m is None:
            return False
        try:
            runs = _runs(local, remote, length)
            base, end, delta = m.base, m.base + m.size, m.addr - m.base
            for _, at, n in runs:
                if at < base or at + n > end:
                    return False    # not this segment (another client of the same engine)
            if op == "read":
                pairs = [(dst, src + delta, n) for dst, src, n in runs]
            else:
                pairs = [(dst + delta, src, n) for src, dst, n in runs]
            total = sum(length)
            _copy(pairs, total)
            if op == "read":
                self.reads += len(local)
                self.read_bytes += total
            else:
                self.writes += len(local)
                self.write_bytes += total
            return True
        finally:
            self._let_go(m)

    async def move_groups(self, op: str, moves: Any, groups: dict[str, Sequence[int]]) -> None:
        """The loop's reads or writes (datapath.Mover): each holder of
        `groups` (its rows of `moves`) this process maps is copied through
        the mapping and removed from `groups`; the rest is left to
        kvflow. Up to COPY_INLINE_MAPPED bytes on the loop's thread, more on
        a worker thread (a cancel waits for the copy, as for the own
        segment)."""
        for holder in list(groups):
            rows = groups[holder]
            if len(rows) == len(moves):
                cols = (moves.local, moves.remote, moves.length)
            else:
                cols = tuple([c[j] for j in rows] for c in (moves.local, moves.remote, moves.length))
            if sum(cols[2]) <= COPY_INLINE_MAPPED:
                done = self.copy(op, holder, *cols)
            else:
                done = await finish_before_cancel(
                    asyncio.get_running_loop().run_in_executor(None, self.copy, op, holder, *cols))
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
        if self._watcher is not None:
            self._watcher.forget(m.sock)    # closed on its thread
        else:
            m.sock.close()
        m.dead = True
        self.maps_dropped += 1
        if not m.users:
            unmap(m.addr, m.size)

    def _map(self, holder: str) -> _Mapping | None:
        """Under the lock: asks `holder`'s server for its segment and maps
        it; None when there is none here or it cannot be used.
        The connection is watched: its end drops the mapping at once (a
        dead holder's memory is freed only when no mapping is left)."""
        try:
            sock, fd, base, size = ask(holder)
        except OSError:
            return None
        try:
            if not fcntl.fcntl(fd, _F_GET_SEALS) & _F_SEAL_SHRINK:
                raise PermissionError("the segment could shrink under the mapping")
            addr = map_fd(fd, size)
        except (OSError, InvalidArgumentError):
            sock.close()
            return None
        finally:
            os.close(fd)            # the mapping keeps the memory
        m = _Mapping(base, size, addr, sock)

        def holder_went(_: socket.socket) -> bool:
            with self._lock:
                if self._maps.get(holder) is m:
                    self._drop(holder, m)
            return True

        self._watcher_locked().watch(sock, holder_went)
        return m

    def _watcher_locked(self) -> Watcher:
        if self._watcher is None:
            self._watcher = Watcher()
            self._watcher.start()
        return self._watcher

    def close(self) -> None:
        """Stops serving (readers drop their mappings), drops every mapping
        here. The own segment is unmapped by `release_segment`, after the
        engine let go of it."""
        with self._lock:
            for holder, m in list(self._maps.items()):
                if isinstance(m, _Mapping):
                    self._drop(holder, m)
            self._maps.clear()
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()          # closes the listener and every connection
        self._serving = False

    def release_segment(self) -> None:
        """Unmaps and closes the own segment (the engine no longer has it
        registered, and nothing reads or writes it)."""
        if self._fd >= 0:
            unmap(self._addr, self._size)
            os.close(self._fd)
            self._fd = -1
