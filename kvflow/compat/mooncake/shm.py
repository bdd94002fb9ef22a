"""Shared memory a dummy client and its real client both map (Mooncake's
ShmHelper): each allocation is one memfd of its own, mapped MAP_SHARED
here; the dummy hands the descriptor to the real client (SCM_RIGHTS over
their local socket), which maps the same pages and reads and writes them
for put_from/get_into. One registry per process, as Mooncake's ShmHelper
is a singleton: `MooncakeHostMemAllocator` and a dummy store's
`alloc_from_mem_pool` allocate from it, and a dummy's register_buffer
finds its segment here."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from kvflow.errors import InvalidArgumentError
from kvflow.store.shmseg import map_fd, unmap

__all__ = ["MooncakeHostMemAllocator", "Segment", "allocate", "free", "map_fd", "segment_at", "unmap"]


@dataclass
class Segment:
    """One memfd and where this process maps it."""
    addr: int
    size: int
    fd: int

    @property
    def end(self) -> int:
        return self.addr + self.size


_lock = threading.Lock()
_segments: dict[int, Segment] = {}      # addr -> segment


def allocate(size: int) -> int:
    """A new shared segment of `size` bytes (zeroed; pages are taken on
    first touch, so a large pool costs nothing until used): its address."""
    if not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"cannot allocate {size!r} bytes of shared memory")
    fd = os.memfd_create("kvflow-mooncake-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        addr = map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _segments[addr] = Segment(addr, size, fd)
    return addr


def free(addr: int) -> int:
    """Unmaps and closes the segment at `addr`: 0, or -1 when none starts
    there (Mooncake's ShmHelper::free). A real client that mapped it keeps
    its own mapping until the dummy unregisters it or goes."""
    with _lock:
        seg = _segments.pop(addr, None)
    if seg is None:
        return -1
    unmap(seg.addr, seg.size)
    os.close(seg.fd)
    return 0


def segment_at(addr: int) -> Segment | None:
    """The segment holding `addr`, if any."""
    with _lock:
        for seg in _segments.values():
            if seg.addr <= addr < seg.end:
                return seg
    return None


class MooncakeHostMemAllocator:
    """mooncake.store.MooncakeHostMemAllocator: host memory a standalone
    real client can map (SGLang's MooncakeHostTensorAllocator puts its
    host KV pool here in standalone_storage mode)."""

    def alloc(self, size: int) -> int:
        """The address of `size` new bytes of shared memory; 0 when they
        could not be had (Mooncake's allocator logs and returns null)."""
        try:
            return allocate(int(size))
        except (InvalidArgumentError, OSError):
            return 0

    def free(self, ptr: int) -> int:
        return free(int(ptr))
