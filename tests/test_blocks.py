"""Prepared descriptor lists (kvflow.engine.blocks): blocks named once and
moved by index on every provider; bad lists and bad indices refused with a
typed error, nothing moved, the engine still usable."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvflow
from kvflow.engine.blocks import first_outside, locate
from kvflow.memory import CUDA, HOST, Access, RemoteRegion
from kvflow.regions import host_table

from _batches import bounded
from _providers import closed_leaks, params, skip_unavailable

PAGE = 4096
PAGES = 64
PROTOCOLS = params("local", "tcp", "rdma")


class Pair:
    pass


async def open_pair(protocol):
    skip_unavailable(protocol)
    p = Pair()
    p.a = kvflow.Engine(protocols=(protocol,))
    p.b = kvflow.Engine(protocols=(protocol,))
    await bounded(p.a.start())
    await bounded(p.b.start())
    p.src = np.random.default_rng(7).integers(0, 256, PAGE * PAGES, dtype=np.uint8)
    p.dst = np.zeros(PAGE * PAGES, np.uint8)
    p.ls, p.rd = p.a.register(p.src), p.b.register(p.dst)
    p.peer = await bounded(p.a.connect(p.b.address))
    offs = np.arange(PAGES, dtype=np.uint64) * PAGE
    p.local = p.a.blocks(p.ls.addr + offs, PAGE)
    p.remote = p.peer.blocks(p.rd.addr + offs, PAGE)
    p.plan = p.peer.prepare(p.local, p.remote)
    return p


async def close_pair(p):
    await p.a.close()
    await p.b.close()
    assert not closed_leaks(p.a.counters()), p.a.counters()
    assert not closed_leaks(p.b.counters()), p.b.counters()


def page(buf, i):
    return bytes(buf[i * PAGE:(i + 1) * PAGE])


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_write_and_read_by_index(protocol):
    p = await open_pair(protocol)
    try:
        await bounded(p.plan.write([3, 7, 9], [0, 1, 2]))
        assert [page(p.dst, j) for j in (0, 1, 2)] == [page(p.src, i) for i in (3, 7, 9)]
        assert not p.dst[3 * PAGE:].any(), "bytes landed outside the three named blocks"
        await bounded(p.plan.write_nowait(np.arange(10, 20)))        # the same indices on both sides
        assert all(page(p.dst, i) == page(p.src, i) for i in range(10, 20))
        p.src[:] = 0
        await bounded(p.plan.read(np.array([0, 1], np.int32), [12, 13]))  # remote blocks 12, 13 back into 0, 1
        assert page(p.src, 0) == page(p.dst, 12) and page(p.src, 1) == page(p.dst, 13)
        # a blocking caller, and the post-then-poll one (threads that are not the loop)
        p.src[:] = 5
        await bounded(asyncio.to_thread(p.plan.write_blocking, [30], [31]))
        posted = await bounded(asyncio.to_thread(p.plan.post_write, [40, 41], [42, 43]))
        await bounded(asyncio.to_thread(posted.wait, 10))
        assert page(p.dst, 31) == page(p.dst, 42) == page(p.dst, 43) == bytes([5]) * PAGE
    finally:
        await close_pair(p)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_bad_indices_move_nothing(protocol):
    p = await open_pair(protocol)
    try:
        for local, remote, match in (([0, PAGES], [0, 1], "local index 64"),
                                     ([0, -1], [0, 1], "local index -1"),
                                     ([0, 1], [0, 99], "remote index 99"),
                                     ([0, 1, 2], [0, 1], "3 local and 2 remote"),
                                     ([], [], "empty batch"),
                                     ([[0, 1]], [[0, 1]], "1-D")):
            with pytest.raises(kvflow.InvalidArgumentError, match=match):
                await bounded(p.plan.write(local, remote))
        with pytest.raises(kvflow.InvalidArgumentError):
            p.plan.write_nowait([0.5], [1])
        assert not p.dst.any(), "a refused transfer moved bytes"
        await bounded(p.plan.write([5]))                             # still usable
        assert page(p.dst, 5) == page(p.src, 5)
    finally:
        await close_pair(p)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_paired_lengths_must_match(protocol):
    p = await open_pair(protocol)
    try:
        offs = np.arange(4, dtype=np.uint64) * 2 * PAGE
        halves = p.peer.blocks(p.rd.addr + offs, [PAGE, PAGE // 2, PAGE, PAGE])
        plan = p.peer.prepare(p.local, halves)
        with pytest.raises(kvflow.LengthMismatchError, match="position 1, local block 1 has 4096 bytes and "
                           "remote block 1 2048") as e:
            await bounded(plan.write([0, 1, 2]))
        assert e.value.index == 1
        assert not p.dst.any()
        await bounded(plan.write([0, 2], [0, 3]))
        assert page(p.dst, 0) == page(p.src, 0) and page(p.dst, 6) == page(p.src, 2)
    finally:
        await close_pair(p)


async def test_adjacent_blocks_merge_within_one_region():
    """A run of picks that continues on both sides is one entry (NIXL's
    descriptor merge); not across two regions that happen to be adjacent,
    and not with merge=False."""
    p = await open_pair("local")
    try:
        la, ra, ln = p.plan.pick([3, 4, 5, 9, 10], [10, 11, 12, 0, 1])
        assert la.tolist() == [p.ls.addr + 3 * PAGE, p.ls.addr + 9 * PAGE]
        assert ra.tolist() == [p.rd.addr + 10 * PAGE, p.rd.addr]
        assert ln.tolist() == [3 * PAGE, 2 * PAGE]
        assert len(p.plan.pick([3, 4, 5], [10, 12, 13])[0]) == 2        # the remote side skips a page
        assert len(p.plan.pick([4, 3], [11, 10])[0]) == 2               # backwards: not a continuation
        assert len(p.plan.pick([3, 4, 5], [10, 11, 12], merge=False)[0]) == 3
        # two regions side by side in one buffer: blocks of each, never one entry over both
        buf = np.zeros(4 * PAGE, np.uint8)
        r1 = p.b.register(buf[:2 * PAGE])
        r2 = p.b.register(buf[2 * PAGE:])
        await bounded(p.peer.refresh())
        split = p.peer.blocks(r1.addr + np.arange(4, dtype=np.uint64) * PAGE, PAGE)
        assert split.spans[1] != split.spans[2]
        plan = p.peer.prepare(p.local, split)
        la, ra, ln = plan.pick([0, 1, 2, 3])
        assert ln.tolist() == [2 * PAGE, 2 * PAGE] and ra.tolist() == [r1.addr, r2.addr]
        await bounded(plan.write([0, 1, 2, 3]))
        assert bytes(buf) == bytes(p.src[:4 * PAGE])
        p.b.deregister(r1)
        p.b.deregister(r2)
    finally:
        await close_pair(p)


async def test_lists_are_checked_once_against_their_memory():
    p = await open_pair("local")
    try:
        with pytest.raises(kvflow.UnregisteredMemoryError, match="block 2 .* not inside this engine's") as e:
            p.a.blocks([p.ls.addr, p.ls.addr + PAGE, p.ls.addr + PAGE * PAGES - 100], PAGE)
        assert e.value.index == 2
        with pytest.raises(kvflow.RemoteAccessError, match=f"block 0 .* memory peer {p.b.address}"):
            p.peer.blocks([p.ls.addr], PAGE)                     # ours, not the peer's
        with pytest.raises(kvflow.RemoteAccessError, match="block 0"):
            p.peer.blocks([2 ** 64 - PAGE // 2], PAGE)           # wraps around the address space
        for addrs, lengths, match in (([p.ls.addr], 0, "length must be > 0"),
                                      ([p.ls.addr, p.ls.addr], [PAGE, 0], "block 1 has length 0"),
                                      ([p.ls.addr], [PAGE, PAGE], "1 block addresses and 2 lengths"),
                                      ([-5], PAGE, "negative"),
                                      (["x"], PAGE, "integers"),
                                      ([[p.ls.addr]], PAGE, "1-D")):
            with pytest.raises(kvflow.InvalidArgumentError, match=match):
                p.a.blocks(addrs, lengths)
        # the wrong list on each side
        with pytest.raises(kvflow.InvalidArgumentError, match="first list is of peer"):
            p.peer.prepare(p.remote, p.remote)
        with pytest.raises(kvflow.InvalidArgumentError, match="second list"):
            p.peer.prepare(p.local, p.local)
        with pytest.raises(kvflow.InvalidArgumentError, match="two kvflow.Blocks"):
            p.peer.prepare(p.local, [(p.rd.addr, PAGE)])
        # a list keeps its own copy: the caller's arrays may change afterwards
        addrs = p.ls.addr + np.arange(2, dtype=np.uint64) * PAGE
        lens = np.full(2, PAGE, np.uint64)
        mine = p.a.blocks(addrs, lens)
        addrs[:] = 0
        lens[:] = 1
        assert mine[1] == (p.ls.addr + PAGE, PAGE) and lens.flags.writeable
        assert len(mine) == 2 and mine.nbytes == 2 * PAGE
        with pytest.raises(ValueError):
            mine.addrs[0] = 1
    finally:
        await close_pair(p)


async def test_a_list_of_deregistered_memory_fails_typed():
    """A list checked at prepare time is still checked per batch: after the
    peer deregisters its memory, a transfer fails as an address array would,
    and nothing lands."""
    p = await open_pair("tcp")
    try:
        p.b.deregister(p.rd)
        await bounded(p.peer.refresh())
        with pytest.raises(kvflow.KVFlowError):
            await bounded(p.plan.write([0, 1]))
        assert not p.dst.any()
    finally:
        await close_pair(p)


def test_first_outside():
    spans = [(100, 200), (300, 400)]
    a = np.array([100, 150, 300, 390], np.uint64)
    assert first_outside(spans, a, np.array([100, 50, 100, 10], np.uint64)) == -1
    assert first_outside(spans, a, np.array([100, 51, 100, 10], np.uint64)) == 1
    assert first_outside(spans, np.array([250], np.uint64), np.array([1], np.uint64)) == 0
    assert first_outside(spans, np.array([50], np.uint64), np.array([1], np.uint64)) == 0
    assert first_outside([], np.array([50], np.uint64), np.array([1], np.uint64)) == 0
    assert first_outside([], np.array([], np.uint64), np.array([], np.uint64)) == -1
    assert locate(spans, a, np.array([100, 50, 100, 11], np.uint64)).tolist() == [0, 0, 1, -1]


# ---------------------------------------------------------------- kvflow.regions: the one lookup


def _scan(regions, addr: int, n: int, need: int) -> bool:
    """The linear scans Engine._holds_host (need 0) and Peer.holds_host
    (need READ or WRITE) were, word for word: the reference."""
    if not need:
        return any(r.kind == HOST and r.addr <= addr and addr + n <= r.end for r in regions)
    return any(r.kind == HOST and r.addr <= addr and addr + n <= r.end and int(r.access) & need
               for r in regions)


def test_host_table_holds_what_the_linear_scan_held():
    """host_table(regions).holds() against the scan it replaced, on random
    layouts of host and GPU regions (gaps, adjacent regions, every access)
    and ranges at and across their edges, empty ones included."""
    rng = np.random.default_rng(41)
    accesses = [Access(0), Access.READ, Access.WRITE, Access.READ | Access.WRITE]
    for _ in range(200):
        regions, addr = [], int(rng.integers(0, 64))
        for _ in range(int(rng.integers(0, 8))):
            length = int(rng.integers(1, 64))
            regions.append(RemoteRegion(addr, length, None, accesses[int(rng.integers(4))],
                                        kind=HOST if rng.random() < 0.7 else CUDA))
            addr += length + int(rng.integers(0, 3)) * int(rng.integers(0, 16))     # adjacent a third of the time
        table = host_table(regions[::-1])           # any order in
        edges = sorted({e for r in regions for e in (r.addr, r.end)} | {0, addr + 8})
        for a in edges + [int(x) for x in rng.integers(0, addr + 8, 24)]:
            for d in (-1, 0, 1):
                for n in (0, 1, 7, 63):
                    start = max(0, a + d)
                    for need in (0, Access.READ, Access.WRITE):
                        assert table.holds(start, n, need) == _scan(regions, start, n, need), \
                            (regions, start, n, need)
    assert not host_table([]).holds(0, 0)


async def test_engine_and_peer_host_lookups_follow_register_and_deregister(make_engine):
    """The engine's table (its paths' holds_host) and a peer's (refreshed
    from the peer's regions) follow register() and deregister(); a peer's
    asks for the access a write or a read needs."""
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    rw, ro = np.zeros(8192, np.uint8), np.zeros(4096, np.uint8)
    r_rw = b.register(rw, name="rw")
    r_ro = b.register(ro, name="ro", access=Access.READ)
    assert b._holds_host(r_rw.addr, 8192) and b._holds_host(r_ro.addr + 4095, 1)
    assert not b._holds_host(r_rw.addr + 1, 8192)          # runs past the end
    peer = await bounded(a.connect(b.address))
    assert peer.holds_host(r_rw.addr, 8192, write=True) and peer.holds_host(r_rw.addr, 8192, write=False)
    assert peer.holds_host(r_ro.addr, 4096, write=False) and not peer.holds_host(r_ro.addr, 4096, write=True)
    assert not peer.holds_host(r_rw.addr + 4096, 8192, write=False)
    b.deregister(r_rw)
    assert not b._holds_host(r_rw.addr, 1) and b._holds_host(r_ro.addr, 4096)
    await bounded(peer.refresh())
    assert not peer.holds_host(r_rw.addr, 1, write=False) and peer.holds_host(r_ro.addr, 1, write=False)
    again = b.register(rw, name="rw")
    assert b._holds_host(again.addr, 8192)
