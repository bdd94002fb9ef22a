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
import itertools
import logging
import math
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
from .calls import Replica, item_result, replica_rows, with_timeout
from .datapath import Mover, Moves
from .device import DeviceRanges
from .errors import InvalidKeyError, MasterUnavailableError
from .fence import CLIENT_TIMEOUT, CONNECT_TIMEOUT, write_window
from .follow import FollowingLink, finder_for
from .gets import Gets
from .leases import LeaseKeeper
from .master import Master
from .metrics import ClientCounters, counted
from .model import check_key
from .puts import Puts
from .records import NS_SEP, plain_keys
from .rpc import BlockingQuery, HeartbeatThread, MasterLink, TcpMasterLink, connect_master
from .shmseg import SameHost
from .ssd_agent import SsdAgent
from .task_calls import TaskCalls

__all__ = ["StoreClient", "Replica"]

log = logging.getLogger(__name__)


# One master per event loop for clients given no master address: the first
# client starts it, the last one to close stops it.
_EMBEDDED: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list]" = weakref.WeakKeyDictionary()


class StoreClient(Puts, Gets, TaskCalls):
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
    `ssd_promote` (a get served from SSD puts the object back in DRAM).
    `segment_name`: the name the segment is mounted under (default
    "kvflow-store/<client id>/0"): copy and move tasks and preferred
    segments name segments by it (the Mooncake API mounts its hostname)."""

    def __init__(self, master: "str | Sequence[str] | Master | None" = None, *, engine: kvflow.Engine | None = None,
                 segment_size: int = 64 << 20, local_buffer_size: int = 16 << 20,
                 listen: str = "127.0.0.1:0", protocols: Sequence[str] | None = None,
                 host: str | None = None, timeout: float = CLIENT_TIMEOUT, replica_num: int = 1,
                 master_listen: str | None = None, prefer_local: bool = False,
                 ssd_path: str | None = None, ssd_capacity: int | None = None, ssd_offload: str = "evict",
                 ssd_verify: bool = False, ssd_promote: bool = True, namespace: str | None = None,
                 quota: int | None = None, segment_name: str | None = None) -> None:
        for name, v in (("segment_size", segment_size), ("local_buffer_size", local_buffer_size)):
            if not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, not {v!r}")
        if not isinstance(replica_num, int) or replica_num < 1:
            raise InvalidArgumentError(f"replica_num must be an int >= 1, not {replica_num!r}")
        if namespace is not None and (type(namespace) is not str or not namespace or NS_SEP in namespace
                                      or len(namespace) > 256):
            raise InvalidArgumentError(f"namespace must be a non-empty str of at most 256 characters, "
                                       f"not {namespace!r}")
        if quota is not None and (namespace is None or type(quota) is not int or quota <= 0):
            raise InvalidArgumentError("quota: a positive int of bytes, for a client given a namespace")
        self.namespace = namespace
        self.quota = quota
        # what the master sees of this client's keys: "<namespace>\x1f<key>"
        self._prefix = namespace + NS_SEP if namespace else ""
        self.master_spec = master
        self._finder = finder_for(master)       # typed error now for a bad list
        self.master_listen = master_listen
        self.prefer_local = bool(prefer_local)
        self.client_id = uuid.uuid4().hex[:16]
        if segment_name is not None and (type(segment_name) is not str or not segment_name
                                         or len(segment_name) > 1024):
            raise InvalidArgumentError(f"segment_name must be a non-empty str, not {segment_name!r}")
        self.segment_name = segment_name or f"kvflow-store/{self.client_id}/0"
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
        self._shm: SameHost | None = None     # its segment in shared memory, same-host ones mapped
        self._heartbeat: asyncio.Task | None = None
        self._repair: asyncio.Task | None = None      # copying new replicas of objects that lost one
        self.replicas_made = 0          # replicas this client copied for objects that lost one
        self._hello: dict = {}
        self._beat_thread: HeartbeatThread | None = None
        self.lease_ttl = 5.0
        self._lease_keeper = LeaseKeeper(self)      # renews the leases of gets still reading (leases.py)
        self.replica_fallbacks = 0      # reads that went on to another replica
        self.counters = ClientCounters()    # metrics(): calls, hits, bytes, round trips (metrics.py)
        self._put_tokens = itertools.count(1)
        self._query: BlockingQuery | None = None
        self._joined: Any = None        # direct.JoinedPool: puts and gets from a caller's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._staging_lock = threading.Lock()   # the local buffer's allocator: the loop's and callers' threads
        self._staging_waiting = 0       # calls on the loop waiting for room in the local buffer
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
    def write_window(self) -> float:
        """Seconds its writes may still land after a put_start's reply: the
        connect to a holder, then the transfer's timeout (fence.py)."""
        return write_window(self.write_timeout, self._mover.connect_timeout if self._mover else CONNECT_TIMEOUT)

    @property
    def write_timeout(self) -> float:
        """Seconds a write into space the master handed out may take: the
        client's `timeout`, or CLIENT_TIMEOUT for a client without one
        (timeout=None), so the write window it reports (the failover fence,
        put_timeouts.py's revoke) bounds its writes too."""
        t = self.timeout
        return float(t) if isinstance(t, (int, float)) and 0 < t < math.inf else CLIENT_TIMEOUT

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
        self._loop = asyncio.get_running_loop()
        try:
            if self.engine is None:
                self.engine = kvflow.Engine(self._listen, protocols=self._protocols)
                await self.engine.start()
            self._shm = SameHost.for_engine(self.engine)
            self._mover = Mover(self.engine, shm=self._shm)
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
                self._segment = (self._shm.segment(self.segment_size) if self._shm is not None
                                 else np.empty(self.segment_size, np.uint8))
                self._segment.fill(0)
                name = f"kvflow-store/{self.client_id}/0"
                self._segment_region = self.engine.register(self._segment, name=name)
                if self._shm is not None:
                    self._shm.serve(self.engine.address)
            if self._ssd is not None:
                await self._ssd.open()          # adopts its files; reported in _attach
            if self._finder is not None:
                following = FollowingLink(self._finder, self._attach)
                following.on_notice = self._notice
                self._link = await following.open(self.timeout)
            else:
                master = self._master_object()
                if isinstance(master, Master):
                    # idempotent: the liveness monitor; with master_listen, the
                    # embedded master also serves other processes over tcp
                    await master.start(self.master_listen if self._embedded is not None else None)
                self._link = await connect_master(master, timeout=self.timeout)
                self._link.on_notice = self._notice
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

    def _notice(self, method: str, args: list) -> None:
        """A notice the master pushed (on the loop's thread): "ssd_wake", a
        reader elsewhere waits for this client to load an SSD copy into its
        segment: the cleaner syncs now instead of at its next poll."""
        if method == "ssd_wake" and self._ssd is not None:
            self._ssd.wake()

    async def _attach(self, link: MasterLink) -> None:
        """Registers with the master on `link` and mounts the segment: at
        start, and again on each new leader (the same client id and segment
        name: a master that recovered them from etcd gives back the same
        segment id and the objects in it)."""
        # its write window (how long its writes may land after a put_start's
        # reply: a new leader fences recovered free space that long), and
        # whether none is in progress: it waits for that first, so that a new
        # leader may lift its fence once every client has said so (fence.py)
        drained = await self._mover.idle(self.write_window) if self._mover is not None else True
        hello = await link.call("register", self.client_id, self.host, self.engine.address,
                                self.write_window, drained, timeout=self.timeout)
        if self._segment_region is not None:
            self.segment_id = await link.call("mount", self.segment_name,
                                              self._segment_region.addr, self.segment_size, timeout=self.timeout)
        if self._ssd is not None:
            await self._ssd.attach(link, self.timeout)
        if self.quota is not None:
            await link.call("set_quota", self.namespace, self.quota, timeout=self.timeout)
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
        if self._repair is not None:
            self._repair.cancel()
            await asyncio.gather(self._repair, return_exceptions=True)
        await self._lease_keeper.close()
        if self._beat_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._beat_thread.stop)
        if self._link is not None:
            await self._link.close()
        for q in (self._query, self._joined):
            if q is not None:
                q.close()
        self._query = self._joined = None
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
        if self._shm is not None:
            self._shm.close()
            self._segment = None
            self._shm.release_segment()

    async def __aenter__(self) -> "StoreClient":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                short = await self._call("heartbeat")
                if short and self._repair is None and self._mover is not None:
                    # objects that lost a replica with one here: copy them
                    self._repair = asyncio.get_running_loop().create_task(self._make_replicas())
            except MasterUnavailableError:
                if self._link is None or self._link.closed:
                    return        # the link is gone; calls will say so
                # a heartbeat that timed out (a stopped or slow master): keep beating
            except KVFlowError:
                pass

    async def _make_replicas(self) -> None:
        """Lost replicas made again: the master hands out objects short of
        the replicas their put asked for (a holder was lost) that this
        client holds one of, with a new allocation on a client that holds
        none; this client writes its own replica there over kvflow and
        reports each copy (the new replica is visible only then)."""
        try:
            while not self._closed:
                reply = await self._call("batch_repair_start", 64)
                items, segs, lease = reply["items"], reply["segments"], reply["lease"]
                if not items:
                    return
                moves = Moves()
                for key, size, src, (sid, dst) in items:
                    moves.add(src, segs[sid][1], dst, size)
                failed: dict = {}
                try:
                    failed = await self._mover.run("write", moves, timeout=self.write_timeout)
                finally:
                    ends = [[key, segs[sid][1] not in failed] for key, _, _, (sid, _) in items]
                    done = await asyncio.shield(self._call("batch_repair_end", ends, lease))
                self.replicas_made += sum(1 for d in done if d == [0, 1])
                if failed:
                    log.warning("kvflow.store: copying lost replicas: %s",
                                "; ".join(f"{h}: {e}" for h, e in failed.items()))
                    return          # tried again at a later heartbeat
        except KVFlowError as e:
            log.warning("kvflow.store: copying lost replicas stopped: %s", e)
        finally:
            self._repair = None

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
                "replica_fallbacks": self.replica_fallbacks, "local_buffer_in_use": self.local_buffer_in_use,
                **({"shm_reads": self._shm.reads, "shm_read_bytes": self._shm.read_bytes, "shm_writes":
                    self._shm.writes, "shm_write_bytes": self._shm.write_bytes,
                    "shm_maps_dropped": self._shm.maps_dropped} if self._shm is not None else {})}

    # -- memory ----------------------------------------------------------------
    def register_buffer(self, buffer: Any, *, name: str | None = None) -> kvflow.Region:
        """Registers memory with the client's engine so put_from/get_into
        may use it (kvflow.Engine.register; its errors)."""
        return self.engine.register(buffer, name=name, access=kvflow.Access.READ | kvflow.Access.WRITE)

    def unregister_buffer(self, region: kvflow.Region) -> None:
        self.engine.deregister(region)

    def _regions(self) -> tuple[list[int], list[int]]:
        """The engine's registered host regions as sorted (starts, ends), read
        once per call (Engine.regions builds a sorted list each time)."""
        # host memory only: what the common case's inline checks and the
        # caller's-thread path (direct.py, memmove to the own segment) take;
        # GPU memory is admitted by _checked_parts alone (device.py)
        regions = [r for r in self.engine.regions if r.kind == "host"]
        return [r.addr for r in regions], [r.end for r in regions]

    def _checked_parts(self, key: Any, ps: Any, regions: tuple[list[int], list[int]]) -> int:
        """The whole check of one object's key and parts, where the funnels'
        inline check of the common case passed on: the object's size, or
        the key's typed error raised. A part outside registered host memory
        may be registered GPU memory (device.py): then the mover is told to
        keep GPU rows off its memmove."""
        check_key(key)
        pairs = self._parts(ps)
        gpu: DeviceRanges | None = None
        for a, s in pairs:
            try:
                self._check_local(a, s, regions)
            except UnregisteredMemoryError:
                if gpu is None:
                    gpu = DeviceRanges(self.engine)
                if not gpu.holds(int(a), int(s)):
                    raise
                self._mover.device = True
        return sum(int(s) for _, s in pairs)

    def _on_device(self, ps: Any) -> bool:
        """Whether any part of an admitted object lies in GPU memory (what
        the CPU may not touch: the SSD tier's file reads)."""
        return self._mover.device and DeviceRanges(self.engine).touches(ps)

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
                                          f"this client's engine (register_buffer: host or GPU memory)")

    # -- queries and removal ---------------------------------------------------
    @with_timeout
    async def exists(self, key: str) -> bool:
        """Whether a complete object `key` is in the pool."""
        return self._one(await self.batch_exists([key]))

    @with_timeout
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
        if type(keys) not in (list, tuple):
            return None
        try:
            joined = "".join(keys)          # in C: TypeError unless each key is a str
        except TypeError:
            return None
        if NS_SEP in joined:                # a key naming another namespace: refused on the loop's path
            return None
        # an empty or too long key is left to the master: its error item
        # makes this return None, and the caller's batch_exists names it
        if self._prefix:
            keys = [self._prefix + k for k in keys]
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
            items = q.call("batch_exists", keys)
        except KVFlowError:
            self.counters.round_trip("batch_exists", time.perf_counter() - t0, False)
            return None
        self.counters.round_trip("batch_exists", time.perf_counter() - t0, True)
        if type(items) is not list or len(items) != len(keys):
            return None
        # the master's items are bools, or [1, code, message] for a bad key:
        # two counts (in C) tell them apart and are the metrics' hits and misses
        hits = items.count(True)
        misses = items.count(False)
        if hits + misses != len(items):
            return None
        self.counters.exists_done(hits, misses)
        return items

    @with_timeout
    async def size(self, key: str) -> int:
        """The object's size. ObjectNotFoundError."""
        return self._one(await self.batch_size([key]))

    @with_timeout
    async def batch_size(self, keys: Sequence[str]) -> list:
        return await self._keyed("batch_size", keys)

    @with_timeout
    async def get_replicas(self, key: str) -> list[Replica]:
        """Where the object's replicas are (and a read lease on it)."""
        found, segs = replica_rows(await self._call("batch_get_replicas", self._ns([key])))
        r = item_result(found[0], key)
        if isinstance(r, KVFlowError):
            raise r
        return [Replica((sid, *segs[sid], addr)) for sid, addr in r[1]]

    @with_timeout
    async def remove(self, key: str, *, force: bool = False) -> None:
        """Removes the object. ObjectNotFoundError; ObjectLeasedError while a
        get holds a lease on it (unless `force`)."""
        self._one(await self.batch_remove([key], force=force))

    @with_timeout
    @counted("remove")
    async def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list:
        return await self._keyed("batch_remove", keys, bool(force))

    @with_timeout
    async def remove_all(self, *, force: bool = False) -> int:
        """Removes every complete object not under a lease (of this client's
        namespace only, when it has one); returns how many."""
        if self.namespace:
            return await self._call("remove_all", bool(force), self.namespace)
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

    @with_timeout
    async def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        """Removes every complete object whose key `pattern` (a Python
        regular expression) matches anywhere (of this client's namespace
        only, matched against its own keys, when it has one), not those
        under a lease unless `force`; returns how many.
        InvalidArgumentError for a bad pattern."""
        if self.namespace:
            return await self._call("remove_by_regex", pattern, bool(force), self.namespace)
        return await self._call("remove_by_regex", pattern, bool(force))

    @with_timeout
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

    def _ns(self, keys: Sequence[Any]) -> Sequence[Any]:
        """The master's names of the caller's keys: "<namespace>\x1f<key>"
        for a client with a namespace. A key holding that separator is
        refused (InvalidKeyError): it would name another namespace."""
        p = self._prefix
        if type(keys) in (list, tuple) and plain_keys(keys, user=True):     # the common case, in C
            return keys if not p else list(map(p.__add__, keys))
        if any(type(k) is str and NS_SEP in k for k in keys):
            raise InvalidKeyError(f"a key may not hold {NS_SEP!r} (the namespace separator)")
        if not p:
            return keys
        return [p + k if type(k) is str else k for k in keys]

    async def _keyed(self, method: str, keys: Sequence[str], *extra: Any) -> list:
        """A batch call whose only input is keys: bad keys get their error
        here, the rest go to the master in one round trip."""
        keys = self._ns(keys)
        if type(keys) in (list, tuple) and plain_keys(keys):
            # the common case (the servers' prefix checks): no per-key work
            items = await self._call(method, list(keys), *extra)
            if method == "batch_exists" and set(map(type, items)) <= {bool}:
                return items
            return [item_result(item, k) for k, item in zip(keys, items)]
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
                results[i] = item_result(item, keys[i])
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
        async with self._staging_freed:
            # counted as waiting before it looks: a caller's thread that frees
            # room after the look wakes it (the wake-up runs on this loop,
            # so only once this call waits)
            self._staging_waiting += 1
            try:
                while True:
                    got = self._stage_now(sizes)
                    if got is not None:
                        return got
                    await self._staging_freed.wait()
            finally:
                self._staging_waiting -= 1

    async def _unstage(self, addrs: list[int]) -> None:
        async with self._staging_freed:
            self._release_staged(addrs)
            self._staging_freed.notify_all()

    def _stage_now(self, sizes: list[int]) -> list[int] | None:
        """Addresses in the local buffer for `sizes`, or None when they do
        not all fit now (no wait); from any thread."""
        alloc, base = self._staging_alloc, self._staging_region.addr
        with self._staging_lock:
            got = []
            for n in sizes:
                off = alloc.allocate(max(n, 1))
                if off is None:
                    for o in got:
                        alloc.release(o)
                    return None
                got.append(off)
        return [base + off for off in got]

    def _release_staged(self, addrs: list[int]) -> None:
        base = self._staging_region.addr
        with self._staging_lock:
            for a in addrs:
                self._staging_alloc.release(a - base)

    def _unstage_now(self, addrs: list[int]) -> None:
        """_unstage from a caller's thread (direct.py): calls on the loop
        waiting for room are woken there."""
        self._release_staged(addrs)
        if self._staging_waiting and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._unstage([]), self._loop)

    def _staging_view(self, addr: int, n: int) -> memoryview:
        off = addr - self._staging_region.addr
        return memoryview(self._staging)[off:off + n]
