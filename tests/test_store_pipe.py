"""kvflow.store's pipelined batches on the caller's thread (direct.py's
_put_piped/_get_piped over pipeline.Pipe): a batch in chunks whose master
round trips overlap the other chunks' bytes. The same per-key results as
one call, no object visible before its bytes are written, nothing left
allocated or leased when a chunk fails, and the master's LRU order of
one call (the head most recent)."""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from kvflow.errors import PeerLostError
from kvflow.store import ObjectExistsError, ObjectNotFoundError, ReplicaUnavailableError, StoreClient, direct
from kvflow.store.calls import pipe_spans
from kvflow.store.records import State

from test_store_client import _assert_no_leak, _data, _pool

N, SIZE = 64, 64 << 10


def _columns(client, src: np.ndarray, dst: np.ndarray) -> tuple[list, list, list]:
    client.register_buffer(src)
    client.register_buffer(dst)
    return ([src.ctypes.data + i * SIZE for i in range(N)], [dst.ctypes.data + i * SIZE for i in range(N)],
            [SIZE] * N)


@contextlib.asynccontextmanager
async def _clients(segments: int = 1):
    """A holder `a` and a client `b` whose segment holds a batch too when
    `segments` is 2, else none (every replica on a's one segment: the
    master's put_start_one_segment)."""
    async with _pool(1, ("tcp",), master_tcp=True, segment_size=16 << 20) as (master, (a,)):
        b = await StoreClient(master.address, segment_size=(16 << 20) * (segments - 1), protocols=("tcp",)).start()
        try:
            yield master, a, b
        finally:
            await b.close()


def _chunks() -> list[range]:
    spans = pipe_spans(N, [SIZE] * N)
    assert len(spans) > 1 and spans[0].start > spans[-1].start      # pipelined, the tail first
    return spans


@pytest.mark.parametrize("segments", [1, 2])
async def test_a_pipelined_batch_matches_one_call(segments):
    async with _clients(segments) as (master, a, b):
        src, dst = _data(N * SIZE, 1), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"p/{i}" for i in range(N)]
        rt = b.metrics()["round_trips"]
        before = rt.get("batch_put_start", {}).get("count", 0), rt.get("batch_get_replicas", {}).get("count", 0)
        assert await asyncio.to_thread(direct.put_from, b, keys, la, sizes) == [1] * N
        # the LRU as one call leaves it: the head most recent, the tail first to go
        assert list(master.model._lru)[-N:] == keys[::-1]
        assert await asyncio.to_thread(direct.get_into, b, keys, da, sizes) == [SIZE] * N
        assert np.array_equal(dst, src)
        assert list(master.model._lru)[-N:] == keys[::-1]
        rt = b.metrics()["round_trips"]
        assert rt["batch_put_start"]["count"] == before[0] + len(_chunks())
        assert rt["batch_get_replicas"]["count"] == before[1] + len(_chunks())
        assert await a.get("p/33") == src[33 * SIZE:34 * SIZE].tobytes()
        # per-key results in a middle chunk: one existed (0), one exists with another size, one missing
        mid = _chunks()[1].start
        src2 = _data(N * SIZE, 2)
        la2, _, _ = _columns(b, src2, np.zeros(1, np.uint8))
        assert await a.put(f"q/{mid + 1}", b"x" * 10) == 1
        keys2 = [f"q/{i}" for i in range(N)]
        keys2[mid] = "p/0"
        got = await asyncio.to_thread(direct.put_from, b, keys2, la2, sizes)
        assert got[mid] == 0 and isinstance(got[mid + 1], ObjectExistsError)
        assert got[:mid] + got[mid + 2:] == [1] * (N - 2)
        asked = list(keys)
        asked[mid + 2] = "nope"
        got = await asyncio.to_thread(direct.get_into, b, asked, da, sizes)
        assert isinstance(got[mid + 2], ObjectNotFoundError) and got[:mid + 2] + got[mid + 3:] == [SIZE] * (N - 1)
        # every lease was released: removed without force
        gone = sorted(set(master.model.objects))
        assert len(gone) == 2 * N - 1 and await b.batch_remove(gone) == [None] * len(gone)
        _assert_no_leak(master)


async def test_a_pipelined_put_never_shows_an_object_before_its_bytes():
    async with _clients() as (master, a, b):
        src, dst = _data(N * SIZE, 3), np.zeros(N * SIZE, np.uint8)
        la, _, sizes = _columns(b, src, dst)
        keys = [f"v/{i}" for i in range(N)]
        moving, seen = direct._move, []

        def watched(client, op, by):
            # a reader on another client, while this chunk's bytes are not written:
            # none of the chunk's objects is visible (the others: visible means whole)
            chunk = [keys[(x - la[0]) // SIZE] for local, _, _ in by.values() for x in local]
            got = asyncio.run_coroutine_threadsafe(a.batch_get(keys), a._loop).result(5)
            for k, r in zip(keys, got):
                if k in chunk:
                    assert isinstance(r, ObjectNotFoundError), k
                elif not isinstance(r, ObjectNotFoundError):
                    i = keys.index(k)
                    assert r == src[i * SIZE:(i + 1) * SIZE].tobytes(), k
            seen.append(len(chunk))
            return moving(client, op, by)

        direct._move = watched
        try:
            assert await asyncio.to_thread(direct.put_from, b, keys, la, sizes) == [1] * N
        finally:
            direct._move = moving
        assert seen == [len(s) for s in _chunks()]
        got = await a.batch_get(keys)
        assert all(g == src[i * SIZE:(i + 1) * SIZE].tobytes() for i, g in enumerate(got))


class _Stop(BaseException):
    """A caller interrupted in a write (KeyboardInterrupt, as a test's own type)."""


@pytest.mark.parametrize("fault", ["holder", "connection", "interrupt"])
async def test_a_pipelined_put_whose_middle_chunk_fails(fault):
    """A holder failing in the middle chunk's write fails its keys alone; a
    connection lost there: the written chunks are committed, the rest put
    by the loop's funnel; an interrupt: what is not written goes back.
    Never anything left allocated."""
    async with _clients() as (master, a, b):
        src, dst = _data(N * SIZE, 4), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"f/{i}" for i in range(N)]
        mid = _chunks()[1]
        moving, calls = direct._move, []

        def failing(client, op, by):
            calls.append(op)
            if len(calls) == 2:
                if fault == "holder":
                    return {h: PeerLostError(f"{h} lost (test)", peer=h) for h in by}
                if fault == "connection":
                    # the master drops the joined connection the pipeline is on
                    for conn in list(master._connections):
                        if conn.session.joined:
                            client._loop.call_soon_threadsafe(conn.transport.abort)
                else:
                    raise _Stop()
            return moving(client, op, by)

        direct._move = failing
        try:
            if fault == "interrupt":
                with pytest.raises(_Stop):
                    await asyncio.to_thread(direct.put_from, b, keys, la, sizes)
                got = None
            else:
                got = await asyncio.to_thread(direct.put_from, b, keys, la, sizes)
        finally:
            direct._move = moving
        await asyncio.sleep(0.05)
        assert not any(o.state is State.ALLOCATED for o in master.model.objects.values())
        assert not any(c.writing for c in master.model.clients.values())
        if fault == "holder":
            assert all(isinstance(got[i], ReplicaUnavailableError) for i in mid)
            assert [r for i, r in enumerate(got) if i not in mid] == [1] * (N - len(mid))
        elif fault == "connection":
            assert got == [1] * N
        else:               # the first chunk (the tail) was committed before the interrupt
            assert sorted(master.model.objects) == sorted(keys[i] for i in _chunks()[0])
        done = [k for k in keys if k in master.model.objects]
        got = await b.batch_get_into(done, [da[keys.index(k)] for k in done], [SIZE] * len(done))
        assert got == [SIZE] * len(done)
        for k in done:
            i = keys.index(k)
            assert np.array_equal(dst[i * SIZE:(i + 1) * SIZE], src[i * SIZE:(i + 1) * SIZE])
        assert await b.batch_remove(done) == [None] * len(done)
        _assert_no_leak(master)


async def test_a_pipelined_get_whose_chunk_is_not_served_here_releases_every_lease():
    async with _clients() as (master, a, b):
        src, dst = _data(N * SIZE, 5), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"g/{i}" for i in range(N)]
        assert await b.batch_put_from(keys, la, sizes) == [1] * N
        moving, calls = direct._move, []

        def failing(client, op, by):
            calls.append(op)
            if len(calls) == 2:         # the middle chunk's holder fails: the loop's funnel reads the batch
                return {h: PeerLostError(f"{h} lost (test)", peer=h) for h in by}
            return moving(client, op, by)

        direct._move = failing
        try:
            assert await asyncio.to_thread(direct.get_into, b, keys, da, sizes) is None
        finally:
            direct._move = moving
        await asyncio.sleep(0.05)
        assert not master.model._leases         # every chunk's lease released, the one in flight too
        assert await b.batch_remove(keys) == [None] * N
        _assert_no_leak(master)


def test_put_start_of_a_batch_on_one_segment_as_put_start_per_key():
    from kvflow.store.master import Master
    m = Master(seed=1)
    s = m.session("t")
    m.dispatch(s, "register", ["c", "h", "e", 10.0, True])
    sid = m.dispatch(s, "mount", ["seg", 1 << 30, 1 << 20])
    assert m.dispatch(s, "batch_put_start", [[["old", 100, 1, None, False]], 1])["items"][0][0] == 0
    m.dispatch(s, "batch_put_end", [[["old", []]]])
    m.model.set_quota("t", 1000)
    items = [["a", 100, 1, None, False], ["old", 100, 1, None, False], ["b", 65, 1, sid, False],
             ["old", 7, 1, None, False], ["t\x1fq", 10, 1, None, False], ["p", 10, 1, None, True],
             ["", 10, 1, None, False], ["c", 0, 1, None, False], ["d", 1 << 20, 1, None, False]]
    assert m.model.put_start_one_segment("c", items, 0.0, 2) is None       # past the high watermark: evictions
    fast = m.model.put_start_one_segment("c", items[:-1], 0.0, 2)
    assert [r is not None for r in fast] == [True, False, True, False, False, False, False, False]
    for o in ("a", "b"):
        m.model.put_revoke("c", o)
    assert m.dispatch(s, "batch_put_start", [items[:4], 3])["items"][3][1] == "busy"     # a key twice
    m.model.put_revoke("c", "a")
    m.model.put_revoke("c", "b")
    out = m.dispatch(s, "batch_put_start", [items[:3] + items[4:-1], 3])["items"]
    assert [it[0] for it in out] == [0, 0, 0, 0, 0, 1, 1]     # the per-key path's answers where not common
    assert out[1] == [0, None] and out[0][1] == [[sid, (1 << 30) + m.model.objects["a"].replicas[0].offset]]
    offs = sorted(m.model.objects[k].replicas[0].offset for k in ("a", "b", "t\x1fq", "p"))
    assert len(set(offs)) == 4 and all(o % 64 == 0 for o in offs)
    assert m.model.objects["a"].state.name == "ALLOCATED" and m.model.objects["p"].pinned
    m.dispatch(s, "batch_put_end", [[[k, []] for k in ("a", "b", "t\x1fq", "p")]])
    assert m.dispatch(s, "batch_remove", [["a", "b", "t\x1fq", "p", "old"], True]) == [[0, None]] * 5
    seg = m.model.segments[sid]
    seg.alloc.check()
    assert m.model.used == 0 and seg.alloc.extents == 1


def test_allocate_run_lays_a_batch_end_to_end_each_released_alone():
    from kvflow.store.allocator import Allocator
    a = Allocator(1 << 20)
    first = a.allocate(1000)
    offs = a.allocate_run([64, 65, 1, 4096])
    assert offs == [1024, 1088, 1216, 1280] and a.used == 1024 + 64 + 128 + 64 + 4096
    for o in (offs[1], first, offs[3], offs[0], offs[2]):
        a.release(o)
        a.check()
    assert a.used == 0 and a.extents == 1
    assert Allocator(4096).allocate_run([4000, 100]) is None


@pytest.mark.parametrize("segments", [1, 2])
async def test_the_loops_pipelined_batch_matches_one_call(segments):
    async with _clients(segments) as (master, a, b):
        src, dst = _data(N * SIZE, 6), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"l/{i}" for i in range(N)]
        before = b.metrics()["round_trips"].get("batch_put_start", {}).get("count", 0)
        assert await b.batch_put_from(keys, la, sizes) == [1] * N
        assert b.metrics()["round_trips"]["batch_put_start"]["count"] == before + len(_chunks())
        assert list(master.model._lru)[-N:] == keys[::-1]
        assert await b.batch_get_into(keys, da, sizes) == [SIZE] * N
        assert np.array_equal(dst, src) and list(master.model._lru)[-N:] == keys[::-1]
        mid = _chunks()[1].start
        assert await a.put(f"m/{mid + 1}", b"x" * 10) == 1
        keys2 = [f"m/{i}" for i in range(N)]
        keys2[mid] = "l/0"
        got = await b.batch_put_from(keys2, la, sizes)
        assert got[mid] == 0 and isinstance(got[mid + 1], ObjectExistsError)
        assert got[:mid] + got[mid + 2:] == [1] * (N - 2)
        asked = list(keys)
        asked[mid + 2] = "nope"
        got = await b.batch_get_into(asked, da, sizes)
        assert isinstance(got[mid + 2], ObjectNotFoundError) and got[:mid + 2] + got[mid + 3:] == [SIZE] * (N - 1)
        gone = sorted(master.model.objects)
        assert len(gone) == 2 * N - 1 and await b.batch_remove(gone) == [None] * len(gone)    # no lease left
        _assert_no_leak(master)


@pytest.mark.parametrize("fault", ["holder", "cancel"])
async def test_the_loops_pipelined_put_whose_middle_chunk_fails(fault):
    async with _clients() as (master, a, b):
        src, dst = _data(N * SIZE, 7), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"c/{i}" for i in range(N)]
        mid = _chunks()[1]
        run, calls = b._mover.run, []

        async def failing(op, moves, *, timeout):
            calls.append(op)
            chunk = [keys[(x - la[0]) // SIZE] for x in moves.local]
            # not written yet: invisible to a reader; what is visible is whole
            for k, r in zip(keys, await a.batch_get(keys)):
                assert isinstance(r, ObjectNotFoundError) if k in chunk else (
                    isinstance(r, ObjectNotFoundError) or r == src[keys.index(k) * SIZE:][:SIZE].tobytes()), k
            if len(calls) == 2:
                assert chunk == [keys[i] for i in mid]
                if fault == "holder":
                    return {h: PeerLostError(f"{h} lost (test)", peer=h) for h in set(moves.holder)}
                put.cancel()
            return await run(op, moves, timeout=timeout)

        b._mover.run = failing
        put = asyncio.ensure_future(b.batch_put_from(keys, la, sizes))
        try:
            if fault == "cancel":
                with pytest.raises(asyncio.CancelledError):
                    await put
            else:
                got = await put
                assert all(isinstance(got[i], ReplicaUnavailableError) for i in mid)
                assert [r for i, r in enumerate(got) if i not in mid] == [1] * (N - len(mid))
        finally:
            b._mover.run = run
        await asyncio.sleep(0.05)
        assert not any(o.state is State.ALLOCATED for o in master.model.objects.values())
        assert not any(c.writing for c in master.model.clients.values())
        done = [k for k in keys if k in master.model.objects]
        expect = [k for i, k in enumerate(keys) if i not in mid] if fault == "holder" else \
            [keys[i] for i in _chunks()[0]]
        assert sorted(done) == sorted(expect)
        got = await b.batch_get_into(done, [da[keys.index(k)] for k in done], [SIZE] * len(done))
        assert got == [SIZE] * len(done)
        assert all(np.array_equal(dst[keys.index(k) * SIZE:][:SIZE], src[keys.index(k) * SIZE:][:SIZE]) for k in done)
        assert await b.batch_remove(done) == [None] * len(done)
        assert await b._mover.idle(0.05)
        _assert_no_leak(master)


async def test_the_loops_pipelined_get_cancelled_releases_every_lease():
    async with _clients() as (master, a, b):
        src, dst = _data(N * SIZE, 8), np.zeros(N * SIZE, np.uint8)
        la, da, sizes = _columns(b, src, dst)
        keys = [f"r/{i}" for i in range(N)]
        assert await b.batch_put_from(keys, la, sizes) == [1] * N
        run, calls = b._mover.run, []

        async def slow(op, moves, *, timeout):
            calls.append(op)
            if len(calls) == 2:
                get.cancel()
            return await run(op, moves, timeout=timeout)

        b._mover.run = slow
        get = asyncio.ensure_future(b.batch_get_into(keys, da, sizes))
        try:
            with pytest.raises(asyncio.CancelledError):
                await get
        finally:
            b._mover.run = run
        await asyncio.sleep(0.05)
        assert not master.model._leases
        assert await b.batch_remove(keys) == [None] * N
        _assert_no_leak(master)
