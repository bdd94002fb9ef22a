"""kvflow.store as SGLang HiCache's storage tier: a native HiCacheStorage.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvflow",
            "module_path": "kvflow.compat.sglang.hicache", "class_name": "KVFlowHiCacheStorage",
            "interface_v1": 1, "master_server_addr": "10.0.0.1:50051"}'

SGLang's StorageBackendFactory imports this module and builds the class
with (storage_config, kwargs); `interface_v1` makes HiCacheController call
the zero-copy batch_get_v1/batch_set_v1 (SGLang's Mooncake backend's path).

How it maps (no Mooncake API layer in between: kvflow.store's StoreClient
directly):
- One kvflow Engine on an EngineThread (its own event loop on a daemon
  thread) and one StoreClient on it. Exists checks, page puts and gets run
  on SGLang's calling thread (its prefetch or backup thread) where
  StoreClient.batch_exists_blocking and kvflow/store/direct.py serve them (a
  tcp master, every page in registered host memory, in DRAM): no hop to
  the loop. Any other call is one coroutine handed to that loop while the
  calling thread blocks on an eventfd.
- register_mem_pool_host registers the host pool's buffer(s) with the
  client's engine once; pages then move straight between the host pool and
  the pool's segments (put_from/get_into: no staging copy).
- One object per page: the page hash, then the TP rank (MHA: each rank
  holds its own heads) or `mla` (MLA: every rank holds the same latent, so
  one shared object), then the PP rank when PP > 1. The object is the page's
  buffers as SGLang's host pool lists them (get_page_buffer_meta: K and V
  for MHA page_first, one buffer for MLA page_first, one per layer for
  layer_first) put and read as scatter/gather parts: one key per page where
  SGLang's Mooncake backend keeps two for MHA (half the master's work).
- batch_exists: the longest present prefix, with one master round trip for
  the whole batch. batch_set_v1: one batch_exists for every page, then the
  missing pages only, in one batch put (one round trip to allocate, one
  kvflow batch per holder, one to commit). batch_get_v1: one batch get
  (one round trip for the replicas, one kvflow batch per holder) and a
  per-page success list.

Extra config keys (all optional): master_server_addr (a kvflow master,
"host:port", "etcd://host:port/cluster" or "host:port,host:port"; default
$KVFLOW_STORE_MASTER, else a master embedded in this process: one process
only), global_segment_size (bytes this rank contributes, default 1 GiB; 0
for none), protocol ("tcp", "rdma", "auto"; default "auto": same-host
copies where the peers share a host), local_hostname (where the engine
listens, default 127.0.0.1), key_prefix (prepended to every key, e.g. a
model name, so two models never share pages), replica_num (default 1),
timeout (seconds per call, default 10).

Failures of single pages are False in the result lists, as SGLang expects;
misuse (pages before register_mem_pool_host, index tensors that do not
match the keys, unsupported layouts) raises a typed kvflow error.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvflow.compat.mooncake.waiting import run_blocking
from kvflow.config import env_str
from kvflow.engine.thread import EngineThread
from kvflow.errors import InvalidArgumentError, KVFlowError
from kvflow.store import StoreClient, StoreTimeoutError, direct

__all__ = ["KVFlowHiCacheStorage", "HiCacheCounters"]

log = logging.getLogger("kvflow.compat.sglang.hicache")

_PROTOCOLS: dict[str, tuple[str, ...] | None] = {"tcp": ("tcp",), "rdma": ("rdma",), "auto": None}


class HiCacheCounters:
    """What the backend asked of the pool since it started (tests and
    metrics read them; updated only on SGLang's calling threads, under a
    lock, as prefetch and backup run on two threads)."""

    __slots__ = ("exists_calls", "pages_written", "pages_skipped", "pages_read", "pages_failed", "_lock")

    def __init__(self) -> None:
        self.exists_calls = self.pages_written = self.pages_skipped = 0
        self.pages_read = self.pages_failed = 0
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__ if name != "_lock"}


def _int_option(extra: dict, name: str, default: int, low: int = 0) -> int:
    v = extra.get(name, default)
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise InvalidArgumentError(f"hicache extra config {name}: an int >= {low}, not {v!r}")
    return v


class KVFlowHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage on kvflow.store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {}) if storage_config is not None else {}
        if storage_config is None:
            raise InvalidArgumentError("KVFlowHiCacheStorage needs SGLang's HiCacheStorageConfig")
        if storage_config.should_split_heads or storage_config.dcp_size > 1:
            raise InvalidArgumentError("KVFlowHiCacheStorage: heterogeneous TP (tp_lcm_size) and DCP "
                                       "layouts are not supported yet")
        protocol = str(extra.get("protocol", "auto"))
        if protocol not in _PROTOCOLS:
            raise InvalidArgumentError(f"hicache extra config protocol {protocol!r}: one of "
                                       f"{', '.join(_PROTOCOLS)}")
        segment = _int_option(extra, "global_segment_size", 1 << 30)
        replica_num = _int_option(extra, "replica_num", 1, low=1)
        timeout = float(extra.get("timeout", 10.0))
        master = extra.get("master_server_addr") or env_str("KVFLOW_STORE_MASTER")
        if isinstance(master, str) and "," in master and "://" not in master:
            master = [a.strip() for a in master.split(",") if a.strip()]
        self.config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        # the key's tail: MHA pages differ per TP rank (each holds its own
        # heads), MLA pages are the same on every rank (one shared object;
        # SGLang lets only the writer rank back them up)
        tail = "mla" if self.is_mla else str(storage_config.tp_rank)
        if storage_config.pp_size > 1:
            tail += f"_{storage_config.pp_rank}"
        self.key_tail = "_" + tail
        self.key_prefix = str(extra.get("key_prefix", ""))
        self.counters = HiCacheCounters()
        self.mem_pool_host: Any = None
        self._regions: list[Any] = []
        self._thread = EngineThread(thread_name=f"kvflow-hicache-tp{storage_config.tp_rank}",
                                    listen=f"{extra.get('local_hostname', '127.0.0.1')}:0",
                                    protocols=_PROTOCOLS[protocol])
        self._thread.start()
        self.client = StoreClient(master, engine=self._thread.engine, segment_size=segment, local_buffer_size=0,
                                  timeout=timeout, replica_num=replica_num)
        try:
            self._call(self.client.start())
        except BaseException:
            self._thread.close()
            raise
        self._closed = False

    def __repr__(self) -> str:
        return (f"<KVFlowHiCacheStorage {'MLA' if self.is_mla else 'MHA'} tp{self.config.tp_rank} "
                f"client={self.client.client_id} master={self.client.master_address}>")

    # ------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coro` on the engine's loop, blocking this thread; raises
        KVFlowError subclasses only."""
        try:
            return run_blocking(self._thread, coro)
        except KVFlowError:
            raise
        except TimeoutError:
            raise StoreTimeoutError("the store call did not finish in time") from None

    def object_keys(self, keys: Sequence[str]) -> list[str]:
        """The pool's key of each page hash (this rank's object of it)."""
        if not isinstance(keys, (list, tuple)) or not all(type(k) is str and k for k in keys):
            raise InvalidArgumentError("keys must be a list of non-empty str page hashes")
        p, t = self.key_prefix, self.key_tail
        return [f"{p}{k}{t}" for k in keys]

    def _page_parts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Each page's buffers in the host pool as (address, size) parts, in
        the order SGLang's host pool lists them."""
        pool = self.mem_pool_host
        if pool is None or not self._regions:
            raise InvalidArgumentError("register_mem_pool_host() first: no host pool is registered")
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-d tensor of token slots")
        if len(host_indices) != len(keys) * pool.page_size:
            raise InvalidArgumentError(f"{len(keys)} pages need {len(keys) * pool.page_size} host slots, "
                                       f"got {len(host_indices)}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if ptrs and isinstance(ptrs[0], (list, tuple)):       # already grouped per page
            return [list(zip(map(int, p), map(int, s))) for p, s in zip(ptrs, sizes)]
        n = len(ptrs) // len(keys) if keys else 0
        if n == 0 or n * len(keys) != len(ptrs):
            raise InvalidArgumentError(f"the host pool gave {len(ptrs)} buffers for {len(keys)} pages")
        return [list(zip(map(int, ptrs[i * n:(i + 1) * n]), map(int, sizes[i * n:(i + 1) * n])))
                for i in range(len(keys))]

    # ------------------------------------------------------------ memory
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host pool's buffer(s) with the client's engine, once
        (a second call with the same pool is a no-op)."""
        if mem_pool_host is self.mem_pool_host and self._regions:
            return
        super().register_mem_pool_host(mem_pool_host)
        get = getattr(mem_pool_host, "get_hybrid_pool_buffer", None)
        buffers = get() if get is not None else [getattr(mem_pool_host, "kv_buffer", None)]
        buffers = [b for b in buffers if b is not None]
        if not buffers:
            raise InvalidArgumentError("the host pool has no kv_buffer to register")
        for b in buffers:
            if not isinstance(b, torch.Tensor) or b.device.type != "cpu" or not b.is_contiguous():
                raise InvalidArgumentError("KVFlowHiCacheStorage needs contiguous CPU host buffers")
            span = (b.data_ptr(), b.numel() * b.element_size())
            self._regions.append(self._thread.call_sync(
                lambda: self.client.register_buffer(span, name=f"hicache:{span[0]:#x}")))

    # ------------------------------------------------------------ interface_v1
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of `keys`, from the first, are in the pool (the first
        missing one ends the prefix). One master round trip."""
        if not keys:
            return 0
        okeys = self.object_keys(keys)
        # from this thread on a blocking socket of the client's (as
        # _set_pages' exists): the loop's hop and back cost a prefetch about
        # as much as the round trip itself (~0.5 ms each way on a loaded host)
        found = self.client.batch_exists_blocking(okeys)
        if found is None:               # a case only the loop serves (it names what went wrong)
            found = self._call(self.client.batch_exists(okeys))
        self.counters.add(exists_calls=1)
        for i, ok in enumerate(found):
            if ok is not True:
                return i
        return len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Backs pages up from the host pool: pages already in the pool are
        skipped (one exists call for all), the rest written zero-copy in one
        batch put. True per page that is in the pool afterwards."""
        if not keys:
            return []
        okeys = self.object_keys(keys)
        parts = self._page_parts(keys, host_indices)
        return self._set_pages(okeys, parts)

    def _set_pages(self, okeys: list[str], parts: list) -> list[bool]:
        """The pages not yet in the pool put: on this thread where
        kvflow/store/direct.py serves both steps, else on the loop."""
        found = self.client.batch_exists_blocking(okeys)
        if found is not None:
            todo = [i for i, ok in enumerate(found) if ok is not True]
            put = direct.put_from_parts(self.client, [okeys[i] for i in todo], [parts[i] for i in todo]) \
                if todo else []
            if put is not None:
                return self._set_done(okeys, todo, put)
        return self._call(self._set(okeys, parts))

    async def _set(self, okeys: list[str], parts: list) -> list[bool]:
        found = await self.client.batch_exists(okeys)
        todo = [i for i, ok in enumerate(found) if ok is not True]
        put = await self.client.batch_put_from_parts([okeys[i] for i in todo], [parts[i] for i in todo]) \
            if todo else []
        return self._set_done(okeys, todo, put)

    def _set_done(self, okeys: list[str], todo: list[int], put: list) -> list[bool]:
        """A set's per-page success list (and counters) from its put's results."""
        out = [True] * len(okeys)
        if todo:
            for i, r in zip(todo, put):
                if isinstance(r, BaseException):
                    out[i] = False
                    log.debug("kvflow hicache: set %s: %s", okeys[i], r)
        failed = out.count(False)
        self.counters.add(exists_calls=1, pages_written=len(todo) - failed, pages_failed=failed,
                          pages_skipped=len(okeys) - len(todo))
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Reads pages into the host pool zero-copy; True per page read whole."""
        if not keys:
            return []
        okeys = self.object_keys(keys)
        parts = self._page_parts(keys, host_indices)
        got = self._get_pages(okeys, parts)
        need = [sum(s for _, s in p) for p in parts]
        out = [type(r) is int and r == n for r, n in zip(got, need)]
        ok = sum(out)
        self.counters.add(pages_read=ok, pages_failed=len(out) - ok)
        for k, r in zip(okeys, got):
            if isinstance(r, BaseException):
                log.debug("kvflow hicache: get %s: %s", k, r)
        return out

    def _get_pages(self, okeys: list[str], parts: list) -> list:
        """Per page its size or error: read on this thread where
        kvflow/store/direct.py serves the call, else on the loop."""
        got = direct.get_into_parts(self.client, okeys, parts)
        return got if got is not None else self._call(self.client.batch_get_into_parts(okeys, parts))

    # ------------------------------------------------------------ the older interface
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Zero-copy read of one page into registered memory at
        target_location (an address, or a list of addresses with
        target_sizes a list of sizes)."""
        return self.batch_get([key], [target_location], [target_sizes]) == 1

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> int:
        """Zero-copy reads; how many pages, from the first, were read."""
        if target_locations is None or target_sizes is None:
            raise InvalidArgumentError("KVFlowHiCacheStorage moves pages zero-copy: give target "
                                       "locations and sizes (or use batch_get_v1)")
        parts = [_parts(a, s) for a, s in zip(target_locations, target_sizes)]
        got = self._get_pages(self.object_keys(keys), parts)
        for i, r in enumerate(got):
            if isinstance(r, BaseException):
                return i
        return len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], None, [target_location], [target_sizes])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Zero-copy writes of pages not yet in the pool; True if all are in."""
        if target_locations is None or target_sizes is None:
            raise InvalidArgumentError("KVFlowHiCacheStorage moves pages zero-copy: give target "
                                       "locations and sizes (or use batch_set_v1)")
        if not keys:
            return False
        parts = [_parts(a, s) for a, s in zip(target_locations, target_sizes)]
        return all(self._set_pages(self.object_keys(keys), parts))

    def pool_stats(self) -> dict:
        """The master's view of the pool (objects, space, evictions, calls
        it has answered) and this backend's counters under "hicache"."""
        return {**self._call(self.client.stats()), "hicache": self.counters.as_dict()}

    # ------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """Removes every object of the pool that no get holds (all models',
        as SGLang's Mooncake backend's remove_all does)."""
        self._call(self.client.remove_all())

    def close(self) -> None:
        """Leaves the pool and stops the engine. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._call(self.client.close())
        except KVFlowError as e:      # the master is gone: leaving is done anyway
            log.debug("kvflow hicache: close: %s", e)
        self._thread.close()


def _parts(addr: Any, size: Any) -> list[tuple[int, int]]:
    if isinstance(addr, (list, tuple)):
        if not isinstance(size, (list, tuple)) or len(size) != len(addr):
            raise InvalidArgumentError("a page's target locations and sizes must be lists of one length")
        return list(zip(addr, size))
    return [(addr, size)]
