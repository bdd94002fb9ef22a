"""Registered memory: access rights, local and remote regions, and turning
what users hand to register() into an address and a length."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow._core import ACCESS
from kvflow.errors import InvalidArgumentError

__all__ = ["Access", "Region", "RemoteRegion", "buffer_span", "host_mapping"]


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

    @property
    def end(self) -> int:
        return self.addr + self.length


def buffer_span(buffer: Any) -> tuple[int, int, bool, Any]:
    """Returns (address, length, writable, keepalive) for a buffer.

    Accepts numpy arrays, bytearray, memoryview, objects exposing
    __array_interface__, objects with data_ptr() and nbytes (or numel() and
    element_size(), as torch tensors) and (ptr, length) tuples. `keepalive`
    must live as long as the registration: for bytearray it holds a buffer
    export, which also stops the bytearray from being resized (and moved).
    Raises InvalidArgumentError for anything else.
    """
    if isinstance(buffer, tuple):
        if len(buffer) != 2 or not all(isinstance(v, (int, np.integer)) for v in buffer):
            raise InvalidArgumentError("a raw buffer is a (ptr, length) tuple of ints")
        ptr, length = int(buffer[0]), int(buffer[1])
        if ptr <= 0 or length <= 0 or ptr + length > 1 << 64:
            raise InvalidArgumentError(f"invalid raw buffer (ptr={ptr:#x}, length={length})")
        # nothing vouches for a raw range: it must be host memory this
        # process has mapped, or the first transfer would fault
        return ptr, length, host_mapping(ptr, length), None
    device = _device_memory(buffer)
    if device is not None:
        raise InvalidArgumentError(
            f"cannot register a {type(buffer).__name__} in {device} memory: this kvflow build moves "
            f"host memory only (kvflow.features['cuda'] is False); register a CPU (or pinned) buffer")
    if hasattr(buffer, "data_ptr") and not isinstance(buffer, np.ndarray):
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
        return ptr, length, host_mapping(ptr, length), buffer
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
    return int(arr.__array_interface__["data"][0]), int(arr.nbytes), bool(arr.flags.writeable), (buffer, arr)


# DLPack device types that are host memory the CPU can touch: CPU, CUDA
# pinned host, ROCm pinned host, CUDA managed.
_DLPACK_HOST = {1, 3, 11, 13}


def _device_memory(buffer: Any) -> str | None:
    """Where a buffer lives when that is not host memory the CPU may touch
    ("cuda:0", ...), else None. Device memory handed to the CPU copy paths
    would crash the process, so it is refused up front. Checks torch's
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
            return f"dlpack device {int(code)}:{index}"
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
                "(GPU memory needs the cuda provider, not built yet)")
        writable = writable and "w" in perms
        at = hi
        if at >= end:
            return writable
    raise InvalidArgumentError(
        f"cannot register {addr:#x}+{length}: {at:#x} is not mapped in this process "
        "(a pointer into GPU memory, freed memory, or a length past the buffer's end?)")

