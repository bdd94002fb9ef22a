"""Mooncake's dummy client: `MooncakeDistributedStore.setup_dummy(mem_pool_size,
local_buffer_size, server_address)` makes the store a thin forwarder to a
standalone real client (`python -m kvflow.compat.mooncake.client`, the
shim's `mooncake_client`) that holds the segment, the engine and the
StoreClient. Every call the store makes on its StoreClient goes to the
real client as one request on a local socket (dummy_wire.py: one round
trip per batch call, whatever its size), and the real client runs the same
StoreClient call there, so the codes are those of a store of its own.

Memory: put_from / get_into and their batch and multi-buffer forms name
addresses in this process. A buffer is usable once register_buffer() has
handed its shared memory (shm.py: `MooncakeHostMemAllocator`, the store's
alloc_from_mem_pool) to the real client, which maps the same pages and
reads and writes them directly; as Mooncake, register_buffer takes exactly
one allocation (its start and its size), and an address outside what was
registered is refused by the real client with -600 (INVALID_PARAMS).
Bytes (put/get, tensors without `_from`) travel inside the messages, where
Mooncake's dummy stages them through its local buffer; mem_pool_size and
local_buffer_size are taken and not used (Mooncake does not use
mem_pool_size either).

The store's calls stay store.py's: this module gives the store a StoreClient
stand-in (`DummyClient`) and a loop thread (`DummyThread`) whose `engine`
lists the buffers registered here (what the store's overlap check and
get_into_ranges read)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from kvflow.engine.thread import EngineThread
from kvflow.errors import InvalidArgumentError, KVFlowError
from kvflow.store import MasterUnavailableError
from kvflow.tasks import cancel_and_wait

from . import shm
from .dummy_wire import recv_frame, send_frame, socket_name
from .store_setup import shutdown

__all__ = ["DummyClient", "DummyThread", "setup_dummy"]

log = logging.getLogger("kvflow.compat.mooncake")

STORE_SETUP_FAILED = -1      # Mooncake's setup_dummy: -1 when the real client cannot be reached


@dataclass(frozen=True)
class ShmRegion:
    """A registered shared-memory buffer, as the store keeps its regions."""
    addr: int
    size: int
    name: str

    @property
    def end(self) -> int:
        return self.addr + self.size


class LocalRegions:
    """DummyThread's `engine`: the buffers this dummy registered (the store
    reads `regions` for its overlap check and get_into_ranges' bounds)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._regions: dict[int, ShmRegion] = {}

    @property
    def regions(self) -> list[ShmRegion]:
        return sorted(self._regions.values(), key=lambda r: r.addr)

    def add(self, region: ShmRegion) -> None:
        self._regions[region.addr] = region

    def discard(self, addr: int) -> None:
        self._regions.pop(addr, None)

    def clear(self) -> None:
        self._regions.clear()


class DummyThread(EngineThread):
    """The store's loop thread without an engine of its own (the real
    client's engine moves the bytes): `engine` is the LocalRegions."""

    def __init__(self, address: str) -> None:
        super().__init__(thread_name="kvflow-mooncake-dummy")
        self.local = LocalRegions(address)

    def _run(self, ready: concurrent.futures.Future) -> None:      # EngineThread's, with no Engine
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._on_loop_error)
        self.loop = loop
        ready.set_result(self.local)
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            loop.run_until_complete(cancel_and_wait(pending))
            loop.close()


class DummyClient:
    """The StoreClient calls store.py, tensor.py and replica_tasks.py make,
    each one request to the real client. Any number of threads may call:
    each request takes an idle connection (or opens one) for its round trip;
    the first connection stays open while the dummy lives, so the real
    client keeps this dummy's mappings until it closes or exits."""

    def __init__(self, port: int, local: LocalRegions) -> None:
        self.port = port
        self.id = uuid.uuid4().hex
        self._local = local
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.root_fs_dir = ""
        self._anchor = self._connect()          # raises OSError when no real client listens
        try:
            self.hello = self._hello(self._anchor)
        except BaseException:
            self._anchor.close()
            raise

    # ------------------------------------------------------------ connections
    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(socket_name(self.port))
        except OSError:
            sock.close()
            raise
        return sock

    def _rpc_on(self, sock: socket.socket, method: str, args: list, kw: dict | None = None,
                fds: tuple[int, ...] = ()) -> tuple[int, Any]:
        """(status, result) of one round trip; OSError/EOFError when the
        connection breaks."""
        send_frame(sock, [method, args, kw or {}], fds)
        (status, result), extra = recv_frame(sock)
        for fd in extra:            # the real client never sends any; never keep one
            socket.close(fd)
        return status, result

    def _rpc(self, method: str, args: list, kw: dict | None = None, fds: tuple[int, ...] = ()) -> Any:
        """One round trip on an idle connection (a new one when none is);
        raises the error the real client answered with."""
        if self._closed:
            raise KVFlowError("the dummy client is closed")
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        try:
            if sock is None:
                sock = self._connect()
                self._hello(sock)
            status, result = self._rpc_on(sock, method, args, kw, fds)
        except (OSError, EOFError, KVFlowError) as e:
            if sock is not None:
                sock.close()        # the stream may be mid-frame: never reused
            if isinstance(e, KVFlowError):
                raise
            raise MasterUnavailableError(f"the real client on port {self.port} is gone: {e}") from None
        with self._lock:
            if self._closed:
                sock.close()
            else:
                self._idle.append(sock)
        if status != 0:
            raise result if isinstance(result, KVFlowError) else KVFlowError(str(result))
        return result

    def _hello(self, sock: socket.socket) -> dict:
        status, result = self._rpc_on(sock, "hello", [self.id])
        if status != 0:
            raise result if isinstance(result, KVFlowError) else KVFlowError(str(result))
        return result

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        # a worker thread blocks on the socket, so calls from several
        # threads of the application run at once on the real client
        return await asyncio.to_thread(self._rpc, method, list(args), kw)

    # ------------------------------------------------------------ StoreClient's calls
    async def batch_put(self, keys: list[str], values: list[Any], **kw: Any) -> list:
        return await self._call("batch_put", list(keys), [bytes(v) for v in values], **kw)

    async def batch_put_from(self, keys: list[str], addrs: list[int], sizes: list[int], **kw: Any) -> list:
        return await self._call("batch_put_from", list(keys), list(addrs), list(sizes), **kw)

    async def batch_put_from_parts(self, keys: list[str], parts: list, **kw: Any) -> list:
        return await self._call("batch_put_from_parts", list(keys), [[list(p) for p in ps] for ps in parts], **kw)

    async def batch_get(self, keys: list[str]) -> list:
        return await self._call("batch_get", list(keys))

    async def batch_get_into_parts(self, keys: list[str], parts: list) -> list:
        return await self._call("batch_get_into_parts", list(keys), [[list(p) for p in ps] for ps in parts])

    async def batch_exists(self, keys: list[str]) -> list:
        return await self._call("batch_exists", list(keys))

    def batch_exists_blocking(self, keys: list[str]) -> list | None:
        """batch_exists from the calling thread (no hop to the loop and a
        worker): the answers, or None when one is an error or the real
        client cannot be reached (then the store asks batch_exists, which
        turns them into codes)."""
        try:
            found = self._rpc("batch_exists", [list(keys)])
        except KVFlowError:
            return None
        return found if all(isinstance(f, bool) for f in found) else None

    async def batch_remove(self, keys: list[str], *, force: bool = False) -> list:
        return await self._call("batch_remove", list(keys), force=bool(force))

    async def size(self, key: str) -> int:
        return await self._call("size", key)

    async def stats(self, *, timeout: float | None = None) -> dict:
        return await asyncio.wait_for(self._call("stats"), timeout)

    async def remove_all(self, *, force: bool = False) -> int:
        return await self._call("remove_all", force=bool(force))

    async def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        return await self._call("remove_by_regex", pattern, force=bool(force))

    async def query_task(self, task_id: tuple[int, int]) -> Any:
        return await self._call("query_task", list(task_id))

    async def replica_desc(self, key: str) -> list:
        return await self._call("replica_desc", key)

    async def create_copy_task(self, key: str, targets: list[str]) -> tuple[int, int]:
        return tuple(await self._call("create_copy_task", key, list(targets)))

    async def create_move_task(self, key: str, source: str, target: str) -> tuple[int, int]:
        return tuple(await self._call("create_move_task", key, source, target))

    # ------------------------------------------------------------ memory
    def register_buffer(self, buffer: tuple[int, int], *, name: str | None = None) -> ShmRegion:
        """Hands the shared memory at buffer (address, size) to the real
        client: it must be exactly one allocation of shm.py, as Mooncake's
        ShmHelper requires. InvalidArgumentError otherwise."""
        addr, size = buffer
        seg = shm.segment_at(addr)
        if seg is None:
            raise InvalidArgumentError(f"{addr:#x} is not in shared memory (MooncakeHostMemAllocator or "
                                       "alloc_from_mem_pool): a real client cannot reach it")
        if (seg.addr, seg.size) != (addr, size):
            raise InvalidArgumentError(f"register {addr:#x}+{size}: the shared memory there is "
                                       f"{seg.addr:#x}+{seg.size}, and is registered whole")
        self._rpc("map", [addr, size], fds=(seg.fd,))
        region = ShmRegion(addr, size, name or f"{addr:#x}")
        self._local.add(region)
        return region

    def unregister_buffer(self, region: ShmRegion) -> None:
        self._local.discard(region.addr)
        self._rpc("unmap", [region.addr])

    async def close(self) -> None:
        """The connections go; the real client then drops this dummy's
        mappings (its own copies of the pages)."""
        with self._lock:
            self._closed = True
            socks, self._idle = self._idle + [self._anchor], []
        for s in socks:
            s.close()
        self._local.clear()


def _port(server_address: str) -> int:
    host, sep, port = str(server_address).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"server_address {server_address!r}: host:port of a real client")
    return int(port)


def setup_dummy(store: Any, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
    """store.setup_dummy(): 0, or -1 when no real client answers at
    server_address's port on this host (the last error says why)."""
    for value, what in ((mem_pool_size, "mem_pool_size"), (local_buffer_size, "local_buffer_size")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{what} must be a non-negative int")
    if not isinstance(server_address, str):
        raise TypeError("server_address must be a str")
    if store._client is not None:
        return 0                # as setup(): a set-up store stays as it is
    try:
        port = _port(server_address)
    except InvalidArgumentError as e:
        return store._fail(e, STORE_SETUP_FAILED)
    thread = DummyThread(f"dummy of {server_address}")
    try:
        client = DummyClient(port, thread.local)
    except (OSError, EOFError, KVFlowError) as e:
        why = e if isinstance(e, KVFlowError) else MasterUnavailableError(
            f"no kvflow real client at {server_address} (python -m kvflow.compat.mooncake.client --port={port}): {e}")
        return store._fail(why, STORE_SETUP_FAILED)
    thread.start()
    store._thread, store._own_thread, store._client = thread, True, client
    store._hostname = str(client.hello.get("hostname", ""))
    store._finalizer = weakref.finalize(store, shutdown, thread, client, store._buffers, True)
    log.debug("kvflow.compat.mooncake: dummy client of %s (segment %s)", server_address, store._hostname)
    return 0
