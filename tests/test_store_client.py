"""kvflow.store end to end in one process: real kvflow engines (tcp, and
the automatic choice, which is `local` within a process), a master shared
in-process, every byte checked."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import zlib

import numpy as np
import pytest

import kvflow
from kvflow.errors import InvalidArgumentError, KVFlowError, UnregisteredMemoryError
from kvflow.store import (BufferTooSmallError, InvalidKeyError, MasterUnavailableError, Master, StoreTimeoutError,
                          NoSpaceError, ObjectExistsError, ObjectLeasedError, ObjectNotFoundError,
                          ReplicaUnavailableError, StoreClient, TaskNotFoundError, TaskStatus)

PROTOCOLS = [pytest.param(("tcp",), id="tcp"), pytest.param(None, id="auto")]


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.asynccontextmanager
async def _pool(n: int, protocols, *, segment_size=4 << 20, master=None, master_tcp=False, **kw):
    master = master or Master(seed=1)
    await master.start("127.0.0.1:0" if master_tcp else None)
    clients = []
    try:
        for _ in range(n):
            clients.append(await StoreClient(master.address if master_tcp else master, segment_size=segment_size,
                                             protocols=protocols, **kw).start())
        yield master, clients
    finally:
        for c in clients:
            await c.close()
        await master.close()


def _assert_no_leak(master: Master, objects: int = 0) -> None:
    m = master.model
    # objects removed by force under a get's lease keep their space until
    # the lease ends: let every lease run out
    m.release_quarantine(float("inf"))
    for s in m.segments.values():
        s.alloc.check()
    assert m.used == sum(s.alloc.used for s in m.segments.values())      # the running total
    assert len(m.objects) == objects
    if objects == 0:
        assert m.used == 0
        assert all(s.alloc.extents == 1 for s in m.segments.values())


@pytest.mark.parametrize("protocols", PROTOCOLS)
async def test_put_on_one_get_on_another(protocols):
    async with _pool(3, protocols) as (master, (a, b, c)):
        values = {f"obj/{i}": _data(n, i).tobytes()
                  for i, n in enumerate([1, 63, 64, 65, 4096, 100_000, 1 << 20])}
        for k, v in values.items():
            assert await a.put(k, v) == 1
        for client in (a, b, c):
            for k, v in values.items():
                assert await client.get(k) == v
                assert await client.size(k) == len(v)
        got = await c.batch_get(list(values) + ["missing"])
        assert got[:-1] == list(values.values())
        assert isinstance(got[-1], ObjectNotFoundError)
        assert await b.batch_exists(list(values) + ["missing"]) == [True] * len(values) + [False]
        # objects spread over the three segments (power of two choices)
        holders = {master.model.segments[master.model.objects[k].replicas[0].segment].client for k in values}
        assert len(holders) >= 2
        # each get released its lease when its reads were over: no force needed
        assert await a.remove_all() == len(values)
        _assert_no_leak(master)


@pytest.mark.parametrize("protocols", PROTOCOLS)
async def test_zero_copy_batch_and_parts(protocols):
    async with _pool(2, protocols, segment_size=16 << 20) as (master, (a, b)):
        n, size = 16, 256 << 10
        src = _data(n * size, 5)
        dst = np.zeros(n * size + 4096, np.uint8)
        ra, rb = a.register_buffer(src), b.register_buffer(dst)
        keys = [f"kv/{i}" for i in range(n)]
        out = await a.batch_put_from(keys, [ra.addr + i * size for i in range(n)], [size] * n, replica_num=2)
        assert out == [2] * n
        assert await a.batch_put_from(keys, [ra.addr] * n, [size] * n) == [0] * n   # dedup: no-op
        # gather into reversed slots
        got = await b.batch_get_into(keys, [rb.addr + (n - 1 - i) * size for i in range(n)], [size] * n)
        assert got == [size] * n
        for i in range(n):
            assert np.array_equal(dst[(n - 1 - i) * size:(n - i) * size], src[i * size:(i + 1) * size])
        assert not dst[n * size:].any()        # nothing written past the objects
        # scatter/gather: an object made of K and V pages in two places
        k_page, v_page = src[:4096], src[8192:8192 + 1000]
        await a.put_from_parts("kv-pair", [(ra.addr, 4096), (ra.addr + 8192, 1000)])
        dst[:] = 0
        assert await b.get_into_parts("kv-pair", [(rb.addr + 10_000, 1000), (rb.addr, 4096)]) == 5096
        assert np.array_equal(dst[10_000:11_000], k_page[:1000])
        assert np.array_equal(dst[:4096], np.concatenate([k_page[1000:], v_page]))
        assert await b.get("kv-pair") == k_page.tobytes() + v_page.tobytes()
        await a.remove_all(force=True)
        _assert_no_leak(master)


async def test_replica_holder_lost_mid_stream_reads_the_other_replica():
    # a and b hold; c (no segment) puts and reads. b's engine dies while c
    # streams gets: every get returns the right bytes from a's replica.
    master = Master(seed=2)
    await master.start()
    a = await StoreClient(master, segment_size=8 << 20, protocols=("tcp",)).start()
    b = await StoreClient(master, segment_size=8 << 20, protocols=("tcp",)).start()
    c = await StoreClient(master, segment_size=0, protocols=("tcp",)).start()
    try:
        values = {f"r/{i}": _data(50_000 + i, i).tobytes() for i in range(40)}
        assert await c.batch_put(list(values), list(values.values()), replica_num=2) == [2] * 40
        only_b = _data(1000, 99).tobytes()
        assert await c.put("only-b", only_b, preferred_segment=b.segment_id) == 1
        assert (await c.get_replicas("only-b"))[0].client == b.client_id

        started = asyncio.Event()

        async def stream():
            n = 0
            for _ in range(10):
                for k, v in values.items():
                    assert await c.get(k) == v
                    n += 1
                    if n == 40:
                        started.set()
            return n

        reader = asyncio.create_task(stream())
        await started.wait()
        await b.engine.close()                 # the holder's process "dies": the master is not told
        assert await reader == 400
        assert c.replica_fallbacks > 0         # some gets did find b gone and went on to a
        # the object whose only replica was on b: a typed error, never bytes
        with pytest.raises(ReplicaUnavailableError):
            await c.get("only-b")
        # puts keep working (b's segment, still listed, fails its writes: fewer replicas)
        for i in range(10):
            n = await c.put(f"after/{i}", values["r/0"], replica_num=2)
            assert n >= 1
            assert await c.get(f"after/{i}") == values["r/0"]
    finally:
        for x in (c, b, a):
            await x.close()
        await master.close()


async def test_lost_replicas_are_made_again():
    """replica_num=2 over three holders; one leaves: every object it held
    a replica of gets a second replica again, copied by the holder of the
    other one onto the holder that had none, and reads the same bytes from
    either replica; objects that never lost one are left alone."""
    master = Master(seed=5, heartbeat_interval=0.1, client_grace=5.0)
    await master.start()
    holders = [await StoreClient(master, segment_size=8 << 20, protocols=("tcp",)).start() for _ in range(3)]
    c = await StoreClient(master, segment_size=0, protocols=("tcp",)).start()
    a, b, d = holders
    try:
        values = {f"r/{i}": _data(30_000 + i, i).tobytes() for i in range(30)}
        assert await c.batch_put(list(values), list(values.values()), replica_num=2) == [2] * 30
        on_b = [k for k in values if b.client_id in {r.client for r in await c.get_replicas(k)}]
        assert 0 < len(on_b) < 30
        await b.close()                        # b's segment and its replicas are gone
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            rows = {k: [r.client for r in await c.get_replicas(k)] for k in values}
            if all(len(v) == 2 for v in rows.values()):
                break
            assert asyncio.get_running_loop().time() < deadline, rows
            await asyncio.sleep(0.1)
        assert all(set(v) == {a.client_id, d.client_id} for v in rows.values()), rows
        assert a.replicas_made + d.replicas_made == len(on_b) == master.model.repaired
        for k, v in values.items():             # each replica holds the object's bytes
            assert await a.get(k) == v and await d.get(k) == v and await c.get(k) == v
        assert not master.model._repairs and not master.model._short
    finally:
        for x in (c, d, a):
            await x.close()
        await master.close()


async def test_namespaces_keep_tenants_apart_and_quotas_evict_their_own():
    """Two tenants (say, two models) put the same keys without seeing each
    other's; a tenant over its quota evicts its own least recently used
    objects, never the other's, and a quota nothing can satisfy is a typed
    error; remove_all takes only the caller's namespace."""
    master = Master(seed=3)
    await master.start()
    value = _data(10_000, 7).tobytes()
    other = _data(10_000, 8).tobytes()
    holder = await StoreClient(master, segment_size=8 << 20, protocols=("tcp",)).start()
    a = await StoreClient(master, segment_size=0, protocols=("tcp",), namespace="llama/tp0",
                          quota=5 * len(value)).start()
    b = await StoreClient(master, segment_size=0, protocols=("tcp",), namespace="qwen/tp0").start()
    plain = await StoreClient(master, segment_size=0, protocols=("tcp",)).start()
    try:
        await b.put("page/0", other)
        assert not await a.exists("page/0") and not await plain.exists("page/0")
        for i in range(5):
            await a.put(f"page/{i}", value)
        assert await a.get("page/0") == value and await b.get("page/0") == other
        await a.get("page/1")                                   # LRU now: 2, 3, 4, 0, 1
        for i in range(5, 8):                                   # over the quota: a's own LRU goes
            await a.put(f"page/{i}", value)
        assert await a.batch_exists([f"page/{i}" for i in range(8)]) == \
            [True, True, False, False, False, True, True, True]
        assert master.model.ns_bytes["llama/tp0"] == 5 * len(value)
        assert await b.get("page/0") == other                   # the other tenant untouched
        await a.put("pinned", value, pin=True)                   # evicts one more of a's own
        with pytest.raises(NoSpaceError):                        # QuotaExceededError: nothing evictable left
            for i in range(6):
                await a.put(f"pin/{i}", value, pin=True)
        with pytest.raises(InvalidKeyError):
            await plain.put("llama/tp0\x1fpage/0", value)
        with pytest.raises(InvalidArgumentError):
            StoreClient(master, namespace="bad\x1fns")
        with pytest.raises(InvalidArgumentError):
            StoreClient(master, quota=10)                        # a quota needs a namespace
        # remove_by_regex: a tenant's pattern meets its own keys, without their prefix
        await b.put("page/9", other)
        assert await a.remove_by_regex("^pin/[0-1]$") == 2
        assert await b.batch_exists(["page/0", "page/9"]) == [True, True]
        assert await a.remove_all(force=True) >= 3
        assert await b.get("page/0") == other and "llama/tp0" not in master.model.ns_bytes
    finally:
        for x in (plain, b, a, holder):
            await x.close()
        await master.close()


async def test_full_pool_puts_evict_and_succeed():
    async with _pool(2, ("tcp",), segment_size=1 << 20) as (master, (a, b)):
        value = _data(100_000, 1).tobytes()
        for i in range(60):                    # 6 MB into a 2 MiB pool
            assert await a.put(f"f/{i}", value) == 1
        assert master.model.evictions > 0
        assert await b.get("f/59") == value    # the newest survive
        assert not await b.exists("f/0")       # the oldest were evicted
        # pinned objects stay; a pool full of pinned objects says NoSpace
        async with _pool(1, ("tcp",), segment_size=1 << 20) as (m2, (p,)):
            for i in range(10):
                await p.put(f"pin/{i}", value, pin=True)
            with pytest.raises(NoSpaceError):
                await p.put("one-more", value)
            assert all(await p.batch_exists([f"pin/{i}" for i in range(10)]))
        # soft pins: kept while unpinned objects can go, taken when nothing else can
        async with _pool(1, ("tcp",), segment_size=1 << 20) as (m3, (p,)):
            await p.put("soft/0", value, soft_pin=True)
            await p.put("soft/1", value, soft_pin=600.0)
            for i in range(20):
                await p.put(f"plain/{i}", value)
            assert all(await p.batch_exists(["soft/0", "soft/1"]))
            for i in range(10):
                await p.put(f"hard/{i}", value, pin=True)
            assert m3.model.soft_evictions >= 1
            with pytest.raises(InvalidArgumentError):
                await p.put("soft/bad", value, soft_pin=-1)


async def test_ten_thousand_put_remove_cycles_with_failing_writers_leak_nothing():
    async with _pool(2, ("tcp",), segment_size=1 << 20) as (master, (a, b)):
        src = _data(1 << 18, 3)
        ra = a.register_buffer(src)
        rng = random.Random(4)
        failures = {"cancelled": 0, "no_space": 0, "unregistered": 0}
        for i in range(10_000):
            size = rng.choice((64, 1000, 4096, 65536))
            key = f"cyc/{i}"
            what = rng.random()
            if what < 0.1:
                # a writer cancelled mid-put: its allocation must come back
                t = asyncio.create_task(a.put_from(key, ra.addr, 1 << 18))
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
                t.cancel()
                try:
                    await t
                    await b.remove(key)
                except asyncio.CancelledError:
                    failures["cancelled"] += 1
                continue
            if what < 0.12:
                with pytest.raises(NoSpaceError):
                    await a.put(key, b"x" * (3 << 20))      # larger than any segment
                failures["no_space"] += 1
                continue
            if what < 0.14:
                with pytest.raises(UnregisteredMemoryError):
                    await a.put_from(key, ra.addr + (1 << 18) - 10, 100)
                failures["unregistered"] += 1
                continue
            assert await a.put_from(key, ra.addr, size) == 1
            await b.remove(key, force=True)
        assert min(failures.values()) > 0
        assert master.calls > 25_000             # every cycle went through the master
        assert a.engine.peer(b.engine.address) is not None    # and over tcp to b's segment
        _assert_no_leak(master)


async def test_writer_dies_between_allocation_and_commit():
    async with _pool(1, ("tcp",), segment_size=16 << 20) as (master, (holder,)):
        w = await StoreClient(master, segment_size=0, protocols=("tcp",)).start()
        src = _data(8 << 20, 1)
        r = w.register_buffer(src)
        t = asyncio.create_task(w.put_from("dying", r.addr, 8 << 20))
        while not master.model.objects:           # the allocation is made
            await asyncio.sleep(0)
        await w.close()                            # the writer leaves: its put is revoked
        with contextlib.suppress(Exception):
            await t
        assert not await holder.exists("dying")
        _assert_no_leak(master)
        assert await holder.put("dying", b"fresh") == 1     # the key is free again
        assert await holder.get("dying") == b"fresh"


async def test_bad_input_gets_typed_errors_and_the_client_stays_usable():
    async with _pool(2, ("tcp",), local_buffer_size=1 << 20) as (master, (a, b)):
        await a.put("good", b"12345")
        buf = np.zeros(4096, np.uint8)
        reg = b.register_buffer(buf)
        unregistered = np.zeros(4096, np.uint8)
        with pytest.raises(InvalidKeyError):
            await a.put("", b"x")
        with pytest.raises(InvalidKeyError):
            await a.put(7, b"x")
        with pytest.raises(InvalidKeyError):
            await b.get(b"good")
        with pytest.raises(InvalidArgumentError):
            await a.put("k", 12345)                # not a buffer
        with pytest.raises(InvalidArgumentError):
            await a.put("huge", bytes(2 << 20))    # larger than the local buffer
        with pytest.raises(ObjectExistsError):
            await a.put("good", b"123")            # same key, another size
        with pytest.raises(InvalidArgumentError):
            await a.batch_put_from(["a", "b"], [reg.addr], [1, 2])
        with pytest.raises(InvalidArgumentError):
            await a.put_from_parts("k", [reg.addr, 100])          # not (address, size) pairs
        with pytest.raises(InvalidArgumentError):
            await b.get_into_parts("good", [])
        with pytest.raises(InvalidArgumentError):
            await a.put_from("k", reg.addr, 1.5)
        with pytest.raises(UnregisteredMemoryError):
            await a.put_from("k", unregistered.ctypes.data, 100)
        with pytest.raises(UnregisteredMemoryError):
            await b.get_into("good", unregistered.ctypes.data, 4096)
        with pytest.raises(UnregisteredMemoryError):
            await b.get_into("good", reg.addr + 4000, 200)      # runs past the region
        with pytest.raises(BufferTooSmallError):
            await b.get_into("good", reg.addr, 4)
        with pytest.raises(InvalidArgumentError):
            await b.get_into("good", reg.addr, 0)
        with pytest.raises(ObjectNotFoundError):
            await b.get("nothing")
        with pytest.raises(ObjectNotFoundError):
            await b.remove("nothing")
        assert not buf.any()                       # nothing landed anywhere
        # a batch: the bad items fail, the good ones go through
        out = await b.batch_get_into(["good", "", "nothing"], [reg.addr, reg.addr + 100, reg.addr + 200],
                                     [100, 100, 100])
        assert out[0] == 5 and isinstance(out[1], InvalidKeyError) and isinstance(out[2], ObjectNotFoundError)
        assert bytes(buf[:5]) == b"12345"
        # still usable
        await a.put("after", b"ok")
        assert await b.get("after") == b"ok" and await b.get("good") == b"12345"
        assert len(master.model.objects) == 2


async def test_batches_mixing_plain_and_odd_objects_give_each_its_own_result():
    # the funnels check and move a batch of plain objects as columns; one
    # odd object anywhere sends the batch down the per-key path, which must
    # give every object its own result, as before
    async with _pool(2, ("tcp",), local_buffer_size=1 << 20) as (master, (a, b)):
        size = 4096
        src, dst = _data(8 * size, 5), np.zeros(8 * size, np.uint8)
        ra, rb = a.register_buffer(src), b.register_buffer(dst)
        unregistered = np.zeros(size, np.uint8)
        assert await a.batch_put_from(["p/0", "p/1"], [ra.addr, ra.addr + size], [size, size]) == [1, 1]
        out = await a.batch_put_from(
            ["p/0", "p/2", "p/3", "p/4", "", "p/5"],
            [ra.addr, ra.addr + 2 * size, unregistered.ctypes.data, ra.addr + 7 * size + 1, ra.addr,
             np.uint64(ra.addr + 5 * size)],
            [size, size, size, size, size, size])
        assert out[0] == 0 and out[1] == 1 and out[5] == 1, out       # existed; stored; a numpy address
        assert isinstance(out[2], UnregisteredMemoryError) and isinstance(out[3], UnregisteredMemoryError)
        assert isinstance(out[4], InvalidKeyError)
        assert not await a.exists("p/3") and not await a.exists("p/4")
        # two parts for one object, one part for the others: per key, the same bytes
        assert await a.batch_put_from_parts(["q/0", "q/1"], [[(ra.addr, 100), (ra.addr + 200, 50)],
                                                            [(ra.addr + size, size)]]) == [1, 1]
        got = await b.batch_get_into(["p/0", "p/1", "p/2", "missing", "p/5", "q/1"],
                                     [rb.addr + i * size for i in range(6)], [size, size, size, size, 8, size])
        assert got[:3] == [size] * 3 and got[5] == size, got
        assert isinstance(got[3], ObjectNotFoundError) and isinstance(got[4], BufferTooSmallError)
        for i, j in ((0, 0), (1, 1), (2, 2), (5, 1)):
            assert np.array_equal(dst[i * size:(i + 1) * size], src[j * size:(j + 1) * size])
        assert await b.batch_get_into(["p/0", "p/2"], [rb.addr, rb.addr + size], [size, size]) == [size, size]
        got = await b.batch_get_into_parts(["q/0"], [[(rb.addr, 120), (rb.addr + 6 * size, 100)]])
        assert got == [150]
        assert np.array_equal(dst[:120], src[:100].tolist() + src[200:220].tolist())
        assert np.array_equal(dst[6 * size:6 * size + 30], src[220:250])
        assert a.metrics()["puts"]["stored"] == 6
        await a.batch_remove(["p/0", "p/1", "p/2", "p/5", "q/0", "q/1"], force=True)
        _assert_no_leak(master)


def test_batch_columns_helpers():
    from kvflow.store.calls import all_ok, single_parts
    from kvflow.store.datapath import holders_of
    starts, ends = [1000, 5000], [2000, 6000]
    assert single_parts(["a", "b"], [[(1000, 10)], [(5990, 10)]], starts, ends) == ([1000, 5990], [10, 10])
    for keys, parts in ((["a", "b"], [[(1000, 10)], [(5991, 10)]]),      # past a region's end
                        (["a"], [[(999, 1)]]), (["a"], [[(2000, 1)]]),    # before / between regions
                        (["a"], [[(1000, 1), (1001, 1)]]), (["a"], [[]]), (["a"], [[(1000, 0)]]),
                        (["a"], [[(True, 1)]]), (["a"], [[(1000.0, 1)]]), (["a"], [[[1000, 1]]]),
                        ([""], [[(1000, 1)]]), ([7], [[(1000, 1)]]), (["a", "b"], [[(1000, 1)]]), ([], [])):
        assert single_parts(keys, parts, starts, ends) is None, (keys, parts)
    assert all_ok([[0, [1]], [0, 5]]) == [[1], 5]
    assert all_ok([[0, [1]], [0, None]]) is None                 # existed already: the per-key path
    assert all_ok([[0, 1], [1, "not_found", "no"]]) is None
    assert all_ok([]) is None
    segs = {3: ["c", "h:1", "host"]}
    assert holders_of([3, 3], segs) == ["h:1", "h:1"]
    assert holders_of([3, 4], {**segs, 4: ["d", "h:2", "host"]}) == ["h:1", "h:2"]


async def test_no_master_is_a_typed_error():
    with pytest.raises(MasterUnavailableError):
        await StoreClient("127.0.0.1:1", segment_size=0, protocols=("tcp",)).start()
    with pytest.raises(InvalidArgumentError):
        await StoreClient("nowhere", segment_size=0, protocols=("tcp",)).start()


async def test_lease_keeps_an_object_from_removal():
    async with _pool(1, ("tcp",), master=Master(lease_ttl=30.0)) as (master, (a,)):
        await a.put("leased", b"v")
        await a.get_replicas("leased")             # a lease for 30 s
        with pytest.raises(ObjectLeasedError):
            await a.remove("leased")
        assert await a.remove_all() == 0
        await a.remove("leased", force=True)
        assert not await a.exists("leased")


async def test_cancelled_get_leaves_the_client_usable():
    async with _pool(2, ("tcp",), segment_size=32 << 20, local_buffer_size=32 << 20) as (master, (a, b)):
        v = _data(16 << 20, 8).tobytes()
        await a.put("big", v, preferred_segment=a.segment_id)
        for delay in (0, 0.001, 0.01):
            t = asyncio.create_task(b.get("big"))
            await asyncio.sleep(delay)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        assert await b.get("big") == v
        assert b.local_buffer_in_use == 0          # staging space came back


async def test_embedded_master_needs_nothing_started():
    async with StoreClient(segment_size=1 << 20) as a, StoreClient(segment_size=1 << 20) as b:
        await a.put("e", b"embedded")
        assert await b.get("e") == b"embedded"
        assert (await b.stats())["clients"] == 2


async def test_a_reader_never_sees_a_half_written_object():
    async with _pool(2, ("tcp",), segment_size=64 << 20, local_buffer_size=64 << 20) as (master, (a, b)):
        v = _data(24 << 20, 9).tobytes()
        for round_ in range(3):
            key = f"half/{round_}"
            put = asyncio.create_task(a.put(key, v, preferred_segment=b.segment_id))
            assert await _polled_while_written(put, b, key, v) == 1


async def _polled_while_written(put: asyncio.Future, reader: StoreClient, key: str, v: bytes):
    """Gets `key` on `reader` until `put` is done: missing or whole, never
    part; returns the put's result."""
    seen = {"missing": 0, "whole": 0}
    while not put.done():
        try:
            got = await reader.get(key)
        except ObjectNotFoundError:
            seen["missing"] += 1
        else:
            assert got == v                  # visible means complete
            seen["whole"] += 1
        await asyncio.sleep(0)
    assert seen["missing"] > 0               # it was polled while being written
    assert await reader.get(key) == v
    return await put


async def test_concurrent_puts_of_one_key_one_wins():
    async with _pool(3, ("tcp",)) as (master, (a, b, c)):
        va, vb = b"A" * 300_000, b"B" * 300_000
        ra, rb = await asyncio.gather(a.put("same", va), b.put("same", vb), return_exceptions=True)
        outcomes = sorted(type(r).__name__ if isinstance(r, Exception) else str(r) for r in (ra, rb))
        # one wrote it; the other found it in progress (busy) or complete (0: dedup)
        assert outcomes in (["1", "ObjectBusyError"], ["0", "1"]), outcomes
        got = await c.get("same")
        assert got in (va, vb)
        assert got == (va if ra == 1 else vb)
        _assert_no_leak(master, objects=1)


async def test_own_segment_large_copies_leave_the_loop_free_and_cancel_drains():
    # a put into and a get from the client's own segment larger than the
    # inline limit runs on a worker thread; cancelling it gives the space
    # back only once the copy is over, and the client stays usable
    async with _pool(1, ("tcp",), segment_size=96 << 20, local_buffer_size=0) as (master, (a,)):
        src = _data(32 << 20, 12)
        dst = np.zeros(32 << 20, np.uint8)
        rs, rd = a.register_buffer(src), a.register_buffer(dst)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        t = asyncio.create_task(ticker())
        assert await a.put_from("own", rs.addr, 32 << 20, preferred_segment=a.segment_id, pin=True) == 1
        assert await a.get_into("own", rd.addr, 32 << 20) == 32 << 20
        t.cancel()
        assert np.array_equal(src, dst)
        assert ticks > 0                       # the loop ran during the copies
        for i in range(5):
            put = asyncio.create_task(a.put_from(f"c{i}", rs.addr, 32 << 20))
            await asyncio.sleep(0.001 * i)
            put.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await put
        await a.remove("own", force=True)
        _assert_no_leak(master, objects=sum([await a.exists(f"c{i}") for i in range(5)]))


async def test_put_cancelled_while_its_allocation_is_on_the_wire_leaks_nothing():
    # over a tcp master link a put cancelled right after sending put_start
    # never sees the reply: the call revokes by its token what that
    # put_start allocated (and nothing of the client's other puts)
    master = Master(seed=5)
    await master.start("127.0.0.1:0")
    try:
        async with StoreClient(master.address, segment_size=4 << 20, protocols=("tcp",)) as a:
            await a.put("keeper", b"k" * 1000, pin=True)      # never evicted by the puts below
            rng = random.Random(6)
            for i in range(300):
                t = asyncio.create_task(a.put(f"c/{i}", b"v" * rng.choice((100, 70_000))))
                for _ in range(rng.randint(0, 4)):
                    await asyncio.sleep(0)
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await asyncio.sleep(0.05)                  # the revokes reach the master
            done = sum(await a.batch_exists([f"c/{i}" for i in range(300)]))
            assert await a.get("keeper") == b"k" * 1000
            assert not [o for o in master.model.objects.values() if o.state.value == "allocated"]
            _assert_no_leak(master, objects=1 + done)
            assert await a.remove_all(force=True) == 1 + done
            _assert_no_leak(master)
    finally:
        await master.close()


async def test_a_fault_of_the_master_is_a_typed_error_and_the_link_stays(monkeypatch, caplog):
    # a bug in one of the master's handlers answers that call with
    # "internal" (a KVFlowError); the client's link and session stay, so its
    # next calls, and the bytes it put, are still there
    master = Master(seed=7)
    await master.start("127.0.0.1:0")
    try:
        async with StoreClient(master.address, segment_size=1 << 20, protocols=("tcp",)) as a:
            await a.put("before", b"kept")
            original = master._batch_size

            def broken(*args):
                raise RuntimeError("planted")
            monkeypatch.setattr(master, "_batch_size", broken)
            with pytest.raises(KVFlowError, match="the master failed.*RuntimeError: planted") as e:
                await a.size("before")
            assert type(e.value) is KVFlowError
            assert "planted" in caplog.text
            monkeypatch.setattr(master, "_batch_size", original)
            assert await a.size("before") == 4                # the same link, the same session
            assert await a.get("before") == b"kept"
            assert (await a.stats())["clients"] == 1
    finally:
        await master.close()


async def test_embedded_master_can_serve_other_processes_too():
    async with StoreClient(segment_size=1 << 20, master_listen="127.0.0.1:0", protocols=("tcp",)) as a:
        address = a.master_address
        assert address and address.startswith("127.0.0.1:")
        async with StoreClient(address, segment_size=1 << 20, protocols=("tcp",)) as b:
            await b.put("via-tcp", b"remote member")
            assert await a.get("via-tcp") == b"remote member"
            assert (await a.stats())["clients"] == 2


async def test_master_refuses_unknown_methods():
    master = Master()
    await master.start("127.0.0.1:0")
    try:
        from kvflow.store.rpc import TcpMasterLink
        link = await TcpMasterLink.open(master.address)
        await link.call("register", "x", "h", "127.0.0.1:1")
        for method in ("connection", "watch_clients", "session_closed", "replicas", "nope"):
            with pytest.raises(InvalidArgumentError):
                await link.call(method)
        with pytest.raises(InvalidArgumentError):
            await link.call("batch_exists")              # wrong arity
        assert await link.call("batch_exists", ["a"]) == [False]     # the link still works
        await link.close()
    finally:
        await master.close()


async def test_a_given_engine_is_used_and_left_open():
    async with kvflow.Engine(protocols=["tcp"]) as e1, kvflow.Engine(protocols=["tcp"]) as e2:
        before = len(e1.regions)
        async with StoreClient(engine=e1, segment_size=1 << 20) as a, \
                StoreClient(engine=e2, segment_size=1 << 20) as b:
            assert a.engine is e1 and len(e1.regions) == before + 2      # segment + local buffer
            await a.put("given", b"engine", preferred_segment=b.segment_id)
            assert await b.get("given") == b"engine"
            assert (await a.get_replicas("given"))[0].engine == e2.address
        # the client gave its memory back and left the engines running
        assert len(e1.regions) == before
        keep = np.zeros(4096, np.uint8)
        e2.register(keep, name="after")
        peer = await e1.connect(e2.address)
        await peer.refresh()                   # the cached peer learns of "after" now, not when pushed
        src = np.full(4096, 7, np.uint8)
        r = e1.register(src)
        await peer.write(np.array([r.addr], np.uint64), np.array([peer.region("after").addr], np.uint64),
                         np.array([4096], np.uint64))
        assert (keep == 7).all()


async def test_call_timeouts_are_typed_and_undo_what_they_started():
    async with _pool(2, ("tcp",), segment_size=64 << 20, local_buffer_size=64 << 20) as (master, (a, b)):
        v = _data(32 << 20, 13).tobytes()
        await a.put("big", v, preferred_segment=b.segment_id)
        for t in (1e-6, 1e-4, 1e-3):
            with contextlib.suppress(StoreTimeoutError):
                await a.get("big", timeout=t)
            with contextlib.suppress(StoreTimeoutError):
                await b.put(f"late/{t}", v, timeout=t, preferred_segment=a.segment_id)
        with pytest.raises(StoreTimeoutError):
            await a.get("big", timeout=1e-6)
        with pytest.raises(InvalidArgumentError):
            await a.get("big", timeout=-1)
        # usable, nothing held: staging back, leases released (remove needs no force)
        assert await a.get("big", timeout=30) == v
        assert a.local_buffer_in_use == 0 and b.local_buffer_in_use == 0
        late = [k for k in (f"late/{t}" for t in (1e-6, 1e-4, 1e-3)) if await a.exists(k)]
        await a.remove("big")
        for k in late:
            await a.remove(k)
        _assert_no_leak(master)


async def test_master_survives_malformed_frames():
    master = Master()
    await master.start("127.0.0.1:0")
    try:
        host, port = master.address.rsplit(":", 1)
        bad_frames = [b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",             # not msgpack
                      b"\x00\x00\x00\x01\x90",                             # [] : not a request
                      b"\xff\xff\xff\xff",                                 # over the frame limit
                      b"\x00\x00\x00\x04\x93\x01\xa1x"]                    # truncated, then EOF
        for frame in bad_frames:
            r, w = await asyncio.open_connection(host, int(port))
            w.write(frame)
            await w.drain()
            w.write_eof()
            assert await asyncio.wait_for(r.read(), 5) == b""         # dropped, no reply
            w.close()
        async with StoreClient(master.address, segment_size=1 << 20, protocols=("tcp",)) as c:
            await c.put("after-garbage", b"fine")
            assert await c.get("after-garbage") == b"fine"
        for _ in range(100):                   # the master sees the client's connection close
            if not master.model.clients:
                break
            await asyncio.sleep(0.01)
        assert not master.model.clients and not master.sessions
    finally:
        await master.close()


def _value_of(key: str) -> bytes:
    # every client can tell the right bytes of any key: size and content from the key
    h = zlib.crc32(key.encode()) % 1000
    return _data(1000 + h * 97, h).tobytes()


@pytest.mark.parametrize("master_tcp", [False, True], ids=["master-in-process", "master-tcp"])
async def test_concurrent_mixed_operations_never_return_wrong_bytes(master_tcp):
    # three clients put, get, remove and batch-get one small key space at
    # once, on a pool small enough to evict all the time; a get returns the
    # key's own bytes or a typed error, never anything else
    from kvflow.store import ObjectBusyError, StoreError
    async with _pool(3, ("tcp",), segment_size=512 << 10, local_buffer_size=4 << 20,
                     master_tcp=master_tcp) as (master, clients):
        keys = [f"mix/{i}" for i in range(40)]
        counts = {"hit": 0, "miss": 0, "put": 0, "removed": 0}

        async def worker(c, seed):
            rng = random.Random(seed)
            for _ in range(int(os.environ.get("STORE_MIX_OPS", "300"))):
                op = rng.random()
                k = rng.choice(keys)
                try:
                    if op < 0.35:
                        await c.put(k, _value_of(k), replica_num=rng.choice((1, 2)))
                        counts["put"] += 1
                    elif op < 0.75:
                        assert await c.get(k) == _value_of(k)
                        counts["hit"] += 1
                    elif op < 0.9:
                        ks = rng.sample(keys, 6)
                        for kk, got in zip(ks, await c.batch_get(ks)):
                            assert isinstance(got, StoreError) or got == _value_of(kk), kk
                    else:
                        await c.remove(k, force=rng.random() < 0.5)
                        counts["removed"] += 1
                except (ObjectNotFoundError, ObjectBusyError, ObjectLeasedError, NoSpaceError):
                    counts["miss"] += 1

        await asyncio.gather(*(worker(c, i) for i, c in enumerate(clients)))
        assert counts["hit"] > 50 and counts["put"] > 50 and master.model.evictions > 0
        await clients[0].remove_all(force=True)
        _assert_no_leak(master)


async def test_prefer_local_puts_the_first_replica_in_the_own_segment():
    async with _pool(3, ("tcp",), prefer_local=True) as (master, (a, b, c)):
        for i in range(10):
            assert await a.put(f"local/{i}", b"x" * 5000, replica_num=2) == 2
            reps = master.model.objects[f"local/{i}"].replicas
            holders = [master.model.segments[r.segment].client for r in reps]
            assert holders[0] == a.client_id and holders[1] != a.client_id
            assert await b.get(f"local/{i}") == b"x" * 5000


async def test_batch_exists_blocking_answers_from_another_thread_and_falls_back():
    async with _pool(1, ("tcp",), master_tcp=True) as (master, (a,)):
        await a.put("here", b"x" * 100)
        loop = asyncio.get_running_loop()
        ask = lambda keys: loop.run_in_executor(None, a.batch_exists_blocking, keys)  # noqa: E731
        assert await ask(["here", "absent"]) == [True, False]
        assert await ask(["here", ""]) is None                  # a bad key: batch_exists says why
        # the master checks the lengths (the client only the types and the
        # namespace separator): a too long key, found or not, falls back too
        assert await ask(["here", "k" * 5000]) is None
        assert await ask(["here", "a\x1fb"]) is None and await ask(["here", 7]) is None
        assert await ask(("here",)) == [True]
        # the master skips its key checks only when every key is found: a
        # found key beside bad ones still gets the bad ones' errors
        link = a._link
        items = await link.call("batch_exists", ["here", "", "k" * 5000, 7, "absent"])
        assert items[0] is True and items[4] is False
        assert [it[:2] for it in items[1:4]] == [[1, "invalid_key"]] * 3, items
        items = await link.call("batch_exists", [["unhashable"], "here"])
        assert items[0][:2] == [1, "invalid_key"] and items[1] is True
        assert a.batch_exists_blocking(["here"]) is None       # the loop's own thread never blocks
        await a.remove("here")
        assert await ask(["here"]) == [False]
        # the query connection is no client: it closing loses nothing
        a._query.close()
        assert await ask(["absent"]) == [False]
        assert (await a.stats())["clients"] == 1
    async with _pool(1, ("tcp",)) as (master, (b,)):              # an in-process master: the loop's path
        assert await asyncio.get_running_loop().run_in_executor(None, b.batch_exists_blocking, ["k"]) is None


def _replica_bytes(holder: StoreClient, addr: int, size: int) -> bytes:
    """What the holder's segment memory holds at a replica's address."""
    off = addr - holder._segment_region.addr
    assert 0 <= off and off + size <= holder.segment_size
    return holder._segment[off:off + size].tobytes()


async def test_copy_and_move_tasks_copy_the_bytes_over_kvflow_and_leak_nothing():
    """A copy task makes replicas on the named segments, copied by the
    holder of the source over kvflow: each new replica's memory holds the
    object's bytes. A move leaves the replica on the target only. Bad input
    is refused with typed errors over the wire, and the space adds up."""
    master = Master(seed=7, heartbeat_interval=0.1, client_grace=5.0)
    await master.start("127.0.0.1:0")
    holders = {name: await StoreClient(master.address, segment_size=4 << 20, protocols=("tcp",),
                                       segment_name=name).start() for name in ("a", "b", "c")}
    c = await StoreClient(master.address, segment_size=0, protocols=("tcp",)).start()
    try:
        values = {f"cm/{i}": _data(200_000 + i, i).tobytes() for i in range(6)}
        for k, v in values.items():
            await c.put(k, v, preferred_segment="a")
        copies = [await c.create_copy_task(k, ["b", "c"]) for k in list(values)[:3]]
        moves = [await c.create_move_task(k, "a", "c") for k in list(values)[3:]]
        for tid in copies + moves:
            info = await c.wait_task(tid, timeout=20)
            assert info.status is TaskStatus.SUCCESS and info.client == holders["a"].client_id, info
        for i, (k, v) in enumerate(values.items()):
            descs = await c.replica_desc(k)
            assert sorted(d.segment for d in descs) == (["a", "b", "c"] if i < 3 else ["c"]), descs
            for d in descs:
                assert d.size == len(v) and _replica_bytes(holders[d.segment], d.addr, d.size) == v
            assert await c.get(k) == v
        assert holders["a"].replicas_made == 3 * 2 + 3

        with pytest.raises(ObjectNotFoundError):
            await c.create_copy_task("missing", ["b"])
        with pytest.raises(ObjectNotFoundError):
            await c.create_move_task("missing", "a", "b")
        for bad in [lambda: c.create_copy_task("cm/0", ["nowhere"]), lambda: c.create_copy_task("cm/0", []),
                    lambda: c.create_move_task("cm/0", "a", "a"), lambda: c.create_move_task("cm/3", "a", "b"),
                    lambda: c.create_move_task("cm/0", "a", "nowhere"), lambda: c.query_task("x")]:
            with pytest.raises(InvalidArgumentError):
                await bad()
        with pytest.raises(TaskNotFoundError):
            await c.query_task((1, 1))
        with pytest.raises(InvalidKeyError):
            await c.create_copy_task("", ["b"])
        await c.get("cm/0")                  # the client is still usable
        assert len(master.model.tasks) == 6 and not master.model._repairs
        _assert_no_leak(master, objects=6)
        # the space in use is the live replicas' (a move's source freed), nothing more
        reps = [r for o in master.model.objects.values() for r in o.replicas]
        assert len(reps) == 3 * 3 + 3 and master.model.used == sum(r.length for r in reps)
    finally:
        for x in (c, *holders.values()):
            await x.close()
        await master.close()
