"""The CUDA driver API as kvflow uses it, through cuda-python
(`cuda.bindings.driver`): initialising, pointer queries, primary contexts,
streams, events, pinned host memory, copies and IPC handles.

Importing this module imports nothing of CUDA: `cuda.bindings` is loaded,
and cuInit called, on the first call that needs it. On a machine without
cuda-bindings or without a driver, available() is False and reason() says
why; every other call raises ProviderUnavailableError with that reason.
A driver call that fails raises CudaError naming the call and the error.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from kvflow.errors import CudaError, ProviderUnavailableError

__all__ = ["DeviceMemory", "Event", "HostMapping", "PinnedHost", "Stream", "available", "copy_async",
           "device_count", "device_of_uuid", "device_uuid", "driver", "ipc_close", "ipc_handle", "ipc_open",
           "launch_host_func", "on_device", "pointer_location", "reason", "stream_mem_ops", "stream_wait_event",
           "use_device",
           "worth_asking", "write_value64", "IPC_HANDLE_BYTES"]

IPC_HANDLE_BYTES = 64           # sizeof(CUipcMemHandle)

_lock = threading.Lock()
_cu: Any = None                 # cuda.bindings.driver, once cuInit succeeded
_why: str | None = None         # why CUDA is not usable here, once tried
_contexts: dict[int, Any] = {}  # device ordinal -> retained primary context


def _load() -> Any:
    global _cu, _why
    if _cu is not None:
        return _cu
    with _lock:
        if _cu is not None or _why is not None:
            return _cu
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:            # cuda-python not installed
            _why = f"cuda-bindings is not installed ({e})"
            return None
        try:
            err, = cu.cuInit(0)
        except Exception as e:              # no libcuda: DynamicLibNotFoundError (a RuntimeError)
            _why = f"no CUDA driver on this machine ({type(e).__name__}: {e})"
            return None
        if err != cu.CUresult.CUDA_SUCCESS:
            _why = f"cuInit failed: {_name(cu, err)}"
            return None
        err, n = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or n == 0:
            _why = "the CUDA driver sees no device"
            return None
        _cu = cu
        return cu


def _name(cu: Any, err: Any) -> str:
    try:
        _, text = cu.cuGetErrorName(err)
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        return str(err)


def available() -> bool:
    """Whether a CUDA device is usable here (never raises)."""
    try:
        return _load() is not None
    except Exception:                       # anything odd about the install: not usable
        return False


def worth_asking() -> bool:
    """Whether the driver could know a raw pointer: cuda-python is loaded
    already, or this machine has an NVIDIA driver's device nodes. Where
    neither holds, nothing is imported and the answer is False at once."""
    if _cu is not None:
        return True
    if _why is not None:
        return False
    return "cuda.bindings.driver" in sys.modules or os.path.exists("/dev/nvidiactl") or \
        os.path.exists("/proc/driver/nvidia")


def reason() -> str | None:
    """Why CUDA is not usable here (None when it is)."""
    return None if available() else _why


def driver() -> Any:
    """cuda.bindings.driver, initialised; ProviderUnavailableError if CUDA
    is not usable here."""
    cu = _load()
    if cu is None:
        raise ProviderUnavailableError(f"CUDA is not usable here: {_why}")
    return cu


def check(result: Any, what: str) -> Any:
    """Unpacks a cuda-bindings result tuple: raises CudaError unless its
    first element is CUDA_SUCCESS; returns the one value after it (or the
    tuple of them, or None)."""
    cu = driver()
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_name(cu, err)}", code=int(err))
    rest = result[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def device_count() -> int:
    """CUDA devices usable here (0 without a driver)."""
    if not available():
        return 0
    return int(check(_cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def _primary(ordinal: int) -> Any:
    """Device `ordinal`'s primary context, retained once per process (the
    runtime API, torch and CuPy share it)."""
    ctx = _contexts.get(ordinal)
    if ctx is None:
        cu = driver()
        with _lock:
            ctx = _contexts.get(ordinal)
            if ctx is None:
                dev = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
                ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _contexts[ordinal] = ctx
    return ctx


def use_device(ordinal: int) -> Any:
    """Makes device `ordinal`'s primary context current on this thread, for
    good: for kvflow's own threads only (a user's thread gets
    on_device(), which puts back what was current)."""
    ctx = _primary(ordinal)
    check(driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[Any]:
    """Device `ordinal`'s primary context, current on this thread for the
    block (pushed, then popped): the calling thread's own current context,
    torch's device say, is what it was after it."""
    cu = driver()
    ctx = _primary(ordinal)
    check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield ctx
    finally:
        cu.cuCtxPopCurrent()


def device_uuid(ordinal: int) -> bytes:
    """The 16-byte UUID of device `ordinal`: what names a GPU across
    processes, whose ordinals differ with CUDA_VISIBLE_DEVICES."""
    cu = driver()
    dev = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    uuid = check(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    raw = getattr(uuid, "bytes", None)
    return bytes(raw)[:16] if raw is not None else ctypes.string_at(uuid.getPtr(), 16)


def device_of_uuid(uuid: bytes) -> int | None:
    """This process's ordinal of the device with `uuid`, or None."""
    for ordinal in range(device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    return None


@dataclass(frozen=True)
class Location:
    """Where a pointer the driver knows lives: kind "cuda" (device memory
    of `device`) or "host" (pinned or registered host memory), and the
    allocation holding it (base, size) for device memory."""

    kind: str
    device: int
    base: int = 0
    size: int = 0


def pointer_location(ptr: int) -> Location | None:
    """What the driver knows of `ptr`: None for memory it does not know
    (plain pageable host memory) or when CUDA is not usable here."""
    if not available():
        return None
    cu = _cu
    # the allocation's extent comes with the rest: cuMemGetAddressRange would
    # want a current context, which the registering thread may not have
    a = cu.CUpointer_attribute
    attrs = [a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
             a.CU_POINTER_ATTRIBUTE_IS_MANAGED, a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
             a.CU_POINTER_ATTRIBUTE_RANGE_SIZE]
    err, values = cu.cuPointerGetAttributes(len(attrs), attrs, ptr)
    if err != cu.CUresult.CUDA_SUCCESS or values is None:
        return None
    mtype, ordinal, managed, start, size = values
    mtype = int(mtype) if not hasattr(mtype, "value") else int(mtype.value)
    if mtype == 0:                          # not a pointer the driver knows
        return None
    if mtype == int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE) and not managed:
        return Location("cuda", int(ordinal), int(start), int(size))
    return Location("host", int(ordinal) if ordinal is not None else -1)


class Stream:
    """A non-blocking stream on one device, the engine's own."""

    def __init__(self, device: int) -> None:
        cu = driver()
        self.device = device
        with on_device(device):
            self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def close(self) -> None:
        if self.handle is not None:
            with on_device(self.device):
                check(_cu.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    """An event without timing (the cheap kind), recorded on a stream and
    polled with done(). blocking: a thread that synchronizes on it sleeps
    instead of spinning (CU_EVENT_BLOCKING_SYNC)."""

    def __init__(self, device: int, blocking: bool = False) -> None:
        cu = driver()
        self.device = device
        flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        with on_device(device):
            self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        with on_device(self.device):
            check(_cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def done(self) -> bool:
        err, = _cu.cuEventQuery(self.handle)
        if err == _cu.CUresult.CUDA_SUCCESS:
            return True
        if err == _cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise CudaError(f"cuEventQuery failed: {_name(_cu, err)}", code=int(err))

    def close(self) -> None:
        if self.handle is not None:
            with on_device(self.device):
                check(_cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


class PinnedHost:
    """Page-locked host memory (cuMemHostAlloc, portable to every context):
    the staging pipeline's bounce buffers. Allocated in `device`'s context
    (so that a process using one GPU wakes no other)."""

    def __init__(self, size: int, device: int = 0, mapped: bool = False) -> None:
        cu = driver()
        flags = int(getattr(cu, "CU_MEMHOSTALLOC_PORTABLE", 1))
        if mapped:                  # also mapped into the device's address space (a kernel reads and writes it)
            flags |= int(getattr(cu, "CU_MEMHOSTALLOC_DEVICEMAP", 2))
        self.device = device
        with on_device(device):
            self.addr = int(check(cu.cuMemHostAlloc(size, flags), "cuMemHostAlloc"))
            # the device's address for it (with unified addressing, the same number)
            self.device_addr = int(check(cu.cuMemHostGetDevicePointer(self.addr, 0),
                                         "cuMemHostGetDevicePointer")) if mapped else 0
        self.size = size

    def close(self) -> None:
        if self.addr:
            with on_device(self.device):
                check(_cu.cuMemFreeHost(self.addr), "cuMemFreeHost")
            self.addr = 0


class DeviceMemory:
    """Device memory of its own (cuMemAlloc on `device`): what kvflow
    allocates itself, as a relay member's device lanes."""

    def __init__(self, size: int, device: int = 0) -> None:
        cu = driver()
        self.device, self.size = device, size
        with on_device(device):
            self.addr = int(check(cu.cuMemAlloc(size), "cuMemAlloc"))

    def close(self) -> None:
        if self.addr:
            with on_device(self.device):
                check(_cu.cuMemFree(self.addr), "cuMemFree")
            self.addr = 0


class HostMapping:
    """Host memory this process already maps (a shared-memory segment, say)
    made reachable by the GPUs (cuMemHostRegister, portable and mapped):
    `device_addr` is its address on the device, so that a stream can write
    into it (write_value64). Page-aligned ranges only. `iomemory`: the
    range is a device's registers mapped into this process (a NIC's UAR
    page, for IBGDA), not RAM."""

    def __init__(self, addr: int, size: int, device: int = 0, iomemory: bool = False) -> None:
        cu = driver()
        if addr % 4096 or size % 4096 or size <= 0:
            raise CudaError(f"a host mapping is whole pages, not {addr:#x}+{size}")
        flags = int(getattr(cu, "CU_MEMHOSTREGISTER_PORTABLE", 1)) | int(getattr(cu, "CU_MEMHOSTREGISTER_DEVICEMAP", 2))
        if iomemory:
            flags |= int(getattr(cu, "CU_MEMHOSTREGISTER_IOMEMORY", 4))
        self.device = device
        with on_device(device):
            check(cu.cuMemHostRegister(addr, size, flags), "cuMemHostRegister")
            self.addr, self.size = addr, size
            try:
                self.device_addr = int(check(cu.cuMemHostGetDevicePointer(addr, 0), "cuMemHostGetDevicePointer"))
            except BaseException:
                cu.cuMemHostUnregister(addr)
                self.addr = 0
                raise

    def close(self) -> None:
        if self.addr:
            with on_device(self.device):
                check(_cu.cuMemHostUnregister(self.addr), "cuMemHostUnregister")
            self.addr = 0


def stream_mem_ops(device: int) -> bool:
    """Whether `device` takes 64-bit stream memory operations
    (cuStreamWriteValue64): what a stream-ordered doorbell needs."""
    cu = driver()
    dev = check(cu.cuDeviceGet(device), f"cuDeviceGet({device})")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(check(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))


def write_value64(stream: Stream, device_addr: int, value: int) -> None:
    """Queues a write of the 64-bit `value` at `device_addr` on `stream`,
    after the work queued before it. The default flags put a system-wide
    memory fence before the write: whoever sees the value (a CPU reading a
    mapped host word, say) also sees what the stream's earlier copies
    wrote. The stream's device's context must be current."""
    cu = _cu
    check(cu.cuStreamWriteValue64(stream.handle, device_addr, value,
                                  int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
          "cuStreamWriteValue64")


def stream_wait_event(stream: Stream, event: "Event") -> None:
    """Work queued on `stream` from now waits for `event` (recorded on
    another stream of the same device). Its context must be current."""
    check(_cu.cuStreamWaitEvent(stream.handle, event.handle, 0), "cuStreamWaitEvent")


def launch_host_func(stream: Stream, fn_addr: int, user_data: int) -> None:
    """Queues a call of the C function at `fn_addr` (void fn(void *)) with
    `user_data` on `stream`, after the work queued before it (on a thread
    of the driver's; the function must call nothing of CUDA). The
    stream's device's context must be current."""
    cu = _cu
    check(cu.cuLaunchHostFunc(stream.handle, cu.CUhostFn(fn_addr), user_data), "cuLaunchHostFunc")


def copy_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Queues a copy of `nbytes` on `stream`: any direction, the driver
    tells host from device by unified addressing. The stream's device's
    context must be current (on_device)."""
    check(_cu.cuMemcpyAsync(dst, src, nbytes, stream.handle), "cuMemcpyAsync")


def ipc_handle(ptr: int, device: int) -> bytes:
    """The 64-byte IPC handle of the device allocation holding `ptr` (a
    peer process opens it with ipc_open and adds ptr's offset from the
    allocation's base)."""
    cu = driver()
    with on_device(device):
        handle = check(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open(raw: bytes, device: int) -> int:
    """Maps a peer's allocation from its IPC handle into this process (in
    `device`'s context, the device that holds it); returns its base here."""
    cu = driver()
    if len(raw) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
    handle = cu.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    lazy = int(getattr(getattr(cu, "CUipcMem_flags", None), "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS", 1))
    with on_device(device):
        return int(check(cu.cuIpcOpenMemHandle(handle, lazy), "cuIpcOpenMemHandle"))


def ipc_close(base: int, device: int) -> None:
    with on_device(device):
        check(driver().cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")
