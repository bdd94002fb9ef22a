"""The rdma provider on real verbs (Soft-RoCE in the VM, or a real NIC).

Beyond the shared parametrised suite (conftest's "rdma" and "rdma-xproc"
providers): automatic selection, a remote access error that fails only its
batch and leaves the endpoint usable after the QP is reconnected, two
devices with slices striped over both (checked with the devices' own
packet counters), notifications over the data path, registration time,
and MR/QP counters that balance. Device health (links down, devices deleted,
added again, retired): test_rdma_devices.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys

import numpy as np
import pytest

import kvflow
from kvflow.providers.rdma import provider as rdma

from _batches import bounded
from _rdma_pair import close_released, connected, rdma_pair, rxe_counter, until

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not kvflow.features["rdma"], reason="kvflow built without libibverbs"),
    pytest.mark.skipif(not rdma.device_names(), reason="no RDMA device on this host (run in the Soft-RoCE VM)"),
]


async def test_remote_access_error_then_endpoint_works(caplog):
    a, b = await rdma_pair()
    try:
        dst, src, r, l, peer = await connected(a, b, 1 << 20, 1)
        assert peer.transport == "rdma"
        await bounded(peer.write([l.addr], [r.addr], [4096]))
        # Deregister and write before A hears of it: A's table still allows
        # the range, so only the NIC can refuse it.
        b.deregister(r)
        with caplog.at_level(logging.WARNING, logger="kvflow"):
            with pytest.raises(kvflow.RemoteAccessError) as ei:
                await bounded(peer.write([l.addr], [r.addr], [8192], timeout=20))
        msg = str(ei.value)
        assert b.address in msg and "REM_ACCESS_ERR" in msg, msg
        assert any(f"rdma device {d['name']}," in msg for d in a.devices()), msg
        assert ei.value.peer == b.address and ei.value.index == 0
        assert bytes(dst[4096:8192]) == bytes(4096), "a refused write must not land"
        # the same endpoint works again once the QP is reconnected
        r2 = b.register(dst, name="kv2")
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                await bounded(peer.write([l.addr], [r2.addr], [1 << 20], timeout=10))
                break
            except kvflow.RemoteAccessError:
                # our copy of B's regions may lag; refresh() is what a user does
                await peer.refresh()
            assert asyncio.get_running_loop().time() < deadline
        assert np.array_equal(dst, src)
        for _ in range(100):
            if all(s["up"] for s in peer.connections()):
                break
            await asyncio.sleep(0.1)
        assert all(s["up"] for s in peer.connections()), peer.connections()
        assert any("broke" in r.getMessage() for r in caplog.records)
        assert a.counters()["slices_inflight"] == 0
        # engine.metrics() counts the break and the repair per QP
        pm = a.metrics()["peers"][b.address]
        assert pm["provider"] == "rdma" and pm["write"]["failed"] >= 1
        assert pm["connection_failures"] >= 1 and pm["repairs"] >= 1, pm["connections"]
        assert all(c["state"] == "up" for c in pm["connections"]), pm["connections"]
    finally:
        await a.close()
        await b.close()


async def test_notify_over_the_data_path_after_the_data():
    a, b = await rdma_pair()
    try:
        dst, src, r, l, peer = await connected(a, b, 1 << 20, 2)
        it = b.notifications().__aiter__()
        before = sum(s["wrs"] for s in peer.connections())
        for i in range(5):
            await bounded(peer.write([l.addr], [r.addr], [1 << 20]))
            await bounded(peer.notify(b"layer %d" % i))
            who, data = await bounded(it.__anext__())
            assert (who, data) == (a.address, b"layer %d" % i)
            assert np.array_equal(dst, src)     # the data was there when the notification came
            src[:] = np.roll(src, 1)
        # each small notification was one work request on a QP (a SEND)
        assert sum(s["wrs"] for s in peer.connections()) - before >= 5 + 5
        big = os.urandom(3 * rdma._verbs.RECV_BYTES)   # too big for a receive buffer: control path
        await bounded(peer.notify(big))
        assert await bounded(it.__anext__()) == (a.address, big)
    finally:
        await a.close()
        await b.close()


async def test_small_nowait_batches_mixed_with_awaited_ones_all_complete():
    """Regression: write_nowait once polled the CQ on the caller's thread
    like an awaited write, and completions found there skipped the eventfd
    without anyone draining them: that batch, and every later one of the
    engine, never completed."""
    a, b = await rdma_pair()
    try:
        dst, src, r, l, peer = await connected(a, b, 1 << 16, 3)
        for i in range(64):
            off = (i * 1024) % (1 << 16)
            t = peer.write_nowait([l.addr + off], [r.addr + off], [1024])
            if i % 3 == 0:
                await bounded(peer.write([l.addr + off], [r.addr + off], [512]))
            await bounded(t, 10)
        assert np.array_equal(dst, src)
        assert a.counters()["slices_inflight"] == 0
    finally:
        await a.close()
        await b.close()


async def test_a_polled_small_write_does_not_wake_the_loop():
    """A small awaited write that the caller's thread polls to completion
    (kvf_submit_poll) is drained right there: no eventfd write. The flag
    that says so was a thread-local in core.c, which is compiled into both
    _core and _verbs; an rdma poll completes slices through _verbs's copy,
    which read its own, never-set flag: every polled rdma batch woke the
    loop to drain nothing (300 wake-ups for 300 writes in the VM; 0 with
    the flag in the shared context). A write that misses the poll budget
    under emulation finishes through the loop, with its one wake-up."""
    a, b = await rdma_pair()
    try:
        dst, src, r, l, peer = await connected(a, b, 1 << 16, 5)
        for _ in range(10):
            await bounded(peer.write([l.addr], [r.addr], [512]))
        n, before = 200, a.counters()["wakeups"]
        for i in range(n):
            off = (i * 512) % (1 << 16)
            await bounded(peer.write([l.addr + off], [r.addr + off], [512]))
        woke = a.counters()["wakeups"] - before
        assert woke < n // 4, f"{woke} loop wake-ups for {n} polled writes"
        assert np.array_equal(dst, src)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("worker_posts", ["0", "1"])
async def test_many_scattered_batches_in_flight_whoever_posts(monkeypatch, worker_posts):
    """Scattered entries (one work request each) in many batches at once,
    more than the QPs' send queues hold, posted by the submitting thread
    (0) or by the device's worker (1, the default on Soft-RoCE), with
    awaited writes and reads in between: every batch completes, and the
    memory is what was written."""
    monkeypatch.setenv("KVFLOW_RDMA_WORKER_POSTS", worker_posts)
    a, b = await rdma_pair()
    try:
        assert all(d["worker_posts"] == (worker_posts == "1") for d in a.devices())
        n, block = 1 << 22, 4096
        dst, src, r, l, peer = await connected(a, b, n, 11)
        offs = list(range(0, n, 2 * block))          # every other block: nothing coalesces
        batches = [offs[i::8] for i in range(8)]     # 8 batches of 64 entries
        pending = [peer.write_nowait([l.addr + o for o in bo], [r.addr + o for o in bo], [block] * len(bo))
                   for bo in batches]
        one = offs[0] + block                       # a gap block, awaited alone meanwhile
        await bounded(peer.write([l.addr + one], [r.addr + one], [block]))
        await bounded(asyncio.gather(*pending), 120)
        want = src.copy()
        for o in range(block, n, 2 * block):
            if o != one:
                want[o:o + block] = 0
        assert np.array_equal(dst, want)
        # and back: a read of every written block, one batch
        back = np.zeros(n, dtype=np.uint8)
        lb = a.register(back)
        await bounded(peer.read([lb.addr + o for o in offs], [r.addr + o for o in offs], [block] * len(offs)), 120)
        for o in offs:
            assert np.array_equal(back[o:o + block], src[o:o + block]), o
        assert a.counters()["slices_inflight"] == 0
    finally:
        await a.close()
        await b.close()


async def test_registration_time_is_reported(caplog):
    async with kvflow.Engine(protocols=("rdma",)) as e:
        buf = np.zeros(rdma.LARGE_REGION, dtype=np.uint8)
        with caplog.at_level(logging.INFO, logger="kvflow"):
            region = e.register(buf)
        assert region.rdma_reg_seconds > 0
        assert len(region.rkeys) == len(e.devices())
        assert any("rdma registration of 64 MiB" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(len(rdma.device_names()) < 2, reason="needs two RDMA devices (tools/rdma_vm.py --devices 2)")
async def test_two_devices_slices_striped_over_both():
    names = rdma.device_names()[:2]
    a, b = await rdma_pair(rdma_devices=names)
    try:
        n = 8 << 20
        dst, src, r, l, peer = await connected(a, b, n, 3)
        sent0 = {d: rxe_counter(d, "sent_pkts") for d in names}
        await bounded(peer.write([l.addr], [r.addr], [n]), 120)
        assert np.array_equal(dst, src)
        per_dev = {0: 0, 1: 0}
        for s in peer.connections():
            per_dev[s["device_index"]] += s["bytes"]
        # kvflow's own accounting: both devices carried a fair share
        assert min(per_dev.values()) >= n // 4, per_dev
        # the devices' counters agree (each packet carries at most one MTU)
        for d in names:
            assert rxe_counter(d, "sent_pkts") - sent0[d] >= (n // 4) // 4096, d
        # reads stripe too
        back = np.zeros(n, dtype=np.uint8)
        lb = a.register(back)
        await bounded(peer.read([lb.addr], [r.addr], [n]), 120)
        assert np.array_equal(back, src)
    finally:
        await a.close()
        await b.close()


async def test_mr_and_qp_counters_balance_through_transfer_repair_and_close():
    """engine.counters() "mrs" and "qps" count verbs objects on both sides:
    a fresh engine holds only its own MRs (probe, landing, notify buffers,
    receive ring: 4 per device) and no QP; regions and connections add
    theirs, a QP repair replaces QPs one for one, deregistering and closing
    the peer give them back, and a closed engine leaves zero of each."""
    a, b = await rdma_pair()
    closed = False
    try:
        ndev = len(a.devices())
        base = a.counters()
        assert base["mrs"] == 4 * ndev and base["qps"] == 0, base
        assert b.counters()["mrs"] == 4 * len(b.devices()) and b.counters()["qps"] == 0
        n = 1 << 20
        dst, src, r, l, peer = await connected(a, b, n, 7)
        nqps = len(peer.connections())
        assert nqps >= 2
        assert a.counters()["mrs"] == base["mrs"] + ndev and a.counters()["qps"] == nqps, a.counters()
        assert b.counters()["qps"] == nqps, b.counters()
        await bounded(peer.write([l.addr], [r.addr], [n]))
        assert np.array_equal(dst, src)
        # a repair: QP 0 out of service, then reconnected (a new QP pair on
        # both ends in place of the old one)
        assert peer._channel.break_qp(0)
        await bounded(a._rdma._repair(peer.link, peer._channel, 0), 60)
        assert peer.connections()[0]["up"]
        assert a.counters()["qps"] == nqps and b.counters()["qps"] == nqps, (a.counters(), b.counters())
        src[:] = np.roll(src, 3)
        await bounded(peer.write([l.addr], [r.addr], [n]))
        assert np.array_equal(dst, src)
        a.deregister(l)
        assert a.counters()["mrs"] == base["mrs"]
        await peer.close()
        assert a.counters()["qps"] == 0, a.counters()
        await until(lambda: b.counters()["qps"] == 0, f"target QPs still counted: {b.counters()}")
        closed = True
        await close_released(a, b)
    finally:
        if not closed:
            await a.close()
            await b.close()


TARGET = r"""
import asyncio, sys, numpy as np, kvflow
async def main():
    async with kvflow.Engine() as e:
        buf = np.zeros(1 << 16, dtype=np.uint8)
        r = e.register(buf, name="kv")
        print(e.address, r.addr, flush=True)
        # wait for the test without blocking this engine's event loop
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(bytes(buf[:16]).hex(), flush=True)
asyncio.run(main())
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a separate pid namespace")
async def test_auto_selection_picks_rdma_for_another_host(caplog):
    """protocols=None: a peer that is not on this host (here: another pid
    namespace, so no cross-memory attach) is reached over rdma."""
    proc = await asyncio.create_subprocess_exec(
        "unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", TARGET,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        address, raddr = (await bounded(proc.stdout.readline(), 60)).decode().split()
        with caplog.at_level(logging.INFO, logger="kvflow"):
            async with kvflow.Engine() as e:
                src = np.frombuffer(b"picked rdma!!!!!", dtype=np.uint8).copy()
                s = e.register(src)
                peer = await bounded(e.connect(address))
                assert peer.transport == "rdma"
                await bounded(peer.write([s.addr], [int(raddr)], [16]))
        assert any("another host" in r.getMessage() and "trying rdma" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert any(f"connected to {address} via rdma" in r.getMessage() for r in caplog.records)
        proc.stdin.write(b"\n")
        await proc.stdin.drain()
        landed = (await bounded(proc.stdout.readline(), 30)).decode().strip()
        assert bytes.fromhex(landed) == b"picked rdma!!!!!"
    finally:
        if proc.returncode is None:
            proc.kill()
        await bounded(proc.wait(), 30)
