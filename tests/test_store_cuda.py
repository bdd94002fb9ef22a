"""kvflow.store with torch CUDA tensors as put_from/get_into's caller side
(kvflow/store/device.py), on a GPU: skipped with the reason where CUDA is
not usable; tools/gpu_check.sh runs it on a lent GPU machine. The same
paths run on every CI machine under the CUDA driver stand-in
(tests/cuda_standin/store_cases.py), which is a test double, not this."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys

import pytest

import kvflow.cuda
from kvflow.errors import UnregisteredMemoryError
from kvflow.store import Master, StoreClient

from _batches import bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 1 << 20

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kvflow.cuda.available(), reason=f"CUDA not usable here: {kvflow.cuda.reason()}")]


def _sha(t) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def _holder(master: str) -> subprocess.Popen:
    """A pool member with a 64 MiB host segment in a process of its own."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_store_holder.py"), master, str(64 << 20),
                          "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert json.loads(p.stdout.readline())["ready"]
    return p


def _stop(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(30) == 0


@pytest.mark.parametrize("segment", ["another process", "own"])
async def test_store_put_from_and_get_into_cuda_tensors(segment):
    """32 objects of 1 MiB from a CUDA tensor into the pool and back into
    another, every byte; an object of a host and a device part; an
    unregistered device range refused, nothing stored."""
    torch = pytest.importorskip("torch")
    master = await Master(seed=1).start("127.0.0.1:0")
    holder = await asyncio.to_thread(_holder, master.address) if segment != "own" else None
    try:
        async with StoreClient(master.address, segment_size=0 if holder else 64 << 20, protocols=("tcp",)) as c:
            n = 32
            src = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8, device="cuda")
            dst = torch.zeros(n * BLOCK, dtype=torch.uint8, device="cuda")
            host = torch.randint(0, 256, (BLOCK,), dtype=torch.uint8)
            loose = torch.zeros(BLOCK, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            rs, rd, rh = c.register_buffer(src), c.register_buffer(dst), c.register_buffer(host)
            assert rs.kind == "cuda"
            keys = [f"t/{i}" for i in range(n)]
            assert await bounded(c.batch_put_from(keys, [rs.addr + i * BLOCK for i in range(n)], [BLOCK] * n)) \
                == [1] * n
            assert await bounded(c.batch_get_into(keys, [rd.addr + i * BLOCK for i in range(n)], [BLOCK] * n)) \
                == [BLOCK] * n
            torch.cuda.synchronize()
            assert _sha(dst) == _sha(src)
            assert await bounded(c.put_from_parts("mix", [(rh.addr, BLOCK), (rs.addr, BLOCK)])) == 1
            assert await bounded(c.get_into("mix", rd.addr, 2 * BLOCK)) == 2 * BLOCK
            torch.cuda.synchronize()
            assert _sha(dst[:BLOCK]) == _sha(host) and _sha(dst[BLOCK:2 * BLOCK]) == _sha(src[:BLOCK])
            with pytest.raises(UnregisteredMemoryError):
                await bounded(c.put_from("loose", loose.data_ptr(), BLOCK))
            assert not await bounded(c.exists("loose"))
            for r in (rs, rd, rh):
                c.unregister_buffer(r)
    finally:
        if holder is not None:
            await asyncio.to_thread(_stop, holder)
        await master.close()
