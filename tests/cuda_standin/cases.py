"""kvflow's GPU paths under the CUDA driver stand-in (cuda_standin.h): run
by tests/test_cuda_standin.py in a pytest of its own whose processes load
the stand-in as libcuda.so.1. A test double, never a GPU result: the
driver calls, their contexts and streams, the IPC mappings and every byte
are checked; speed, the copy engines and the device code are not (the
stand-in runs kvflow's kernels as C of its own). tools/gpu_check.sh on a
GPU is the acceptance.

Device memory here is not CPU memory at its device address (the stand-in
reserves it PROT_NONE), so a CPU path handed a device pointer fails as on a
GPU; the tests read and fill it through the stand-in's shadow of it
(kvfstandin_peek), not through kvflow's copies.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvflow
from _batches import bounded
from _cuda_standin import hooks

STANDIN = hooks()
pytestmark = [pytest.mark.cuda_standin,
              pytest.mark.skipif(STANDIN is None, reason="not under the CUDA stand-in (tests/test_cuda_standin.py "
                                                          "runs these)")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUARD = 4096
BALANCED = ("stream", "event", "pinned", "registered", "ipc", "module")


def _drv():
    from kvflow._cuda import driver as drv
    return drv


def _ok(result, what="call"):
    from cuda.bindings import driver as cu
    err = result[0] if isinstance(result, tuple) else result
    assert err == cu.CUresult.CUDA_SUCCESS, f"{what}: {err} ({STANDIN.kvfstandin_last_error().decode()})"
    rest = result[1:] if isinstance(result, tuple) else ()
    return rest[0] if len(rest) == 1 else rest


def _code(result):
    return result[0] if isinstance(result, tuple) else result


class DeviceArray:
    """`nbytes` of device memory (cuMemAlloc) with guard bytes either side,
    registerable as a CUDA array (__cuda_array_interface__); `host` views
    its bytes through the stand-in's shadow (never the device address)."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        drv = _drv()
        self.device, self.nbytes = device, nbytes
        with drv.on_device(device):
            self.base = int(_ok(drv.driver().cuMemAlloc(nbytes + 2 * GUARD), "cuMemAlloc"))
        self.ptr = self.base + GUARD
        whole = STANDIN.kvfstandin_peek(self.base, nbytes + 2 * GUARD)
        self._all = np.ctypeslib.as_array((ctypes.c_uint8 * (nbytes + 2 * GUARD)).from_address(whole))
        self._all[:GUARD] = 0xA5
        self._all[GUARD + nbytes:] = 0x5A
        self.host = self._all[GUARD:GUARD + nbytes]

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def guards_ok(self) -> bool:
        return bool((self._all[:GUARD] == 0xA5).all() and (self._all[GUARD + self.nbytes:] == 0x5A).all())

    def close(self) -> None:
        drv = _drv()
        if self.base:
            with drv.on_device(self.device):
                _ok(drv.driver().cuMemFree(self.base), "cuMemFree")
            self.base = 0


@pytest.fixture
def gpu_mem():
    """gpu_mem(nbytes, device=0) -> DeviceArray; teardown checks its guard
    bytes and frees it."""
    made: list[DeviceArray] = []

    def make(nbytes: int, device: int = 0) -> DeviceArray:
        a = DeviceArray(nbytes, device)
        made.append(a)
        return a

    yield make
    bad = [i for i, a in enumerate(made) if not a.guards_ok()]
    for a in made:
        a.close()
    assert not bad, f"guard bytes overwritten around device arrays #{bad}"


@pytest.fixture(autouse=True)
def standin_balance():
    """Streams, events, pinned and registered host memory, IPC mappings and
    modules the test's engines made are gone once they closed."""
    before = {k: STANDIN.kvfstandin_count(k.encode()) for k in BALANCED}
    yield
    after = {k: STANDIN.kvfstandin_count(k.encode()) for k in BALANCED}
    left = {k: (before[k], after[k]) for k in BALANCED if after[k] > before[k] and k != "module"}
    assert not left, f"driver objects left after the engines closed (before, after): {left}"


def _sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# ---------------------------------------------------------------- the stand-in itself


def test_misuse_is_refused_with_the_drivers_codes(gpu_mem):
    """Every misuse the issue names fails with the driver's code: a call
    that needs a current context made without one, a destroyed stream,
    event, context or module, and work queued on a stream of another
    context (device 1's while device 0's context is current)."""
    from cuda.bindings import driver as cu
    drv = _drv()
    E = cu.CUresult
    buf = gpu_mem(1 << 16)
    host = np.zeros(1 << 16, np.uint8)
    s0, s1 = drv.Stream(0), drv.Stream(1)
    e0, e1 = drv.Event(0), drv.Event(1)
    fatbin = open(os.path.join(ROOT, "kvflow", "_cuda", "kvflow_kernels.fatbin"), "rb").read()
    got: dict[str, object] = {}

    def no_context():           # a fresh thread: no current context
        got["alloc"] = _code(cu.cuMemAlloc(4096))
        got["stream"] = _code(cu.cuStreamCreate(0))
        got["event"] = _code(cu.cuEventCreate(0))
        got["copy"] = _code(cu.cuMemcpyAsync(buf.ptr, host.ctypes.data, 4096, s0.handle))
        got["hostalloc"] = _code(cu.cuMemHostAlloc(4096, 0))
        got["module"] = _code(cu.cuModuleLoadData(fatbin))
        got["ipc_get"] = _code(cu.cuIpcGetMemHandle(buf.base))
        got["record"] = _code(cu.cuEventRecord(e0.handle, s0.handle))
        got["query"] = _code(cu.cuEventQuery(e0.handle))          # takes no current context: fine
    t = threading.Thread(target=no_context)
    t.start()
    t.join()
    for k in ("alloc", "stream", "event", "copy", "hostalloc", "module", "ipc_get", "record"):
        assert got[k] == E.CUDA_ERROR_INVALID_CONTEXT, (k, got[k])
    assert got["query"] == E.CUDA_SUCCESS

    with drv.on_device(0):
        # a stream of another context (device 1's) for work queued now
        assert _code(cu.cuMemcpyAsync(buf.ptr, host.ctypes.data, 4096, s1.handle)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuStreamWriteValue64(s1.handle, buf.ptr, 1, 0)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuStreamWaitEvent(s1.handle, e0.handle, 0)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuEventRecord(e1.handle, s0.handle)) == E.CUDA_ERROR_INVALID_HANDLE    # event of ctx 1
        module = _ok(cu.cuModuleLoadData(fatbin), "cuModuleLoadData")
        fn = _ok(cu.cuModuleGetFunction(module, b"kvf_flag_write"), "cuModuleGetFunction")
        slots = np.array([buf.ptr, 7], np.uint64)
        params = np.array([slots.ctypes.data, slots.ctypes.data + 8], np.uint64)
        assert _code(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s1.handle, params.ctypes.data, 0)) == \
            E.CUDA_ERROR_INVALID_HANDLE
        # the same calls on the current context's own stream work
        _ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s0.handle, params.ctypes.data, 0), "cuLaunchKernel")
        _ok(cu.cuStreamSynchronize(s0.handle), "cuStreamSynchronize")
        assert int(buf.host[:8].view(np.uint64)[0]) == 7
        # destroyed handles
        _ok(cu.cuModuleUnload(module), "cuModuleUnload")
        assert _code(cu.cuModuleGetFunction(module, b"kvf_flag_write")) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s0.handle, params.ctypes.data, 0)) == \
            E.CUDA_ERROR_INVALID_HANDLE
        dead_s = _ok(cu.cuStreamCreate(0))
        _ok(cu.cuStreamDestroy(dead_s))
        assert _code(cu.cuMemcpyAsync(buf.ptr, host.ctypes.data, 4096, dead_s)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuStreamSynchronize(dead_s)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuStreamDestroy(dead_s)) == E.CUDA_ERROR_INVALID_HANDLE
        dead_e = _ok(cu.cuEventCreate(0))
        _ok(cu.cuEventDestroy(dead_e))
        assert _code(cu.cuEventQuery(dead_e)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuEventRecord(dead_e, s0.handle)) == E.CUDA_ERROR_INVALID_HANDLE
        assert _code(cu.cuStreamWaitEvent(s0.handle, dead_e, 0)) == E.CUDA_ERROR_INVALID_HANDLE
        # freed device memory
        gone = _ok(cu.cuMemAlloc(4096))
        _ok(cu.cuMemFree(gone))
        assert _code(cu.cuMemcpyAsync(int(gone), host.ctypes.data, 4096, s0.handle)) == E.CUDA_ERROR_INVALID_VALUE
        assert _code(cu.cuMemFree(gone)) == E.CUDA_ERROR_INVALID_VALUE

    def destroyed_context():
        dev = _ok(cu.cuDeviceGet(0))
        ctx = _ok(cu.cuCtxCreate(None, 0, dev))         # created and current on this thread
        s = _ok(cu.cuStreamCreate(0))
        _ok(cu.cuCtxDestroy(ctx))
        got["set"] = _code(cu.cuCtxSetCurrent(ctx))
        got["push"] = _code(cu.cuCtxPushCurrent(ctx))
        got["its_stream"] = _code(cu.cuStreamSynchronize(s))
        ctx2 = _ok(cu.cuCtxCreate(None, 0, dev))
        _ok(cu.cuCtxPushCurrent(ctx2))
        _ok(cu.cuCtxDestroy(ctx2))                      # pops it; the one below is ctx2 too
        got["current_destroyed"] = _code(cu.cuMemAlloc(4096))
    t = threading.Thread(target=destroyed_context)
    t.start()
    t.join()
    assert got["set"] == E.CUDA_ERROR_INVALID_CONTEXT and got["push"] == E.CUDA_ERROR_INVALID_CONTEXT
    assert got["its_stream"] == E.CUDA_ERROR_INVALID_HANDLE
    assert got["current_destroyed"] == E.CUDA_ERROR_CONTEXT_IS_DESTROYED
    for x in (s0, s1, e0, e1):
        x.close()


def test_device_memory_is_not_cpu_memory(gpu_mem):
    """A device pointer handed to a CPU path fails as on a GPU (EFAULT
    here, where a memcpy would fault), and the driver knows it as device
    memory of its allocation."""
    buf = gpu_mem(1 << 16, device=1)
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    try:
        assert libc.write(w, ctypes.c_void_p(buf.ptr), 4096) == -1 and ctypes.get_errno() == errno.EFAULT
    finally:
        os.close(r), os.close(w)
    loc = _drv().pointer_location(buf.ptr + 100)
    assert (loc.kind, loc.device, loc.base) == ("cuda", 1, buf.base)
    assert _drv().pointer_location(np.zeros(8).ctypes.data) is None


# ---------------------------------------------------------------- kvflow's GPU paths


@pytest.mark.parametrize("protocol", ["tcp", "local"])
@pytest.mark.parametrize("kinds", ["cuda->host", "host->cuda", "cuda->cuda", "read host->cuda",
                                   "read cuda->cuda", "read cuda->host"])
async def test_gpu_memory_moves(gpu_mem, make_engine, protocol, kinds):
    """Staged writes and reads between two engines (tcp: through the
    pinned bounce buffers and the peer's inbox; local, one process: one
    direct copy), every byte checked: 64 entries of 64 KiB and one of
    2 MiB, cut across slots."""
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    n = 6 << 20
    want = _pattern(n, 1)
    read = kinds.startswith("read")
    src_kind, dst_kind = kinds.split()[-1].split("->")
    src = gpu_mem(n) if src_kind == "cuda" else np.zeros(n, np.uint8)
    dst = gpu_mem(n) if dst_kind == "cuda" else np.zeros(n, np.uint8)
    (src.host if src_kind == "cuda" else src)[:] = want
    copies = STANDIN.kvfstandin_count(b"copies")
    if read:            # a reads from b's src into its own dst
        b.register(src, name="src")
        rd = a.register(dst, name="dst")
        peer = await bounded(a.connect(b.address))
        await bounded(peer.read([rd.addr], [peer.region("src").addr], [n]))
    else:               # a writes its src into b's dst
        rs = a.register(src, name="src")
        b.register(dst, name="dst")
        peer = await bounded(a.connect(b.address))
        offs = np.arange(64, dtype=np.uint64) * np.uint64(65536)
        await bounded(peer.write(rs.addr + offs, peer.region("dst").addr + offs, np.full(64, 65536, np.uint64)))
        await bounded(peer.write([rs.addr + (4 << 20)], [peer.region("dst").addr + (4 << 20)], [2 << 20]))
    got = dst.host if dst_kind == "cuda" else dst
    assert _sha(got) == _sha(want)
    assert STANDIN.kvfstandin_count(b"copies") > copies          # the driver made the copies


@pytest.mark.parametrize("protocol", ["tcp", "local"])
async def test_gpu_memory_moves_between_two_gpus(gpu_mem, make_engine, protocol):
    """A write from cuda:1 into a peer's cuda:0 and a read back into cuda:1
    from there: each engine's copies in its own GPU's context."""
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    n = 3 << 20
    src, mid, back = gpu_mem(n, device=1), gpu_mem(n, device=0), gpu_mem(n, device=1)
    src.host[:] = _pattern(n, 9)
    rs, rb = a.register(src, name="src"), a.register(back, name="back")
    b.register(mid, name="mid")
    peer = await bounded(a.connect(b.address))
    offs = np.arange(3, dtype=np.uint64) * np.uint64(1 << 20)
    await bounded(peer.write(rs.addr + offs, peer.region("mid").addr + offs, np.full(3, 1 << 20, np.uint64)))
    assert _sha(mid.host) == _sha(src.host)
    await bounded(peer.read([rb.addr], [peer.region("mid").addr], [n]))
    assert _sha(back.host) == _sha(src.host)


_IPC_PEER = r"""
import asyncio, hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/..']
import kvflow, numpy as np
from cases import DeviceArray
async def main():
    async with kvflow.Engine("127.0.0.1:0", protocols=("local",)) as eng:
        whole = DeviceArray(8 << 20)
        eng.register((whole.ptr, 4 << 20), name="lo")                    # two regions of one allocation
        eng.register((whole.ptr + (4 << 20), 4 << 20), name="hi")
        whole.host[:] = np.random.default_rng(7).integers(0, 256, 8 << 20, dtype=np.uint8)
        mem = np.zeros(1 << 20, np.uint8)
        eng.register(mem, name="h")
        print(json.dumps({"address": eng.address}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line in ("", "quit"):
                break
            print(json.dumps({"sha": hashlib.sha256(whole.host.tobytes()).hexdigest(),
                              "host": hashlib.sha256(mem.tobytes()).hexdigest(),
                              "guards": whole.guards_ok()}), flush=True)
        whole.close()
asyncio.run(main())
"""


async def test_cuda_ipc_between_processes(gpu_mem, make_engine):
    """A same-host peer in another process (local provider): writes into
    and reads from its GPU memory are one copy each through CUDA IPC (its
    allocation opened here, not staged), into two regions of one
    allocation and from two engines of this process; its host memory
    staged; every byte checked on both sides; the mappings close with the
    peers."""
    proc = subprocess.Popen([sys.executable, "-c", _IPC_PEER, os.path.dirname(os.path.abspath(__file__))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    loop = asyncio.get_running_loop()

    async def ask(line: str) -> dict:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return json.loads(await bounded(loop.run_in_executor(None, proc.stdout.readline), 60))

    try:
        hello = json.loads(await bounded(loop.run_in_executor(None, proc.stdout.readline), 60))
        theirs = _pattern(8 << 20, 7)
        a = await make_engine(protocols=["local"])
        b = await make_engine(protocols=["local"])
        src = gpu_mem(8 << 20)
        src.host[:] = _pattern(8 << 20, 3)
        back = gpu_mem(8 << 20)
        ra, rb = a.register(src, name="src"), b.register(back, name="back")
        opens = STANDIN.kvfstandin_count(b"ipc_opens")
        staged = STANDIN.kvfstandin_count(b"pinned")
        pa = await bounded(a.connect(hello["address"]))
        pb = await bounded(b.connect(hello["address"]))
        lo, hi = pa.region("lo").addr, pa.region("hi").addr
        # a writes the low half into "lo", the high half into "hi"
        await bounded(pa.write([ra.addr, ra.addr + (4 << 20)], [lo, hi], [4 << 20, 4 << 20]))
        assert (await ask("sha"))["sha"] == _sha(src.host)
        # b reads it all back through its own mapping
        await bounded(pb.read([rb.addr, rb.addr + (4 << 20)], [lo, hi], [4 << 20, 4 << 20]))
        assert _sha(back.host) == _sha(src.host)
        assert STANDIN.kvfstandin_count(b"ipc_opens") > opens            # the direct path, not staged
        assert STANDIN.kvfstandin_count(b"pinned") == staged             # no staging memory was made yet
        assert (await ask("sha"))["guards"]
        # into its host memory: no IPC there, so staged through its inbox over the local provider
        await bounded(pa.write([ra.addr + 12345], [pa.region("h").addr], [1 << 20]))
        assert (await ask("sha"))["host"] == _sha(src.host[12345:12345 + (1 << 20)])
        await pa.close()
        await pb.close()
        assert STANDIN.kvfstandin_count(b"ipc") == 0, "an IPC mapping outlived its peer"
        del theirs
    finally:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(30)


@pytest.mark.parametrize("after_kind", ["event", "stream"])
async def test_after_waits_for_the_users_stream(gpu_mem, make_engine, after_kind):
    """write(after=): the batch starts once the user's stream has run what
    it queued before (here a 300 ms pause, then the copy that writes the
    source), so the new bytes are sent, not the old ones."""
    from cuda.bindings import driver as cu
    drv = _drv()
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    n = 1 << 20
    src = gpu_mem(n)
    src.host[:] = 1                                     # old bytes
    new = _pattern(n, 11)
    dst = np.zeros(n, np.uint8)
    rs = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = await bounded(a.connect(b.address))
    with drv.on_device(0):
        stream = _ok(cu.cuStreamCreate(1))
        assert STANDIN.kvfstandin_delay(ctypes.c_void_p(int(stream)), 300_000) == 0
        _ok(cu.cuMemcpyHtoDAsync(src.ptr, new.ctypes.data, n, stream))
        event = _ok(cu.cuEventCreate(0))
        _ok(cu.cuEventRecord(event, stream))
    try:
        await bounded(peer.write([rs.addr], [peer.region("dst").addr], [n],
                                 after=event if after_kind == "event" else stream))
        assert _sha(dst) == _sha(new)
    finally:
        with drv.on_device(0):
            _ok(cu.cuStreamSynchronize(stream))
            _ok(cu.cuEventDestroy(event))
            _ok(cu.cuStreamDestroy(stream))


_GPU_MEMBER = """
import asyncio, sys, kvflow
async def main():
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                             relay=kvflow.RelayGroup("node0", 1, 1, directory=sys.argv[1], device=0)) as eng:
        print(eng.address, eng.relay_stats()["device_lanes"], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


@pytest.mark.parametrize("member_in", ["this process", "its own process"])
@pytest.mark.parametrize("dst_kind", ["host", "cuda"])
async def test_gpu_batches_relay_through_device_lanes(gpu_mem, make_engine, tmp_path, member_in, dst_kind):
    """A write from GPU memory to a destination on another rail goes
    through the member on that rail by its device lanes: each slot copied
    GPU to GPU (CUDA IPC when the member is another process), its doorbell
    written by the sender's stream (cuStreamWriteValue64) and its bell rung
    by a host function; every byte lands, and the sender's counters say
    every byte took the device lanes."""
    d = str(tmp_path)
    member = None
    if member_in == "this process":
        m = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node0", 1, 1, directory=d, device=0))
        assert m.relay_stats()["device_lanes"] == 1
    else:
        member = subprocess.Popen([sys.executable, "-c", _GPU_MEMBER, d], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        if member is not None:
            line = await bounded(asyncio.get_running_loop().run_in_executor(None, member.stdout.readline), 60)
            assert line.split()[1:] == ["1"], f"the member process said {line!r}"
        sender = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node0", 0, 0, directory=d))
        dest = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node1", 1, 1, directory=d))
        n = 24 << 20
        want = _pattern(n, 5)
        src = gpu_mem(n)
        src.host[:] = want
        pool = gpu_mem(n) if dst_kind == "cuda" else np.zeros(n, np.uint8)
        s = sender.register(src, name="src")
        dest.register(pool, name="kv")
        peer = await bounded(sender.connect(dest.address))
        dst = peer.region("kv").addr
        offs = np.arange(24, dtype=np.uint64) * np.uint64(1 << 20)
        hostfns = STANDIN.kvfstandin_count(b"hostfns")
        await bounded(peer.write(s.addr + offs, dst + offs, np.full(24, 1 << 20, np.uint64)), 120)
        assert _sha(pool.host if dst_kind == "cuda" else pool) == _sha(want)
        stats = sender.relay_stats()
        assert stats["device_lane_bytes"] == n and stats["relayed_bytes"] == n and stats["rerouted_bytes"] == 0
        assert STANDIN.kvfstandin_count(b"hostfns") > hostfns        # the bells
        await sender.close()        # its mapping of the member's device lanes closes before they are freed
    finally:
        if member is not None:
            member.stdin.close()
            member.wait(30)


async def _until_done(event) -> None:
    while not event.done():
        await asyncio.sleep(1e-3)


async def test_a_kernel_puts_its_layer_through_the_proxy(gpu_mem, make_engine):
    """GPU-initiated puts, proxy mode, the host side: kvf_layer_put (the
    stand-in's C reading of it, running putring.cuh's kvf_put and
    kvf_put_wait on the stream's thread) puts each block's rows from device
    memory through the ring in mapped pinned memory; the PutProxy posts
    them as writes from GPU memory to a tcp peer; every row lands equal to
    the host's product and every status is 0."""
    from kvflow._cuda import kernels
    from kvflow.gpu.proxy import PutProxy, PutRing, ring_bytes
    drv = _drv()
    rows, din, dout, rpb = 256, 16, 64, 16
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    rng = np.random.default_rng(0)
    x_h = rng.standard_normal((rows, din)).astype(np.float32)
    w_h = rng.standard_normal((din, dout)).astype(np.float32)
    x, w, kv = gpu_mem(x_h.nbytes), gpu_mem(w_h.nbytes), gpu_mem(rows * dout * 4)
    x.host[:] = x_h.view(np.uint8).ravel()
    w.host[:] = w_h.view(np.uint8).ravel()
    blocks = rows // rpb
    out = gpu_mem(16 * blocks)
    a.register(kv, name="kv")
    dst = np.zeros(rows * dout, np.float32)
    b.register(dst, name="kv")
    peer = await bounded(a.connect(b.address))
    stream, event = drv.Stream(0), drv.Event(0)
    pinned = drv.PinnedHost(ring_bytes(blocks, 4), mapped=True)
    try:
        with PutProxy(PutRing(blocks, 4, addr=pinned.addr, size=pinned.size), [peer]) as proxy:
            n = kernels.layer_put(stream, x.ptr, w.ptr, kv.ptr, rows, din, dout, rpb, pinned.device_addr, 0,
                                  peer.region("kv").addr, out.ptr)
            event.record(stream)
            await bounded(_until_done(event), 60)
            stats = proxy.stats()
        assert n == blocks and stats["finished"] == blocks and stats["failed"] == 0, stats
        res = out.host.view(np.int64).reshape(blocks, 2)
        assert set(res[:, 0].tolist()) == {0}
        assert np.allclose(dst, (x_h.astype(np.float64) @ w_h).astype(np.float32).ravel(), rtol=1e-4, atol=1e-4)
    finally:
        pinned.close()
        event.close()
        stream.close()


def test_kernels_flag_write_and_doorbells(gpu_mem):
    """kvf_flag_write and kvf_doorbells, behind the work on their stream:
    a flag in mapped pinned memory, doorbells from values in device memory."""
    from kvflow._cuda import kernels
    drv = _drv()
    pinned = drv.PinnedHost(4096, mapped=True)
    stream = drv.Stream(0)
    vals = gpu_mem(64)
    try:
        words = np.ctypeslib.as_array((ctypes.c_uint64 * 512).from_address(pinned.addr))
        words[:] = 0
        vals.host[:] = np.arange(1, 9, dtype=np.uint64).view(np.uint8)
        kernels.flag_write(stream, pinned.device_addr + 8, 0xC0FFEE)
        kernels.doorbells(stream, pinned.device_addr + 64, vals.ptr, 8)
        with drv.on_device(0):
            drv.check(drv.driver().cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
        assert int(words[1]) == 0xC0FFEE and int(words[0]) == 0
        assert words[8:16].tolist() == list(range(1, 9)) and int(words[16]) == 0
    finally:
        stream.close()
        pinned.close()


_RESTARTING_PEER = r"""
import asyncio, hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/..']
import kvflow
from cases import DeviceArray
async def main():
    async with kvflow.Engine(sys.argv[2], protocols=("local",)) as eng:
        kv = DeviceArray(4 << 20)
        r = eng.register(kv, name="kv")
        print(json.dumps({"address": eng.address, "kv": r.addr}), flush=True)
        loop = asyncio.get_running_loop()
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "sha":
            print(json.dumps({"sha": hashlib.sha256(kv.host.tobytes()).hexdigest()}), flush=True)
asyncio.run(main())
"""


async def test_a_restarted_peer_gets_the_write_not_its_predecessor(gpu_mem, make_engine):
    """A same-host peer killed and restarted at the same address, its GPU
    region at the same device address (a GPU's allocator hands the same
    addresses to the same sequence of allocations; so does the stand-in):
    a write to the new one lands in the new one's memory, not through the
    CUDA IPC mapping of its predecessor's allocation."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.get_running_loop()
    here = os.path.dirname(os.path.abspath(__file__))

    async def start():
        p = subprocess.Popen([sys.executable, "-c", _RESTARTING_PEER, here, f"127.0.0.1:{port}"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        return p, json.loads(await bounded(loop.run_in_executor(None, p.stdout.readline), 60))

    async def sha(p) -> str:
        p.stdin.write("sha\n")
        p.stdin.flush()
        return json.loads(await bounded(loop.run_in_executor(None, p.stdout.readline), 60))["sha"]

    a = await make_engine(protocols=["local"])
    src = gpu_mem(4 << 20)
    rs = a.register(src, name="src")
    first, hello = await start()
    second = None
    try:
        src.host[:] = _pattern(4 << 20, 21)
        peer = await bounded(a.connect(hello["address"]))
        await bounded(peer.write([rs.addr], [peer.region("kv").addr], [4 << 20]))
        assert await sha(first) == _sha(src.host)
        first.kill()
        first.wait(30)
        second, hello2 = await start()
        assert (hello2["address"], hello2["kv"]) == (hello["address"], hello["kv"]), "the premise: the same address"
        src.host[:] = _pattern(4 << 20, 22)
        peer2 = await bounded(a.connect(hello2["address"]))
        await bounded(peer2.write([rs.addr], [peer2.region("kv").addr], [4 << 20]))
        assert await sha(second) == _sha(src.host), "the write went to the predecessor's memory"
        await peer2.close()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.stdin.close()
                p.wait(30)


def test_nixl_api_moves_vram(gpu_mem):
    """kvflow.compat.nixl with VRAM descriptor lists of device pointers (as
    vLLM's NixlConnector registers its KV caches): a write of 64 blocks and
    a read back, every byte."""
    import time
    import uuid
    from kvflow.compat.nixl import nixl_agent, nixl_agent_config
    n = 4 << 20
    a = nixl_agent(f"a-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent(f"b-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    src, dst, back = gpu_mem(n), gpu_mem(n), gpu_mem(n)
    src.host[:] = _pattern(n, 13)
    assert a.register_memory([(src.ptr, n, 0, ""), (back.ptr, n, 0, "")], "VRAM") is not None
    assert b.register_memory([(dst.ptr, n, 0, "")], "VRAM") is not None
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())

    def run(op: str, local: int) -> None:
        descs = a.get_xfer_descs([(local + i * 65536, 65536, 0) for i in range(64)], "VRAM")
        remote = a.get_xfer_descs([(dst.ptr + i * 65536, 65536, 0) for i in range(64)], "VRAM")
        h = a.initialize_xfer(op, descs, remote, b.name, b"done")
        a.transfer(h)
        deadline = time.monotonic() + 60
        while a.check_xfer_state(h) == "PROC":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert a.check_xfer_state(h) == "DONE"
        a.release_xfer_handle(h)

    run("WRITE", src.ptr)
    assert _sha(dst.host) == _sha(src.host)
    run("READ", back.ptr)
    assert _sha(back.host) == _sha(src.host)
    a.remove_remote_agent(b.name)
    b.remove_remote_agent(a.name)
    del a, b
    import gc
    gc.collect()


def test_mooncake_api_registers_cuda_memory(gpu_mem):
    """kvflow.compat.mooncake: register_memory(ptr, len, "cuda:0") of device
    memory on both sides (as SGLang's and vLLM's Mooncake connectors pass
    their KV pools), then transfer_sync_write and _read, every byte."""
    from kvflow.compat.mooncake import TransferEngine
    n = 2 << 20
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst, back = gpu_mem(n), gpu_mem(n), gpu_mem(n)
    src.host[:] = _pattern(n, 17)
    assert a.register_memory(src.ptr, n, "cuda:0") == 0 and a.register_memory(back.ptr, n, "cuda:0") == 0
    assert b.register_memory(dst.ptr, n, "cuda:0") == 0
    peer = f"127.0.0.1:{b.get_rpc_port()}"
    assert a.transfer_sync_write(peer, src.ptr, dst.ptr, n) == 0
    assert _sha(dst.host) == _sha(src.host)
    assert a.transfer_sync_read(peer, back.ptr, dst.ptr, n) == 0
    assert _sha(back.host) == _sha(src.host)
    for eng, ptrs in ((a, (src.ptr, back.ptr)), (b, (dst.ptr,))):
        for p in ptrs:
            assert eng.unregister_memory(p) == 0
    for eng in (a, b):
        close = getattr(eng, "close", None) or getattr(eng, "shutdown", None)
        if close is not None:
            close()


@pytest.mark.parametrize("into", ["host", "cuda"])
async def test_a_timed_out_gpu_write_leaves_nothing_behind(gpu_mem, make_engine, into):
    """A staged write from GPU memory that times out while its device→host
    copies are slow (200 ms each here): TransferTimeoutError, and nothing of
    it lands later over the write that follows (which lands whole); the
    engines and the peer still work."""
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    n = 8 << 20
    src = gpu_mem(n)
    dst = gpu_mem(n) if into == "cuda" else np.zeros(n, np.uint8)
    rs = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = await bounded(a.connect(b.address))
    there = peer.region("dst").addr
    src.host[:] = 1
    STANDIN.kvfstandin_copy_delay(200_000)
    try:
        with pytest.raises(kvflow.TransferTimeoutError):
            await bounded(peer.write([rs.addr], [there], [n], timeout=0.1))
    finally:
        STANDIN.kvfstandin_copy_delay(0)
    src.host[:] = _pattern(n, 23)
    await bounded(peer.write([rs.addr], [there], [n]))
    await asyncio.sleep(0.6)                    # longer than any copy of the first write still running
    assert _sha(dst.host if into == "cuda" else dst) == _sha(src.host)
    # every staging slot back on both sides, every lease of b's inbox given back
    from kvflow._testing import staging_leaks
    assert a.metrics()["staging"]["outgoing"]["allocations"] == 1       # it was staged, through pinned slots
    assert staging_leaks(a.staging_stats()) == {} and staging_leaks(b.staging_stats()) == {}


async def test_after_is_bounded_by_the_timeout(gpu_mem, make_engine):
    """write(timeout=, after=) whose stream is not done within the timeout
    raises TransferTimeoutError in about that time, sends nothing, and the
    next write (after the stream finished) lands whole."""
    import time
    from cuda.bindings import driver as cu
    drv = _drv()
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    n = 1 << 20
    src = gpu_mem(n)
    src.host[:] = 3
    dst = np.zeros(n, np.uint8)
    rs = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = await bounded(a.connect(b.address))
    with drv.on_device(0):
        stream = _ok(cu.cuStreamCreate(1))
        assert STANDIN.kvfstandin_delay(ctypes.c_void_p(int(stream)), 1_500_000) == 0
    try:
        t0 = time.monotonic()
        with pytest.raises(kvflow.TransferTimeoutError):
            await bounded(peer.write([rs.addr], [peer.region("dst").addr], [n], timeout=0.2, after=stream))
        assert time.monotonic() - t0 < 1.0, "the wait for after= outlived the write's timeout"
        assert not dst.any()
        with drv.on_device(0):
            _ok(cu.cuStreamSynchronize(stream))
        await bounded(peer.write([rs.addr], [peer.region("dst").addr], [n], timeout=5, after=stream))
        assert (dst == 3).all()
    finally:
        with drv.on_device(0):
            _ok(cu.cuStreamSynchronize(stream))
            _ok(cu.cuStreamDestroy(stream))


async def test_a_stuck_after_does_not_hold_up_the_next(gpu_mem, make_engine):
    """A write whose after= stream is stuck times out; a later write whose
    after= stream finishes in 50 ms is not held up behind the stuck one."""
    import time
    from cuda.bindings import driver as cu
    drv = _drv()
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    n = 1 << 16
    src = gpu_mem(n)
    src.host[:] = 4
    dst = np.zeros(n, np.uint8)
    rs = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = await bounded(a.connect(b.address))
    there = peer.region("dst").addr
    with drv.on_device(0):
        stuck, quick = _ok(cu.cuStreamCreate(1)), _ok(cu.cuStreamCreate(1))
        assert STANDIN.kvfstandin_delay(ctypes.c_void_p(int(stuck)), 4_000_000) == 0
    try:
        with pytest.raises(kvflow.TransferTimeoutError):
            await bounded(peer.write([rs.addr], [there], [n], timeout=0.1, after=stuck))
        with drv.on_device(0):
            assert STANDIN.kvfstandin_delay(ctypes.c_void_p(int(quick)), 50_000) == 0
        t0 = time.monotonic()
        await bounded(peer.write([rs.addr], [there], [n], timeout=2, after=quick))
        assert time.monotonic() - t0 < 1.5 and (dst == 4).all()
    finally:
        with drv.on_device(0):
            for s in (stuck, quick):
                _ok(cu.cuStreamSynchronize(s))
                _ok(cu.cuStreamDestroy(s))
