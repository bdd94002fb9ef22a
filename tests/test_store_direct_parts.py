"""kvflow.store's puts and gets of objects made of several buffers on the
caller's own thread (kvflow/store/direct.py put_from_parts,
get_into_parts: SGLang HiCache's K and V pages, the Mooncake API's
multi-buffer calls), against a master on tcp in this process and real
kvflow engines: every byte and every result the same as the loop's
funnels (batch_put_from_parts, batch_get_into_parts), and the calls the
path does not serve handed back before anything was done."""
from __future__ import annotations

import asyncio

import numpy as np

from kvflow.errors import UnregisteredMemoryError
from kvflow.store import BufferTooSmallError, ObjectNotFoundError, direct

from test_store_client import _assert_no_leak, _data, _pool

# per object the sizes of its parts: one, two (K and V), three uneven
SHAPES = [[4096], [2048, 2048], [1000, 3000, 96], [512, 512], [7], [4096, 1]]


def _layout(base: int, shapes: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Each object's parts laid out one after another from `base`, a gap
    of 64 bytes between parts (so a part never runs into the next)."""
    parts, at = [], base
    for sizes in shapes:
        ps = []
        for n in sizes:
            ps.append((at, n))
            at += n + 64
        parts.append(ps)
    return parts


def _bytes_of(buf: np.ndarray, parts: list[tuple[int, int]]) -> bytes:
    base = buf.ctypes.data
    return b"".join(buf[a - base:a - base + n].tobytes() for a, n in parts)


def _same(x: list, y: list) -> bool:
    """Per key the same result: equal values, or errors of one type and message."""
    return all(type(p) is type(q) and (str(p) == str(q) if isinstance(p, BaseException) else p == q)
               for p, q in zip(x, y, strict=True))


async def test_parts_put_and_get_on_a_callers_thread_match_the_loops_byte_for_byte():
    async with _pool(2, ("tcp",), master_tcp=True, segment_size=8 << 20) as (master, (a, b)):
        src, dst, ref = _data(1 << 16, 3), np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
        for buf in (src, dst, ref):
            b.register_buffer(buf)
        parts = _layout(src.ctypes.data, SHAPES)
        direct_keys, loop_keys = [f"p/d{i}" for i in range(len(SHAPES))], [f"p/l{i}" for i in range(len(SHAPES))]
        put = await asyncio.to_thread(direct.put_from_parts, b, direct_keys, parts)
        assert put == await b.batch_put_from_parts(loop_keys, parts) == [1] * len(SHAPES)
        # an existing key: 0, as the loop's
        assert await asyncio.to_thread(direct.put_from_parts, b, direct_keys[:2], parts[:2]) == [0, 0]
        # the object is its parts concatenated, whoever reads it
        for k, ps in zip(direct_keys, parts):
            assert await a.get(k) == _bytes_of(src, ps)
        # the direct get fills each object's parts as the loop's does, also
        # the loop's objects and across the two clients
        for keys in (direct_keys, loop_keys):
            dparts, lparts = _layout(dst.ctypes.data, SHAPES), _layout(ref.ctypes.data, SHAPES)
            dst[:] = 0xAB
            ref[:] = 0xAB
            got = await asyncio.to_thread(direct.get_into_parts, b, keys, dparts)
            assert got == await b.batch_get_into_parts(keys, lparts) == [sum(s) for s in SHAPES]
            assert np.array_equal(dst, ref)
            assert all(_bytes_of(dst, ps) == _bytes_of(src, qs) for ps, qs in zip(dparts, parts))
        # buffers larger than the objects: the parts filled in order, the
        # rest untouched; a missing key; a buffer too small: the loop's results
        a.register_buffer(dst)
        a.register_buffer(ref)
        keys = [direct_keys[2], direct_keys[1], "p/missing", direct_keys[0]]
        room = [[600, 600, 3000], [1024, 4000], [10], [2000, 2000]]     # the last is 96 bytes short
        dparts, lparts = _layout(dst.ctypes.data, room), _layout(ref.ctypes.data, room)
        dst[:] = 0xCD
        ref[:] = 0xCD
        got = await asyncio.to_thread(direct.get_into_parts, a, keys, dparts)
        assert got is not None and _same(got, await a.batch_get_into_parts(keys, lparts))
        assert got[:2] == [4096, 4096] and isinstance(got[2], ObjectNotFoundError)
        assert isinstance(got[3], BufferTooSmallError)
        assert np.array_equal(dst, ref)
        assert _bytes_of(dst, dparts[0])[:4096] == _bytes_of(src, parts[2])
        assert (dst[dparts[3][0][0] - dst.ctypes.data:][:4000] == 0xCD).all()      # nothing read
        assert a.metrics()["errors"]["get"] >= 2
        # every lease was released: the objects go at once, without force
        assert await b.batch_remove(direct_keys + loop_keys) == [None] * (2 * len(SHAPES))
        _assert_no_leak(master)


async def test_a_part_outside_registered_memory_is_the_loops_typed_error_and_nothing_is_written():
    async with _pool(1, ("tcp",), master_tcp=True) as (master, (a,)):
        src, stray = _data(1 << 14, 4), _data(4096, 5)
        a.register_buffer(src)
        parts = _layout(src.ctypes.data, [[100, 200], [300]])
        parts[0][1] = (stray.ctypes.data, 200)          # K registered, V not
        keys = ["u/0", "u/1"]
        assert await asyncio.to_thread(direct.put_from_parts, a, keys, parts) is None
        assert not master.model.objects and await a.batch_exists(keys) == [False, False]
        assert await asyncio.to_thread(direct.get_into_parts, a, keys, parts) is None
        # the loop's funnel gives that object its typed error, and puts the other
        put = await a.batch_put_from_parts(keys, parts)
        assert isinstance(put[0], UnregisteredMemoryError) and put[1] == 1
        got = await a.batch_get_into_parts(keys, parts)
        assert isinstance(got[0], UnregisteredMemoryError) and got[1] == 300
        # neither is a part that is not an (int, int) pair, nor no part at all
        assert await asyncio.to_thread(direct.put_from_parts, a, ["u/2"], [[(src.ctypes.data, 0)]]) is None
        assert await asyncio.to_thread(direct.put_from_parts, a, ["u/2"], [[]]) is None
        assert await asyncio.to_thread(direct.get_into_parts, a, ["u/1"], [[(float(src.ctypes.data), 8)]]) is None
        assert list(master.model.objects) == ["u/1"]


async def test_one_part_objects_through_the_parts_entries_are_put_from_and_get_into():
    async with _pool(2, ("tcp",), master_tcp=True) as (master, (a, b)):
        src, dst = _data(8 * 1024, 6), np.zeros(8 * 1024, np.uint8)
        b.register_buffer(src)
        b.register_buffer(dst)
        keys = [f"o/{i}" for i in range(8)]
        parts = [[(src.ctypes.data + i * 1024, 1024)] for i in range(8)]
        assert await asyncio.to_thread(direct.put_from_parts, b, keys, parts) == [1] * 8
        got = await asyncio.to_thread(direct.get_into, b, keys, [dst.ctypes.data + i * 1024 for i in range(8)],
                                      [1024] * 8)
        assert got == [1024] * 8 and np.array_equal(src, dst)
        m = b.metrics()
        assert m["puts"]["stored"] == 8 and m["bytes"]["put"]["dram"] == 8 * 1024


async def test_parts_calls_on_several_threads_at_once():
    async with _pool(2, ("tcp",), master_tcp=True, segment_size=8 << 20) as (master, (a, b)):
        shapes = [[1024, 1024], [512, 1536], [2048]]
        bufs = [(_data(1 << 14, 10 + t), np.zeros(1 << 14, np.uint8)) for t in range(4)]
        for src, dst in bufs:
            a.register_buffer(src)
            b.register_buffer(dst)

        def worker(t: int) -> None:
            src, dst = bufs[t]
            for i in range(10):
                keys = [f"t{t}/{i}/{j}" for j in range(len(shapes))]
                parts = _layout(src.ctypes.data + i * 16, shapes)
                assert direct.put_from_parts(a, keys, parts) == [1] * len(shapes)
                into = _layout(dst.ctypes.data, shapes)
                assert direct.get_into_parts(b, keys, into) == [2048] * len(shapes)
                assert all(_bytes_of(dst, p) == _bytes_of(src, q) for p, q in zip(into, parts))
        await asyncio.gather(*(asyncio.to_thread(worker, t) for t in range(4)))
        assert 1 <= len(a._joined._idle) <= 4
        assert len(master.model.objects) == 4 * 10 * len(shapes)
        assert not any(o.state.name == "ALLOCATED" for o in master.model.objects.values())
