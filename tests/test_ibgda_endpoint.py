"""IBGDA endpoints on real verbs (Soft-RoCE in the VM harness):
Engine(rdma_ibgda=True) gives each rdma channel one more RC QP per device
pair, connected by the same rdma_connect handshake, outside the channel's
workers. rxe is not mlx5, so no GPU can drive it here: view() refuses with
the reason, and the host writes through the endpoint's own QP instead,
which proves the handshake wired it to the right QP of the right peer. The
device side is tested on the host against rdma-core (tests/test_ibgda.py);
none of it has run on an mlx5 NIC."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvflow
from kvflow.providers.rdma import provider as rdma

from _batches import bounded

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not kvflow.features["rdma"], reason="kvflow built without libibverbs"),
    pytest.mark.skipif(not rdma.device_names(), reason="no RDMA device on this host (run in the Soft-RoCE VM)"),
]


async def _pair(n: int, **kw):
    a = kvflow.Engine(protocols=("rdma",), rdma_ibgda=True, **kw)
    b = kvflow.Engine(protocols=("rdma",))
    await a.start()
    await b.start()
    dst = np.zeros(n, dtype=np.uint8)
    src = np.random.default_rng(5).integers(0, 255, n, dtype=np.uint8)
    r = b.register(dst, name="kv")
    l = a.register(src)
    peer = await bounded(a.connect(b.address))
    return a, b, dst, src, r, l, peer


async def test_an_ibgda_endpoint_per_device_pair_writes_into_the_peer():
    n = 1 << 20
    a, b, dst, src, r, l, peer = await _pair(n)
    try:
        eps = peer.ibgda_endpoints()
        nqps = len(peer.connections())
        pairs = {(c["device"], c["remote_device"]) for c in peer.connections()}
        assert len(eps) == len(pairs) >= 1, (eps, pairs)
        assert {(e.device, e.remote_device) for e in eps} == pairs
        # the extra QPs, on both ends, and none of them is one of the channel's
        assert a.counters()["qps"] == nqps + len(eps) and b.counters()["qps"] == nqps + len(eps)
        # (QP numbers are per device)
        assert not {(e.device, e.qpn) for e in eps} & {(c["device"], c["qpn"]) for c in peer.connections()}
        for i, ep in enumerate(eps):
            assert not ep.capable
            with pytest.raises(kvflow.ProviderUnavailableError, match="not an mlx5 device"):
                ep.view()
            table = ep.local_regions()
            assert l.addr in table["addr"].tolist() and list(table["addr"]) == sorted(table["addr"])
            # each endpoint writes its own part, and only that part lands
            part = n // len(eps)
            lo = i * part
            await bounded(ep.write_from_host(l.addr + lo, r.addr + lo, part))
            assert np.array_equal(dst[lo:lo + part], src[lo:lo + part])
            assert not dst[lo + part:].any()
            # a queue the host has posted on cannot be handed to a device
            with pytest.raises(kvflow.ProviderUnavailableError, match="host has written through"):
                ep.view()
        # the channel is untouched by them
        src[:] = np.roll(src, 1)
        await bounded(peer.write([l.addr], [r.addr], [n]))
        assert np.array_equal(dst, src)
    finally:
        await a.close()
        await b.close()


async def test_bad_ibgda_writes_are_refused_before_anything_is_posted():
    n = 1 << 16
    a, b, dst, src, r, l, peer = await _pair(n)
    try:
        ep = peer.ibgda_endpoints()[0]
        stray = np.ones(4096, dtype=np.uint8)            # never registered
        with pytest.raises(kvflow.UnregisteredMemoryError):
            await ep.write_from_host(stray.ctypes.data, r.addr, 4096)
        with pytest.raises(kvflow.UnregisteredMemoryError):
            await ep.write_from_host(l.addr + n - 8, r.addr, 16)          # past the local region's end
        with pytest.raises(kvflow.RemoteAccessError):
            await ep.write_from_host(l.addr, r.addr + n - 8, 16)          # past the peer's region
        for bad in (0, -1, 1 << 31, 1.5, True):
            with pytest.raises(kvflow.InvalidArgumentError):
                await ep.write_from_host(l.addr, r.addr, bad)
        assert not dst.any()
        await bounded(ep.write_from_host(l.addr, r.addr, n))            # still usable
        assert np.array_equal(dst, src)
    finally:
        await a.close()
        await b.close()


async def test_ibgda_qps_go_with_their_peer_and_are_absent_unless_asked():
    n = 4096
    a, b, dst, src, r, l, peer = await _pair(n)
    c = kvflow.Engine(protocols=("rdma",))
    await c.start()
    try:
        eps = peer.ibgda_endpoints()
        assert eps
        await peer.close()
        assert a.counters()["qps"] == 0, a.counters()
        for _ in range(600):               # the target drops its QPs when the session ends
            if b.counters()["qps"] == 0:
                break
            await asyncio.sleep(0.05)
        assert b.counters()["qps"] == 0, b.counters()
        with pytest.raises(kvflow.KVFlowError):
            await eps[0].write_from_host(l.addr, r.addr, n)               # its QP is gone
        # an engine not asked for them makes none
        p2 = await bounded(c.connect(b.address))
        assert p2.ibgda_endpoints() == []
        assert c.counters()["qps"] == len(p2.connections())
    finally:
        await a.close()
        await b.close()
        await c.close()
