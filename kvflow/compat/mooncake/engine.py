"""`TransferEngine`: Mooncake's Python class on one kvflow Engine that runs
on an EngineThread (see the package docstring and docs/mooncake.md)."""
from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import ctypes
import itertools
import json
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Coroutine, Iterator, Sequence

import msgpack
import numpy as np

from kvflow.compat.mooncake.codes import (
    CONNECT_TIMEOUT, ERR_ADDRESS_NOT_REGISTERED, ERR_ADDRESS_OVERLAPPED, ERR_INVALID_ARGUMENT,
    ERR_SOCKET, NOTIFY_TAG, OK, PROTOCOLS, REGION_PREFIX, SMALL_BATCH, STATUS_DONE,
    STATUS_FAILED, STATUS_PENDING, STATUS_TIMEOUT, TransferNotify, TransferOpcode, mooncake_flag, transfer_timeout)
from kvflow.compat.mooncake.metadata import metadata_url, segment_key
from kvflow.compat.mooncake.waiting import EAGER_TASKS, Waiter, drive, shutdown
from kvflow.engine.engine import Engine
from kvflow.engine.peer import Peer
from kvflow.engine.thread import EngineThread
from kvflow.errors import (InvalidArgumentError, KVFlowError, PeerUnreachableError, ProviderUnavailableError,
                           TransferTimeoutError)
from kvflow.memory import CUDA, Region, RemoteRegion
from kvflow.schedule.qos import Priority, qos_args

log = logging.getLogger("kvflow.compat.mooncake")


def _listen_address(local_hostname: str) -> tuple[str, str]:
    """(listen address for kvflow, host part) from "host", "host:port",
    "[v6]:port" or a bare IPv6 address."""
    host, sep, port = local_hostname.rpartition(":")
    if sep and port.isdigit() and (host.startswith("[") or ":" not in host):
        return f"{host}:{port}", host.strip("[]")
    if ":" in local_hostname and not local_hostname.startswith("["):
        return f"[{local_hostname}]:0", local_hostname
    return f"{local_hostname}:0", local_hostname.strip("[]")


def _first_region(regions: Sequence[Region | RemoteRegion]) -> int:
    """Address of the earliest registered region: by the sequence number in
    its name where it has one, else the lowest address."""
    def order(r: Region | RemoteRegion) -> tuple[int, int]:
        name = r.name or ""
        if name.startswith(REGION_PREFIX) and name[len(REGION_PREFIX):].isdigit():
            return (0, int(name[len(REGION_PREFIX):]))
        return (1, r.addr)
    return min(regions, key=order).addr if regions else 0


def _decode_notify(address: str, data: bytes) -> TransferNotify:
    try:
        tag, name, msg = msgpack.unpackb(data)
        if tag == NOTIFY_TAG and isinstance(name, str) and isinstance(msg, str):
            return TransferNotify(name, msg)
    except (ValueError, TypeError, msgpack.UnpackException):
        pass
    # a plain kvflow peer's notify(): named after the sender
    return TransferNotify(address, data.decode("utf-8", "replace"))


async def _collect_notifies(engine: Engine, into: collections.deque[TransferNotify]) -> None:
    async for address, data in engine.notifications():
        into.append(_decode_notify(address, data))



class TransferEngine:
    """Mooncake's `TransferEngine`, on kvflow. See the package docstring for
    the API conventions and docs/mooncake.md for every difference from Mooncake.

    `last_error` holds the most recent failure of any call (a KVFlowError)."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._thread: EngineThread | None = None
        self._engine: Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._address = ""
        self._local_hostname = ""
        self._timeout_s = transfer_timeout()
        # Loop thread only (callers may test membership of _peers: a hint).
        self._peers: dict[str, Peer] = {}
        self._regions: dict[int, Region] = {}          # by address, in registration order
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        # Any thread: single dict/set/deque operations are atomic under the GIL.
        self._batches: dict[int, Waiter] = {}
        self._batch_ids = itertools.count(1)
        self._inflight: set[Waiter] = set()
        # Transfers for the loop to start: enqueued by any thread, the loop
        # woken once per burst, drained there in one go (_drain).
        self._queued: collections.deque[Coroutine[Any, Any, None]] = collections.deque()
        self._wake_pending = False
        self._managed: dict[int, tuple[np.ndarray, mmap.mmap]] = {}
        self._managed_lock = threading.Lock()
        self._notifies: collections.deque[TransferNotify] = collections.deque()
        self._qos = threading.local()       # set_transfer_priority(): per calling thread
        self._finalizer: Any = None
        self.last_error: KVFlowError | None = None
        self._segment = ""          # with a metadata server: this engine's segment name

    # ------------------------------------------------------------ lifecycle
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Starts the engine. metadata_server: "P2PHANDSHAKE" (peers name
        this engine "host:get_rpc_port()"; it listens on local_hostname's
        port when it has one), or a metadata server: "http://host:port/path"
        (Mooncake's HTTP metadata server), "etcd://host:port",
        "redis://host:port", or a bare "host:port" (etcd), where this engine
        is published under local_hostname as its segment name (and listens
        on a free port). protocol "tcp", "rdma" (tcp, with a warning, when
        no RDMA device can be opened, or when MC_FORCE_TCP is set, as
        Mooncake does) or "auto"; device_name: RDMA devices, comma-separated
        ("" for all). Returns 0, or -1 (logged)."""
        return self._initialize(local_hostname, metadata_server, protocol, device_name, None)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """initialize() with Mooncake's explicit metadata type ("etcd",
        "redis" or "http") for a metadata_server given without a scheme."""
        return self._initialize(local_hostname, metadata_server, protocol, device_name, metadata_type or None)

    def _initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                    metadata_type: str | None) -> int:
        if self._thread is not None:
            return self._fail(InvalidArgumentError("initialize(): this TransferEngine is already initialized"))
        if protocol not in PROTOCOLS:
            return self._fail(InvalidArgumentError(
                f"protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}"))
        try:
            url = metadata_url(metadata_server, metadata_type)
        except InvalidArgumentError as e:
            return self._fail(e)
        if protocol == "rdma" and mooncake_flag("MC_FORCE_TCP"):
            log.info("kvflow.compat.mooncake: MC_FORCE_TCP is set: protocol 'tcp' instead of 'rdma'")
            protocol = "tcp"
        devices = [d.strip() for d in (device_name or "").split(",") if d.strip()]
        segment = local_hostname or "127.0.0.1"
        listen, host = _listen_address(segment)
        options: dict[str, Any] = {"listen": listen, "protocols": PROTOCOLS[protocol]}
        if url is not None:
            # the name carries the port; the listener takes a free one (Mooncake's
            # default without MC_LEGACY_RPC_PORT_BINDING)
            options.update(listen=f"{listen.rpartition(':')[0]}:0", metadata=url, name=segment_key(segment))
        if protocol != "tcp" and devices:
            options["rdma_devices"] = devices
        try:
            thread, engine = self._start_engine(options, protocol, device_name, devices)
        except (KVFlowError, OSError) as e:
            return self._fail(e if isinstance(e, KVFlowError) else KVFlowError(str(e)))
        self._thread, self._engine, self._loop = thread, engine, thread.loop
        self._address, self._local_hostname = engine.address, host
        self._segment = segment if url is not None else ""
        self._finalizer = weakref.finalize(self, shutdown, thread, self._inflight, self._queued)
        return OK

    def _start_engine(self, options: dict[str, Any], protocol: str, device_name: str,
                      devices: list[str]) -> tuple[EngineThread, Engine]:
        """The engine on its thread; for "rdma" without a usable device, a
        warning and a tcp engine instead (Mooncake's fallback)."""
        thread = EngineThread(thread_name="kvflow-mooncake", **options)
        try:
            engine = thread.start()
            if protocol == "rdma" and thread.call_sync(lambda: engine.descriptor().rdma) is None:
                thread.close()
                log.warning("kvflow.compat.mooncake: protocol 'rdma': no RDMA device could be opened%s; "
                            "falling back to tcp", f" among {device_name}" if devices else "")
                options = {k: v for k, v in options.items() if k != "rdma_devices"}
                thread = EngineThread(thread_name="kvflow-mooncake", **{**options, "protocols": PROTOCOLS["tcp"]})
                engine = thread.start()
            if options.get("metadata"):
                # as Mooncake, fail when the server does not take our record
                # (kvflow's Engine would start anyway and publish later)
                thread.call(engine.lookup(options["name"]))
            thread.submit(_collect_notifies(engine, self._notifies))
        except BaseException:
            thread.close()
            raise
        return thread, engine

    def get_engine(self) -> Engine | None:
        """The kvflow Engine behind this TransferEngine (None before
        initialize()). Mooncake returns its C++ engine here; kvflow's runs
        on its own event-loop thread, so call its coroutines there
        (EngineThread.call_sync / submit), not from this thread's loop."""
        return self._engine

    def get_engine_ptr(self) -> int:
        """Mooncake returns the address of its C++ TransferEngine, for C++
        extensions that drive it directly. kvflow has no such object: this
        raises NotImplementedError (it never returns a pointer that
        something could dereference)."""
        raise NotImplementedError("kvflow.compat.mooncake: there is no C++ TransferEngine behind this engine; "
                                  "use get_engine() for the kvflow Engine")

    def get_rpc_port(self) -> int:
        """The port peers reach this engine on: they name it "host:port"."""
        if not self._address:
            return self._fail(self._not_running())
        return int(self._address.rpartition(":")[2])

    def close(self) -> None:
        """Closes the engine: in-flight transfers fail, later calls return
        -1. Idempotent (kvflow extension; Mooncake has no close)."""
        self._loop = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._finalizer is not None and not self._finalizer.alive else (
            "running" if self._address else "new")
        return f"<kvflow.compat.mooncake.TransferEngine {self._address or '-'} {state}>"

    # ------------------------------------------------------------ memory
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers [buffer_addr, buffer_addr + capacity) for transfers both
        ways: host memory, or GPU memory (a device pointer, as SGLang's and
        vLLM's connectors pass their KV pools; `location` "cuda:N" says so,
        else the CUDA driver tells). 0; -7 if it overlaps a registered
        region; -1 otherwise (GPU memory where CUDA is not usable here)."""
        return self._manage(self._register_all, [(buffer_addr, capacity)], location)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the region that starts at buffer_addr. 0; -3 if none does."""
        return self._manage(self._unregister_all, [buffer_addr])

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Registers every (address, capacity) pair, or none of them. Codes as
        register_memory; -1 if the lists differ in length."""
        if len(buffer_addresses) != len(capacities):
            return self._fail(InvalidArgumentError(
                f"batch_register_memory: {len(buffer_addresses)} addresses, {len(capacities)} capacities"))
        return self._manage(self._register_all, list(zip(buffer_addresses, capacities)), location)

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters every listed region; -3 if one was not registered."""
        return self._manage(self._unregister_all, list(buffer_addresses))

    def allocate_managed_buffer(self, length: int) -> int:
        """Maps `length` bytes (zeroed, page-aligned) and registers them.
        Returns the address, or 0."""
        if self._thread is None:
            return self._fail(self._not_running(), 0)
        try:
            mem = mmap.mmap(-1, max(int(length), 1))
        except (OSError, ValueError, OverflowError) as e:
            return self._fail(KVFlowError(f"allocate_managed_buffer({length}): {e}"), 0)
        arr = np.frombuffer(mem, dtype=np.uint8)
        addr = int(arr.ctypes.data)
        if self._manage(self._register_all, [(addr, len(mem))]) != OK:
            del arr
            mem.close()
            return 0
        with self._managed_lock:
            self._managed[addr] = (arr, mem)
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Unregisters and unmaps a buffer from allocate_managed_buffer.
        0; -1 for an address it did not allocate."""
        with self._managed_lock:
            held = self._managed.pop(buffer_addr, None)
        if held is None:
            return self._fail(InvalidArgumentError(
                f"free_managed_buffer: {buffer_addr:#x} was not allocated by allocate_managed_buffer"))
        # Already unregistered by unregister_memory is fine: it is freed all the same.
        self._manage(self._unregister_all, [buffer_addr], True)
        arr, mem = held
        del arr, held               # the array holds an export of the map
        mem.close()
        return OK

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The first region (in registration order) that the engine
        `segment_name` ("host:port") has registered, this engine's own when
        segment_name names it. 0 if it has none or cannot be reached."""
        if self._thread is None:
            return self._fail(self._not_running(), 0)
        try:
            if segment_name in (self._address, self._local_hostname) or \
                    (self._segment and segment_name == self._segment):
                return self._thread.call_sync(lambda: _first_region(list(self._regions.values())))
            return self._blocking(self._first_remote(segment_name))
        except KVFlowError as e:
            return self._fail(e, 0)

    @staticmethod
    def write_bytes_to_buffer(dest_address: int, src_ptr: bytes | str, length: int) -> int:
        """Copies `length` bytes of src_ptr (bytes, or str as UTF-8) to
        dest_address. 0; -1 if src_ptr is shorter than length."""
        data = src_ptr.encode() if isinstance(src_ptr, str) else bytes(src_ptr)
        if not 0 <= length <= len(data):
            log.warning("kvflow (mooncake compat): write_bytes_to_buffer: length %d, %d bytes given",
                        length, len(data))
            return ERR_INVALID_ARGUMENT
        ctypes.memmove(dest_address, data, length)
        return OK

    @staticmethod
    def read_bytes_from_buffer(source_address: int, length: int) -> bytes:
        """`length` bytes at source_address."""
        return ctypes.string_at(source_address, length)

    # ------------------------------------------------------------ kvflow's option: priorities
    def set_transfer_priority(self, priority: Priority = Priority.NORMAL,
                              deadline: float | None = None) -> int:
        """kvflow's option (Mooncake has none): the class (kvflow.Priority)
        and deadline (seconds from each call; None: none) of the transfers
        that the calling thread starts from now on, with every transfer
        call of this class; other threads keep theirs (default NORMAL, no
        deadline). 0, or -1 for a bad value (last_error says which)."""
        try:
            qos_args(priority, deadline)
        except InvalidArgumentError as e:
            return self._fail(e)
        self._qos.value = (Priority(priority), deadline)
        return OK

    @contextlib.contextmanager
    def transfer_priority(self, priority: Priority, deadline: float | None = None) -> Iterator[None]:
        """set_transfer_priority() for a `with` block, on the calling thread;
        the previous setting comes back at its end. InvalidArgumentError
        for a bad value."""
        before = getattr(self._qos, "value", None)
        qos_args(priority, deadline)
        self._qos.value = (Priority(priority), deadline)
        try:
            yield
        finally:
            self._qos.value = before

    def _priority(self) -> tuple[Priority, float | None]:
        return getattr(self._qos, "value", None) or (Priority.NORMAL, None)

    # ------------------------------------------------------------ transfers
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        """Writes `length` bytes from local `buffer` to the peer's
        `peer_buffer_address`; returns 0 once they landed, else -1."""
        return self._sync(True, target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        """Reads `length` bytes of the peer's `peer_buffer_address` into `buffer`; 0 or -1."""
        return self._sync(False, target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Writes entry i: lengths[i] bytes from buffers[i] to
        peer_buffer_addresses[i]; 0 once all landed, else -1."""
        return self._sync(True, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        """Reads a batch (as batch_transfer_sync_write, the other way); 0 or -1."""
        return self._sync(False, target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: Any, notify: Any = None, transport_hint: str = "") -> int:
        """One read or write (opcode Read/Write), then `notify` (a
        TransferNotify) delivered to the peer's get_notifies(); 0 or -1."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length],
                                        opcode, notify)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: Any, notify: Any = None, transport_hint: str = "") -> int:
        """A batch read or write, then the optional notification; 0 or -1."""
        write = _is_write(opcode)
        if write is None:
            return self._fail(InvalidArgumentError(f"opcode {opcode!r} is neither Read nor Write"))
        return self._sync(write, target_hostname, buffers, peer_buffer_addresses, lengths, notify)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """Starts a batch write; returns its id for get_batch_transfer_status
        (0 if it could not be submitted)."""
        return self._async(True, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Starts a batch read; its id, or 0."""
        return self._async(False, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: Any, transport_hint: str = "") -> int:
        """Starts a batch read or write (opcode); its id, or 0."""
        write = _is_write(opcode)
        if write is None:
            return self._fail(InvalidArgumentError(f"opcode {opcode!r} is neither Read nor Write"), 0)
        return self._async(write, target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """Starts one write; its batch id for transfer_check_status, or 0."""
        return self._async(True, target_hostname, [buffer], [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every listed batch; 0 if all succeeded, else -1. Each
        id is collected: asking for it again gives -1."""
        waiters = [(b, self._batches.pop(b, None)) for b in batch_ids]
        code = OK
        for batch_id, w in waiters:
            if w is None:
                code = self._fail(InvalidArgumentError(f"unknown or already collected batch id {batch_id}"))
                continue
            err = w.wait()
            if err is not None:
                code = self._fail(err)
        return code

    def transfer_check_status(self, batch_id: int) -> int:
        """Does not block: 1 done (the id is collected), 0 in flight, -1
        failed, -2 timed out (both collect it; -1 for an unknown id too)."""
        w = self._batches.get(batch_id)
        if w is None:
            return self._fail(InvalidArgumentError(f"unknown or already collected batch id {batch_id}"))
        if not w.finished:
            return STATUS_PENDING
        self._batches.pop(batch_id, None)
        if w.error is None:
            return STATUS_DONE
        self._fail(w.error)
        return STATUS_TIMEOUT if isinstance(w.error, TransferTimeoutError) else STATUS_FAILED

    # ------------------------------------------------------------ peers, notifications
    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (then forgotten)."""
        out = []
        while True:
            try:
                out.append(self._notifies.popleft())
            except IndexError:
                return out

    def send_probe(self, peer_server_name: str) -> int:
        """Checks that the engine at peer_server_name ("host:port") answers:
        0; -102 if it cannot be reached; -1 for other failures."""
        if self._thread is None:
            return self._fail(self._not_running())
        try:
            self._blocking(self._probe(peer_server_name))
        except PeerUnreachableError as e:
            return self._fail(e, ERR_SOCKET)
        except KVFlowError as e:
            return self._fail(e)
        return OK

    @staticmethod
    def get_local_topology(device_name: str | None = None) -> str:
        """Mooncake's topology JSON: per NUMA node "cpu:N", [RDMA devices on
        that node, the other devices]; device_name filters (comma-separated)."""
        wanted = {d.strip() for d in (device_name or "").split(",") if d.strip()}
        try:
            devices = sorted(os.listdir("/sys/class/infiniband"))
        except OSError:
            devices = []
        if wanted:
            devices = [d for d in devices if d in wanted]
        node_of = {d: _numa_node(f"/sys/class/infiniband/{d}/device/numa_node") for d in devices}
        try:
            nodes = {int(n[4:]) for n in os.listdir("/sys/devices/system/node")
                     if n.startswith("node") and n[4:].isdigit()}
        except OSError:
            nodes = set()
        topology = {f"cpu:{n}": [[d for d in devices if node_of[d] == n],
                                 [d for d in devices if node_of[d] != n]]
                    for n in sorted(nodes | set(node_of.values()) or {0})}
        return json.dumps(topology, indent="\t")

    # ------------------------------------------------------------ internals
    def _fail(self, error: BaseException, code: int = ERR_INVALID_ARGUMENT) -> int:
        """Records and logs a failure; returns `code` (Mooncake never raises)."""
        if not isinstance(error, KVFlowError):
            error = KVFlowError(f"{type(error).__name__}: {error}")
        self.last_error = error
        log.warning("kvflow (mooncake compat): %s", error)
        return code

    def _not_running(self) -> KVFlowError:
        if self._thread is None:
            return KVFlowError("TransferEngine is not initialized (call initialize() first)")
        return KVFlowError("TransferEngine is closed")

    def _manage(self, fn: Any, *args: Any) -> int:
        """Runs a memory-table change on the loop thread (kvflow's register
        and deregister are loop-owned: they tell connected peers)."""
        if self._thread is None or self._loop is None:
            return self._fail(self._not_running())
        try:
            return self._thread.call_sync(fn, *args)
        except Exception as e:  # noqa: BLE001 - a TypeError for a non-int address too: -1, never a raise
            return self._fail(e)

    def _blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coro` on the loop and waits; raises only KVFlowError."""
        assert self._thread is not None
        try:
            return self._thread.call(coro)
        except KVFlowError:
            raise
        except TimeoutError:
            raise KVFlowError("the peer did not answer in time") from None
        except Exception as e:  # noqa: BLE001 - callers map every failure to a code
            raise KVFlowError(f"{type(e).__name__}: {e}") from None

    def _register_all(self, spans: list[tuple[int, int]], location: str = "*") -> int:
        assert self._engine is not None
        gpu = isinstance(location, str) and location.startswith(CUDA)
        if gpu:
            import kvflow.cuda
            if not kvflow.cuda.available():
                return self._fail(ProviderUnavailableError(
                    f"register_memory(location={location!r}): CUDA is not usable here ({kvflow.cuda.reason()})"))
        for addr, cap in spans:
            if addr <= 0 or cap <= 0:
                return self._fail(InvalidArgumentError(f"cannot register {addr:#x}+{cap}: empty or null"))
        # Mooncake refuses overlapping regions with its own code (-7).
        spans_by_addr = sorted([(r.addr, r.end) for r in self._regions.values()]
                               + [(a, a + c) for a, c in spans])
        for (a0, e0), (a1, e1) in itertools.pairwise(spans_by_addr):
            if a1 < e0:
                return self._fail(InvalidArgumentError(
                    f"{a1:#x}+{e1 - a1} overlaps the region at {a0:#x}+{e0 - a0}"), ERR_ADDRESS_OVERLAPPED)
        done: list[int] = []
        try:
            for addr, cap in spans:
                name = f"{REGION_PREFIX}{next(self._seq)}"
                region = self._engine.register((addr, cap), name=name)
                if gpu and region.kind != CUDA:
                    self._engine.deregister(region)
                    raise InvalidArgumentError(f"{addr:#x}+{cap}: location {location!r}, but the CUDA "
                                               "driver does not know it as device memory")
                self._regions[addr] = region
                done.append(addr)
        except KVFlowError:
            for addr in done:
                self._engine.deregister(self._regions.pop(addr))
            raise
        return OK

    def _unregister_all(self, addrs: list[int], quiet: bool = False) -> int:
        assert self._engine is not None
        missing = []
        for addr in addrs:
            region = self._regions.pop(addr, None)
            if region is None:
                missing.append(addr)
            else:
                self._engine.deregister(region)
        if missing and not quiet:
            return self._fail(InvalidArgumentError(
                f"not registered: {', '.join(hex(a) for a in missing)}"), ERR_ADDRESS_NOT_REGISTERED)
        return OK

    def _columns(self, la: Sequence[int], ra: Sequence[int],
                 ln: Sequence[int]) -> tuple[Sequence[int], Sequence[int], Sequence[int], float]:
        """A batch's columns as kvflow takes them (empty entries dropped),
        and its timeout. Raises InvalidArgumentError for lists of different
        lengths."""
        n = len(la)
        if len(ra) != n or len(ln) != n:
            raise InvalidArgumentError(
                f"buffers, peer_buffer_addresses and lengths differ in length ({n}, {len(ra)}, {len(ln)})")
        if 0 in ln:         # Mooncake accepts empty entries; kvflow refuses them
            kept = [(a, b, c) for a, b, c in zip(la, ra, ln) if c != 0]
            la, ra, ln = [k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept]
        total = int(ln.sum()) if isinstance(ln, np.ndarray) else sum(ln)
        if len(ln) > SMALL_BATCH:
            la, ra, ln = _u64(la, "buffers"), _u64(ra, "peer_buffer_addresses"), _u64(ln, "lengths")
        return la, ra, ln, self._timeout_s + total / 1e9     # Mooncake: + 1 s per GB

    def _start(self, write: bool, target: str, la: Sequence[int], ra: Sequence[int],
               ln: Sequence[int], notify: Any = None) -> Waiter:
        """Queues one transfer for the loop (the only cross-thread hop) and
        returns its waiter. Raises KVFlowError, before queuing anything,
        for lists of different lengths or a closed engine."""
        loop = self._loop
        if loop is None:
            raise self._not_running()
        la, ra, ln, timeout = self._columns(la, ra, ln)
        waiter = Waiter()
        self._inflight.add(waiter)
        self._queued.append(self._run(write, target, la, ra, ln, timeout, notify, waiter, self._priority()))
        # Enqueue before reading the flag, which _drain clears before it
        # drains: either that drain takes this entry or this call wakes the
        # loop again. Two callers may both wake it: harmless.
        if not self._wake_pending:
            self._wake_pending = True
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:        # closed under us, maybe after close() failed the rest
                assert self._thread is not None
                shutdown(self._thread, self._inflight, self._queued)
        return waiter

    def _drain(self) -> None:
        self._wake_pending = False
        queued = self._queued
        while queued:
            self._launch(queued.popleft())

    def _launch(self, coro: Coroutine[Any, Any, None]) -> None:
        """Starts a transfer's coroutine on the loop right away, not one
        loop iteration later as create_task() would: each iteration is an
        epoll_wait that drops and retakes the GIL while the caller's thread
        is going to sleep, 10-25 us per call on a 2-core machine."""
        if EAGER_TASKS:
            task = asyncio.Task(coro, loop=self._loop, eager_start=True)  # type: ignore[call-arg]
            if not task.done():
                self._tasks.add(task)       # the loop keeps only weak references
                task.add_done_callback(self._tasks.discard)
        else:
            drive(coro)

    def _sync(self, write: bool, target: str, la: Sequence[int], ra: Sequence[int],
              ln: Sequence[int], notify: Any = None) -> int:
        if notify is None:
            code = self._sync_direct(write, target, la, ra, ln)
            if code is not None:
                return code
        try:
            err = self._start(write, target, la, ra, ln, notify).wait()
        except KVFlowError as e:
            err = e
        return OK if err is None else self._fail(err)

    def _sync_direct(self, write: bool, target: str, la: Sequence[int], ra: Sequence[int],
                     ln: Sequence[int]) -> int | None:
        """A synchronous transfer to a connected target, through
        Peer.write_blocking/read_blocking: on the calling thread where the
        provider allows it (no hop to the engine's loop and back), else on
        the loop. None where this path does not apply (a new or lost
        target, the loop's own thread): _start does it then."""
        peer = self._peers.get(target)
        thread = self._thread
        if peer is None or thread is None or not peer.alive or thread.on_loop_thread():
            return None
        try:
            la, ra, ln, timeout = self._columns(la, ra, ln)
            priority, deadline = self._priority()
            if len(ln):
                (peer.write_blocking if write else peer.read_blocking)(la, ra, ln, timeout=timeout,
                                                                       priority=priority, deadline=deadline)
        except KVFlowError as e:
            return self._fail(e)
        return OK

    def _async(self, write: bool, target: str, la: Sequence[int], ra: Sequence[int],
               ln: Sequence[int]) -> int:
        if self._thread is None or self._loop is None:
            return self._fail(self._not_running(), 0)
        try:
            if target not in self._peers:
                # A new target: connect now, so that an unreachable one gives
                # 0 as in Mooncake (later failures go to the batch's status).
                self._blocking(self._connect(target))
            waiter = self._start(write, target, la, ra, ln)
        except KVFlowError as e:
            return self._fail(e, 0)
        batch_id = next(self._batch_ids)
        self._batches[batch_id] = waiter
        return batch_id

    # Coroutines below run on the engine's loop.
    async def _connect(self, target: str) -> Peer:
        assert self._engine is not None
        # with a metadata server every target is a segment name, looked up there
        peer = await self._engine.connect(segment_key(target) if self._segment else target,
                                          timeout=CONNECT_TIMEOUT)
        self._peers[target] = peer
        return peer

    async def _run(self, write: bool, target: str, la: Sequence[int], ra: Sequence[int],
                   ln: Sequence[int], timeout: float, notify: Any, waiter: Waiter,
                   qos: tuple[Priority, float | None]) -> None:
        # Until it succeeds: a coroutine cancelled or closed (GeneratorExit,
        # when the engine closes) on the way must not report success.
        error: KVFlowError | None = KVFlowError("the transfer engine was closed")
        try:
            peer = self._peers.get(target)
            if peer is None or not peer.alive:
                peer = await self._connect(target)
            if len(ln):
                priority, deadline = qos
                if write:
                    await peer.write(la, ra, ln, timeout=timeout, priority=priority, deadline=deadline)
                else:
                    await peer.read(la, ra, ln, timeout=timeout, priority=priority, deadline=deadline)
            if notify is not None:
                await peer.notify(msgpack.packb((NOTIFY_TAG, str(notify.name), str(notify.msg))))
            error = None
        except KVFlowError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - not a kvflow error: still a -1, never a hang
            error = KVFlowError(f"{type(e).__name__}: {e}")
        finally:
            self._inflight.discard(waiter)
            waiter.finish(error)

    async def _first_remote(self, target: str) -> int:
        peer = self._peers.get(target)
        if peer is None or not peer.alive:
            peer = await self._connect(target)
        await peer.refresh()        # regions registered a moment ago count too
        return _first_region(peer.regions)

    async def _probe(self, target: str) -> None:
        peer = self._peers.get(target)
        if peer is None or not peer.alive:
            peer = await self._connect(target)
        try:
            await peer.refresh(timeout=CONNECT_TIMEOUT)      # one round trip to the peer's engine
        except asyncio.TimeoutError:
            raise PeerUnreachableError(f"{target} did not answer a probe", peer=target) from None




def _u64(values: Sequence[int], what: str) -> Any:
    """A batch column as a uint64 array, made on the caller's thread: the
    loop thread then takes it without a copy, where a long list of ints
    would cost it ~9 us per column (numpy arrays pass through unchanged).
    array.array refuses negative, too large and non-integer entries."""
    if isinstance(values, np.ndarray):
        return values
    try:
        return np.frombuffer(array.array("Q", values), dtype=np.uint64)
    except (OverflowError, TypeError) as e:
        raise InvalidArgumentError(f"{what}: not a list of unsigned 64-bit ints ({e})") from None


def _is_write(opcode: Any) -> bool | None:
    try:
        op = int(opcode)
    except (TypeError, ValueError):
        return None
    return {int(TransferOpcode.Write): True, int(TransferOpcode.Read): False}.get(op)


def _numa_node(path: str) -> int:
    try:
        with open(path) as f:
            return max(int(f.read().strip()), 0)
    except (OSError, ValueError):
        return 0
