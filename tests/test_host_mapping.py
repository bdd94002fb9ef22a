"""register() of a raw (ptr, length) range or a data_ptr() object checks
that the range is host memory this process has mapped (/proc/self/maps):
a hole (a raw pointer into GPU memory, freed memory, a length past the end)
or a page without read access is refused with InvalidArgumentError naming
the first bad address, instead of the first transfer killing the process
with SIGSEGV; read-only mappings register for READ access only."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

import kvflow
from kvflow.memory import host_mapping

from _batches import bounded

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20


@pytest.fixture
def pages():
    """pages(n) -> address of n fresh anonymous read-write pages (unmapped at teardown)."""
    made = []

    def make(n):
        addr = libc.mmap(None, n * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        made.append((addr, n))
        return addr
    yield make
    for addr, n in made:
        libc.munmap(addr, n * PAGE)          # pages already unmapped are ignored by the kernel


def test_mapped_memory_passes_and_says_whether_it_is_writable(pages):
    base = pages(4)
    assert host_mapping(base, 4 * PAGE) is True
    assert host_mapping(base + 10, 100) is True
    assert libc.mprotect(base + PAGE, PAGE, PROT_READ) == 0
    assert host_mapping(base, 4 * PAGE) is False
    arr = np.zeros(1 << 20, np.uint8)
    assert host_mapping(arr.ctypes.data, arr.nbytes) is True


async def test_a_hole_is_refused_naming_its_address(pages):
    base = pages(4)
    assert libc.munmap(base + 2 * PAGE, PAGE) == 0
    async with kvflow.Engine(protocols=("tcp",)) as eng:
        with pytest.raises(kvflow.InvalidArgumentError, match=f"{base + 2 * PAGE:#x} is not mapped"):
            eng.register((base, 4 * PAGE))
        tail = pages(8)
        assert libc.munmap(tail + 4 * PAGE, 4 * PAGE) == 0
        with pytest.raises(kvflow.InvalidArgumentError, match=f"{tail + 4 * PAGE:#x} is not mapped"):
            eng.register((tail + 2 * PAGE, 4 * PAGE))       # starts mapped, runs past its end
        eng.register((base, 2 * PAGE))                       # the mapped part is fine
        assert len(eng._regions) == 1


async def test_unreadable_pages_and_read_only_memory(pages):
    base = pages(4)
    assert libc.mprotect(base + PAGE, PAGE, PROT_NONE) == 0      # a guard page, or a GPU's reservation
    async with kvflow.Engine(protocols=("tcp",)) as a, kvflow.Engine(protocols=("tcp",)) as b:
        with pytest.raises(kvflow.InvalidArgumentError, match=f"{base + PAGE:#x} is mapped without read access"):
            a.register((base, 4 * PAGE))
        ro = pages(4)
        ctypes.memset(ro, 0x5A, 4 * PAGE)
        assert libc.mprotect(ro, 4 * PAGE, PROT_READ) == 0
        with pytest.raises(kvflow.InvalidArgumentError, match="read-only"):
            a.register((ro, 4 * PAGE))                              # default access includes WRITE
        src = a.register((ro, 4 * PAGE), access=kvflow.Access.READ)
        dst = np.zeros(4 * PAGE, np.uint8)
        rd = b.register(dst)
        peer = await bounded(a.connect(b.address))
        await bounded(peer.write([src.addr], [rd.addr], [4 * PAGE]))   # a read-only source is fine
        assert (dst == 0x5A).all()


async def test_a_pointer_nobody_mapped_never_reaches_a_transfer(pages):
    """What a raw GPU pointer looks like to a CPU-only process: an address
    with nothing mapped there. It used to register, and the first write
    died with SIGSEGV in the native sender."""
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        # the hole is made right before the register: made before the
        # engines started, their own allocations could land in it
        gone = pages(16)
        libc.munmap(gone, 16 * PAGE)
        with pytest.raises(kvflow.InvalidArgumentError, match="not mapped"):
            a.register((gone, 16 * PAGE))
        # the engine is still usable
        src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
        ls, rd = a.register(src), b.register(dst)
        peer = await bounded(a.connect(b.address))
        await bounded(peer.write([ls.addr], [rd.addr], [4096]))
        assert dst.all()
