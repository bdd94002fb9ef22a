"""`nixl._utils`: raw host memory for tests and examples, as NIXL's module
has it: malloc_passthru / free_passthru (libc; 4096-byte aligned, as
NIXL's, so the buffers suit O_DIRECT too), ba_buf (fills a buffer with
0xba) and verify_transfer (compares two buffers).

Differences from NIXL's (a few lines of C++): arguments are checked (a
negative size or a null address raises ValueError, a size or address that
is not an integer TypeError, where NIXL's would write through it or
wrap), a failed allocation raises MemoryError (NIXL's returns 0), and
verify_transfer raises AssertionError at the first differing byte (NIXL's
is a C assert, compiled out of its release builds)."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import numpy as np

ALIGN = 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.posix_memalign.restype = ctypes.c_int
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

__all__ = ["ba_buf", "free_passthru", "malloc_passthru", "verify_transfer"]


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        try:
            value = value.__index__()          # numpy integers
        except (AttributeError, TypeError):
            raise TypeError(f"{what} is an integer, not {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{what} must be >= 0, not {value}")
    return int(value)


def _address(value: Any, what: str = "the address") -> int:
    addr = _count(value, what)
    if addr == 0:
        raise ValueError(f"{what} is null")
    return addr


def malloc_passthru(size: int) -> int:
    """`size` bytes of host memory, aligned to 4096 bytes; its address.
    MemoryError when there is none."""
    size = _count(size, "the size")
    ptr = ctypes.c_void_p()
    err = _libc.posix_memalign(ctypes.byref(ptr), ALIGN, max(size, 1))
    if err or not ptr.value:
        raise MemoryError(f"malloc_passthru({size}) failed (errno {err})")
    return int(ptr.value)


def free_passthru(addr: int) -> None:
    """Frees what malloc_passthru returned (0 is a no-op, as free's)."""
    addr = _count(addr, "the address")
    if addr:
        _libc.free(addr)


def ba_buf(addr: int, size: int) -> None:
    """Sets `size` bytes at `addr` to 0xba."""
    size = _count(size, "the size")
    addr = _address(addr)
    if size:
        ctypes.memset(addr, 0xBA, size)


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Checks that the `size` bytes at `addr1` and `addr2` are equal;
    AssertionError naming the first byte that differs."""
    size = _count(size, "the size")
    addr1, addr2 = _address(addr1, "the first address"), _address(addr2, "the second address")
    if not size or _libc.memcmp(addr1, addr2, size) == 0:
        return
    a = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr1))
    b = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr2))
    at = int(np.argmax(a != b))
    raise AssertionError(f"the buffers differ at byte {at} of {size}: {int(a[at]):#04x} != {int(b[at]):#04x}")
