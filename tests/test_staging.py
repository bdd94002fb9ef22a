"""The staging pipeline that carries GPU memory over the host providers
(kvflow.paths.slots, kvflow.paths.staged), driven with host
memory: the pipeline is written once against a copy engine, and
HostCopyEngine is one (memmove on a worker thread) as CudaCopyEngine is
another. Real engines, real tcp and local providers, the real control
sessions for the inbox leases; what stands in for GPU memory is host
memory entered in an engine's GPU table (host_gpu below), so every byte
the stage moves can be checked here. tests/test_cuda.py runs the same
paths on a GPU where there is one."""
from __future__ import annotations

import asyncio
import time
import hashlib

import numpy as np
import pytest

import kvflow
from kvflow._testing import settled
from kvflow.gpu.copy import HostCopyEngine
from kvflow.memory import Access, Region
from kvflow.paths.base import PathContext
from kvflow.paths.slots import BouncePool, pack, run_staged
from kvflow.paths.staged import GpuMemory

from _batches import bounded

SLOT = 256 << 10


def _numpy_memory(nbytes: int):
    buf = np.zeros(nbytes, np.uint8)
    return buf.ctypes.data, buf


def host_gpu(engine: kvflow.Engine, staging_bytes: int = 4 * SLOT) -> GpuMemory:
    """Gives `engine` GPU memory whose copies are host copies and whose
    staging memory is plain host memory: the staged paths, driven with
    host memory."""
    ctx = PathContext(
        register_host=lambda a, n, nm, access=Access.READ | Access.WRITE:
            engine._register_host(a, n, nm, access, True, None),
        deregister=engine.deregister, holds_host=engine._holds_host,
        copier=lambda device: HostCopyEngine(), allocate=_numpy_memory)
    engine._gpu = GpuMemory(ctx, staging_bytes=staging_bytes, slot_bytes=SLOT)
    return engine._gpu


def gpu_region(engine: kvflow.Engine, arr: np.ndarray, name: str, access=Access.READ | Access.WRITE,
               device: int = 0) -> Region:
    """Enters `arr` in the engine's GPU table as device memory of `device`."""
    engine._gpu_ids -= 1
    region = Region(arr.ctypes.data, arr.nbytes, name, access, engine._gpu_ids, arr, kind="cuda", device=device)
    assert engine._gpu.local.add(region)
    engine._regions[region.id] = region
    engine._regions_changed()
    return region


def staging(engine: kvflow.Engine, pool: str) -> dict:
    """One staging pool's public figures (engine.metrics()["staging"])."""
    figures = engine.metrics()["staging"][pool]
    assert figures is not None, f"{engine.address} has no {pool} pool"
    assert figures["free"] + figures["in_use"] == figures["slots"], figures
    return figures


def inbox_idle(engine: kvflow.Engine) -> bool:
    """Every inbox slot back and no lease held."""
    s = staging(engine, "inbox")
    return s["free"] == s["slots"] and s["leases"] == 0


def sha(a) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a))).hexdigest()


# ---------------------------------------------------------------- the pipeline alone


def test_pack_shares_and_cuts_slots():
    parts = pack([0x1000, 0x9000, 0x20000], [0x100000, 0x200000, 0x300000], [100, 200, 3 * 1000], 1000)
    assert [p.nbytes for p in parts] == [1000, 1000, 1000, 300]
    assert parts[0].entries == [(0, 0x1000, 0x100000, 100), (100, 0x9000, 0x200000, 200),
                                (300, 0x20000, 0x300000, 700)]
    assert parts[1].entries == [(0, 0x20000 + 700, 0x300000 + 700, 1000)]
    assert parts[3].entries == [(0, 0x20000 + 2700, 0x300000 + 2700, 300)]
    with pytest.raises(kvflow.InvalidArgumentError):
        pack([1], [2], [0], 1000)
    with pytest.raises(kvflow.InvalidArgumentError):
        pack([1, 2], [3], [4], 1000)


async def test_pipeline_bounded_allocated_once_and_overlapped():
    """Slot k+1 fills while slot k drains; never more slots in use than the
    pool has; its memory is allocated once for every run."""
    allocations = []

    def allocate(n):
        allocations.append(n)
        return _numpy_memory(n)

    pool = BouncePool(1000, 3, allocate)
    pool.stats.keep_events = True
    in_drain = 0
    most = 0

    async def fill(slot, part):
        await asyncio.sleep(0.001)

    async def drain(slot, part):
        nonlocal in_drain, most
        in_drain += 1
        most = max(most, in_drain)
        await asyncio.sleep(0.01)
        in_drain -= 1

    parts = pack(list(range(0, 20000, 1000)), list(range(0, 20000, 1000)), [1000] * 20, 1000)
    for _ in range(2):
        await bounded(run_staged(pool, parts, fill, drain))
    assert len(allocations) == 1 and allocations[0] == 3000
    assert pool.stats.max_in_use == 3 and pool.stats.slots_in_use == 0 and pool.free == 3
    assert most >= 2, "drains never overlapped the next fill"
    ev = pool.stats.events
    # a fill started while an earlier slot had not drained yet
    first_drain = ev.index(next(e for e in ev if e[0] == "drained"))
    assert sum(1 for e in ev[:first_drain] if e[0] == "fill") >= 2
    assert pool.stats.fills == pool.stats.drains == 40


async def test_pipeline_error_returns_every_slot():
    pool = BouncePool(1000, 2, _numpy_memory)
    calls = 0

    async def fill(slot, part):
        pass

    async def drain(slot, part):
        nonlocal calls
        calls += 1
        me = calls          # this drain's number: `calls` moves on while it sleeps (under load, past 3)
        await asyncio.sleep(0.001 * me)
        if me == 3:
            raise kvflow.PeerLostError("gone")

    parts = pack([0] * 10, [0] * 10, [1000] * 10, 1000)
    with pytest.raises(kvflow.PeerLostError):
        await bounded(run_staged(pool, parts, fill, drain))
    assert pool.free == 2 and pool.stats.slots_in_use == 0
    # the pool is usable after the error
    await bounded(run_staged(pool, parts[:2], fill, lambda s, p: asyncio.sleep(0)))


async def test_a_drain_cancelled_before_it_started_returns_its_slot():
    """A fill that fails at once, right after the previous slot's drain
    task was made (it has not run a step yet): that task is cancelled
    before it starts, and its slot comes back all the same. (A cancelled
    staged write hit the same window: tests/test_staging.py's
    test_staged_nowait_strided_blocking_and_posted failed 1-2 times in 20
    with a slot missing.)"""
    pool = BouncePool(1000, 2, _numpy_memory)
    drained = []

    async def fill(slot, part):
        if part is parts[1]:
            raise kvflow.ProviderUnavailableError("copy failed")   # before any await: no step between

    async def drain(slot, part):
        drained.append(part)
        await asyncio.sleep(0.01)

    parts = pack([0] * 2, [0] * 2, [1000] * 2, 1000)
    with pytest.raises(kvflow.ProviderUnavailableError):
        await bounded(run_staged(pool, parts, fill, drain))
    assert not drained                          # the first drain never started
    assert pool.free == 2 and pool.stats.slots_in_use == 0
    await bounded(run_staged(pool, parts, lambda s, p: asyncio.sleep(0), drain))
    assert pool.free == 2 and len(drained) == 2


async def test_slots_come_back_when_the_cleanup_itself_is_cancelled():
    """A fill fails at once; the cleanup then waits for a drain that was
    already on the wire (it waits for its bytes when cancelled, as a
    Transfer does), and the caller cancels that wait too. The slot of the
    drain that never started comes back all the same, and the others as
    their drains end."""
    pool = BouncePool(1000, 3, _numpy_memory)

    async def fill(slot, part):
        if part is parts[1]:
            await asyncio.sleep(0)              # drain 0 starts here
        if part is parts[2]:
            raise kvflow.ProviderUnavailableError("copy failed")   # drain 1 has not started

    async def drain(slot, part):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)            # what is on the wire is waited for
            raise

    parts = pack([0] * 3, [0] * 3, [1000] * 3, 1000)
    task = asyncio.get_running_loop().create_task(run_staged(pool, parts, fill, drain))
    await asyncio.sleep(0.02)                   # in the cleanup's wait for drain 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.free == 2                       # fill 2's slot and drain 1's; drain 0 still waits
    deadline = time.monotonic() + 5
    while pool.free < 3:
        assert time.monotonic() < deadline, pool.free
        await asyncio.sleep(0.01)
    assert pool.stats.slots_in_use == 0


# ---------------------------------------------------------------- staged transfers between engines


@pytest.fixture(params=["tcp", "local"])
def protocols(request):
    """tcp: staged; local (the peer in this process): a direct copy."""
    return [request.param]


async def _pair(make_engine, protocols):
    a = await make_engine(protocols=protocols)
    b = await make_engine(protocols=protocols)
    host_gpu(a)
    host_gpu(b)
    peer = await bounded(a.connect(b.address))
    return a, b, peer


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_write_from_gpu_memory_to_host(make_engine, protocols):
    a, b, peer = await _pair(make_engine, protocols)
    src = _pattern(3 * SLOT + 12345, 1)
    gpu_region(a, src, "kv")
    dst = np.zeros(4 << 20, np.uint8)
    d = b.register(dst, name="pool")
    # many small entries and one that spans several slots
    offs = np.arange(0, 64 * 4096, 4096, dtype=np.uint64)
    await bounded(peer.write(src.ctypes.data + offs, d.addr + 2 * offs, np.full(64, 4096, np.uint64)))
    for i in range(64):
        assert sha(dst[2 * i * 4096: 2 * i * 4096 + 4096]) == sha(src[i * 4096: (i + 1) * 4096])
    big = src.nbytes - 300000
    await bounded(peer.write([src.ctypes.data + 300000], [d.addr + (2 << 20)], [big]))
    assert sha(dst[2 << 20: (2 << 20) + big]) == sha(src[300000:])
    out = staging(a, "outgoing")
    if protocols == ["tcp"]:
        assert out["allocations"] == 1 and 2 <= out["max_in_use"] <= out["slots"]
        assert out["fills"] == out["drains"] > 0 and out["free"] == out["slots"]
    else:                   # the peer is in this process: one direct copy, nothing staged
        assert out["allocations"] == 0 and out["fills"] == 0 and out["max_in_use"] == 0


async def test_write_into_gpu_memory(make_engine, protocols):
    """Host → peer's GPU memory and GPU → peer's GPU memory: the peer lends
    inbox slots and lands each one; the write returns after the last landed,
    so a notification after it finds the data there."""
    a, b, peer = await _pair(make_engine, protocols)
    pool = np.zeros(2 << 20, np.uint8)
    gpu_region(b, pool, "kv_pool")
    await bounded(peer.refresh())
    r = peer.region("kv_pool")
    assert (r.kind, r.device) == ("cuda", 0)
    host_src = _pattern(SLOT * 2 + 777, 2)
    hs = a.register(host_src)
    await bounded(peer.write([hs.addr], [r.addr], [host_src.nbytes]))
    assert sha(pool[:host_src.nbytes]) == sha(host_src)

    gsrc = _pattern(5 * SLOT + 5, 3)
    gpu_region(a, gsrc, "kv")
    offs = np.arange(0, 16, dtype=np.uint64) * np.uint64(65536)
    await bounded(peer.write(gsrc.ctypes.data + offs, r.addr + (1 << 20) + offs, np.full(16, 65536, np.uint64)))
    await bounded(peer.notify(b"landed"))
    sender, msg = await bounded(b.notifications().__anext__())
    assert msg == b"landed"
    assert sha(pool[1 << 20: (1 << 20) + 16 * 65536]) == sha(gsrc[:16 * 65536])
    # every inbox slot came back once the writes were done
    await asyncio.sleep(0.05)
    assert inbox_idle(b)


async def test_read_into_gpu_memory(make_engine, protocols):
    a, b, peer = await _pair(make_engine, protocols)
    remote = _pattern(3 * SLOT + 99, 4)
    b.register(remote, name="src")
    await bounded(peer.refresh())
    local = np.zeros(remote.nbytes, np.uint8)
    gpu_region(a, local, "kv")
    await bounded(peer.read([local.ctypes.data], [peer.region("src").addr], [remote.nbytes]))
    assert sha(local) == sha(remote)


async def test_read_from_gpu_memory(make_engine, protocols):
    """From the peer's GPU memory into host memory and into GPU memory:
    the peer fills leased inbox slots (stage_fetch) that are read back; a
    GPU region without READ access is refused."""
    a, b, peer = await _pair(make_engine, protocols)
    remote = _pattern(3 * SLOT + 4321, 7)
    gpu_region(b, remote, "kv")
    gpu_region(b, np.zeros(4096, np.uint8), "wo", access=Access.WRITE)
    await bounded(peer.refresh())
    r = peer.region("kv").addr
    host = np.zeros(remote.nbytes, np.uint8)
    h = a.register(host)
    offs = np.arange(32, dtype=np.uint64) * np.uint64(8192)
    await bounded(peer.read(h.addr + offs, r + offs, np.full(32, 8192, np.uint64)))
    assert sha(host[:32 * 8192]) == sha(remote[:32 * 8192])
    local_gpu = np.zeros(remote.nbytes, np.uint8)
    gpu_region(a, local_gpu, "mine")
    await bounded(peer.read([local_gpu.ctypes.data], [r], [remote.nbytes]))
    assert sha(local_gpu) == sha(remote)
    with pytest.raises(kvflow.RemoteAccessError):
        await bounded(peer.read([h.addr], [peer.region("wo").addr], [4096]))
    await asyncio.sleep(0.05)
    assert inbox_idle(b)


async def test_staged_bad_input_loses_nothing(make_engine, protocols):
    """A destination outside the peer's GPU regions, or in one it may not
    write, is refused before a byte moves; a forged stage_land naming
    memory outside every GPU region is refused by the target; both engines
    stay usable."""
    a, b, peer = await _pair(make_engine, protocols)
    pool = np.zeros(1 << 20, np.uint8)
    ro = np.zeros(1 << 16, np.uint8)
    gpu_region(b, pool, "kv_pool")
    gpu_region(b, ro, "ro", access=Access.READ)
    await bounded(peer.refresh())
    src = _pattern(1 << 16, 5)
    s = a.register(src)
    with pytest.raises(kvflow.RemoteAccessError):
        await bounded(peer.write([s.addr], [peer.region("ro").addr], [4096]))
    with pytest.raises(kvflow.RemoteAccessError):     # runs past the region's end
        await bounded(peer.write([s.addr], [peer.region("kv_pool").addr + (1 << 20) - 100], [4096]))
    assert not pool.any() and not ro.any()
    # a forged landing: a real lease, then a destination in host memory
    lease = await bounded(peer.link.request({"t": "stage_lease", "inbox": "gpu", "slots": 1}))
    assert lease["t"] == "stage_leased"
    victim = np.zeros(4096, np.uint8)
    b.register(victim, name="victim")
    bad = await bounded(peer.link.request({"t": "stage_land", "inbox": "gpu", "lease": lease["lease"], "slot": lease["slots"][0],
                                           "entries": [[0, victim.ctypes.data, 4096]]}))
    assert bad["t"] == "stage_error" and "not inside a GPU region" in bad["message"]
    bad = await bounded(peer.link.request({"t": "stage_land", "inbox": "gpu", "lease": lease["lease"], "slot": lease["slots"][0] + 8,
                                           "entries": [[0, pool.ctypes.data, 16]]}))
    assert bad["t"] == "stage_error" and "not a slot of this lease" in bad["message"]
    bad = await bounded(peer.link.request({"t": "stage_land", "inbox": "gpu", "lease": lease["lease"], "slot": lease["slots"][0],
                                           "entries": [[SLOT - 8, pool.ctypes.data, 16]]}))
    assert bad["t"] == "stage_error" and "outside the slot" in bad["message"]
    peer.link.send({"t": "stage_release", "inbox": "gpu", "lease": lease["lease"]})
    assert not victim.any() and not pool.any()
    await bounded(peer.write([s.addr], [peer.region("kv_pool").addr], [src.nbytes]))
    assert sha(pool[:src.nbytes]) == sha(src)


async def test_dropped_session_returns_its_inbox_slots(make_engine):
    a, b, peer = await _pair(make_engine, ["tcp"])
    gpu_region(b, np.zeros(1 << 16, np.uint8), "kv_pool")
    lease = await bounded(peer.link.request({"t": "stage_lease", "inbox": "gpu", "slots": 4}))
    assert lease["t"] == "stage_leased"
    lent = staging(b, "inbox")
    assert len(lease["slots"]) == lent["in_use"] == lent["max_in_use"] and lent["leases"] == 1
    # kvflow._testing's balance check sees the lent slots (engine_pair would report them)
    assert await settled(b, 0.05) == {"inbox.in_use": len(lease["slots"]), "inbox.leases": 1}
    await bounded(peer.close())
    assert await settled(b) == {} and inbox_idle(b)         # the session's lease ended with it


async def test_staging_figures_reach_prometheus(make_engine):
    """kvflow.metrics exports the staging pools (label pool): a held lease
    shows as one lease and its slot in use, gone once released; a pool
    that lends nothing has no leases, one not made has no samples."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvflow.metrics import register_prometheus

    a, b, peer = await _pair(make_engine, ["tcp"])
    gpu_region(b, np.zeros(1 << 16, np.uint8), "kv_pool")
    registry = prometheus_client.CollectorRegistry()
    register_prometheus(b, registry, name="decode-0")
    value = registry.get_sample_value
    inbox, outgoing = {"engine": "decode-0", "pool": "inbox"}, {"engine": "decode-0", "pool": "outgoing"}
    lease = await bounded(peer.link.request({"t": "stage_lease", "inbox": "gpu", "slots": 1}))
    assert lease["t"] == "stage_leased"
    assert value("kvflow_staging_slots", inbox) == staging(b, "inbox")["slots"] >= 1
    assert value("kvflow_staging_leases", inbox) == 1 and value("kvflow_staging_slots_in_use", inbox) == 1
    assert value("kvflow_staging_slots_in_use", outgoing) == 0 and value("kvflow_staging_leases", outgoing) is None
    assert value("kvflow_staging_slots", {"engine": "decode-0", "pool": "relay_inbox"}) is None
    peer.link.send({"t": "stage_release", "inbox": "gpu", "lease": lease["lease"]})
    assert await settled(b) == {}
    assert value("kvflow_staging_leases", inbox) == 0 and value("kvflow_staging_slots_in_use", inbox) == 0
    assert value("kvflow_staging_slots_max_in_use", inbox) == 1


async def test_descriptor_carries_gpu_regions():
    from kvflow.control.descriptor import regions_from_wire, regions_to_wire
    from kvflow.memory import RemoteRegion
    regions = [RemoteRegion(0x1000, 4096, "host", Access.READ, (1, 2)),
               RemoteRegion(0x7F0000000000, 1 << 30, "kv", Access.READ | Access.WRITE, (), "cuda", 3)]
    wire = regions_to_wire(regions)
    assert wire[0] == [0x1000, 4096, 1, "host", [1, 2]]        # host regions: as before
    back = regions_from_wire(wire)
    assert [(r.kind, r.device) for r in back] == [("host", -1), ("cuda", 3)]
    handle = bytes(range(64))
    # with its CUDA IPC handle (64 bytes) and offset in the allocation
    handle = bytes(range(64))
    uuid = bytes(range(100, 116))
    ipc = RemoteRegion(0x7F0000001000, 4096, "kv2", Access.WRITE, (), "cuda", 1, (handle, 0x1000, uuid))
    (back,) = regions_from_wire(regions_to_wire([ipc]))
    assert (back.kind, back.device, back.ipc) == ("cuda", 1, (handle, 0x1000, uuid))
    for bad_ipc in ([b"short", 0, uuid], [handle, -1, uuid], [handle], ["x" * 64, 0, uuid], [handle, 0],
                    [handle, 0, b"short"]):
        with pytest.raises(kvflow.ProtocolError):
            regions_from_wire([[0x1000, 4096, 3, None, [], 0, *bad_ipc]])
    for bad in ([[0x1000, 4096, 3, None, [], -1]], [[0x1000, 4096, 3, None, [], "0"]],
                [[0x1000, 4096, 3, None, [], 0, 1]], [[0x1000, 4096, 3, None, [], 0, handle, 0, bytes(16), 9]]):
        with pytest.raises(kvflow.ProtocolError):
            regions_from_wire(bad)


async def test_staged_nowait_strided_blocking_and_posted(make_engine):
    """The other ways into a write reach the staged path too: write_nowait
    (a TaskTransfer, cancellable), strided entries (expanded), write_blocking
    and post_write from another thread."""
    a, b, peer = await _pair(make_engine, ["tcp"])
    pool = np.zeros(1 << 20, np.uint8)
    gpu_region(b, pool, "kv_pool")
    await bounded(peer.refresh())
    base = peer.region("kv_pool").addr
    src = _pattern(1 << 18, 6)
    s = a.register(src)
    t = peer.write_nowait([s.addr], [base], [65536])
    assert t.nbytes == 65536
    await bounded(t)
    assert t.done() and sha(pool[:65536]) == sha(src[:65536])
    # strided: 8 pieces of 1 KiB, every 4 KiB on the source, every 2 KiB on the target
    await bounded(peer.write([s.addr], [base + 65536], [1024], counts=[8], local_strides=[4096],
                             remote_strides=[2048]))
    for k in range(8):
        assert sha(pool[65536 + 2048 * k: 65536 + 2048 * k + 1024]) == sha(src[4096 * k: 4096 * k + 1024])
    loop = asyncio.get_running_loop()
    await bounded(loop.run_in_executor(None, lambda: peer.write_blocking([s.addr], [base + (1 << 19)], [1 << 17])))
    assert sha(pool[1 << 19: (1 << 19) + (1 << 17)]) == sha(src[:1 << 17])
    pool[:] = 0

    def posted():
        p = peer.post_write([s.addr], [base], [1 << 18])
        while not p.poll():
            pass
    await bounded(loop.run_in_executor(None, posted))
    assert sha(pool[:1 << 18]) == sha(src)
    # a cancelled staged write raises TransferCancelledError and returns its slots
    big = np.zeros(4 << 20, np.uint8)
    gpu_region(a, big, "big")
    for wait in (0, 0.001, 0.003):
        t = peer.write_nowait([big.ctypes.data], [base], [1 << 20])
        await asyncio.sleep(wait)           # cancelled before it starts, and while its slots are busy
        if t.cancel():
            with pytest.raises(kvflow.TransferCancelledError):
                await bounded(t)
        else:
            await bounded(t)
    await asyncio.sleep(0.05)
    assert staging(a, "outgoing")["in_use"] == 0
    # a lease granted after its write was cancelled is given back, not left lent to nobody
    assert await settled(b) == {} and inbox_idle(b)
    await bounded(peer.write([s.addr], [base], [4096]))          # still usable


async def test_strided_blocking_and_posted_reach_gpu_memory(make_engine, protocols):
    """write_blocking and post_write take strided entries as write() does
    (one submission path, Peer._submit), and the router sends them to the
    peer's GPU memory too (tcp: staged; local: a direct copy)."""
    a, b, peer = await _pair(make_engine, protocols)
    pool = np.zeros(1 << 18, np.uint8)
    gpu_region(b, pool, "kv_pool")
    await bounded(peer.refresh())
    base = peer.region("kv_pool").addr
    src = _pattern(1 << 16, 9)
    s = a.register(src)
    loop = asyncio.get_running_loop()
    strided = {"counts": [8], "local_strides": [4096], "remote_strides": [2048]}

    def posted():
        p = peer.post_write([s.addr], [base + 65536], [1024], **strided)
        while not p.poll():
            pass
    await bounded(loop.run_in_executor(None, lambda: peer.write_blocking([s.addr], [base], [1024], **strided)))
    await bounded(loop.run_in_executor(None, posted))
    for off in (0, 65536):
        for k in range(8):
            assert sha(pool[off + 2048 * k: off + 2048 * k + 1024]) == sha(src[4096 * k: 4096 * k + 1024])


async def test_after_needs_cuda(make_engine):
    import kvflow.cuda
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here: tests/test_cuda.py waits for real events")
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    dst = b.register(np.zeros(4096, np.uint8), name="d")
    src = a.register(np.ones(4096, np.uint8))
    peer = await bounded(a.connect(b.address))
    with pytest.raises(kvflow.ProviderUnavailableError, match="CUDA is not usable here"):
        await bounded(peer.write([src.addr], [dst.addr], [4096], after=object()))
    await bounded(peer.write([src.addr], [dst.addr], [4096]))


def test_mooncake_gpu_location_without_cuda():
    import kvflow.cuda
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here")
    from kvflow.compat.mooncake import TransferEngine
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert te.register_memory(0x7F0000000000, 1 << 20, "cuda:0") == -1
        host = np.zeros(4096, np.uint8)
        assert te.register_memory(host.ctypes.data, host.nbytes, "cpu:0") == 0
        assert te.register_memory(host.ctypes.data + 8192 * 0 + 0, 16, "cuda:0") == -1   # host memory, said cuda
    finally:
        te.close() if hasattr(te, "close") else None


async def test_a_cancelled_awaiter_of_a_staged_transfer_waits_for_it_to_stop():
    """A staged transfer (a task: kvflow.engine.transfer.TaskTransfer) whose
    awaiting task is cancelled, once and then again: the cancellation comes
    through only after the transfer's own task has stopped, i.e. after its
    transfers waited for what they had on the wire, as a native batch's
    awaiter does."""
    import time

    from kvflow.engine.transfer import TaskTransfer

    stopped = []

    async def staged():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)            # its drains wait for bytes on the wire
            stopped.append(time.monotonic())
            raise

    t = TaskTransfer(staged(), "peer:1", 4096)

    async def awaiter():
        await t

    task = asyncio.get_running_loop().create_task(awaiter())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await bounded(task)
    assert stopped and t.done(), "the awaiter's cancellation came through while the transfer still ran"
