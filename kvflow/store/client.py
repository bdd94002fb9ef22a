"""StoreClient: a process's member of the pool.

    async with StoreClient(master="10.0.0.1:50051", segment_size=1 << 30) as store:
        await store.put("k", b"bytes")
        assert await store.get("k") == b"bytes"

It mounts `segment_size` bytes of host memory (registered with its kvflow
Engine) into the pool, and keeps `local_buffer_size` bytes of registered
memory to stage put()/get() of Python bytes. put_from/get_into move bytes
straight between memory the caller registered (`register_buffer`) and the
holders' segments: a put is kvflow writes into the replicas the master
allocated, then a commit; a get asks for the replicas (one round trip,
granting a read lease) and reads the nearest (this process, this host,
the network), falling back to the next replica within the same call when
a holder is lost.

Objects are immutable: putting a key that exists (with the same size) is a
no-op success, as SGLang's and vLLM's store code expects (they check
existence first and put only what is missing).

Batch forms return one result per key, in order: the value, or the
KVFlowError that key met (the others still went through); errors of the
whole call (master unreachable, malformed arguments) raise. The single
forms raise their key's error.
"""
from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

import kvflow
from kvflow.errors import InvalidArgumentError, KVFlowError, UnregisteredMemoryError

from .allocator import Allocator
from .datapath import Mover, Moves
from .follow import FollowingLink, finder_for
from .errors import (BufferTooSmallError, LeaseExpiredError, MasterUnavailableError, ObjectNotFoundError,
                     ReplicaUnavailableError, SsdBusyError, StoreTimeoutError, error_from_code)
from .master import Master
from .metrics import ClientCounters, counted
from .model import MAX_KEY_BYTES, check_key
from .ssd_agent import SsdAgent, SsdCopies, promote, read_copies
from .rpc import BlockingQuery, HeartbeatThread, MasterLink, TcpMasterLink, connect_master

__all__ = ["StoreClient", "Replica"]

Parts = Sequence[tuple[int, int]]

# One master per event loop for clients given no master address: the first
# client starts it, the last one to close stops it.
_EMBEDDED: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list]" = weakref.WeakKeyDictionary()


class Replica(tuple):
    """(segment id, client id, holder engine address, holder host, address)."""
    __slots__ = ()

    segment = property(lambda self: self[0])
    client = property(lambda self: self[1])
    engine = property(lambda self: self[2])
    host = property(lambda self: self[3])
    addr = property(lambda self: self[4])


def _with_timeout(fn):
    """Gives a public call a keyword-only `timeout=` (seconds, None: the
    client's own per-step timeouts only). The whole call runs under it; on
    expiry it is cancelled, which undoes what it started (revokes a put's
    allocations, releases a get's lease, drains its transfers) before
    StoreTimeoutError is raised."""
    @functools.wraps(fn)
    async def call(self, *args: Any, timeout: float | None = None, **kw: Any) -> Any:
        if timeout is None:
            return await fn(self, *args, **kw)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, not {timeout!r}")
        cm = asyncio.timeout(timeout)
        try:
            async with cm:
                return await fn(self, *args, **kw)
        except TimeoutError:
            if cm.expired():
                raise StoreTimeoutError(f"{fn.__name__} did not finish within {timeout} s") from None
            raise
    return call


def _replica_rows(reply: dict) -> tuple[list, dict]:
    """A put_start/get_replicas reply: its items, and its segments table
    (segment id -> [client, engine, host])."""
    return reply["items"], reply["segments"]


def _one_part(key: Any, ps: Any, starts: list[int], ends: list[int]) -> int:
    """The size of an object given as one (int address, int size) part of
    registered host memory under a plain valid key; 0 for anything else
    (then the caller's full checks run and raise the right error)."""
    if type(key) is not str or not key or len(key) > MAX_KEY_BYTES // 4 or type(ps) is not list \
            or len(ps) != 1:
        return 0
    p = ps[0]
    if type(p) is not tuple or len(p) != 2:
        return 0
    a, n = p
    if type(a) is not int or type(n) is not int or a <= 0 or n <= 0:
        return 0
    i = bisect.bisect_right(starts, a) - 1
    if i < 0 or a + n > ends[i]:
        return 0
    return n


def _result(item: Any, key: str) -> Any:
    if item is True or item is False:          # batch_exists' compact items
        return item
    if item[0] == 0:
        return item[1]
    return error_from_code(item[1], item[2], key)


class StoreClient:
    """A member of the pool. `master`: "host:port" of a standalone master,
    "etcd://host:port/cluster" or a list of "host:port" (follow the
    cluster's leader across restarts and failovers: kvflow/store/follow.py),
    a `Master` object, or None for the master embedded in this process
    (started by the first such client). `engine`: a started kvflow.Engine
    to use (else the client starts its own with `listen`/`protocols`).
    `segment_size`: bytes this client contributes (0: none).
    `local_buffer_size`: staging memory for put()/get() of bytes (0: only
    put_from/get_into). `timeout`: seconds each call's transfers and master
    round trips may take. `replica_num`: the default per put.
    `master_listen`: "host:port" where the embedded master (master=None)
    also listens for clients in other processes, when this client is the
    one that starts it (it stops when the last client of this process
    closes). `prefer_local`: a put's first replica goes to this client's own
    segment when it fits (a memmove, and the nearest replica for this
    process's gets), the others elsewhere as usual.
    `ssd_path`: a directory for this client's SSD tier (ssd_agent.py;
    None: no tier), `ssd_capacity` bytes of files in it (default 4 x
    segment_size), `ssd_offload` "evict" (copy the objects of its segment
    nearest eviction) or "eager" (copy every object of its segment),
    `ssd_verify` (checksum every SSD read, not only at adoption),
    `ssd_promote` (a get served from SSD puts the object back in DRAM)."""

    def __init__(self, master: "str | Sequence[str] | Master | None" = None, *, engine: kvflow.Engine | None = None,
                 segment_size: int = 64 << 20, local_buffer_size: int = 16 << 20,
                 listen: str = "127.0.0.1:0", protocols: Sequence[str] | None = None,
                 host: str | None = None, timeout: float = 10.0, replica_num: int = 1,
                 master_listen: str | None = None, prefer_local: bool = False,
                 ssd_path: str | None = None, ssd_capacity: int | None = None, ssd_offload: str = "evict",
                 ssd_verify: bool = False, ssd_promote: bool = True) -> None:
        for name, v in (("segment_size", segment_size), ("local_buffer_size", local_buffer_size)):
            if not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, not {v!r}")
        if not isinstance(replica_num, int) or replica_num < 1:
            raise InvalidArgumentError(f"replica_num must be an int >= 1, not {replica_num!r}")
        self.master_spec = master
        self._finder = finder_for(master)       # typed error now for a bad list
        self.master_listen = master_listen
        self.prefer_local = bool(prefer_local)
        self.client_id = uuid.uuid4().hex[:16]
        self.host = host or socket.gethostname()
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        self.timeout = timeout
        self.replica_num = replica_num
        self.engine = engine
        self._own_engine = engine is None
        self._listen = listen
        self._protocols = protocols
        self._link: MasterLink | None = None
        self._embedded: Master | None = None
        self._segment: np.ndarray | None = None
        self._segment_region: kvflow.Region | None = None
        self.segment_id: int | None = None
        self._staging: np.ndarray | None = None
        self._staging_region: kvflow.Region | None = None
        self._staging_alloc: Allocator | None = None
        self._staging_freed: asyncio.Condition | None = None
        self._mover: Mover | None = None
        self._heartbeat: asyncio.Task | None = None
        self._hello: dict = {}
        self._beat_thread: HeartbeatThread | None = None
        self.lease_ttl = 5.0
        self.replica_fallbacks = 0      # reads that went on to another replica
        self.counters = ClientCounters()    # metrics(): calls, hits, bytes, round trips (metrics.py)
        self._put_tokens = itertools.count(1)
        self._query: BlockingQuery | None = None
        self._loop_thread: int | None = None
        self._started = False
        self._closed = False
        self._ssd: SsdAgent | None = None
        if ssd_path is not None:
            if ssd_capacity is None:
                ssd_capacity = 4 * segment_size or 1 << 30
            self._ssd = SsdAgent(self, ssd_path, ssd_capacity, mode=ssd_offload, verify=bool(ssd_verify),
                                 promote=bool(ssd_promote))
        self.ssd_promote = bool(ssd_promote)

    def __repr__(self) -> str:
        where = self.master_spec if isinstance(self.master_spec, (str, list, tuple)) else "embedded"
        return f"<StoreClient {self.client_id} master={where} segment={self.segment_size}>"

    @property
    def master_address(self) -> str | None:
        """Where other processes reach this client's master ("host:port"), or
        None for an in-process master that does not listen."""
        if isinstance(self._link, FollowingLink):
            return self._link.address
        if isinstance(self.master_spec, str):
            return self.master_spec
        m = self._embedded or (self.master_spec if isinstance(self.master_spec, Master) else None)
        return m.address if m is not None else None

    @property
    def local_buffer_in_use(self) -> int:
        """Bytes of the local buffer held by put()/get() calls in progress."""
        return self._staging_alloc.used if self._staging_alloc else 0

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> "StoreClient":
        """Connects to (or embeds) the master, mounts the segment, starts
        heartbeats. MasterUnavailableError if the master cannot be reached."""
        if self._started:
            return self
        self._started = True
        self._loop_thread = threading.get_ident()
        try:
            if self.engine is None:
                self.engine = kvflow.Engine(self._listen, protocols=self._protocols)
                await self.engine.start()
            self._mover = Mover(self.engine)
            if self.local_buffer_size:
                self._staging = np.empty(self.local_buffer_size, np.uint8)
                self._staging.fill(0)
                self._staging_region = self.engine.register(self._staging)
                self._staging_alloc = Allocator(self.local_buffer_size)
                self._staging_freed = asyncio.Condition()
            if self.segment_size:
                # touched now, not by the first puts: np.zeros maps pages lazily,
                # and a put landing on never-touched pages pays a page fault per
                # 4 KiB (3-10x slower writes until the segment has been used once)
                self._segment = np.empty(self.segment_size, np.uint8)
                self._segment.fill(0)
                name = f"kvflow-store/{self.client_id}/0"
                self._segment_region = self.engine.register(self._segment, name=name)
            if self._ssd is not None:
                await self._ssd.open()          # adopts its files; reported in _attach
            if self._finder is not None:
                self._link = await FollowingLink(self._finder, self._attach).open(self.timeout)
            else:
                master = self._master_object()
                if isinstance(master, Master):
                    # idempotent: the liveness monitor; with master_listen, the
                    # embedded master also serves other processes over tcp
                    await master.start(self.master_listen if self._embedded is not None else None)
                self._link = await connect_master(master, timeout=self.timeout)
                await self._attach(self._link)
            hello = self._hello
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(float(hello["heartbeat"])))
            if self._ssd is not None:
                self._ssd.start()
            if isinstance(self._link, (TcpMasterLink, FollowingLink)):
                self._beat_thread = HeartbeatThread(self._link.address, self.client_id, hello["beat_token"],
                                                    float(hello["heartbeat"]))
                self._beat_thread.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def _attach(self, link: MasterLink) -> None:
        """Registers with the master on `link` and mounts the segment: at
        start, and again on each new leader (the same client id and segment
        name: a master that recovered them from etcd gives back the same
        segment id and the objects in it)."""
        hello = await link.call("register", self.client_id, self.host, self.engine.address,
                                timeout=self.timeout)
        if self._segment_region is not None:
            self.segment_id = await link.call("mount", f"kvflow-store/{self.client_id}/0",
                                              self._segment_region.addr, self.segment_size, timeout=self.timeout)
        if self._ssd is not None:
            await self._ssd.attach(link, self.timeout)
        self._hello = hello
        self.lease_ttl = float(hello["lease_ttl"])
        if self._beat_thread is not None and isinstance(link, TcpMasterLink):
            self._beat_thread.retarget(link.address, hello["beat_token"])

    def _master_object(self) -> "str | Master":
        if self.master_spec is not None:
            return self.master_spec
        loop = asyncio.get_running_loop()
        slot = _EMBEDDED.get(loop)
        if slot is None:
            slot = _EMBEDDED[loop] = [Master(), 0]
        slot[1] += 1
        self._embedded = slot[0]
        return slot[0]

    async def close(self) -> None:
        """Leaves the pool: the master forgets this client and the objects
        only it held; the engine is closed if the client started it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ssd is not None:
            await self._ssd.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self._beat_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._beat_thread.stop)
        if self._link is not None:
            await self._link.close()
        if (q := self._query) is not None:
            self._query = None
            q.close()
        if self._finder is not None:
            await self._finder.close()
        if self._embedded is not None:
            slot = _EMBEDDED.get(asyncio.get_running_loop())
            if slot is not None and slot[0] is self._embedded:
                slot[1] -= 1
                if slot[1] <= 0:
                    del _EMBEDDED[asyncio.get_running_loop()]
                    await self._embedded.close()
        if self.engine is not None:
            if self._own_engine:
                await self.engine.close()
            else:
                for r in (self._segment_region, self._staging_region):
                    if r is not None:
                        self.engine.deregister(r)

    async def __aenter__(self) -> "StoreClient":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self._call("heartbeat")
            except MasterUnavailableError:
                if self._link is None or self._link.closed:
                    return        # the link is gone; calls will say so
                # a heartbeat that timed out (a stopped or slow master): keep beating
            except KVFlowError:
                pass

    async def _call(self, method: str, *args: Any) -> Any:
        if self._link is None or self._closed:
            raise MasterUnavailableError("the client is not started, or closed")
        t0, ok = time.perf_counter(), False
        try:
            out = await self._link.call(method, *args, timeout=self.timeout)
            ok = True
            return out
        finally:
            self.counters.round_trip(method, time.perf_counter() - t0, ok)

    def metrics(self) -> dict:
        """What this client did: calls, hits and misses, puts, bytes per
        tier, lease waits, master round trips (count, latency histogram);
        kvflow/store/metrics.py names them, docs/metrics.md too."""
        return {"kind": "client", "client_id": self.client_id, **self.counters.snapshot(),
                "replica_fallbacks": self.replica_fallbacks, "local_buffer_in_use": self.local_buffer_in_use}

    # -- memory ----------------------------------------------------------------
    def register_buffer(self, buffer: Any, *, name: str | None = None) -> kvflow.Region:
        """Registers memory with the client's engine so put_from/get_into
        may use it (kvflow.Engine.register; its errors)."""
        return self.engine.register(buffer, name=name, access=kvflow.Access.READ | kvflow.Access.WRITE)

    def unregister_buffer(self, region: kvflow.Region) -> None:
        self.engine.deregister(region)

    def _regions(self) -> tuple[list[int], list[int]]:
        """The engine's registered regions as sorted (starts, ends), read once
        per call (Engine.regions builds a sorted list each time)."""
        # host memory only: the own-segment path copies with memmove, and
        # GPU memory through the store is not built yet
        regions = [r for r in self.engine.regions if r.kind == "host"]
        return [r.addr for r in regions], [r.end for r in regions]

    @staticmethod
    def _parts(ps: Any) -> list:
        """An object's parts as a list of (address, size) pairs."""
        try:
            out = [(a, s) for a, s in ps]
        except (TypeError, ValueError):
            raise InvalidArgumentError("an object's parts must be (address, size) pairs") from None
        if not out:
            raise InvalidArgumentError("an object needs at least one part")
        return out

    @staticmethod
    def _check_local(addr: Any, size: Any, regions: tuple[list[int], list[int]]) -> None:
        if type(addr) is not int or type(size) is not int:
            if not isinstance(addr, (int, np.integer)) or not isinstance(size, (int, np.integer)) \
                    or isinstance(addr, bool) or isinstance(size, bool):
                raise InvalidArgumentError(f"address and size must be ints, not {type(addr).__name__}, "
                                           f"{type(size).__name__}")
            addr, size = int(addr), int(size)
        if size <= 0 or addr <= 0:
            raise InvalidArgumentError(f"bad range: address {addr:#x}, size {size}")
        starts, ends = regions
        i = bisect.bisect_right(starts, addr) - 1     # regions never overlap
        if i < 0 or addr + size > ends[i]:
            raise UnregisteredMemoryError(f"[{addr:#x}, +{size}) is not inside memory registered with "
                                          f"this client's engine (register_buffer; host memory)")

    # -- puts ------------------------------------------------------------------
    @_with_timeout
    async def put_from(self, key: str, addr: int, size: int, **kw: Any) -> int:
        """Puts `size` bytes at `addr` (registered memory) as `key`.
        Returns the number of replicas stored (0 when the key existed
        already: a no-op). Raises InvalidKeyError, InvalidArgumentError,
        UnregisteredMemoryError, ObjectBusyError, ObjectExistsError (the key
        exists with another size), NoSpaceError, ReplicaUnavailableError
        (every replica's write failed), MasterUnavailableError."""
        return self._one(await self.batch_put_from_parts([key], [[(addr, size)]], **kw))

    @_with_timeout
    async def put_from_parts(self, key: str, parts: Parts, **kw: Any) -> int:
        """put_from of an object made of several buffers, concatenated in order."""
        return self._one(await self.batch_put_from_parts([key], [parts], **kw))

    @_with_timeout
    async def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                             **kw: Any) -> list:
        if not (len(keys) == len(addrs) == len(sizes)):
            raise InvalidArgumentError("keys, addrs and sizes must have the same length")
        return await self.batch_put_from_parts(keys, [[(a, s)] for a, s in zip(addrs, sizes)], **kw)

    @_with_timeout
    @counted("put")
    async def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Parts], *,
                                   replica_num: int | None = None, preferred_segment: int | None = None,
                                   pin: bool = False, soft_pin: float | bool | None = None,
                                   _again: bool = False, _wait: bool = True) -> list:
        """The funnel of every put. One master round trip to allocate, one
        kvflow batch per holder, one round trip to commit. `pin`: never
        evicted (only removed); `soft_pin`: evicted only when nothing
        unpinned can go, for that many seconds (True: the master's
        soft_pin_ttl). The keys of one call are a chained prefix, head
        first: the master evicts its tail before its head. A put whose
        commit reached a new leader that never saw its allocation (the old
        one died in between: follow.py) is put again, once."""
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        rn = self.replica_num if replica_num is None else replica_num
        if preferred_segment is None and self.prefer_local:
            preferred_segment = self.segment_id
        if not isinstance(rn, int) or isinstance(rn, bool) or rn < 1:
            raise InvalidArgumentError(f"replica_num must be an int >= 1, not {rn!r}")
        wire_pin: bool | list = bool(pin)
        if soft_pin is not None and soft_pin is not False and not pin:
            if soft_pin is not True and (isinstance(soft_pin, bool) or not isinstance(soft_pin, (int, float))
                                         or not soft_pin > 0):
                raise InvalidArgumentError(f"soft_pin must be True or seconds > 0, not {soft_pin!r}")
            wire_pin = ["soft", None if soft_pin is True else float(soft_pin)]
        results: list[Any] = [None] * len(keys)
        todo: list[int] = []
        sizes: list[int] = []
        regions = self._regions()
        starts, ends_ = regions
        for i, (key, ps) in enumerate(zip(keys, parts)):
            n = _one_part(key, ps, starts, ends_)
            if n:                                       # the common case, checked inline
                todo.append(i)
                sizes.append(n)
                continue
            try:
                check_key(key)
                if not ps:
                    raise InvalidArgumentError("an object needs at least one part")
                for a, s in self._parts(ps):
                    self._check_local(a, s, regions)
                todo.append(i)
                sizes.append(sum(int(s) for _, s in ps))
            except KVFlowError as e:
                results[i] = e
        if not todo:
            return results
        relinks = getattr(self._link, "reconnects", 0)
        token = next(self._put_tokens)
        try:
            reply = await self._call("batch_put_start", [[keys[i], sizes[j], rn, preferred_segment, wire_pin]
                                                         for j, i in enumerate(todo)], token)
        except (asyncio.CancelledError, MasterUnavailableError):
            # the request may have reached the master and allocated: undo this
            # call's allocations (queued behind the put_start on the same link)
            await asyncio.shield(self._revoke([keys[i] for i in todo], token))
            raise
        started, segs = _replica_rows(reply)
        writing: list[tuple[int, list]] = []          # (index, [[segment, address], ...])
        ssd_busy = False
        for i, item in zip(todo, started):
            r = _result(item, keys[i])
            if isinstance(r, KVFlowError):
                results[i] = r
                ssd_busy = ssd_busy or type(r) is SsdBusyError
            elif r is None:
                results[i] = 0                      # exists already: immutable, nothing to write
            else:
                writing.append((i, r))
        if not writing:
            if _wait and ssd_busy:
                await self._wait_for_ssd(keys, parts, results, rn, preferred_segment, pin, soft_pin)
            return results
        try:
            moves = Moves()
            for i, reps in writing:
                ps = parts[i]
                for sid, addr in reps:
                    holder = segs[sid][1]
                    if len(ps) == 1:
                        moves.add(int(ps[0][0]), holder, addr, int(ps[0][1]))
                        continue
                    off = 0
                    for a, s in ps:
                        moves.add(int(a), holder, addr + off, int(s))
                        off += int(s)
            failed = await self._mover.run("write", moves, timeout=self.timeout)
        except BaseException:
            # cancelled, or a bug: nothing of the writes is in flight any more
            # (kvflow drains before raising); give the space back
            await asyncio.shield(self._revoke([keys[i] for i, _ in writing], token))
            raise
        ends = [[keys[i], [sid for sid, _ in reps if segs[sid][1] in failed] if failed else []]
                for i, reps in writing]
        ended = await self._call("batch_put_end", ends)
        again = []
        for (i, reps), item in zip(writing, ended):
            r = _result(item, keys[i])
            if r == 0:
                errs = "; ".join(f"{h}: {failed[h]}" for h in {segs[sid][1] for sid, _ in reps} if h in failed)
                r = ReplicaUnavailableError(f"every replica write of {keys[i]!r} failed: {errs}", key=keys[i])
            elif isinstance(r, ObjectNotFoundError) and getattr(self._link, "reconnects", 0) != relinks \
                    and not _again:
                again.append(i)
            results[i] = r
        if self._ssd is not None and self._ssd.mode == "eager":
            self._ssd.wake()
        if again:
            redo = await self.batch_put_from_parts([keys[i] for i in again], [parts[i] for i in again],
                                                   replica_num=rn, preferred_segment=preferred_segment,
                                                   pin=pin, soft_pin=soft_pin, _again=True)
            for i, r in zip(again, redo):
                results[i] = r
        if _wait and ssd_busy:
            await self._wait_for_ssd(keys, parts, results, rn, preferred_segment, pin, soft_pin)
        return results

    async def _wait_for_ssd(self, keys: Sequence[str], parts: Sequence[Parts], results: list, rn: int,
                            preferred: int | None, pin: bool, soft_pin: float | bool | None) -> None:
        """Puts that met SsdBusyError (the pool is full of objects an eager
        SSD tier is still copying) are put again, backing off, until they
        fit or the client's timeout has passed: the disk's pace is the
        pool's, instead of objects lost."""
        busy = [i for i, r in enumerate(results) if isinstance(r, SsdBusyError)]
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        while busy and time.monotonic() + delay < deadline:
            if self._ssd is not None:
                self._ssd.wake()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            redo = await self.batch_put_from_parts([keys[i] for i in busy], [parts[i] for i in busy],
                                                   replica_num=rn, preferred_segment=preferred, pin=pin,
                                                   soft_pin=soft_pin, _wait=False)
            for i, r in zip(busy, redo):
                results[i] = r
            busy = [i for i in busy if isinstance(results[i], SsdBusyError)]

    async def _revoke(self, keys: list[str], token: int) -> None:
        try:
            await self._call("batch_put_revoke", keys, token)
        except KVFlowError:
            pass        # the master is gone or lost us: it dropped our puts itself

    @_with_timeout
    async def put(self, key: str, value: Any, **kw: Any) -> int:
        """Puts bytes (anything with the buffer protocol) through the local
        buffer. Returns replicas stored (0: existed). put_from's errors, and
        InvalidArgumentError for a value larger than the local buffer."""
        return self._one(await self.batch_put([key], [value], **kw))

    @_with_timeout
    async def batch_put(self, keys: Sequence[str], values: Sequence[Any], **kw: Any) -> list:
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values must have the same length")
        views = []
        for v in values:
            try:
                m = memoryview(v).cast("B")
            except TypeError:
                raise InvalidArgumentError(f"a value must support the buffer protocol, not "
                                           f"{type(v).__name__}") from None
            views.append(m)
        results: list[Any] = [None] * len(keys)
        for chunk in self._chunks([len(m) for m in views], results):
            addrs = await self._stage([len(views[i]) for i in chunk])
            try:
                for i, a in zip(chunk, addrs):
                    n = len(views[i])
                    np.frombuffer(self._staging_view(a, n), np.uint8)[:] = np.frombuffer(views[i], np.uint8)
                out = await self.batch_put_from_parts([keys[i] for i in chunk],
                                                      [[(a, len(views[i]))] for i, a in zip(chunk, addrs)], **kw)
            finally:
                await self._unstage(addrs)
            for i, r in zip(chunk, out):
                results[i] = r
        return results

    # -- gets ------------------------------------------------------------------
    @_with_timeout
    async def get_into(self, key: str, addr: int, size: int) -> int:
        """Reads `key` into `size` bytes at `addr` (registered memory).
        Returns the object's size. Raises ObjectNotFoundError,
        BufferTooSmallError, UnregisteredMemoryError, InvalidKeyError,
        ReplicaUnavailableError (no replica's holder could be read),
        LeaseExpiredError, MasterUnavailableError."""
        return self._one(await self.batch_get_into_parts([key], [[(addr, size)]]))

    @_with_timeout
    async def get_into_parts(self, key: str, parts: Parts) -> int:
        return self._one(await self.batch_get_into_parts([key], [parts]))

    @_with_timeout
    async def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list:
        if not (len(keys) == len(addrs) == len(sizes)):
            raise InvalidArgumentError("keys, addrs and sizes must have the same length")
        return await self.batch_get_into_parts(keys, [[(a, s)] for a, s in zip(addrs, sizes)])

    @_with_timeout
    @counted("get")
    async def batch_get_into_parts(self, keys: Sequence[str], parts: Sequence[Parts]) -> list:
        """The funnel of every get into registered memory."""
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        results: list[Any] = [None] * len(keys)
        todo = []
        regions = self._regions()
        starts, ends = regions
        for i, (key, ps) in enumerate(zip(keys, parts)):
            if _one_part(key, ps, starts, ends):       # the common case, checked inline
                todo.append(i)
                continue
            try:
                check_key(key)
                if not ps:
                    raise InvalidArgumentError("an object needs at least one part")
                for a, s in self._parts(ps):
                    self._check_local(a, s, regions)
                todo.append(i)
            except KVFlowError as e:
                results[i] = e
        if not todo:
            return results
        t0 = time.monotonic()       # before the lease is granted: a safe bound on its age
        reply = await self._call("batch_get_replicas", [keys[i] for i in todo])
        try:
            found, segs = _replica_rows(reply)
            holders = self._holders(segs)
            reading = []
            for i, item in zip(todo, found):
                r = _result(item, keys[i])
                if isinstance(r, KVFlowError):
                    results[i] = r
                    continue
                size, reps = r[0], r[1]
                room = sum(int(s) for _, s in parts[i])
                if room < size:
                    results[i] = BufferTooSmallError(f"{keys[i]!r} is {size} bytes, the buffer {room}",
                                                     key=keys[i])
                    continue
                reading.append((i, size, self._nearest(reps, holders) if reps or len(r) < 3 else SsdCopies(r[2])))
            await self._read(keys, reading, parts, results, t0)
        finally:
            self._release(reply)
        return results

    def _release(self, reply: dict) -> None:
        """Nothing of the call's reads is in flight any more (kvflow drains a
        failed or cancelled batch before raising): its lease may go, so the
        objects can be removed and evicted again at once."""
        lease = reply.get("lease")
        if lease and self._link is not None:
            self._link.notify("release_lease", lease)

    def _holders(self, segs: dict) -> dict:
        """segment id -> (rank, holder engine): 0 this process, 1 this host, 2 elsewhere."""
        me = self.engine.address
        return {int(sid): (0 if engine == me else 1 if host == self.host else 2, engine)
                for sid, (_, engine, host) in segs.items()}

    @staticmethod
    def _nearest(reps: list, holders: dict) -> list[tuple[str, int]]:
        """[(holder engine, address), ...], nearest first."""
        out = [(holders[sid], addr) for sid, addr in reps]
        if len(out) > 1:
            out.sort(key=lambda x: x[0][0])
        return [(h[1], addr) for h, addr in out]

    async def _read(self, keys: Sequence[str], reading: list, parts: Sequence[Parts], results: list,
                    t0: float) -> None:
        if any(type(e[2]) is SsdCopies for e in reading):
            ssd = [e for e in reading if type(e[2]) is SsdCopies]
            read = await read_copies(self, keys, ssd, parts, results)
            if self.ssd_promote:
                await promote(self, keys, read, parts)
            reading = [e for e in reading if type(e[2]) is not SsdCopies]
        attempt = {i: 0 for i, _, _ in reading}
        last: dict[int, list[str]] = {}
        pending = reading
        while pending:
            moves = Moves()
            for i, size, reps in pending:
                holder, addr = reps[attempt[i]]
                ps = parts[i]
                if len(ps) == 1:
                    moves.add(int(ps[0][0]), holder, addr, size)
                    continue
                off = 0
                for a, s in ps:
                    n = min(int(s), size - off)
                    if n <= 0:
                        break
                    moves.add(int(a), holder, addr + off, n)
                    off += n
            failed = await self._mover.run("read", moves, timeout=self.timeout)
            if not failed:
                for i, size, _ in pending:
                    results[i] = size
                break
            again = []
            for i, size, reps in pending:
                h = reps[attempt[i]][0]
                if h not in failed:
                    results[i] = size
                    continue
                last.setdefault(i, []).append(f"{h}: {failed[h]}")
                attempt[i] += 1
                if attempt[i] < len(reps):
                    self.replica_fallbacks += 1
                    again.append((i, size, reps))
                else:
                    results[i] = ReplicaUnavailableError(
                        f"no replica of {keys[i]!r} could be read ({'; '.join(last[i])})", key=keys[i])
            pending = again
        if time.monotonic() - t0 >= self.lease_ttl:
            for i, _, _ in reading:
                if isinstance(results[i], int):
                    results[i] = LeaseExpiredError(
                        f"reading {keys[i]!r} outlasted its {self.lease_ttl} s lease", key=keys[i])

    @_with_timeout
    async def get(self, key: str) -> bytes:
        """The object's bytes, through the local buffer. get_into's errors."""
        return self._one(await self.batch_get([key]))

    @_with_timeout
    @counted("get")
    async def batch_get(self, keys: Sequence[str]) -> list:
        results: list[Any] = [None] * len(keys)
        todo = []
        for i, key in enumerate(keys):
            try:
                check_key(key)
                todo.append(i)
            except KVFlowError as e:
                results[i] = e
        if not todo:
            return results
        t0 = time.monotonic()
        reply = await self._call("batch_get_replicas", [keys[i] for i in todo])
        try:
            return await self._get_staged(keys, todo, reply, results, t0)
        finally:
            self._release(reply)

    async def _get_staged(self, keys: Sequence[str], todo: list[int], reply: dict, results: list,
                          t0: float) -> list:
        found, segs = _replica_rows(reply)
        holders = self._holders(segs)
        sized = []
        for i, item in zip(todo, found):
            r = _result(item, keys[i])
            if isinstance(r, KVFlowError):
                results[i] = r
            else:
                sized.append((i, r[0], self._nearest(r[1], holders) if r[1] or len(r) < 3 else SsdCopies(r[2])))
        sizes = [s for _, s, _ in sized]
        sub: list[Any] = [None] * len(sized)
        for chunk in self._chunks(sizes, sub):
            addrs = await self._stage([sizes[j] for j in chunk])
            try:
                parts = {sized[j][0]: [(a, sizes[j])] for j, a in zip(chunk, addrs)}
                await self._read(keys, [sized[j] for j in chunk], parts, results, t0)
                for j, a in zip(chunk, addrs):
                    i = sized[j][0]
                    if isinstance(results[i], int):
                        results[i] = bytes(self._staging_view(a, sizes[j]))
            finally:
                await self._unstage(addrs)
        for j, r in enumerate(sub):
            if r is not None:
                results[sized[j][0]] = r
        return results

    # -- queries and removal ---------------------------------------------------
    @_with_timeout
    async def exists(self, key: str) -> bool:
        """Whether a complete object `key` is in the pool."""
        return self._one(await self.batch_exists([key]))

    @_with_timeout
    @counted("exists")
    async def batch_exists(self, keys: Sequence[str]) -> list:
        """One round trip for any number of keys."""
        return await self._keyed("batch_exists", keys)

    def batch_exists_blocking(self, keys: Sequence[str]) -> list | None:
        """batch_exists for a caller on another thread than the client's
        loop (a synchronous API): straight to the master on a blocking
        socket of its own, one round trip, no hop to the loop and back.
        The same answers as batch_exists (a list of bools); None when this
        path cannot serve the call (an in-process master, a key that needs
        batch_exists' per-key checks, the master unreachable on it): then
        call batch_exists on the loop, which says what went wrong."""
        link = self._link
        if self._closed or link is None or link.closed or not isinstance(link, (TcpMasterLink, FollowingLink)):
            return None
        if not all(type(k) is str and 0 < len(k) <= MAX_KEY_BYTES // 4 for k in keys):
            return None
        address = link.address
        if address is None or threading.get_ident() == self._loop_thread:
            return None                 # no leader known; or the loop's own thread: never block it
        q = self._query
        if q is None or q.address != address:
            if q is not None:
                q.close()
            q = self._query = BlockingQuery(address, self.timeout)
        t0 = time.perf_counter()
        try:
            items = q.call("batch_exists", list(keys))
        except KVFlowError:
            self.counters.round_trip("batch_exists", time.perf_counter() - t0, False)
            return None
        self.counters.round_trip("batch_exists", time.perf_counter() - t0, True)
        if isinstance(items, list) and len(items) == len(keys) and all(type(x) is bool for x in items):
            self.counters.done("exists", (), {}, items)
            return items
        return None

    @_with_timeout
    async def size(self, key: str) -> int:
        """The object's size. ObjectNotFoundError."""
        return self._one(await self.batch_size([key]))

    @_with_timeout
    async def batch_size(self, keys: Sequence[str]) -> list:
        return await self._keyed("batch_size", keys)

    @_with_timeout
    async def get_replicas(self, key: str) -> list[Replica]:
        """Where the object's replicas are (and a read lease on it)."""
        found, segs = _replica_rows(await self._call("batch_get_replicas", [key]))
        r = _result(found[0], key)
        if isinstance(r, KVFlowError):
            raise r
        return [Replica((sid, *segs[sid], addr)) for sid, addr in r[1]]

    @_with_timeout
    async def remove(self, key: str, *, force: bool = False) -> None:
        """Removes the object. ObjectNotFoundError; ObjectLeasedError while a
        get holds a lease on it (unless `force`)."""
        self._one(await self.batch_remove([key], force=force))

    @_with_timeout
    @counted("remove")
    async def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list:
        return await self._keyed("batch_remove", keys, bool(force))

    @_with_timeout
    async def remove_all(self, *, force: bool = False) -> int:
        """Removes every complete object not under a lease; returns how many."""
        return await self._call("remove_all", bool(force))

    @property
    def ssd(self) -> SsdAgent | None:
        """This client's SSD tier (None without ssd_path)."""
        return self._ssd

    @property
    def root_fs_dir(self) -> str:
        """The master's --root-fs-dir ("" none): where it suggests SSD tiers go."""
        return str(self._hello.get("root_fs_dir") or "")

    async def attach_ssd(self, path: str, capacity: int, *, offload: str = "evict", verify: bool = False,
                         promote: bool = True) -> SsdAgent:
        """Adds an SSD tier to a started client (the ssd_* options of the
        constructor, later: for a client that learns its directory from the
        master). InvalidArgumentError when it has one, or for bad options."""
        if self._ssd is not None:
            raise InvalidArgumentError("this client has an SSD tier already")
        if self._link is None or self._closed:
            raise InvalidArgumentError("attach_ssd: start the client first")
        agent = SsdAgent(self, path, capacity, mode=offload, verify=verify, promote=promote)
        await agent.open()
        try:
            await agent.attach(self._link, self.timeout)
        except BaseException:
            await agent.close()
            raise
        self._ssd, self.ssd_promote = agent, bool(promote)
        agent.start()
        return agent

    async def ssd_flush(self) -> int:
        """Copies to SSD now what the tier would copy next (see ssd_offload);
        returns how many copies were written. InvalidArgumentError without
        an SSD tier."""
        if self._ssd is None:
            raise InvalidArgumentError("this client has no SSD tier (ssd_path)")
        return await self._ssd.flush()

    @_with_timeout
    async def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        """Removes every complete object whose key `pattern` (a Python
        regular expression) matches anywhere, not those under a lease unless
        `force`; returns how many. InvalidArgumentError for a bad pattern."""
        return await self._call("remove_by_regex", pattern, bool(force))

    @_with_timeout
    async def stats(self, *, detail: bool = False) -> dict:
        """The master's counts; with `detail`, its whole view (segments,
        clients, leases, evictions: Master.metrics(), what kvflow-info
        --store prints)."""
        return await (self._call("stats", True) if detail else self._call("stats"))

    # -- helpers ---------------------------------------------------------------
    @staticmethod
    def _one(results: list) -> Any:
        r = results[0]
        if isinstance(r, BaseException):
            raise r
        return r

    async def _keyed(self, method: str, keys: Sequence[str], *extra: Any) -> list:
        """A batch call whose only input is keys: bad keys get their error
        here, the rest go to the master in one round trip."""
        if all(type(k) is str and 0 < len(k) <= MAX_KEY_BYTES // 4 for k in keys):
            # the common case (the servers' prefix checks): no per-key work
            items = await self._call(method, list(keys), *extra)
            if method == "batch_exists" and all(type(x) is bool for x in items):
                return items
            return [_result(item, k) for k, item in zip(keys, items)]
        results: list[Any] = [None] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            try:
                check_key(k)
                todo.append(i)
            except KVFlowError as e:
                results[i] = e
        if todo:
            items = await self._call(method, [keys[i] for i in todo], *extra)
            for i, item in zip(todo, items):
                results[i] = _result(item, keys[i])
        return results

    def _chunks(self, sizes: list[int], results: list) -> list[list[int]]:
        """Indices grouped so each group fits the local buffer; an object
        larger than the whole buffer gets its error in `results`."""
        cap = self._staging_alloc.capacity if self._staging_alloc else 0
        chunks: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for i, n in enumerate(sizes):
            need = (max(n, 1) + 63) // 64 * 64
            if need > cap:
                results[i] = InvalidArgumentError(
                    f"object of {n} bytes does not fit the local buffer ({cap} bytes): "
                    f"use put_from/get_into, or a larger local_buffer_size")
                continue
            if used + need > cap:
                chunks.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += need
        if cur:
            chunks.append(cur)
        return chunks

    async def _stage(self, sizes: list[int]) -> list[int]:
        """Addresses in the local buffer for `sizes` (all or none: waits
        while other calls hold the space)."""
        base = self._staging_region.addr
        async with self._staging_freed:
            while True:
                got = []
                for n in sizes:
                    off = self._staging_alloc.allocate(max(n, 1))
                    if off is None:
                        break
                    got.append(off)
                if len(got) == len(sizes):
                    return [base + off for off in got]
                for off in got:
                    self._staging_alloc.release(off)
                await self._staging_freed.wait()

    async def _unstage(self, addrs: list[int]) -> None:
        base = self._staging_region.addr
        async with self._staging_freed:
            for a in addrs:
                self._staging_alloc.release(a - base)
            self._staging_freed.notify_all()

    def _staging_view(self, addr: int, n: int) -> memoryview:
        off = addr - self._staging_region.addr
        return memoryview(self._staging)[off:off + n]
