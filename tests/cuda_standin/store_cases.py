"""kvflow.store with GPU memory as the caller's side of put_from/get_into,
under the CUDA driver stand-in (run by tests/test_cuda_standin.py beside
cases.py, whose fixtures these use). A test double, never a GPU result:
tools/gpu_check.sh runs the same file on a GPU.

The pool's segments are host memory; the caller's buffers are device
memory the stand-in keeps PROT_NONE at its device address, so any CPU copy
of it (the own segment's memmove, a sendmsg of a device address) fails as
on a GPU. The bytes are checked through the stand-in's shadow of device
memory and through the holder's own reads (get() of bytes), never through
the path under test alone.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cases
from _batches import bounded
from cases import STANDIN, _pattern, _sha

from kvflow.errors import UnregisteredMemoryError
from kvflow.store import Master, StoreClient

pytestmark = [pytest.mark.cuda_standin,
              pytest.mark.skipif(STANDIN is None, reason="not under the CUDA stand-in (tests/test_cuda_standin.py "
                                                          "runs these)")]

# cases.py's fixtures, by name here: device arrays with guard bytes, and
# the driver objects back to their count once the test's engines closed
gpu_mem = cases.gpu_mem
standin_balance = cases.standin_balance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLDER = os.path.join(ROOT, "tests", "_store_holder.py")
BLOCK = 256 << 10


def _holder(master: str, segment_size: int) -> subprocess.Popen:
    """A pool member with a host segment, in a process of its own (it never
    touches CUDA); ready once it printed its line."""
    p = subprocess.Popen([sys.executable, HOLDER, master, str(segment_size), "1"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = p.stdout.readline()
    assert json.loads(line)["ready"], line
    return p


def _stop(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(30) == 0


def _master_process() -> tuple[str, subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = p.stdout.readline()
    assert "ready" in line, line
    return line.split()[-1], p


async def test_store_moves_gpu_memory_to_another_processs_segment(gpu_mem):
    """put_from of device memory into a holder's host segment in another
    process (staged: device -> pinned slot -> tcp), get_into back into
    device memory (tcp -> slot -> device), every byte compared, and the
    holder's copy read as bytes too; an unregistered device range refused
    with nothing written; a batch mixing host and device buffers."""
    master = await Master(seed=1).start("127.0.0.1:0")
    # on a thread: the master answers the holder on this loop meanwhile
    holder = await asyncio.to_thread(_holder, master.address, 16 << 20)
    try:
        async with StoreClient(master.address, segment_size=0, protocols=("tcp",)) as c:
            n = 8
            src, dst = gpu_mem(n * BLOCK), gpu_mem(n * BLOCK)
            src.host[:] = _pattern(n * BLOCK, 1)
            rs, rd = c.register_buffer(src), c.register_buffer(dst)
            assert rs.kind == "cuda" and rd.kind == "cuda"
            keys = [f"gpu/{i}" for i in range(n)]
            addrs = [rs.addr + i * BLOCK for i in range(n)]
            copies = STANDIN.kvfstandin_count(b"copies")
            assert await bounded(c.batch_put_from(keys, addrs, [BLOCK] * n, replica_num=1)) == [1] * n
            assert STANDIN.kvfstandin_count(b"copies") > copies          # the driver made the D2H copies
            # the holder's segment holds the bytes (read as bytes through the host path)
            got = await bounded(c.batch_get(keys))
            assert b"".join(got) == src.host.tobytes()
            sizes = await bounded(c.batch_get_into(keys, [rd.addr + i * BLOCK for i in range(n)], [BLOCK] * n))
            assert sizes == [BLOCK] * n
            assert _sha(dst.host) == _sha(src.host)

            # device memory not registered, or past a registered region's end: refused, nothing written
            loose = gpu_mem(BLOCK)
            loose.host[:] = 7
            with pytest.raises(UnregisteredMemoryError):
                await bounded(c.put_from("loose", loose.ptr, BLOCK))
            with pytest.raises(UnregisteredMemoryError):
                await bounded(c.put_from("past", rs.addr + (n - 1) * BLOCK, 2 * BLOCK))
            assert await bounded(c.batch_exists(["loose", "past"])) == [False, False]
            with pytest.raises(UnregisteredMemoryError):
                await bounded(c.get_into("gpu/0", loose.ptr, BLOCK))
            assert (loose.host == 7).all()
            out = await bounded(c.batch_get_into(["gpu/0", "gpu/1"], [loose.ptr, rd.addr], [BLOCK, BLOCK]))
            assert isinstance(out[0], UnregisteredMemoryError) and out[1] == BLOCK

            # one batch of host and device buffers, and an object of a host and a device part
            host_src = _pattern(2 * BLOCK, 2)
            host_dst = np.zeros(2 * BLOCK, np.uint8)
            hs, hd = c.register_buffer(host_src), c.register_buffer(host_dst)
            src.host[:BLOCK] = _pattern(BLOCK, 3)
            assert await bounded(c.batch_put_from(["mix/host", "mix/dev"], [hs.addr, rs.addr], [BLOCK, BLOCK])) \
                == [1, 1]
            assert await bounded(c.put_from_parts("mix/both", [(hs.addr + BLOCK, BLOCK), (rs.addr, BLOCK)])) == 1
            dst.host[:] = 0
            assert await bounded(c.batch_get_into(["mix/host", "mix/dev"], [rd.addr, hd.addr], [BLOCK, BLOCK])) \
                == [BLOCK, BLOCK]
            assert _sha(dst.host[:BLOCK]) == _sha(host_src[:BLOCK])         # host -> pool -> device
            assert _sha(host_dst[:BLOCK]) == _sha(src.host[:BLOCK])         # device -> pool -> host
            assert await bounded(c.get_into_parts("mix/both", [(rd.addr + BLOCK, BLOCK),
                                                               (hd.addr + BLOCK, BLOCK)])) == 2 * BLOCK
            assert _sha(dst.host[BLOCK:2 * BLOCK]) == _sha(host_src[BLOCK:])
            assert _sha(host_dst[BLOCK:]) == _sha(src.host[:BLOCK])
            for r in (rs, rd, hs, hd):
                c.unregister_buffer(r)
    finally:
        await asyncio.to_thread(_stop, holder)
        await master.close()


@pytest.mark.parametrize("protocols", [("tcp",), None], ids=["tcp", "auto"])
async def test_store_moves_gpu_memory_to_its_own_segment(gpu_mem, protocols):
    """The client's own segment (host memory of this process): device rows
    go through the engine's peer of itself (one cuMemcpyAsync each way),
    never the own segment's memmove (a CPU copy of a stand-in device address
    would fault here)."""
    async with StoreClient(segment_size=8 << 20, protocols=protocols) as c:
        n = 4
        src, dst = gpu_mem(n * BLOCK), gpu_mem(n * BLOCK)
        src.host[:] = _pattern(n * BLOCK, 5)
        rs, rd = c.register_buffer(src), c.register_buffer(dst)
        keys = [f"own/{i}" for i in range(n)]
        assert await bounded(c.batch_put_from(keys, [rs.addr + i * BLOCK for i in range(n)], [BLOCK] * n)) == [1] * n
        assert b"".join(await bounded(c.batch_get(keys))) == src.host.tobytes()
        assert await bounded(c.batch_get_into(keys, [rd.addr + i * BLOCK for i in range(n)], [BLOCK] * n)) \
            == [BLOCK] * n
        assert _sha(dst.host) == _sha(src.host)
        c.unregister_buffer(rs)
        c.unregister_buffer(rd)


def test_mooncake_store_api_takes_gpu_pointers(gpu_mem):
    """kvflow.compat.mooncake.store as SGLang's and vLLM's Mooncake store
    code calls it: register_buffer(ptr, size) of device memory (the driver
    tells it apart, as the wheel's wildcard location does), batch_put_from
    and batch_get_into with device pointers, a holder in another process
    and the store's own segment; an unregistered device pointer -600."""
    from kvflow.compat.mooncake.store import MooncakeDistributedStore
    address, master = _master_process()
    holder = _holder(address, 16 << 20)
    store = MooncakeDistributedStore()
    try:
        assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 4 << 20, "tcp", "", address) == 0
        n = 8
        src, dst, loose = gpu_mem(n * BLOCK), gpu_mem(n * BLOCK), gpu_mem(BLOCK)
        src.host[:] = _pattern(n * BLOCK, 11)
        assert store.register_buffer(src.ptr, n * BLOCK) == 0 and store.register_buffer(dst.ptr, n * BLOCK) == 0
        keys = [f"mc/{i}" for i in range(n)]
        assert store.batch_put_from(keys, [src.ptr + i * BLOCK for i in range(n)], [BLOCK] * n) == [0] * n
        assert b"".join(store.get_batch(keys)) == src.host.tobytes()
        assert store.batch_get_into(keys, [dst.ptr + i * BLOCK for i in range(n)], [BLOCK] * n) == [BLOCK] * n
        assert _sha(dst.host) == _sha(src.host)
        assert store.put_from("mc/loose", loose.ptr, BLOCK) == -600
        assert store.get_into("mc/0", loose.ptr, BLOCK) == -600
        assert store.is_exist("mc/loose") == 0
        assert store.unregister_buffer(src.ptr) == 0 and store.unregister_buffer(dst.ptr) == 0
    finally:
        assert store.close() == 0
        _stop(holder)
        master.terminate()
        master.wait(10)


async def test_store_reads_an_ssd_only_object_into_gpu_memory(gpu_mem, tmp_path):
    """An object only on the SSD tier, read into device memory: the file is
    read by the CPU, which may not write there, so its holder loads it into
    a DRAM replica first and that is read over kvflow (staged)."""
    obj = 512 << 10
    async with StoreClient(segment_size=4 << 20, protocols=("tcp",), ssd_path=str(tmp_path), ssd_offload="evict",
                           ssd_promote=False) as c:
        vals = {}
        for i in range(24):                 # 3 segments' worth: most go to the SSD, then out of DRAM
            vals[f"s{i}"] = _pattern(obj, 20 + i).tobytes()
            await bounded(c.put(f"s{i}", vals[f"s{i}"]))
            await bounded(c.ssd_flush())
        cold = [k for k in vals if not c._embedded.model.objects[k].replicas]
        assert cold
        dst = gpu_mem(obj)
        rd = c.register_buffer(dst)
        assert await bounded(c.get_into(cold[0], rd.addr, obj)) == obj
        assert dst.host.tobytes() == vals[cold[0]]
        c.unregister_buffer(rd)
