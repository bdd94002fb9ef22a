"""kvflow.store's puts and gets on the caller's own thread
(kvflow/store/direct.py: the Mooncake API's path), against a master on
tcp in this process and real kvflow engines: the same results as the
loop's funnels, the two-phase put kept, and the fallbacks (a broken
connection, a call the path does not serve) leaving nothing behind."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvflow.store import BufferTooSmallError, MasterUnavailableError, ObjectNotFoundError, direct

from test_store_client import _assert_no_leak, _data, _polled_while_written, _pool


async def test_puts_and_gets_on_a_callers_thread_match_the_loops():
    async with _pool(2, ("tcp",), master_tcp=True, segment_size=8 << 20) as (master, (a, b)):
        src, dst = _data(32 * 4096, 1), np.zeros(33 * 4096, np.uint8)
        b.register_buffer(src)
        b.register_buffer(dst)
        keys = [f"d/{i}" for i in range(32)]
        addrs = [src.ctypes.data + i * 4096 for i in range(32)]
        before = b.metrics()["round_trips"].get("batch_put_start", {}).get("count", 0)
        assert await asyncio.to_thread(direct.put_from, b, keys, addrs, [4096] * 32) == [1] * 32
        assert b._joined is not None and any(s.joined for s in master.sessions)
        assert b.metrics()["round_trips"]["batch_put_start"]["count"] == before + 1
        assert await asyncio.to_thread(direct.put_from, b, keys[:2], addrs[:2], [4096] * 2) == [0, 0]  # existed
        # the loop's get reads what the caller's thread wrote, and the other way round
        assert await a.get("d/5") == src[5 * 4096:6 * 4096].tobytes()
        got = await asyncio.to_thread(direct.get_into, b, keys + ["nope"], [dst.ctypes.data + i * 4096
                                                                              for i in range(33)], [4096] * 33)
        assert got[:32] == [4096] * 32 and isinstance(got[32], ObjectNotFoundError)
        assert np.array_equal(dst[:32 * 4096], src)
        small = await asyncio.to_thread(direct.get_into, b, ["d/0"], [dst.ctypes.data], [100])
        assert isinstance(small[0], BufferTooSmallError)
        # bytes through the local buffer
        assert await asyncio.to_thread(direct.put_bytes, b, ["s/1"], [memoryview(b"hello")]) == [1]
        assert await asyncio.to_thread(direct.get_bytes, b, ["s/1", "s/2"]) is not None
        out = await asyncio.to_thread(direct.get_bytes, a, ["s/1", "s/2"])
        assert out[0] == b"hello" and isinstance(out[1], ObjectNotFoundError)
        assert b.local_buffer_in_use == 0 and a.local_buffer_in_use == 0
        # every lease was released: the objects go at once, without force
        assert await b.batch_remove(keys + ["s/1"]) == [None] * 33
        _assert_no_leak(master)


async def test_the_loops_own_thread_and_an_in_process_master_are_not_served():
    async with _pool(1, ("tcp",)) as (master, (a,)):          # the master in process: no tcp to join
        assert await asyncio.to_thread(direct.put_bytes, a, ["k"], [memoryview(b"x")]) is None
    async with _pool(1, ("tcp",), master_tcp=True) as (master, (a,)):
        assert direct.put_bytes(a, ["k"], [memoryview(b"x")]) is None     # the loop's thread: never block it
        assert a.local_buffer_in_use == 0


async def test_join_needs_the_clients_token_and_its_connection_loses_no_one():
    async with _pool(1, ("tcp",), master_tcp=True) as (master, (a,)):
        bad = direct.JoinedQuery(master.address, 5.0, a.client_id, "not-the-token")
        with pytest.raises(MasterUnavailableError):
            await asyncio.to_thread(bad.join)
        pool = direct.JoinedPool(master.address, 5.0, a.client_id, "not-the-token")
        with pytest.raises(direct.NotJoinedError):
            await asyncio.to_thread(pool.call, "stats")
        assert pool.refused                 # not asked again: the loop's funnel serves such a client
        assert await asyncio.to_thread(direct.put_bytes, a, ["kept"], [memoryview(b"v")]) == [1]
        a._joined.close()                   # the joined connection goes: the client and its objects stay
        await asyncio.sleep(0.05)
        assert a.client_id in master.model.clients and await a.get("kept") == b"v"
        assert await asyncio.to_thread(direct.get_bytes, a, ["kept"]) == [b"v"]      # joined again


async def test_a_broken_connection_falls_back_and_leaves_nothing_allocated():
    async with _pool(2, ("tcp",), master_tcp=True) as (master, (a, b)):
        assert await asyncio.to_thread(direct.put_bytes, a, ["first"], [memoryview(b"1")]) == [1]
        a._joined._idle[0]._sock.close()    # the connection breaks under the next call
        assert await asyncio.to_thread(direct.put_bytes, a, ["second"], [memoryview(b"2")]) is None
        assert not any(o.state.name == "ALLOCATED" for o in master.model.objects.values())
        assert await a.put("second", b"2") == 1          # the key is free: the loop's funnel puts it
        assert await asyncio.to_thread(direct.get_bytes, b, ["second"]) == [b"2"]
        _assert_no_leak(master, objects=2)


async def test_a_reader_never_sees_an_object_put_from_a_thread_before_its_commit():
    async with _pool(2, ("tcp",), master_tcp=True, segment_size=64 << 20,
                     local_buffer_size=64 << 20) as (master, (a, b)):
        v = _data(24 << 20, 9).tobytes()
        for round_ in range(3):
            key = f"half/{round_}"
            put = asyncio.ensure_future(asyncio.to_thread(direct.put_bytes, a, [key], [memoryview(v)]))
            assert await _polled_while_written(put, b, key, v) == [1]


async def test_a_put_on_the_loop_waiting_for_local_buffer_room_is_woken_by_a_thread():
    async with _pool(1, ("tcp",), master_tcp=True, local_buffer_size=1 << 20) as (master, (a,)):
        held = a._stage_now([900 << 10])             # most of the buffer, as a caller's thread holds it
        put = asyncio.ensure_future(a.put("waits", b"w" * (600 << 10)))
        await asyncio.sleep(0.1)
        assert not put.done()
        t0 = time.monotonic()
        await asyncio.to_thread(a._unstage_now, held)
        assert await asyncio.wait_for(put, 5) == 1 and time.monotonic() - t0 < 2


def test_single_columns_checks_each_range_or_the_batchs_span_at_once():
    from kvflow.store.calls import single_columns
    starts, ends = [1000, 5000], [2000, 6000]
    assert single_columns(["a", "b"], [1000, 1990], [10, 10], starts, ends) == ([1000, 1990], [10, 10])
    assert single_columns(("a", "b"), (1000, 5000), (10, 10), starts, ends) == ([1000, 5000], [10, 10])  # two regions
    for addrs, sizes in (([1000, 1995], [10, 10]), ([1000, 2500], [10, 10]), ([999], [1]), ([1000], [0]),
                         ([1000], [True]), ([1000.0], [1]), ([1000, 1001], [1])):
        assert single_columns(["a", "b"][:len(addrs)], addrs, sizes, starts, ends) is None, (addrs, sizes)
    assert single_columns(["a\x1fb"], [1000], [1], starts, ends) == ([1000], [1])   # a master's (prefixed) name
    assert single_columns([""], [1000], [1], starts, ends) is None


async def test_callers_on_several_threads_each_get_a_connection():
    async with _pool(2, ("tcp",), master_tcp=True, local_buffer_size=8 << 20) as (master, (a, b)):
        def worker(t: int) -> None:
            for i in range(20):
                assert direct.put_bytes(a, [f"t{t}/{i}"], [memoryview(bytes([t]) * 1000)]) == [1]
                assert direct.get_bytes(b, [f"t{t}/{i}"]) == [bytes([t]) * 1000]
        await asyncio.gather(*(asyncio.to_thread(worker, t) for t in range(4)))
        assert 1 <= len(a._joined._idle) <= 4
        # a connection broken by a late reply (a loaded host) is closed and
        # made again by its next call: only the open ones act on the master
        live = [q for c in (a, b) for q in c._joined._idle if q._sock is not None and q._joined]
        for _ in range(100):        # a session closed by the client leaves the master when it reads the EOF
            if sum(s.joined for s in master.sessions if not s.closed) == len(live):
                break
            await asyncio.sleep(0.02)
        assert sum(s.joined for s in master.sessions if not s.closed) == len(live)
        await a.close()
        assert a._joined is None and not any(s.joined and s.client_id == a.client_id for s in master.sessions
                                             if not s.closed)
        # what a's segment held went with it; what b's holds stays, nothing else
        assert all(r.segment == b.segment_id for o in master.model.objects.values() for r in o.replicas)
        _assert_no_leak(master, objects=len(master.model.objects))


async def test_a_put_on_a_callers_thread_keeps_its_client_from_saying_its_writes_are_over():
    """A client re-attaching to a new leader says none of its writes is in
    progress (the leader's fence lifts on it, fence.py): a put on a caller's
    thread counts from before its put_start is sent until its writes end."""
    async with _pool(2, ("tcp",), master_tcp=True, segment_size=8 << 20) as (master, (a, b)):
        src = _data(4 * 4096, 3)
        b.register_buffer(src)
        seen: list[bool] = []
        writing = direct._move

        def watched(client, op, by, *start_by):
            # the loop's idle() from inside the write: it must not see the client idle
            seen.append(asyncio.run_coroutine_threadsafe(client._mover.idle(0.05), client._loop).result(5))
            return writing(client, op, by, *start_by)

        direct._move = watched
        try:
            keys = [f"w/{i}" for i in range(4)]
            addrs = [src.ctypes.data + i * 4096 for i in range(4)]
            assert await asyncio.to_thread(direct.put_from, b, keys, addrs, [4096] * 4) == [1] * 4
        finally:
            direct._move = writing
        assert seen == [False]
        assert await b._mover.idle(0.05)            # over: idle again
        assert await a.get("w/2") == src[2 * 4096:3 * 4096].tobytes()
