"""Registered memory: access rights, local and remote regions, and turning
what users hand to register() into an address and a length."""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow._core import ACCESS
from kvflow.errors import InvalidArgumentError

__all__ = ["CUDA", "HOST", "Access", "Region", "RemoteRegion", "Span", "buffer_span", "host_mapping"]

# Memory kinds (Region.kind): memory the CPU touches, and a CUDA GPU's
HOST = "host"
CUDA = "cuda"


class Access(enum.IntFlag):
    """What peers may do to a region (the bits of kvf.h's KVF_ACCESS_*)."""

    READ = ACCESS["READ"]
    WRITE = ACCESS["WRITE"]


# Local table only: the memory itself is writable, so reads may land in it.
LOCAL_WRITE = ACCESS["LOCAL_WRITE"]


@dataclass(frozen=True)
class Region:
    """A range of this engine's memory that peers may reach."""

    addr: int
    length: int
    name: str | None
    access: Access
    id: int = field(repr=False, compare=False, default=0)
    _owner: Any = field(repr=False, compare=False, default=None)
    # rdma: memory keys per device, and how long registering took (s)
    rkeys: tuple[int, ...] = field(repr=False, compare=False, default=())
    rdma_reg_seconds: float = field(repr=False, compare=False, default=0.0)
    # "host" (memory the CPU touches) or "cuda" (device memory of GPU `device`)
    kind: str = "host"
    device: int = -1
    # GPU memory: (CUDA IPC handle of its allocation, region's offset in it, its GPU's UUID), or None
    ipc: tuple[bytes, int, bytes] | None = field(repr=False, compare=False, default=None)

    @property
    def end(self) -> int:
        return self.addr + self.length


@dataclass(frozen=True)
class RemoteRegion:
    """A region of a peer, as its descriptor tells it."""

    addr: int
    length: int
    name: str | None
    access: Access
    rkeys: tuple[int, ...] = field(repr=False, compare=False, default=())
    kind: str = "host"
    device: int = -1
    # GPU memory: (CUDA IPC handle of its allocation, region's offset in it, its GPU's UUID), or None
    ipc: tuple[bytes, int, bytes] | None = field(repr=False, compare=False, default=None)

    @property
    def end(self) -> int:
        return self.addr + self.length


@dataclass(frozen=True)
class Span:
    """What register() was handed, as memory: where it is, whether it may
    be written, what must live as long as the registration (`keep`), and
    its kind: "host" (memory the CPU may touch) or "cuda" (device memory
    of GPU `device`, which only the CUDA paths may touch)."""

    addr: int
    length: int
    writable: bool
    keep: Any
    kind: str = "host"
    device: int = -1
    base: int = 0               # GPU memory: the start of the CUDA allocation holding it


def buffer_span(buffer: Any) -> Span:
    """The memory of a buffer handed to register().

    Host memory: numpy arrays, bytearray, memoryview, objects exposing
    __array_interface__, objects with data_ptr() and nbytes (or numel()
    and element_size(), as CPU torch tensors). GPU memory: torch CUDA
    tensors, objects exposing __cuda_array_interface__ (CuPy, Numba) or a
    DLPack CUDA device (JAX), and cuda-python allocations as
    (CUdeviceptr, length). Raw (ptr, length) tuples: the CUDA driver says
    whether ptr is device memory where it is usable; else (and for host
    memory) the range must be mapped readable in this process. `keep`
    must live as long as the registration: for bytearray it holds a
    buffer export, which also stops the bytearray from being resized
    (and moved). Raises InvalidArgumentError for anything else, and
    ProviderUnavailableError for GPU memory where CUDA is not usable.
    """
    if isinstance(buffer, tuple):
        return _raw_span(buffer)
    device = _device_memory(buffer)
    if device is not None:
        return _device_span(buffer, device)
    if hasattr(buffer, "data_ptr") and not isinstance(buffer, np.ndarray):
        ptr, length = _tensor_extent(buffer)
        return Span(ptr, length, host_mapping(ptr, length), buffer)
    try:
        if isinstance(buffer, np.ndarray):
            arr = buffer
        elif isinstance(buffer, (bytearray, memoryview, bytes)):
            arr = np.frombuffer(buffer, dtype=np.uint8)
        elif hasattr(buffer, "__array_interface__"):
            arr = np.asarray(buffer)
        else:
            raise InvalidArgumentError(f"cannot register a {type(buffer).__name__}")
    except (TypeError, ValueError, BufferError) as e:
        if isinstance(e, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"cannot register a {type(buffer).__name__}: {e}") from e
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError("buffer must be contiguous to be registered")
    if arr.nbytes == 0:
        raise InvalidArgumentError("cannot register an empty buffer")
    return Span(int(arr.__array_interface__["data"][0]), int(arr.nbytes), bool(arr.flags.writeable), (buffer, arr))


def _raw_span(buffer: tuple) -> Span:
    if len(buffer) != 2 or not isinstance(buffer[1], (int, np.integer)):
        raise InvalidArgumentError("a raw buffer is a (ptr, length) tuple of ints")
    ptr_obj, length = buffer[0], int(buffer[1])
    if isinstance(ptr_obj, (int, np.integer)):
        ptr = int(ptr_obj)
    elif type(ptr_obj).__name__ == "CUdeviceptr":       # cuda-python's device pointer
        ptr = int(ptr_obj)
    else:
        raise InvalidArgumentError("a raw buffer is a (ptr, length) tuple of ints")
    if ptr <= 0 or length <= 0 or ptr + length > 1 << 64:
        raise InvalidArgumentError(f"invalid raw buffer (ptr={ptr:#x}, length={length})")
    where = _driver_location(ptr)
    if where is not None and where.kind == CUDA:
        if ptr + length > where.base + where.size:
            raise InvalidArgumentError(
                f"cannot register {ptr:#x}+{length}: the CUDA allocation holding it ends at "
                f"{where.base + where.size:#x}")
        return Span(ptr, length, True, None, "cuda", where.device, where.base)
    # nothing else vouches for a raw range: it must be host memory this
    # process has mapped, or the first transfer would fault
    return Span(ptr, length, host_mapping(ptr, length), None)


def _driver_location(ptr: int) -> Any:
    """What the CUDA driver knows of ptr, or None (no driver, or memory it
    does not know). cuda-python is imported only if it was already, or if
    a driver library is on this machine: raw host ranges cost nothing more
    where there is no GPU."""
    from kvflow._cuda import driver
    return driver.pointer_location(ptr) if driver.worth_asking() else None


def _tensor_extent(buffer: Any) -> tuple[int, int]:
    if getattr(buffer, "is_contiguous", None) is not None and not buffer.is_contiguous():
        raise InvalidArgumentError("tensor must be contiguous to be registered")
    ptr = int(buffer.data_ptr())
    if hasattr(buffer, "nbytes"):
        length = int(buffer.nbytes)
    elif hasattr(buffer, "numel") and hasattr(buffer, "element_size"):
        length = int(buffer.numel()) * int(buffer.element_size())
    else:
        raise InvalidArgumentError("an object with data_ptr() needs nbytes or numel()/element_size()")
    if ptr <= 0 or length <= 0:
        raise InvalidArgumentError("cannot register an empty buffer")
    return ptr, length


def _device_span(buffer: Any, where: str) -> Span:
    """A GPU buffer's span: its extent from the object, its device from the
    object where it says, checked against the CUDA driver."""
    from kvflow.errors import ProviderUnavailableError
    from kvflow._cuda import driver
    name = type(buffer).__name__
    if not where.startswith(CUDA):
        raise InvalidArgumentError(f"cannot register a {name} in {where} memory: kvflow moves host and "
                                   "CUDA memory only")
    if not driver.available():
        raise ProviderUnavailableError(
            f"cannot register a {name} in {where} memory: CUDA is not usable here ({driver.reason()})")
    iface = _cuda_array_interface(buffer)
    if iface is not None:
        ptr, length, writable = _interface_extent(iface, name)
    elif hasattr(buffer, "data_ptr"):
        ptr, length = _tensor_extent(buffer)
        writable = True
    else:
        ptr, length, writable, keep = dlpack_extent(buffer)
        buffer = (buffer, keep)
    loc = driver.pointer_location(ptr)
    if loc is None or loc.kind != CUDA:
        raise InvalidArgumentError(f"cannot register a {name}: the CUDA driver does not know {ptr:#x} as "
                                   "device memory")
    if ptr + length > loc.base + loc.size:
        raise InvalidArgumentError(f"cannot register a {name}: {ptr:#x}+{length} runs past its CUDA allocation")
    return Span(ptr, length, writable, buffer, "cuda", loc.device, loc.base)


def _cuda_array_interface(buffer: Any) -> dict | None:
    try:
        iface = getattr(buffer, "__cuda_array_interface__", None)
    except Exception:           # torch raises for CPU tensors
        return None
    return iface if isinstance(iface, dict) else None


def _interface_extent(iface: dict, name: str) -> tuple[int, int, bool]:
    """(ptr, length, writable) from a __cuda_array_interface__ (version 2
    or 3): C-contiguous only (strides None or the C strides)."""
    try:
        ptr, readonly = iface["data"]
        shape = tuple(int(n) for n in iface["shape"])
        itemsize = np.dtype(iface["typestr"]).itemsize
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"cannot register a {name}: malformed __cuda_array_interface__ ({e})") from None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = iface.get("strides")
    if strides is not None and count > 1:
        want, step = [], itemsize
        for n in reversed(shape):
            want.append(step)
            step *= n
        if tuple(int(x) for x in strides) != tuple(reversed(want)) and \
                not all(n == 1 or st == w for n, st, w in zip(shape, strides, reversed(want))):
            raise InvalidArgumentError(f"cannot register a {name}: it must be C-contiguous")
    length = count * itemsize
    if not ptr or length <= 0:
        raise InvalidArgumentError(f"cannot register an empty {name}")
    return int(ptr), length, not readonly


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_extent(buffer: Any) -> tuple[int, int, bool, Any]:
    """(ptr, length, writable, capsule) of a DLPack producer, read from the
    DLTensor its __dlpack__() capsule holds (the capsule is not consumed:
    holding it keeps the memory alive, and its destructor releases it).
    C-contiguous tensors only (strides NULL or the C strides)."""
    name = type(buffer).__name__
    try:
        capsule = buffer.__dlpack__()
        tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    except Exception as e:
        raise InvalidArgumentError(f"cannot register a {name}: its __dlpack__() failed ({e})") from None
    bits, lanes = tensor.dtype.bits, tensor.dtype.lanes
    if bits % 8 or lanes < 1:
        raise InvalidArgumentError(f"cannot register a {name}: DLPack dtype of {bits} bits × {lanes}")
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    itemsize = bits // 8 * lanes
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if tensor.strides and count > 1:
        step = 1
        for i in reversed(range(tensor.ndim)):
            if shape[i] != 1 and tensor.strides[i] != step:
                raise InvalidArgumentError(f"cannot register a {name}: it must be C-contiguous")
            step *= shape[i]
    ptr = (tensor.data or 0) + tensor.byte_offset
    length = count * itemsize
    if not ptr or length <= 0:
        raise InvalidArgumentError(f"cannot register an empty {name}")
    return ptr, length, True, capsule


# DLPack device types that are host memory the CPU can touch: CPU, CUDA
# pinned host, ROCm pinned host, CUDA managed.
_DLPACK_HOST = {1, 3, 11, 13}
_DLPACK_CUDA = 2


def _device_memory(buffer: Any) -> str | None:
    """Where a buffer lives when that is not host memory the CPU may touch
    ("cuda:0", ...), else None. Device memory handed to the CPU copy paths
    would crash the process: it takes the CUDA paths, or is refused. Checks torch's
    `device`, `__dlpack_device__()` and `__cuda_array_interface__` (CuPy,
    Numba and torch CUDA tensors)."""
    if isinstance(buffer, (np.ndarray, bytearray, memoryview, bytes, tuple)):
        return None
    dev = getattr(buffer, "device", None)
    kind = getattr(dev, "type", None)
    if isinstance(kind, str) and kind not in ("cpu", "meta"):
        index = getattr(dev, "index", None)
        return kind if index is None else f"{kind}:{index}"
    dlpack = getattr(buffer, "__dlpack_device__", None)
    if callable(dlpack):
        try:
            code, index = dlpack()
        except Exception:       # a CPU-only object may refuse: not device memory then
            code = None
        if isinstance(code, int) and code not in _DLPACK_HOST:
            return f"cuda:{index}" if int(code) == _DLPACK_CUDA else f"dlpack device {int(code)}:{index}"
    try:
        if hasattr(buffer, "__cuda_array_interface__"):
            return "cuda"
    except Exception:           # torch raises for CPU tensors
        pass
    return None


def _maps() -> list[tuple[int, int, str, str]]:
    """This process's mappings: (start, end, permissions, what) sorted by start."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16), parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def host_mapping(addr: int, length: int) -> bool:
    """Checks that [addr, addr+length) is host memory this process has
    mapped readable, from /proc/self/maps: a range with a hole (a raw
    pointer into GPU memory, a freed buffer, a length past the end) or a
    page without read access (PROT_NONE: a guard page, a GPU's address
    reservation) raises InvalidArgumentError naming the first such
    address, before anything could fault on it. Returns whether all of it
    is writable too. One read of the maps file: microseconds per mapping,
    whatever the range's size."""
    end = addr + length
    at = addr
    writable = True
    for lo, hi, perms, what in _maps():
        if hi <= at:
            continue
        if lo > at:
            break                               # a hole at `at`
        if "r" not in perms:
            raise InvalidArgumentError(
                f"cannot register {addr:#x}+{length}: {at:#x} is mapped without read access "
                f"({perms}{' ' + what if what else ''}): not host memory this process can read "
                "(GPU memory is registered as a CUDA tensor or array, or a raw pointer where the CUDA "
                "driver knows it)")
        writable = writable and "w" in perms
        at = hi
        if at >= end:
            return writable
    raise InvalidArgumentError(
        f"cannot register {addr:#x}+{length}: {at:#x} is not mapped in this process "
        "(a pointer into GPU memory, freed memory, or a length past the buffer's end?)")

