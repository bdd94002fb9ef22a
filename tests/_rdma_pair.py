"""Shared parts of the rdma tests on real verbs (test_rdma.py,
test_rdma_devices.py): an engine pair over rdma, a connected peer with
random source bytes, a device's own counters, waiting for a condition, and
closing engines that must have released every MR and QP.
"""

from __future__ import annotations

import asyncio

import numpy as np

import kvflow

from _batches import TIME_SCALE, bounded


def rxe_counter(dev: str, name: str) -> int:
    """A device's own counter (sysfs hw_counters): independent of kvflow."""
    with open(f"/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}") as f:
        return int(f.read())


async def rdma_pair(**kw):
    a = kvflow.Engine(protocols=("rdma",), **kw)
    b = kvflow.Engine(protocols=("rdma",), **kw)
    await a.start()
    await b.start()
    return a, b


async def connected(a, b, n: int, seed: int):
    """B registers n zero bytes as "kv", A registers n random bytes; A
    connects to B. Returns (dst, src, remote region, local region, peer)."""
    dst = np.zeros(n, dtype=np.uint8)
    src = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    r = b.register(dst, name="kv")
    l = a.register(src)
    peer = await bounded(a.connect(b.address))
    return dst, src, r, l, peer


async def close_released(*engines):
    """Closes the engines; every MR and QP they held must be gone."""
    for e in engines:
        await bounded(e.close(), 30)
    for e in engines:
        c = e.counters()
        assert c["mrs"] == 0 and c["qps"] == 0, c


async def until(cond, what: str, limit: float = 30):
    """Waits (bounded) until cond() holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit * TIME_SCALE
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)
