"""`MooncakeDistributedStore`: Mooncake Store's Python class on kvflow.store.

    from kvflow.compat.mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    store.setup("10.0.0.1", "P2PHANDSHAKE", 1 << 30, 16 << 20, "tcp", "", "10.0.0.9:50051")
    store.put("k", b"bytes")                      # 0
    store.get("k")                                # b"bytes" (b"" when missing)

Names, argument order and return conventions are those of the
mooncake-transfer-engine wheel's `mooncake.store` (0.3.13): int calls give
0 or a byte count on success and Mooncake's negative ErrorCode on failure
(codes.py) and never raise for a failed operation; arguments of the wrong
type raise TypeError as the wheel's binding does. Failures are logged at
debug level on "kvflow.compat.mooncake" and kept, as the typed kvflow
exception, in `last_error`.

How it maps: setup() starts one kvflow Engine on an EngineThread (its own
event loop on a daemon thread) and a kvflow.store.StoreClient on that loop,
connected to the kvflow master at `master_server_addr` (`python -m
kvflow.store master`); global_segment_size is the client's segment,
local_buffer_size its staging buffer for put()/get() of bytes. The common
puts and gets (put, put_batch, batch_put_from, get, get_batch,
batch_get_into, batch_is_exist) run on the calling thread
(kvflow/store/direct.py: the master on blocking connections of the
client's, the bytes with blocking kvflow transfers); every other call, and
those where that path does not apply, is one coroutine handed to that
loop while the calling thread blocks, as Mooncake's C++ calls block. Any
number of threads may call at once.

Every difference from Mooncake Store is in docs/store.md ("Mooncake
Store's API").
"""
from __future__ import annotations

import ctypes
import enum
import logging
import re
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from kvflow.engine.thread import EngineThread
from kvflow.errors import InvalidArgumentError, KVFlowError, UnregisteredMemoryError
from kvflow.store import direct
from kvflow.store import (BufferTooSmallError, InvalidKeyError, LeaseExpiredError, MasterUnavailableError,
                          NoSpaceError, ObjectBusyError, ObjectExistsError, ObjectLeasedError, ObjectNotFoundError,
                          ReplicaUnavailableError, SegmentError, StoreClient, StoreTimeoutError, TaskNotFoundError)

from .codes import (PROTOCOLS, STORE_INTERNAL_ERROR, STORE_INVALID_PARAMS, STORE_LEASE_EXPIRED,
                    STORE_NO_AVAILABLE_HANDLE, STORE_NOT_SUPPORTED, STORE_OBJECT_HAS_LEASE, STORE_OBJECT_NOT_FOUND,
                    STORE_RPC_FAIL, STORE_RPC_TIMEOUT, STORE_SEGMENT_NOT_FOUND, STORE_TASK_NOT_FOUND,
                    STORE_TRANSFER_FAIL, mooncake_flag)
from .dummy import setup_dummy as _setup_dummy
from .replica_tasks import (Descriptor, DiskDescriptor, MemoryDescriptor, QueryTaskResponse, ReplicaDescriptor,
                            ReplicaStatus, ReplicaTaskCalls, TaskStatus, TaskType)
from .shm import MooncakeHostMemAllocator
from .store_setup import PORT_RANGE, attach_root_fs, engine_thread, shutdown, size_value, ssd_options
from .tensor import TensorCalls
from .waiting import run_blocking

__all__ = ["BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor", "MooncakeDistributedStore",
           "ObjectDataType", "PORT_RANGE", "QueryTaskResponse", "ReplicaDescriptor", "ReplicaStatus",
           "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType"]

log = logging.getLogger("kvflow.compat.mooncake")

DEFAULT_SIZE = 16 << 20

# kvflow error -> Mooncake ErrorCode; the first class in the exception's
# MRO that is listed wins (BufferTooSmallError before InvalidArgumentError).
_CODES: dict[type, int] = {
    ObjectNotFoundError: STORE_OBJECT_NOT_FOUND,
    ObjectLeasedError: STORE_OBJECT_HAS_LEASE,
    LeaseExpiredError: STORE_LEASE_EXPIRED,
    NoSpaceError: STORE_NO_AVAILABLE_HANDLE,
    ReplicaUnavailableError: STORE_TRANSFER_FAIL,
    MasterUnavailableError: STORE_RPC_FAIL,
    StoreTimeoutError: STORE_RPC_TIMEOUT,
    TaskNotFoundError: STORE_TASK_NOT_FOUND,
    SegmentError: STORE_SEGMENT_NOT_FOUND,
    BufferTooSmallError: STORE_INVALID_PARAMS,
    InvalidKeyError: STORE_INVALID_PARAMS,
    UnregisteredMemoryError: STORE_INVALID_PARAMS,
    InvalidArgumentError: STORE_INVALID_PARAMS,
}


def error_code(exc: BaseException) -> int:
    """The Mooncake ErrorCode for a kvflow failure."""
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return STORE_INTERNAL_ERROR


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's per-put options. kvflow uses replica_num,
    preferred_segments or else preferred_segment (segments by name: a
    store's get_hostname(); a name not mounted is ignored, as Mooncake
    ignores an unknown one), with_hard_pin (kvflow's pin: never evicted) and
    soft_pin_action ENABLE with soft_pin_ttl_ms (a soft pin: evicted only
    when nothing unpinned can go, for that long; None: the master's
    default); the rest is accepted and kept."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        # the binding's std::optional<uint64_t>: None or 0 .. 2**64 - 1, else TypeError
        if value is not None and (type(value) is not int or not 0 <= value < 1 << 64):
            raise TypeError(f"soft_pin_ttl_ms must be None or an int in [0, 2**64), not {value!r}")
        self._soft_pin_ttl_ms = value

    def __str__(self) -> str:
        ttl = "default" if self._soft_pin_ttl_ms is None else self._soft_pin_ttl_ms
        action = SoftPinAction(self.soft_pin_action).name
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
                f"dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: {action}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(bool(self.with_hard_pin))}, preferred_segments: "
                f"[{', '.join(self.preferred_segments)}], preferred_nof_segments: "
                f"[{', '.join(self.preferred_nof_segments)}], prefer_alloc_in_same_node: "
                f"{int(bool(self.prefer_alloc_in_same_node))}, data_type: {ObjectDataType(self.data_type).name} }}")

    __repr__ = __str__


class BufferHandle(bytearray):
    """get_buffer()'s result: the object's bytes with Mooncake's `ptr()` and
    `size()`, and the buffer protocol (bytes(h), memoryview(h), numpy). A
    copy owned by the handle (Mooncake's lives in the client's local
    buffer until the handle is dropped)."""

    def ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)


def _keys(keys: Any, what: str = "keys") -> list[str]:
    if not isinstance(keys, (list, tuple)) or (set(map(type, keys)) - {str}      # in C: the hot case
                                               and not all(isinstance(k, str) for k in keys)):
        raise TypeError(f"{what} must be a list of str")
    return list(keys)


def _uints(values: Any, what: str) -> list[int]:
    # the binding's size_t / uintptr_t columns: non-negative ints, else TypeError
    if type(values) in (list, tuple) and values and set(map(type, values)) == {int} and min(values) >= 0:
        return list(values)             # the hot case, in C: no Python frame per value
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(f"{what} must be a list of non-negative ints")
    return list(values)


def _uint(value: Any, what: str) -> int:
    return _uints([value], what)[0]


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__}")
    return key


def _view(value: Any) -> memoryview:
    try:
        return memoryview(value).cast("B")
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not {type(value).__name__!r}") from None


class MooncakeDistributedStore(TensorCalls, ReplicaTaskCalls):
    """Mooncake Store's client (see the module docstring); the tensor calls
    are tensor.py's, the copy/move tasks and replica descriptors
    replica_tasks.py's, joining and leaving the pool store_setup.py's."""

    _code = staticmethod(error_code)

    def __init__(self) -> None:
        self._thread: EngineThread | None = None
        self._own_thread = False
        self._client: StoreClient | None = None
        self._hostname = ""
        self._buffers: dict[int, Any] = {}      # register_buffer address -> kvflow Region
        self._finalizer: weakref.finalize | None = None
        self.last_error: KVFlowError | None = None

    def __repr__(self) -> str:
        state = "ready" if self._client is not None else "not set up"
        return f"<kvflow.compat.mooncake.MooncakeDistributedStore {self._hostname or '-'} {state}>"

    # ------------------------------------------------------------ lifecycle
    def setup(self, local_hostname: Any, metadata_server: str | None = None,
              global_segment_size: int = DEFAULT_SIZE, local_buffer_size: int = DEFAULT_SIZE,
              protocol: str = "tcp", rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Joins the pool: 0, or a negative code (-600 bad parameters, -1012
        a feature kvflow.store does not have, -1 unknown protocol, -900 the
        master cannot be reached). Also setup(config: dict), with Mooncake's
        keys and human-readable sizes."""
        if isinstance(local_hostname, dict):
            return self._setup_dict(local_hostname)
        if metadata_server is None:
            raise TypeError("setup() takes (local_hostname, metadata_server, global_segment_size, "
                            "local_buffer_size, protocol, rdma_devices, master_server_addr, ...) or (config: dict)")
        _uint(global_segment_size, "global_segment_size")
        _uint(local_buffer_size, "local_buffer_size")
        if self._client is not None:
            return 0            # Mooncake: a second setup of a set-up store is a no-op success
        ssd: dict = {}
        if enable_ssd_offload:
            try:
                ssd = ssd_options(ssd_offload_path)
            except InvalidArgumentError as e:
                return self._fail(e, STORE_INVALID_PARAMS)
        if tenant_id not in ("", "default"):
            return self._fail(InvalidArgumentError(f"tenant_id {tenant_id!r}: kvflow.store has no tenants"),
                              STORE_NOT_SUPPORTED)
        if enable_client_http_server:
            log.warning("kvflow.compat.mooncake: enable_client_http_server: no client HTTP server is started")
        if protocol == "rdma" and mooncake_flag("MC_FORCE_TCP"):
            protocol = "tcp"
        if protocol not in PROTOCOLS:
            return self._fail(InvalidArgumentError(f"protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}"),
                              STORE_INTERNAL_ERROR)
        # metadata_server (P2PHANDSHAKE, http://, etcd://, redis://) is
        # accepted and not used: kvflow's master records where each
        # segment's engine listens, which is what Mooncake keeps there.
        host, _, port = str(local_hostname or "localhost").rpartition(":") if ":" in str(local_hostname) \
            else (str(local_hostname or "localhost"), "", "")
        try:
            thread, self._own_thread, self._hostname = engine_thread(engine, host, port, protocol, rdma_devices)
            self._thread = thread
        except KVFlowError as e:
            return self._fail(e, STORE_INVALID_PARAMS)
        # "host:port"; kvflow's durable master: "etcd://host:port/cluster" or
        # "host:port,host:port" (the client follows the leader)
        master: str | list[str] = master_server_addr
        if "," in master_server_addr and "://" not in master_server_addr:
            master = [a.strip() for a in master_server_addr.split(",") if a.strip()]
        try:
            client = StoreClient(master, engine=thread.engine, segment_size=global_segment_size,
                                 local_buffer_size=local_buffer_size, segment_name=self._hostname, **ssd)
        except KVFlowError as e:
            if self._own_thread:
                thread.close()
            self._thread, self._hostname = None, ""
            return self._fail(e, STORE_INVALID_PARAMS)
        try:
            thread.call(client.start())
        except Exception as e:  # noqa: BLE001 - a code, never a raise
            if self._own_thread:
                thread.close()
            self._thread, self._hostname = None, ""
            e = e if isinstance(e, KVFlowError) else MasterUnavailableError(f"{type(e).__name__}: {e}")
            return self._fail(e, error_code(e))
        if not ssd and client.root_fs_dir:
            # the master was started with --root_fs_dir: Mooncake's clients
            # then start their file storage there, and so do these (each in a
            # directory of its own under it, the first one no other process holds)
            try:
                thread.call(attach_root_fs(client, host))
            except KVFlowError as e:
                log.warning("kvflow.compat.mooncake: no SSD tier under %s: %s", client.root_fs_dir, e)
        self._client = client
        # Mooncake frees its client in the destructor (SGLang never calls
        # close()): so does this, when collected or at interpreter exit
        self._finalizer = weakref.finalize(self, shutdown, thread, client, self._buffers, self._own_thread)
        return 0

    def _setup_dict(self, config: dict) -> int:
        c = {str(k): v for k, v in config.items()}
        if not c.get("local_hostname") or not c.get("metadata_server"):
            return self._fail(InvalidArgumentError("config needs local_hostname and metadata_server"),
                              STORE_INVALID_PARAMS)
        sizes = {}
        for name in ("global_segment_size", "local_buffer_size"):
            n = size_value(c.get(name, DEFAULT_SIZE))
            if n is None:
                return self._fail(InvalidArgumentError(f"{name}: {c[name]!r} is not a size"), STORE_INVALID_PARAMS)
            sizes[name] = n
        flag = lambda v: str(v).strip().lower() in ("1", "true", "yes", "on")  # noqa: E731
        return self.setup(str(c["local_hostname"]), str(c["metadata_server"]), sizes["global_segment_size"],
                          sizes["local_buffer_size"], str(c.get("protocol", "tcp")), str(c.get("rdma_devices", "")),
                          str(c.get("master_server_addr", "127.0.0.1:50051")),
                          enable_ssd_offload=flag(c.get("enable_ssd_offload", False)),
                          ssd_offload_path=str(c.get("ssd_offload_path", "")),
                          tenant_id=str(c.get("tenant_id", "default")),
                          enable_client_http_server=flag(c.get("enable_client_http_server", False)))

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy client: every call forwarded to the standalone real
        client at server_address (`python -m kvflow.compat.mooncake.client`,
        `mooncake_client`), buffers shared with it (dummy.py): 0 or -1."""
        return _setup_dummy(self, mem_pool_size, local_buffer_size, server_address)

    def alloc_from_mem_pool(self, size: int) -> int:
        """`size` bytes of shared memory a real client can map (register_buffer
        them whole before put_from/get_into); 0 when none could be had."""
        return MooncakeHostMemAllocator().alloc(_uint(size, "size"))

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = DEFAULT_SIZE) -> int:
        """Mooncake's older entry point: setup() with its fixed defaults
        (localhost, a 1 GiB local buffer, the master at 127.0.0.1:50051)."""
        if self._client is not None:
            return self._fail(InvalidArgumentError("init_all(): already set up"), STORE_INVALID_PARAMS)
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, 1 << 30, protocol, device_name,
                          "127.0.0.1:50051")

    def close(self) -> int:
        """Leaves the pool (objects only this client held go) and stops the
        engine; 0. Idempotent; setup() may be called again afterwards."""
        finalizer, self._finalizer = self._finalizer, None
        self._client, self._thread, self._hostname = None, None, ""
        if finalizer is not None:
            finalizer()
        self._buffers = {}
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 the master does not answer."""
        if self._client is None:
            return 1
        try:
            self._call(self._client.stats(timeout=5.0))
        except KVFlowError:
            return 2
        return 0

    def get_hostname(self) -> str:
        """"host:port" of this client's engine (its segment's name)."""
        return self._hostname

    # ------------------------------------------------------------ memory
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers [buffer_ptr, +size) for put_from/get_into: 0, or -600
        (overlaps a registered buffer, null, not set up)."""
        buffer_ptr, size = _uint(buffer_ptr, "buffer_ptr"), _uint(size, "size")
        return self._memory(self._register, buffer_ptr, size)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or -600 when buffer_ptr was not registered."""
        return self._memory(self._unregister, _uint(buffer_ptr, "buffer_ptr"))

    def _register(self, addr: int, size: int) -> int:
        if addr == 0 or size == 0:
            raise InvalidArgumentError(f"cannot register {addr:#x}+{size}")
        for r in self._thread.engine.regions:
            if addr < r.end and r.addr < addr + size:
                raise InvalidArgumentError(f"{addr:#x}+{size} overlaps a registered region")
        self._buffers[addr] = self._client.register_buffer((addr, size), name=f"mooncake-store:{addr:#x}")
        return 0

    def _unregister(self, addr: int) -> int:
        region = self._buffers.pop(addr, None)
        if region is None:
            raise InvalidArgumentError(f"{addr:#x} is not a registered buffer")
        self._client.unregister_buffer(region)
        return 0

    def _memory(self, fn: Callable[..., int], *args: Any) -> int:
        if self._client is None:
            return self._fail(self._not_ready(), STORE_INVALID_PARAMS)
        try:
            return self._thread.call_sync(fn, *args)
        except KVFlowError as e:
            return self._fail(e, STORE_INVALID_PARAMS)

    # ------------------------------------------------------------ puts
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Stores bytes (any buffer) through the local buffer: 0, or a code.
        A key that exists already: 0 and the object is unchanged (Mooncake's
        objects are immutable too)."""
        return self.put_batch([_key(key)], [value], config)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """put() of the concatenation of `parts`."""
        views = [_view(p) for p in parts]
        return self.put(_key(key), b"".join(views), config)

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        """put() of each: 0 when all went in, else the first failure's code."""
        keys, views = _keys(keys), [_view(v) for v in values]
        if len(keys) != len(views):
            return self._fail(InvalidArgumentError("keys and values differ in length"), STORE_INVALID_PARAMS)
        codes = self._puts(lambda c, kw: c.batch_put(keys, views, **kw), len(keys), config,
                           lambda c, kw: direct.put_bytes(c, keys, views, **kw))
        return next((r for r in codes if r), 0)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Stores [buffer_ptr, +size) of registered memory: 0 or a code."""
        return self.batch_put_from([_key(key)], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        keys, ptrs, sizes = _keys(keys), _uints(buffer_ptrs, "buffer_ptrs"), _uints(sizes, "sizes")
        if not len(keys) == len(ptrs) == len(sizes):
            return self._fail_all(len(keys), "keys, buffer_ptrs and sizes differ in length")
        return self._puts(lambda c, kw: c.batch_put_from(keys, ptrs, sizes, **kw), len(keys), config,
                          lambda c, kw: direct.put_from(c, keys, ptrs, sizes, **kw))

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], config: ReplicateConfig | None = None) -> list[int]:
        """Each object is its buffers concatenated (SGLang's K and V pages)."""
        parts = self._multi(keys, all_buffer_ptrs, all_sizes)
        if parts is None:
            return self._fail_all(len(keys), "keys, all_buffer_ptrs and all_sizes differ in length")
        return self._puts(lambda c, kw: c.batch_put_from_parts(keys, parts, **kw), len(keys), config,
                          lambda c, kw: direct.put_from_parts(c, keys, parts, **kw))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """put() that replaces an existing object (removed first, force)."""
        return self.upsert_batch([_key(key)], [value], config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self.upsert(_key(key), b"".join(_view(p) for p in parts), config)

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        keys = _keys(keys)
        if (code := self._replace(keys, config)) is not None:
            return code
        return self.put_batch(keys, values, config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([_key(key)], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        keys = _keys(keys)
        if (code := self._replace(keys, config)) is not None:
            return [code] * len(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes, config)

    def _replace(self, keys: list[str], config: ReplicateConfig | None) -> int | None:
        """An upsert's first half: the old objects go (force: a reader still
        copying keeps its bytes; kvflow frees them when it is done). Not
        atomic: a reader between the two halves finds no object."""
        if self._client is None:
            return self._fail(self._not_ready(), STORE_INTERNAL_ERROR)
        if (bad := self._options(config)) is not None:
            return self._fail(bad, STORE_INVALID_PARAMS)
        try:
            self._call(self._client.batch_remove(keys, force=True))
        except KVFlowError as e:
            return self._fail(e, error_code(e))
        return None

    def _options(self, config: ReplicateConfig | None) -> InvalidArgumentError | None:
        """What Mooncake refuses in a ReplicateConfig (a soft-pin TTL without
        soft_pin_action ENABLE, replica_num < 1), or None when it is fine."""
        if config is None:
            return None
        if not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, not {type(config).__name__}")
        if config.soft_pin_ttl_ms is not None and config.soft_pin_action != SoftPinAction.ENABLE:
            return InvalidArgumentError("soft_pin_ttl_ms needs soft_pin_action ENABLE")
        if not isinstance(config.replica_num, int) or config.replica_num < 1:
            return InvalidArgumentError(f"replica_num must be >= 1, not {config.replica_num!r}")
        return None

    def _puts(self, run: Callable[[StoreClient, dict], Coroutine[Any, Any, list]], n: int,
              config: ReplicateConfig | None, on_caller: Callable[[StoreClient, dict], list | None] | None = None
              ) -> list[int]:
        """The funnel of every put: per key 0 or a code. `on_caller`: the
        put on the calling thread (kvflow/store/direct.py), where it serves
        the call (None: it does not, and `run` goes to the store's loop)."""
        client = self._client
        if client is None:
            return self._fail_all(n, self._not_ready(), STORE_INTERNAL_ERROR)
        if n == 0:
            return []
        if (bad := self._options(config)) is not None:
            return self._fail_all(n, bad)
        kw: dict[str, Any] = {}
        if config is not None:
            kw["replica_num"] = config.replica_num
            kw["pin"] = bool(config.with_hard_pin)
            if config.soft_pin_action == SoftPinAction.ENABLE and not config.with_hard_pin:
                ttl = config.soft_pin_ttl_ms
                kw["soft_pin"] = True if ttl is None else max(ttl, 1) / 1000
            # segments by name (each store mounts its hostname): the master
            # resolves them, and ignores a name not mounted, as Mooncake does
            if config.preferred_segments:
                kw["preferred_segment"] = [str(n) for n in config.preferred_segments]
            elif config.preferred_segment:
                kw["preferred_segment"] = str(config.preferred_segment)
        try:
            results = self._direct(on_caller, client, kw) if on_caller is not None else None
            if results is None:
                results = self._call(run(client, kw))
        except KVFlowError as e:
            return self._fail_all(n, e, error_code(e))
        out = []
        for r in results:
            if isinstance(r, (ObjectExistsError, ObjectBusyError)):
                out.append(0)   # Mooncake: a key that exists (or is being put) is a no-op success
            elif isinstance(r, BaseException):
                out.append(self._fail(r, error_code(r)))
            else:
                out.append(0)
        return out

    # ------------------------------------------------------------ gets
    def get(self, key: str) -> bytes:
        """The object's bytes; b"" when it is missing or cannot be read."""
        return self.get_batch([_key(key)])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [b"" if isinstance(r, BaseException) else r for r in self._gets(_keys(keys))]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object as a BufferHandle; None when missing."""
        return self.batch_get_buffer([_key(key)])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [None if isinstance(r, BaseException) else BufferHandle(r) for r in self._gets(_keys(keys))]

    def _gets(self, keys: list[str]) -> list[Any]:
        if self._client is None:
            return [self._not_ready()] * len(keys)
        if not keys:
            return []
        try:
            results = self._direct(direct.get_bytes, self._client, keys)
            if results is None:
                results = self._call(self._client.batch_get(keys))
        except KVFlowError as e:
            return [e] * len(keys)
        for r in results:
            if isinstance(r, BaseException):
                self._fail(r, 0)
        return results

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Reads the object into registered memory: its size, or a code
        (-704 missing, -600 the buffer is too small or not registered)."""
        return self.batch_get_into([_key(key)], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        keys, ptrs, sizes = _keys(keys), _uints(buffer_ptrs, "buffer_ptrs"), _uints(sizes, "sizes")
        if not len(keys) == len(ptrs) == len(sizes):
            return self._fail_all(len(keys), "keys, buffer_ptrs and sizes differ in length")
        return self._reads(keys, [[(a, s)] for a, s in zip(ptrs, sizes)], (ptrs, sizes))

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Each object spread over its buffers in order; per key its size or a code."""
        parts = self._multi(keys, all_buffer_ptrs, all_sizes)
        if parts is None:
            return self._fail_all(len(keys), "keys, all_buffer_ptrs and all_sizes differ in length")
        return self._reads(list(keys), parts)

    def _reads(self, keys: list[str], parts: list[list[tuple[int, int]]],
               columns: tuple[list[int], list[int]] | None = None) -> list[int]:
        """The funnel of every get into registered memory, read on the
        calling thread where kvflow/store/direct.py serves the call;
        `columns`: the (addresses, sizes) of one-buffer objects (its faster
        entry), else `parts`."""
        if self._client is None:
            return self._fail_all(len(keys), self._not_ready(), STORE_INTERNAL_ERROR)
        if not keys:
            return []
        try:
            if columns is not None:
                results = self._direct(direct.get_into, self._client, keys, *columns)
            else:
                results = self._direct(direct.get_into_parts, self._client, keys, parts)
            if results is None:
                results = self._call(self._client.batch_get_into_parts(keys, parts))
        except KVFlowError as e:
            return self._fail_all(len(keys), e, error_code(e))
        return [self._fail(r, error_code(r)) if isinstance(r, BaseException) else r for r in results]

    @staticmethod
    def _multi(keys: Any, all_ptrs: Any, all_sizes: Any) -> list[list[tuple[int, int]]] | None:
        _keys(keys)
        if not isinstance(all_ptrs, (list, tuple)) or not isinstance(all_sizes, (list, tuple)):
            raise TypeError("all_buffer_ptrs and all_sizes must be lists of lists of ints")
        cols = [(_uints(p, "all_buffer_ptrs"), _uints(s, "all_sizes")) for p, s in zip(all_ptrs, all_sizes)]
        if not len(keys) == len(all_ptrs) == len(all_sizes) or any(len(p) != len(s) for p, s in cols):
            return None
        return [list(zip(p, s)) for p, s in cols]

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]], all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Byte ranges of objects into registered buffers, buffer-major: per
        buffer, per key, per range the bytes copied or a code. Each object
        is read whole through the local buffer, then its ranges copied."""
        ptrs = _uints(buffer_ptrs, "buffer_ptrs")
        if not len(ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return [[[self._fail(InvalidArgumentError("the columns differ in length"), STORE_INVALID_PARAMS)]]
                    for _ in ptrs]
        wanted = sorted({k for ks in all_keys for k in _keys(ks, "all_keys")})
        got = dict(zip(wanted, self._gets(wanted)))
        ends = {}
        if self._thread is not None:
            regions = self._thread.call_sync(lambda: [(r.addr, r.end) for r in self._thread.engine.regions])
            ends = {p: next((e for a, e in regions if a <= p < e), 0) for p in ptrs}
        out = []
        for ptr, keys, dsts, srcs, sizes in zip(ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
            per_key = []
            for key, d, s, n in zip(keys, dsts, srcs, sizes):
                if not len(d) == len(s) == len(n):
                    per_key.append([] if not (d or s or n) else [STORE_INVALID_PARAMS] * max(1, len(d)))
                    continue
                data = got.get(key)
                if isinstance(data, BaseException):
                    per_key.append([error_code(data)] * len(d))
                    continue
                row = []
                for dst, src, size in zip(_uints(d, "dst"), _uints(s, "src"), _uints(n, "sizes")):
                    if src + size > len(data) or ptr + dst + size > ends.get(ptr, 0):
                        row.append(STORE_INVALID_PARAMS)
                        continue
                    ctypes.memmove(ptr + dst, data[src:src + size], size)
                    row.append(size)
                per_key.append(row)
            out.append(per_key)
        return out

    # ------------------------------------------------------------ queries, removal
    def is_exist(self, key: str) -> int:
        """1 exists, 0 not, -1 an error (the master cannot be reached)."""
        return self.batch_is_exist([_key(key)])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        client = self._client
        if client is not None and keys and type(keys) in (list, tuple):
            # the hot case: batch_exists_blocking checks that every key is a
            # plain str (else None, and _keys below says what is wrong) and
            # asks from this thread, no hop to the loop thread
            found = client.batch_exists_blocking(keys)
            if found is not None:
                return list(bytes(found))       # bools as 1 or 0, in C
        keys = _keys(keys)
        if client is None:
            return self._fail_all(len(keys), self._not_ready(), STORE_INTERNAL_ERROR)
        if not keys:
            return []
        try:
            found = self._call(self._client.batch_exists(keys))
        except KVFlowError as e:
            return self._fail_all(len(keys), e, STORE_INTERNAL_ERROR)
        # an invalid key exists nowhere: 0, as Mooncake answers for ""
        return [1 if r is True else 0 if r is False or isinstance(r, InvalidArgumentError) else -1 for r in found]

    def get_size(self, key: str) -> int:
        """The object's size, or a code (-704 missing)."""
        return self._single(self._client.size(_key(key)) if self._client else None)

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 missing, -706 a get holds a lease on it (unless force)."""
        return self.batch_remove([_key(key)], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        keys = _keys(keys)
        if self._client is None:
            return self._fail_all(len(keys), self._not_ready(), STORE_INTERNAL_ERROR)
        if not keys:
            return []
        try:
            results = self._call(self._client.batch_remove(keys, force=bool(force)))
        except KVFlowError as e:
            return self._fail_all(len(keys), e, error_code(e))
        return [self._fail(r, error_code(r)) if isinstance(r, BaseException) else 0 for r in results]

    def remove_all(self, force: bool = False) -> int:
        """Removes every object (not those under a lease unless force): how
        many, or a code."""
        return self._single(self._client.remove_all(force=bool(force)) if self._client else None)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every object whose key the pattern matches anywhere (not
        those under a lease unless force): how many, or a code (-600 for a
        pattern that does not compile, as Mooncake). kvflow's patterns are
        Python's `re`; Mooncake's are std::regex (ECMAScript): the common
        forms (^prefix, .*, [a-z], \\d) mean the same."""
        try:
            re.compile(_key(regex_pattern))
        except re.error as e:
            return self._fail(InvalidArgumentError(f"bad regex: {e}"), STORE_INVALID_PARAMS)
        return self._single(self._client.remove_by_regex(regex_pattern, force=bool(force)) if self._client else None)

    # ------------------------------------------------------------ internals
    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coro` on the store's loop; raises only KVFlowError."""
        thread = self._thread
        if thread is None:
            coro.close()
            raise self._not_ready()
        try:
            return run_blocking(thread, coro)
        except KVFlowError:
            raise
        except TimeoutError:
            raise StoreTimeoutError("the call did not finish in time") from None
        except Exception as e:  # noqa: BLE001 - every failure becomes a code
            raise KVFlowError(f"{type(e).__name__}: {e}") from None

    @staticmethod
    def _direct(fn: Callable[..., list | None], *args: Any) -> list | None:
        """A call on the calling thread (kvflow/store/direct.py): its results,
        or None where that path does not serve it; raises only KVFlowError.
        A dummy's client (setup_dummy) forwards every call to its real client
        instead: not served here."""
        if not isinstance(args[0], StoreClient):
            return None
        try:
            return fn(*args)
        except KVFlowError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a code
            raise KVFlowError(f"{type(e).__name__}: {e}") from None

    def _single(self, coro: Coroutine[Any, Any, int] | None) -> int:
        if coro is None:
            return self._fail(self._not_ready(), STORE_INTERNAL_ERROR)
        try:
            return self._call(coro)
        except KVFlowError as e:
            return self._fail(e, error_code(e))

    def _not_ready(self) -> KVFlowError:
        return KVFlowError("MooncakeDistributedStore is not set up (call setup()) or is closed")

    def _fail(self, error: BaseException, code: int) -> int:
        """Records a failure; returns `code` (Mooncake's calls never raise)."""
        if not isinstance(error, KVFlowError):
            error = KVFlowError(f"{type(error).__name__}: {error}")
        self.last_error = error
        log.debug("kvflow.compat.mooncake store: %s", error)
        return code

    def _fail_all(self, n: int, error: BaseException | str, code: int = STORE_INVALID_PARAMS) -> list[int]:
        if isinstance(error, str):
            error = InvalidArgumentError(error)
        return [self._fail(error, code)] * n
