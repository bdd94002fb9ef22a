"""Data-path tests, run on every provider (tcp, local, local-xproc, tcp-xproc).

Each test moves random batches (1 to 4096 entries, 1 B to 64 MiB, unaligned,
non-overlapping) and checks the result byte for byte against a reference copy
made with numpy; the fixtures check the guard bytes around every region after
the test.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

import kvflow
from _batches import TIME_SCALE, KiB, MiB, apply_entries, as_arg, bounded, first_bad_entry, log_uniform, place, sha256, split
from _target import pattern

BIG = 66 * MiB  # room for one 64 MiB entry at a random, unaligned offset
BIG_REGIONS = [{"name": "rw", "length": BIG, "access": 3}]


def _plans():
    """Batch shapes: (id, lengths(rng)). About 90 MiB per direction in total."""
    return [
        ("one-64MiB", lambda rng: np.array([64 * MiB], np.uint64)),
        ("one-byte", lambda rng: np.array([1], np.uint64)),
        ("4096-tiny", lambda rng: log_uniform(rng, 1, 2 * KiB, 4096)),
        ("many-small", lambda rng: log_uniform(rng, 1, 64 * KiB, int(rng.integers(1, 1001)))),
        ("16-medium", lambda rng: log_uniform(rng, 1, 4 * MiB, 16)),
        ("small+16MiB", lambda rng: rng.permutation(np.append(log_uniform(rng, 1, 4 * KiB, 64), np.uint64(16 * MiB)))),
        ("256-mixed", lambda rng: log_uniform(rng, 1, 256 * KiB, 256)),
        ("3-exact-pages", lambda rng: np.array([4096, 8192, 65536], np.uint64)),
    ]


async def test_peer_view(pair):
    """peer.address / transport / regions describe the target as it registered them."""
    p = pair
    assert p.peer.address == p.target.address
    assert p.peer.transport == p.provider.protocol
    remote = {r.name: r for r in p.peer.regions}
    for name, info in p.target.regions.items():
        assert name in remote, f"{name} missing from peer.regions {list(remote)}"
        r = remote[name]
        assert (int(r.addr), int(r.length), int(r.access)) == (info.addr, info.length, info.access)
        one = p.peer.region(name)
        assert (one.name, int(one.addr), int(one.length), int(one.access)) == (name, info.addr, info.length, info.access)
    with pytest.raises(KeyError):
        p.peer.region("no-such-region")
    # connect() is cached per address
    assert await bounded(p.eng.connect(p.target.address)) is p.peer


@pytest.mark.parametrize("direction", ["write", "read"])
async def test_random_batches(make_pair, local_mem, direction):
    """Every plan of _plans(), one after another, verified after each batch."""
    p = await make_pair(regions=BIG_REGIONS)
    rng = np.random.default_rng(1234 if direction == "write" else 4321)
    local = local_mem(p.eng, BIG)
    local.view[:] = pattern(7, BIG)
    remote_expected = pattern(8, BIG)
    await bounded(p.target.fill("rw", 8))
    expected = None  # reads: what the local buffer must hold

    for k, (plan_id, plan) in enumerate(_plans()):
        lengths = plan(rng).astype(np.uint64)
        loff = place(rng, lengths, BIG)
        roff = place(rng, lengths, BIG)
        laddrs = np.uint64(local.addr) + loff
        raddrs = np.uint64(p.raddr("rw")) + roff
        args = (as_arg(laddrs, k), as_arg(raddrs, k), as_arg(lengths, k))
        t0 = time.monotonic()
        if direction == "write":
            np.bitwise_xor(local.view, np.uint8(k + 1), out=local.view)  # new source data each batch
            assert await bounded(p.peer.write(*args), 120) is None
            apply_entries(remote_expected, roff, local.view, loff, lengths)
            got = await bounded(p.target.sha("rw"), 60)
            if got != sha256(remote_expected):
                shas = await p.target.sha_many("rw", zip(roff.tolist(), lengths.tolist()))
                bad = [i for i, (o, n) in enumerate(zip(roff.tolist(), lengths.tolist()))
                       if shas[i] != sha256(remote_expected[o : o + n])]
                pytest.fail(f"{plan_id}: remote region wrong after write; bad entries {bad[:10]} of {len(lengths)}"
                            + ("" if bad else " (bytes outside the entries changed)"))
        else:
            # The remote region keeps pattern 8; the local buffer changes every
            # batch (xor), so a read that moved nothing cannot pass by luck.
            np.bitwise_xor(local.view, np.uint8(k + 1), out=local.view)
            if expected is None:
                expected = local.view.copy()
            else:
                np.bitwise_xor(expected, np.uint8(k + 1), out=expected)
            apply_entries(expected, loff, remote_expected, roff, lengths)
            assert await bounded(p.peer.read(*args), 120) is None
            if not np.array_equal(local.view, expected):
                pytest.fail(f"{plan_id}: local buffer wrong after read: "
                            + first_bad_entry(local.view, loff, expected, loff, lengths))
        elapsed = time.monotonic() - t0
        assert elapsed < 60, f"{plan_id}: {elapsed:.1f}s"


async def test_many_coroutines_in_flight(pair, local_mem):
    """32 coroutines, each with its own slice of the remote region, write and read
    batches at the same time; half through write_nowait awaited later."""
    p = pair
    n_workers = 32
    slice_len = p.target.regions["rw"].length // n_workers  # 128 KiB
    src = local_mem(p.eng, n_workers * slice_len)
    dst = local_mem(p.eng, n_workers * slice_len)
    src.view[:] = pattern(11, len(src.view))
    remote_expected = pattern(12, p.target.regions["rw"].length)
    await bounded(p.target.fill("rw", 12))
    in_flight = 0
    peak = 0

    async def worker(i: int) -> None:
        nonlocal in_flight, peak
        rng = np.random.default_rng(1000 + i)
        base = i * slice_len
        for rnd in range(4):
            lengths = log_uniform(rng, 1, 8 * KiB, int(rng.integers(1, 33)))
            loff = base + place(rng, lengths, slice_len)
            roff = base + place(rng, lengths, slice_len)
            src.view[base : base + slice_len] ^= np.uint8(rnd + 1)
            la = np.uint64(src.addr) + loff
            ra = np.uint64(p.raddr("rw")) + roff
            in_flight += 1
            peak = max(peak, in_flight)
            if (i + rnd) % 2:
                await p.peer.write(la, ra, lengths)
            else:
                t = p.peer.write_nowait(la, ra, lengths)
                await asyncio.sleep(0)
                await t
            in_flight -= 1
            apply_entries(remote_expected, roff, src.view, loff, lengths)
            # read the same ranges back into the other buffer and compare locally
            da = np.uint64(dst.addr) + loff
            await p.peer.read(da, ra, lengths)
            for o, n in zip(loff.tolist(), lengths.tolist()):
                if not np.array_equal(dst.view[o : o + n], src.view[o : o + n]):
                    raise AssertionError(f"worker {i} round {rnd}: read-back differs at local offset {o} (len {n})")

    await bounded(asyncio.gather(*(worker(i) for i in range(n_workers))), 120)
    assert peak > 1, "the batches never overlapped in time"
    assert await bounded(p.target.sha("rw")) == sha256(remote_expected)


async def test_a_loop_of_awaited_writes_lets_the_loop_run(pair, local_mem):
    """Small writes that finish inline (local: copied on the caller's
    thread; tcp: polled to completion) do not suspend their coroutine. A
    caller awaiting them back to back must still let other tasks run: the
    engine yields at least once a millisecond (PeerContext.inline_turn)."""
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    src.view[:] = pattern(21, len(src.view))
    ra = p.raddr("rw")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0)
    start, writes = ticks, 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.2:
        await p.peer.write([src.addr], [ra], [64 * KiB])
        writes += 1
    ran = ticks - start
    tick.cancel()
    assert writes > 0
    # one turn per millisecond at least: about 200 in 0.2 s; a starved loop gives 0
    assert ran >= 20, f"the other task ran {ran} times during {writes} writes in 0.2 s"
    assert await bounded(p.target.sha("rw", 0, 64 * KiB)) == sha256(src.view[:])


async def test_nowait_awaited_later(pair, local_mem):
    """write_nowait/read_nowait return Transfers at once; awaiting them later (in
    any order, or through gather) completes them; nbytes and done() agree."""
    p = pair
    rng = np.random.default_rng(5)
    rw_len = p.target.regions["rw"].length
    src = local_mem(p.eng, rw_len)
    src.view[:] = pattern(21, rw_len)
    await bounded(p.target.fill("rw", 22))
    remote_expected = pattern(22, rw_len)

    # 8 writes on disjoint remote eighths
    part = rw_len // 8
    transfers, entries, nbytes = [], [], []
    for k in range(8):
        lengths = log_uniform(rng, 1, 32 * KiB, int(rng.integers(1, 65)))
        loff = k * part + place(rng, lengths, part)
        roff = k * part + place(rng, lengths, part)
        t = p.peer.write_nowait(np.uint64(src.addr) + loff, np.uint64(p.raddr("rw")) + roff, lengths)
        assert isinstance(t, kvflow.Transfer)
        nbytes.append((t.nbytes, int(lengths.sum())))
        transfers.append(t)
        entries.append((loff, roff, lengths))
    await asyncio.sleep(0.01)
    for t in reversed(transfers):
        assert await bounded(t) is None
        assert t.done()
    for loff, roff, lengths in entries:
        apply_entries(remote_expected, roff, src.view, loff, lengths)
    assert await bounded(p.target.sha("rw")) == sha256(remote_expected)

    # 8 reads into disjoint local eighths, awaited together
    dst = local_mem(p.eng, rw_len)
    expected = dst.view.copy()
    reads, read_sizes = [], []
    for k in range(8):
        lengths = log_uniform(rng, 1, 32 * KiB, int(rng.integers(1, 65)))
        loff = k * part + place(rng, lengths, part)
        roff = place(rng, lengths, rw_len)
        apply_entries(expected, loff, remote_expected, roff, lengths)
        read_sizes.append(lengths.sum())
        reads.append(p.peer.read_nowait(np.uint64(dst.addr) + loff, np.uint64(p.raddr("rw")) + roff, lengths))
    assert await bounded(asyncio.gather(*reads)) == [None] * 8
    assert all(t.done() for t in reads)
    assert np.array_equal(dst.view, expected)
    nbytes += [(t.nbytes, int(n)) for t, n in zip(reads, read_sizes)]
    assert all(got == want for got, want in nbytes), f"Transfer.nbytes (got, want): {nbytes}"


async def test_notification_after_data(pair, local_mem):
    """write, then notify: when the target receives the notification, the data is
    already in its memory. Notifications arrive in order and name the sender."""
    p = pair
    rng = np.random.default_rng(31)
    await bounded(p.target.watch())
    src = local_mem(p.eng, 1 * MiB)
    src.view[:] = pattern(32, len(src.view))
    n = 40
    slot = p.target.regions["rw"].length // n  # disjoint remote range per notification
    for seq in range(n):
        length = int(log_uniform(rng, 1, min(slot, 96 * KiB), 1)[0])
        roff = seq * slot + int(rng.integers(0, slot - length + 1))
        loff = int(rng.integers(0, len(src.view) - length + 1))
        pieces = split(rng, length, int(rng.integers(1, 9)))
        starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.uint64)
        await bounded(p.peer.write(np.uint64(src.addr + loff) + starts, np.uint64(p.raddr("rw", roff)) + starts, pieces))
        msg = {"seq": seq, "region": "rw", "offset": roff, "length": length, "sha": sha256(src.view[loff : loff + length])}
        await bounded(p.peer.notify(json.dumps(msg).encode()))

    deadline = time.monotonic() + 15
    notes = []
    while time.monotonic() < deadline:
        notes = await bounded(p.target.notifications())
        if len(notes) >= n:
            break
        await asyncio.sleep(0.02)
    assert len(notes) == n, f"target got {len(notes)} of {n} notifications"
    assert [x.get("seq") for x in notes] == list(range(n)), "notifications out of order"
    assert all(x.get("from") == p.eng.address for x in notes), {x.get("from") for x in notes}
    late = [x["seq"] for x in notes if not x.get("ok")]
    assert not late, f"notifications arrived before their data: seq {late}"


async def test_notifications_to_initiator(pair):
    """The target connects back and notifies; eng.notifications() yields
    (sender address, bytes) in order."""
    p = pair
    it = p.eng.notifications().__aiter__()
    first = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    payloads = [b"hello", b"\x00" * 3, bytes(range(256)) * 16]
    for data in payloads:
        await bounded(p.target.notify(p.eng.address, data))
    got = [await bounded(first, 15)]
    for _ in payloads[1:]:
        got.append(await bounded(it.__anext__(), 15))
    assert [a for a, _ in got] == [p.target.address] * len(payloads)
    assert [bytes(d) for _, d in got] == payloads
    if hasattr(it, "aclose"):
        await bounded(it.aclose())


async def test_region_registered_after_connect(pair, local_mem):
    """A region the target registers after connect() can be written, and then
    shows in peer.regions / peer.region(name)."""
    p = pair
    info = await bounded(p.target.register("late", 256 * KiB + 3))
    await bounded(p.target.fill("late", 41))
    src = local_mem(p.eng, info.length)
    src.view[:] = pattern(42, info.length)
    await bounded(p.peer.write([src.addr + 1], [info.addr + 2], [info.length - 3]))
    expected = pattern(41, info.length)
    expected[2 : info.length - 1] = src.view[1 : info.length - 2]
    assert await bounded(p.target.sha("late")) == sha256(expected)

    deadline = time.monotonic() + 5
    while "late" not in {r.name for r in p.peer.regions} and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    names = {r.name for r in p.peer.regions}
    assert "late" in names, names
    r = p.peer.region("late")
    assert (int(r.addr), int(r.length), int(r.access)) == (info.addr, info.length, info.access)

    # and read it back
    dst = local_mem(p.eng, info.length)
    await bounded(p.peer.read([dst.addr], [info.addr], [info.length]))
    assert np.array_equal(dst.view, expected)


@pytest.mark.parametrize("direction", ["write", "read"])
async def test_strided_entries(make_pair, local_mem, direction):
    """Strided entries (a head slice of every token, both ways of TP
    mismatch) land exactly where the expanded plain entries would; an entry
    that strays outside the peer's regions is named by its strided index."""
    p = await make_pair()
    n = 1 << 20
    local = local_mem(p.eng, n)
    local.view[:] = pattern(3, n)
    await bounded(p.target.fill("rw", 4))
    remote = pattern(4, p.target.regions["rw"].length).copy()
    # entry 0: 100 tokens × 4 heads × 64 B, take heads 1..2 → contiguous; entry 1: the reverse
    la = np.array([local.addr + 64, local.addr + 300_000], np.uint64)
    ra = np.array([p.raddr("rw", 1000), p.raddr("rw", 200_000 + 128)], np.uint64)
    ln = np.array([128, 128], np.uint64)
    counts = np.array([100, 50], np.uint64)
    ls = np.array([256, 128], np.uint64)
    rs = np.array([128, 256], np.uint64)
    op = p.peer.write if direction == "write" else p.peer.read
    await bounded(op(la, ra, ln, counts=counts, local_strides=ls, remote_strides=rs))
    lo, ro = la - np.uint64(local.addr), ra - np.uint64(p.raddr("rw"))
    src_l, src_r = local.view.copy(), remote.copy()
    for i in range(2):
        for k in range(int(counts[i])):
            a, b = int(lo[i] + k * ls[i]), int(ro[i] + k * rs[i])
            if direction == "write":
                remote[b:b + 128] = src_l[a:a + 128]
            else:
                src_l[a:a + 128] = src_r[b:b + 128]
    if direction == "write":
        assert await bounded(p.target.sha("rw")) == sha256(remote)
    else:
        assert np.array_equal(local.view, src_l)
    far = np.array([p.raddr("rw"), p.raddr("rw", p.target.regions["rw"].length - 1024)], np.uint64)
    with pytest.raises(kvflow.RemoteAccessError) as e:
        await bounded(op(la, far, ln, counts=counts, local_strides=ls, remote_strides=rs))
    assert e.value.index == 1
    with pytest.raises(kvflow.InvalidArgumentError):
        await op(la, ra, ln, counts=counts, local_strides=ls)          # strides come together
    with pytest.raises(kvflow.InvalidArgumentError):
        await op(la, ra, ln, counts=[1, 0], local_strides=ls, remote_strides=rs)


async def test_blocking_calls_from_a_thread(pair, local_mem):
    """write_blocking/read_blocking from a thread that is not the loop's
    (what the Mooncake-compatible API does) move the same bytes as write()
    and read(), raise the same typed errors, and refuse the loop's own
    thread; Engine.peer() finds the connected peer without connecting."""
    p = pair
    rng = np.random.default_rng(11)
    rw_len = p.target.regions["rw"].length
    src = local_mem(p.eng, rw_len)
    src.view[:] = pattern(31, rw_len)
    await bounded(p.target.fill("rw", 32))
    remote_expected = pattern(32, rw_len)
    lengths = log_uniform(rng, 1, 64 * KiB, 48)
    loff, roff = place(rng, lengths, rw_len), place(rng, lengths, rw_len)
    apply_entries(remote_expected, roff, src.view, loff, lengths)
    assert p.eng.peer(p.target.address) is p.peer
    assert p.eng.peer("127.0.0.1:1") is None and p.peer in p.eng.peers

    await bounded(asyncio.to_thread(p.peer.write_blocking, np.uint64(src.addr) + loff,
                                    np.uint64(p.raddr("rw")) + roff, lengths, timeout=30))
    assert await bounded(p.target.sha("rw")) == sha256(remote_expected)
    dst = local_mem(p.eng, rw_len)
    await bounded(asyncio.to_thread(p.peer.read_blocking, [dst.addr], [p.raddr("rw")], [rw_len]))
    assert np.array_equal(dst.view, remote_expected)

    with pytest.raises(kvflow.RemoteAccessError):      # outside the peer's regions, even after a refresh
        await bounded(asyncio.to_thread(p.peer.write_blocking, [src.addr], [8], [4096]))
    with pytest.raises(kvflow.UnregisteredMemoryError):
        await bounded(asyncio.to_thread(p.peer.write_blocking, [8], [p.raddr("rw")], [4096]))
    with pytest.raises(kvflow.KVFlowError, match="event loop"):
        p.peer.write_blocking([src.addr], [p.raddr("rw")], [4096])
    # the peer still works, and a Transfer reports its end to a callback
    done: list[kvflow.Transfer] = []
    t = p.peer.write_nowait([src.addr], [p.raddr("rw")], [4096])
    t.add_done_callback(done.append)
    await bounded(t)
    await asyncio.sleep(0)
    assert done == [t]


@pytest.mark.parametrize("size", [64 * KiB, 64 * KiB + 1000, 192 * KiB])
async def test_single_spliced_writes_are_not_held_back(make_engine, size):
    """One write whose payload is spliced whole on an idle tcp connection
    (the submitter's inline send) used to end with SPLICE_F_MORE: the
    kernel then held the tail segment back until its cork timer, 63 ms per
    64 KiB write here. Twenty in a row must take far less than one timer
    (the bound is ~100x what they take)."""
    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"])
    src, dst = np.ones(MiB, np.uint8), np.zeros(MiB, np.uint8)
    a.register(src)
    b.register(dst)
    peer = await bounded(a.connect(b.address))
    await peer.write([src.ctypes.data], [dst.ctypes.data], [size])      # warm
    t0 = time.perf_counter()
    for _ in range(20):
        await bounded(peer.write([src.ctypes.data], [dst.ctypes.data], [size]))
    took = time.perf_counter() - t0
    assert took < 0.5 * TIME_SCALE, f"20 writes of {size} B took {took * 1e3:.0f} ms"
    assert (dst[:size] == 1).all()
