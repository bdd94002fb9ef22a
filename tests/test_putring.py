"""GPU-initiated puts, proxy mode (issue 21), on the host: the put ring
(kvflow._putring) and the proxy (kvflow.gpu.proxy) with real engines
and real peers. The producers are host threads, and the device side's own
code (kvflow/_cuda/putring.cuh, kvf_put and kvf_put_wait) compiled for the
host with gcc: the same protocol a kernel runs, checked against the
layout the proxy reads. (The kernel itself runs in tests/test_cuda.py on a
GPU.)"""
from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

import kvflow
from kvflow._putring import (E_CANCELED, E_INVALID, E_NO_PEER, E_REMOTE, E_UNREGISTERED, OP_GET, OP_PUT,
                             PutRing, PutRingError, ring_bytes)
from kvflow.gpu.proxy import PutProxy

from _batches import bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_DIR = os.path.join(ROOT, "kvflow", "_cuda")

_SHIM = r"""
#include <stddef.h>
#include "putring.cuh"
unsigned long long host_put(char *ring, unsigned int c, unsigned int op, unsigned int peer, unsigned long long l,
                            unsigned long long r, unsigned long long n, unsigned long long tag)
{ return kvf_put(ring, c, op, peer, l, r, n, tag); }
long long host_wait(char *ring, unsigned int c, unsigned long long t) { return kvf_put_wait(ring, c, t); }
void layout(unsigned long long *o)
{
    o[0] = sizeof(struct kvf_ring_header); o[1] = sizeof(struct kvf_ring_ctl); o[2] = sizeof(struct kvf_ring_slot);
    o[3] = offsetof(struct kvf_ring_ctl, head); o[4] = offsetof(struct kvf_ring_ctl, taken);
    o[5] = offsetof(struct kvf_ring_ctl, completed); o[6] = offsetof(struct kvf_ring_ctl, failed);
    o[7] = offsetof(struct kvf_ring_ctl, fail_code);
    o[8] = offsetof(struct kvf_ring_slot, seq); o[9] = offsetof(struct kvf_ring_slot, op);
    o[10] = offsetof(struct kvf_ring_slot, peer); o[11] = offsetof(struct kvf_ring_slot, local);
    o[12] = offsetof(struct kvf_ring_slot, remote); o[13] = offsetof(struct kvf_ring_slot, length);
    o[14] = offsetof(struct kvf_ring_slot, tag); o[15] = offsetof(struct kvf_ring_slot, status);
    o[16] = offsetof(struct kvf_ring_slot, done); o[17] = offsetof(struct kvf_ring_header, closed);
    o[18] = KVF_RING_MAGIC; o[19] = KVF_PUT; o[20] = KVF_GET; o[21] = (unsigned long long)KVF_ECANCELED;
    o[22] = KVF_RING_HEADER; o[23] = KVF_RING_CTL; o[24] = KVF_RING_SLOT;
}
"""


@pytest.fixture(scope="module")
def device_side(tmp_path_factory):
    """putring.cuh's host build, as a ctypes library (its calls release the GIL)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("putring")
    src, lib = d / "shim.c", d / "libputshim.so"
    src.write_text(_SHIM)
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", f"-I{HEADER_DIR}", "-o", str(lib), str(src)],
                   check=True)
    so = ctypes.CDLL(str(lib))
    so.host_put.restype = ctypes.c_ulonglong
    so.host_put.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong,
                            ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong]
    so.host_wait.restype = ctypes.c_longlong
    so.host_wait.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong]
    return so


def test_the_device_header_agrees_with_the_ring_layout(device_side):
    o = (ctypes.c_ulonglong * 25)()
    device_side.layout(o)
    off = PutRing(1, 1).offsets()
    assert (o[0], o[1], o[2]) == (off["header"], off["ctl"], off["slot"]) == (o[22], o[23], o[24])
    assert [o[i] for i in range(3, 8)] == [off[k] for k in ("head", "taken", "completed", "failed", "fail_code")]
    assert o[8] == off["seq"] and o[9] == off["op_peer"] and o[10] == off["op_peer"] + 4
    assert [o[i] for i in range(11, 17)] == [off[k] for k in ("local", "remote", "length", "tag", "status", "done")]
    assert o[17] == off["closed"]
    from kvflow import _putring
    assert (o[18], o[19], o[20]) == (_putring.MAGIC, OP_PUT, OP_GET)
    assert ctypes.c_longlong(o[21]).value == E_CANCELED


def test_ring_round_trip_credit_and_bad_input():
    ring = PutRing(2, 4)
    assert ring.nbytes == ring_bytes(2, 4) == 256 + 2 * (128 + 4 * 64)
    for i in range(4):
        assert ring.post(1, OP_PUT, 3, 100 + i, 200 + i, 64, tag=i) == i
    with pytest.raises(PutRingError, match="no free slot"):        # the credit: slot 0 not finished
        ring.post(1, OP_PUT, 3, 0, 0, 64, timeout=0.05)
    assert ring.take(0) is None
    got = [ring.take(1) for _ in range(4)]
    assert got == [(i, OP_PUT, 3, 100 + i, 200 + i, 64, i) for i in range(4)]
    assert ring.take(1) is None
    ring.finish(1, 2, 0)                                           # out of order: completed stays 0
    assert ring.state(1)["completed"] == 0
    ring.finish(1, 0, 0)
    ring.finish(1, 1, E_REMOTE)
    assert ring.state(1) == {"head": 4, "taken": 4, "completed": 3}
    assert ring.wait(1, 1) == E_REMOTE and ring.failure(1) == (1, E_REMOTE)
    assert ring.post(1, OP_PUT, 3, 0, 0, 64, timeout=0.05) == 4    # slot 0 is free again
    with pytest.raises(PutRingError, match="already finished"):
        ring.finish(1, 0, 0)
    with pytest.raises(PutRingError, match="not taken"):
        ring.finish(1, 4, 0)
    with pytest.raises(PutRingError, match="never posted"):
        ring.wait(0, 0)
    with pytest.raises(PutRingError, match="not finished"):
        ring.wait(1, 3, timeout=0.02)
    with pytest.raises(PutRingError, match="channel 2"):
        ring.post(2, OP_PUT, 0, 0, 0, 1)
    # attach to a ring in memory one owns; refusals for what is not one
    buf = np.zeros(ring_bytes(3, 8) + 64, np.uint8)
    addr = (buf.ctypes.data + 63) // 64 * 64
    mine = PutRing(3, 8, addr=addr, size=ring_bytes(3, 8))
    other = PutRing(addr=addr, create=False)
    assert (other.channels, other.slots, other.nbytes) == (3, 8, ring_bytes(3, 8))
    mine.post(2, OP_GET, 1, 5, 6, 7)
    assert other.take(2) == (0, OP_GET, 1, 5, 6, 7, 0)
    with pytest.raises(PutRingError, match="aligned"):
        PutRing(1, 1, addr=addr + 8, size=4096)
    with pytest.raises(PutRingError, match="do not hold"):
        PutRing(3, 8, addr=addr, size=1000)
    zeros = np.zeros(4096, np.uint8)
    with pytest.raises(PutRingError, match="no put ring"):
        PutRing(addr=(zeros.ctypes.data + 63) // 64 * 64, create=False)
    with pytest.raises(PutRingError):
        PutRing(0, 4)
    ring.close()
    with pytest.raises(PutRingError, match="closed"):
        ring.take(0)


async def _pair(make_engine, protocol, size):
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    s = a.register(src, name="src")
    dst = np.zeros(size, np.uint8)
    b.register(dst, name="kv")
    peer = await bounded(a.connect(b.address))
    return a, b, src, s, dst, peer


@pytest.mark.parametrize("protocol", ["tcp", "local"])
async def test_device_code_producers_put_through_the_proxy(make_engine, device_side, protocol):
    """Four threads, each a channel's producer running putring.cuh's kvf_put
    and kvf_put_wait (host build), 150 puts of 16 KiB each through 4-slot
    channels (every slot wraps many times), half of them waited one by one,
    half posted ahead: every byte lands where it was put."""
    a, b, src, s, dst, peer = await _pair(make_engine, protocol, 10 << 20)
    ring = PutRing(4, 4)
    remote = peer.region("kv").addr
    chunk, per = 16 << 10, 150
    statuses: dict[int, list[int]] = {}

    def producer(c: int) -> None:
        mine, tickets = [], []
        for i in range(per):
            off = (c * per + i) * chunk
            t = device_side.host_put(ring.addr, c, OP_PUT, 0, s.addr + off, remote + off, chunk, i)
            if c % 2:
                mine.append(device_side.host_wait(ring.addr, c, t))
            else:
                tickets.append(t)
                if len(tickets) == 4:                 # posted ahead, a slot's worth each
                    mine += [device_side.host_wait(ring.addr, c, x) for x in tickets]
                    tickets = []
        mine += [device_side.host_wait(ring.addr, c, x) for x in tickets]
        statuses[c] = mine

    loop = asyncio.get_running_loop()
    with PutProxy(ring, [peer]) as proxy:
        await bounded(asyncio.gather(*(loop.run_in_executor(None, producer, c) for c in range(4))), 60)
        assert proxy.stats()["finished"] == 4 * per and proxy.stats()["failed"] == 0
        assert proxy.stats()["bytes"] == 4 * per * chunk
    assert all(st == [0] * per for st in statuses.values())
    n = 4 * per * chunk
    assert np.array_equal(dst[:n], src[:n])
    assert all(ring.state(c) == {"head": per, "taken": per, "completed": per} for c in range(4))


async def test_gets_and_bad_descriptors(make_engine):
    """A get reads the peer's bytes here; a bad descriptor is finished with
    its code (nothing posted, the first failure kept), and the proxy and
    the engine go on working."""
    a, b, src, s, dst, peer = await _pair(make_engine, "tcp", 1 << 20)
    back = np.zeros(1 << 20, np.uint8)
    rb = a.register(back, name="back")
    remote = peer.region("kv").addr
    ring = PutRing(1, 8)
    loop = asyncio.get_running_loop()
    unregistered = np.zeros(4096, np.uint8)

    def run() -> list[int]:
        out = []
        t = ring.post(0, OP_PUT, 0, s.addr, remote, 1 << 20)
        out.append(ring.wait(0, t))
        t = ring.post(0, OP_GET, 0, rb.addr + 4096, remote + 8192, 65536)
        out.append(ring.wait(0, t))
        for args in ((9, 0, s.addr, remote, 64), (OP_PUT, 3, s.addr, remote, 64), (OP_PUT, 0, s.addr, remote, 0),
                     (OP_PUT, 0, unregistered.ctypes.data, remote, 64), (OP_PUT, 0, s.addr, remote + (1 << 20), 64)):
            out.append(ring.wait(0, ring.post(0, *args)))
        t = ring.post(0, OP_PUT, 0, s.addr + 100, remote + 200, 300)    # and it still works
        out.append(ring.wait(0, t))
        return out

    with PutProxy(ring, [peer]) as proxy:
        got = await bounded(loop.run_in_executor(None, run))
        assert got == [0, 0, E_INVALID, E_NO_PEER, E_INVALID, E_UNREGISTERED, E_REMOTE, 0]
        assert proxy.stats()["failed"] == 5 and len(proxy.errors) == 5
        assert "remote" in proxy.errors[-1][2].lower() or "region" in proxy.errors[-1][2].lower()
    assert ring.failure(0) == (2, E_INVALID)
    assert np.array_equal(back[4096:4096 + 65536], src[8192:8192 + 65536])
    assert np.array_equal(dst[200:500], src[100:400])
    await bounded(peer.write([s.addr], [remote], [4096]))                # the engine is fine


async def test_a_stopped_proxy_releases_its_waiters(make_engine, device_side):
    """Producers waiting for credit or for a completion when the proxy
    stops get E_CANCELED (device code) or PutRingError (host API): none
    hangs."""
    a, b, src, s, dst, peer = await _pair(make_engine, "tcp", 1 << 20)
    ring = PutRing(2, 2)
    proxy = PutProxy(ring, [])                     # no peers: every put fails fast with E_NO_PEER
    proxy.start()
    assert ring.wait(0, ring.post(0, OP_PUT, 0, s.addr, 0, 64)) == E_NO_PEER
    proxy.close()
    assert ring.closed
    # the proxy is gone: a waiter for a ticket nobody takes, and a post without credit
    t = device_side.host_put(ring.addr, 1, OP_PUT, 0, s.addr, 0, 64, 0)
    assert device_side.host_wait(ring.addr, 1, t) == E_CANCELED
    device_side.host_put(ring.addr, 1, OP_PUT, 0, s.addr, 0, 64, 0)
    assert device_side.host_put(ring.addr, 1, OP_PUT, 0, s.addr, 0, 64, 0) == 2**64 - 1    # no slot: gave up
    with pytest.raises(PutRingError, match="stopped"):
        ring.post(1, OP_PUT, 0, s.addr, 0, 64)
    assert ring.wait(0, 0) == E_NO_PEER


async def test_a_lost_peer_fails_its_puts_and_the_proxy_goes_on(make_engine):
    a, b, src, s, dst, peer = await _pair(make_engine, "tcp", 4 << 20)
    c = await make_engine(protocols=["tcp"])
    other = np.zeros(1 << 20, np.uint8)
    c.register(other, name="kv")
    peer2 = await bounded(a.connect(c.address))
    ring = PutRing(1, 4)
    remote, remote2 = peer.region("kv").addr, peer2.region("kv").addr
    loop = asyncio.get_running_loop()
    with PutProxy(ring, [peer, peer2]) as proxy:
        assert await bounded(loop.run_in_executor(None, lambda: ring.wait(0, ring.post(0, OP_PUT, 0, s.addr,
                                                                                        remote, 4096)))) == 0
        await bounded(b.close())
        for _ in range(200):                                   # until the engine saw the peer go
            if not peer.alive:
                break
            await asyncio.sleep(0.02)
        st = await bounded(loop.run_in_executor(None, lambda: ring.wait(0, ring.post(0, OP_PUT, 0, s.addr,
                                                                                      remote, 65536))))
        assert st < 0                                          # a typed failure, not a hang
        st2 = await bounded(loop.run_in_executor(None, lambda: ring.wait(0, ring.post(0, OP_PUT, 1, s.addr,
                                                                                       remote2, 65536))))
        assert st2 == 0 and np.array_equal(other[:65536], src[:65536])
        assert proxy.stats()["failed"] == 1


def test_proxy_arguments_are_checked():
    with pytest.raises(kvflow.InvalidArgumentError):
        PutProxy(object(), [])                                 # type: ignore[arg-type]
    with pytest.raises(kvflow.InvalidArgumentError):
        PutProxy(PutRing(1, 1), [], max_inflight=0)
    p = PutProxy(PutRing(1, 1), [])
    p.start()
    with pytest.raises(kvflow.InvalidArgumentError, match="started"):
        p.start()
    p.close()


def test_the_host_mode_of_the_gpu_put_tool_runs():
    """tools/gpu_put.py --host, which measures the proxy's cost per put that
    the docs quote, on a few puts: it moves the bytes and reports them."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("gpu_put", os.path.join(ROOT, "tools", "gpu_put.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_put"] = mod
    spec.loader.exec_module(mod)
    res = asyncio.run(mod.run_host("local", n=20))
    assert res["puts"] == 20 and 0 < res["post_poll_p50_us"] and 0 < res["put_p50_us"] < 1e6
