"""`nixl._utils`: raw host memory for descriptors (libc malloc/free)."""
from __future__ import annotations

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]

__all__ = ["free_passthru", "malloc_passthru"]


def malloc_passthru(size: int) -> int:
    """`size` bytes of host memory (malloc); its address. MemoryError when
    there is none."""
    addr = _libc.malloc(size)
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """Frees what malloc_passthru returned."""
    _libc.free(addr)
