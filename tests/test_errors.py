"""Error paths, on every provider. After each error the test proves that the same
engine and peer still move data correctly (``assert_still_works``); the fixtures
check guard bytes and the loop exception handler on both sides."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time

import numpy as np
import pytest

import kvflow
from _batches import TIME_SCALE, KiB, MiB, Pair, assert_still_works, bounded, place, sha256
from _target import find_data_ports, pattern

U64 = 2**64


async def expect(exc_type, call, timeout: float = 30.0):
    """Run ``call()`` (a coroutine, a Transfer, or something raising at once),
    await what it returns, and return the exception it raised."""
    with pytest.raises(exc_type) as info:
        res = call()
        if inspect.isawaitable(res):
            await bounded(res, timeout)
    return info.value


async def expect_timeout(call, attempts: int = 5):
    """``call()`` with a tiny timeout must raise TransferTimeoutError. A
    batch that beats the timer (the loop handles the completion's wake-up
    before the timer in the same iteration, possible where the transfer is
    fast against a loaded loop) is retried: some attempt must time out."""
    for _ in range(attempts):
        try:
            res = call()
            if inspect.isawaitable(res):
                await bounded(res, 30)
        except kvflow.TransferTimeoutError as e:
            return e
    pytest.fail(f"no TransferTimeoutError in {attempts} attempts")


def names_peer(exc: BaseException, address: str, index: int | None = None) -> None:
    text = str(exc)
    assert address in text, f"message does not name the peer {address}: {text!r}"
    if index is not None:
        assert str(index) in text, f"message does not name entry {index}: {text!r}"


def batch(p, src, n: int = 5, entry_len: int = 1000):
    """n valid, disjoint entries from ``src`` into the target's "rw" region."""
    la = [src.addr + 3 + i * 2 * entry_len for i in range(n)]
    ra = [p.raddr("rw", 7 + i * 2 * entry_len) for i in range(n)]
    return la, ra, [entry_len] * n


async def expect_both(exc_type, p, direction: str, args, **kw):
    """The same call through ``peer.write``/``read`` and through
    ``write_nowait``/``read_nowait`` then ``await``: both raise ``exc_type``
    with the same index. Returns the first exception."""
    direct = getattr(p.peer, direction)
    nowait = getattr(p.peer, f"{direction}_nowait")
    e1 = await expect(exc_type, lambda: direct(*args, **kw))
    e2 = await expect(exc_type, lambda: nowait(*args, **kw))
    assert type(e1) is type(e2) and getattr(e1, "index", None) == getattr(e2, "index", None), (e1, e2)
    return e1


both_ways = pytest.mark.parametrize("direction", ["write", "read"])


# ---------------------------------------------------------------- local memory


@both_ways
async def test_unregistered_local_memory(pair, local_mem, direction):
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    stray = np.zeros(64 * KiB, np.uint8)  # never registered

    la, ra, ln = batch(p, src)
    la[3] = int(stray.ctypes.data) + 100
    e = await expect_both(kvflow.UnregisteredMemoryError, p, direction, (la, ra, ln))
    assert e.index == 3
    names_peer(e, p.target.address, 3)

    # a range that starts inside the region and runs past its end
    la, ra, ln = batch(p, src)
    la[2] = src.addr + len(src.view) - 10
    ln[2] = 20
    e = await expect_both(kvflow.UnregisteredMemoryError, p, direction, (la, ra, ln))
    assert e.index == 2

    # a range that spans two adjacent registered regions is not inside *one* region
    whole = np.zeros(8 * KiB, np.uint8)
    r1 = p.eng.register(whole[: 4 * KiB])
    r2 = p.eng.register(whole[4 * KiB :])
    la, ra, ln = batch(p, src)
    la[0] = int(whole.ctypes.data) + 4 * KiB - 8
    ln[0] = 16
    e = await expect_both(kvflow.UnregisteredMemoryError, p, direction, (la, ra, ln))
    assert e.index == 0
    p.eng.deregister(r1)
    p.eng.deregister(r2)

    if direction == "read":
        assert not stray.any(), "a failed read wrote into unregistered memory"
    await assert_still_works(p, local_mem)


async def test_deregistered_local_memory(pair, local_mem):
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    la, ra, ln = batch(p, src)
    await bounded(p.peer.write(la, ra, ln))
    p.eng.deregister(src.region)
    e = await expect(kvflow.UnregisteredMemoryError, lambda: p.peer.write(la, ra, ln))
    assert e.index == 0
    await assert_still_works(p, local_mem)


# ---------------------------------------------------------------- remote memory


@both_ways
async def test_remote_out_of_bounds(pair, local_mem, direction):
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    rw = p.target.regions["rw"]
    before = await bounded(p.target.sha("ro"))

    # runs past the end of "rw"
    la, ra, ln = batch(p, src)
    ra[4] = rw.addr + rw.length - 10
    ln[4] = 11
    e = await expect_both(kvflow.RemoteAccessError, p, direction, (la, ra, ln))
    assert e.index == 4
    assert e.peer == p.target.address
    names_peer(e, p.target.address, 4)

    # starts before "rw"
    la, ra, ln = batch(p, src)
    ra[1] = rw.addr - 1
    e = await expect_both(kvflow.RemoteAccessError, p, direction, (la, ra, ln))
    assert e.index == 1

    # an address in no region at all
    la, ra, ln = batch(p, src)
    ra[0] = 4096
    e = await expect_both(kvflow.RemoteAccessError, p, direction, (la, ra, ln))
    assert e.index == 0

    assert await bounded(p.target.sha("ro")) == before
    await assert_still_works(p, local_mem)


async def test_remote_access_rights(pair, local_mem):
    """write needs WRITE on the remote region, read needs READ."""
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    src.view[:] = pattern(3, len(src.view))
    await bounded(p.target.fill("ro", 5))
    ro_sha = await bounded(p.target.sha("ro"))

    la, ra, ln = batch(p, src, n=3)
    ra[1] = p.raddr("ro", 100)
    e = await expect_both(kvflow.RemoteAccessError, p, "write", (la, ra, ln))
    assert e.index == 1 and e.peer == p.target.address
    assert await bounded(p.target.sha("ro")) == ro_sha, "a write landed in a read-only region"

    la, ra, ln = batch(p, src, n=3)
    ra[2] = p.raddr("wo", 100)
    e = await expect_both(kvflow.RemoteAccessError, p, "read", (la, ra, ln))
    assert e.index == 2 and e.peer == p.target.address

    # the allowed direction works on both
    dst = local_mem(p.eng, 4 * KiB)
    await bounded(p.peer.read([dst.addr], [p.raddr("ro", 1)], [4000]))
    assert np.array_equal(dst.view[:4000], pattern(5, p.target.regions["ro"].length)[1:4001])
    await bounded(p.peer.write([src.addr], [p.raddr("wo", 3)], [5000]))
    assert await bounded(p.target.sha("wo", 3, 5000)) == sha256(src.view[:5000])
    await assert_still_works(p, local_mem)


async def test_deregistered_remote_region(pair, local_mem):
    """After the target deregisters a region, writes to it fail (at the latest
    once peer.regions no longer lists it) and nothing lands in that memory."""
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    info = await bounded(p.target.register("tmp", 64 * KiB))
    la = [src.addr]
    ra = [info.addr + 10]
    await bounded(p.peer.write(la, ra, [100]))
    await bounded(p.target.deregister("tmp"))
    deadline = time.monotonic() + 5
    while "tmp" in {r.name for r in p.peer.regions} and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    e = await expect(kvflow.RemoteAccessError, lambda: p.peer.write(la, ra, [100]))
    assert e.index == 0
    await assert_still_works(p, local_mem)


# ---------------------------------------------------------------- argument checks


@both_ways
async def test_invalid_arguments(pair, local_mem, direction):
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    cases = {}
    la, ra, ln = batch(p, src)
    ln[2] = 0
    cases["zero length"] = (la, ra, ln)
    la, ra, ln = batch(p, src)
    la[1] = U64 - 8
    ln[1] = 16
    cases["local overflow"] = (la, ra, ln)
    la, ra, ln = batch(p, src)
    ra[3] = U64 - 8
    ln[3] = 16
    cases["remote overflow"] = (la, ra, ln)
    la, ra, ln = batch(p, src)
    cases["lengths shorter"] = (la, ra, ln[:-1])
    cases["remote shorter"] = (la, ra[:-1], ln)
    cases["local longer"] = (la + [src.addr], ra, ln)
    cases["empty"] = ([], [], [])
    cases["empty numpy"] = (np.array([], np.uint64),) * 3
    for what, args in cases.items():
        e = await expect_both(kvflow.InvalidArgumentError, p, direction, args)
        assert isinstance(e, ValueError), what
        assert isinstance(e, kvflow.KVFlowError), what
    await assert_still_works(p, local_mem)


# ---------------------------------------------------------------- connecting


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def test_connect_dead_address(provider, make_engine, make_target, local_mem):
    eng = await make_engine()
    dead = f"127.0.0.1:{_closed_port()}"
    for _ in range(2):  # a failure is not cached as a peer
        t0 = time.monotonic()
        e = await expect(kvflow.PeerUnreachableError, lambda: eng.connect(dead), timeout=15)
        assert time.monotonic() - t0 < 3, "connect to a closed port should fail promptly"
        assert dead in str(e)

    target = await make_target()
    peer = await bounded(eng.connect(target.address))
    await assert_still_works(Pair(provider, eng, target, peer), local_mem)


@pytest.mark.parametrize("behaviour", ["close", "garbage", "http"])
async def test_connect_not_kvflow(provider, make_engine, behaviour):
    """A listener that does not speak kvflow: PeerUnreachableError, promptly."""
    replies = {"close": None, "garbage": bytes(range(256)) * 64, "http": b"HTTP/1.1 400 Bad Request\r\n\r\n"}
    writers = []

    async def on_conn(reader, writer):
        writers.append(writer)
        if replies[behaviour] is not None:
            try:
                writer.write(replies[behaviour])
                await writer.drain()
            except OSError:
                pass
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        eng = await make_engine()
        t0 = time.monotonic()
        await expect(kvflow.PeerUnreachableError, lambda: eng.connect(f"127.0.0.1:{port}", timeout=5.0), timeout=15)
        assert time.monotonic() - t0 < 6
    finally:
        server.close()
        await server.wait_closed()


async def test_connect_silent_listener_times_out(provider, make_engine):
    """A listener that accepts and never answers: connect(timeout=) is honoured."""
    held = []

    async def on_conn(reader, writer):
        held.append(writer)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        eng = await make_engine()
        t0 = time.monotonic()
        await expect((kvflow.PeerUnreachableError, kvflow.TransferTimeoutError),
                     lambda: eng.connect(f"127.0.0.1:{port}", timeout=1.0), timeout=15)
        assert time.monotonic() - t0 < 4, "connect(timeout=1.0) took too long"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- hostile bytes

GARBAGE = [
    b"",  # connect, close
    b"GET / HTTP/1.1\r\nHost: kvflow\r\n\r\n",
    b"\xff" * 64,  # absurd length prefixes, whatever the framing
    b"\x00" * 4096,
    b"\x7f\xff\xff\xff" * 16,
    np.random.default_rng(77).bytes(256 * KiB),
    b"KV",  # a partial first frame, then close
]


async def _hammer(host: str, port: int) -> list:
    """Send every GARBAGE payload on its own connection; return two connections
    left open (one silent, one mid-frame) that the caller closes later."""
    for payload in GARBAGE:
        try:
            reader, writer = await bounded(asyncio.open_connection(host, port), 10)
        except OSError:
            continue
        try:
            writer.write(payload)
            await bounded(writer.drain(), 10)
            try:  # give the engine a moment to answer or hang up
                await asyncio.wait_for(reader.read(65536), 0.2)
            except asyncio.TimeoutError:
                pass
        except OSError:
            pass
        finally:
            writer.close()
    lingering = []
    for payload in (b"", b"\x01\x02\x03"):
        try:
            reader, writer = await bounded(asyncio.open_connection(host, port), 10)
            writer.write(payload)
            await writer.drain()
            lingering.append(writer)
        except OSError:
            pass
    return lingering


async def _fresh_peer_works(provider, make_engine, target, local_mem):
    eng = await make_engine()
    peer = await bounded(eng.connect(target.address, timeout=10.0))
    await assert_still_works(Pair(provider, eng, target, peer), local_mem, seed=5)


async def test_garbage_to_handshake_port(pair, make_engine, local_mem):
    p = pair
    host, port = p.target.address.rsplit(":", 1)
    lingering = await _hammer(host, int(port))
    try:
        await _fresh_peer_works(p.provider, make_engine, p.target, local_mem)
        await assert_still_works(p, local_mem)
    finally:
        for w in lingering:
            w.close()


async def test_garbage_to_data_ports(pair, make_engine, local_mem):
    p = pair
    ports = p.target.data_ports or find_data_ports(p.peer)
    if not ports:
        pytest.skip("the engine exposes no data port (checked eng.data_ports and peer attributes)")
    host = p.target.address.rsplit(":", 1)[0]
    lingering = []
    for port in ports:
        lingering += await _hammer(host, int(port))
    try:
        await assert_still_works(p, local_mem)
        await _fresh_peer_works(p.provider, make_engine, p.target, local_mem)
    finally:
        for w in lingering:
            w.close()


# ---------------------------------------------------------------- authentication


async def test_wrong_secret(provider, make_engine, make_target, local_mem):
    target = await make_target(secret="s3cret-A")
    for secret in ("s3cret-B", None):
        eng = await make_engine(secret=secret)
        for _ in range(2):  # not cached as a success
            e = await expect(kvflow.AuthenticationError, lambda en=eng: en.connect(target.address))
            assert target.address in str(e)
    eng = await make_engine(secret="s3cret-A")
    peer = await bounded(eng.connect(target.address))
    await assert_still_works(Pair(provider, eng, target, peer), local_mem)


# ---------------------------------------------------------------- timeout, cancel

BIG = 66 * MiB
BIG_REGIONS = [{"name": "rw", "length": BIG, "access": 3}]


@pytest.mark.parametrize("nowait", [False, True], ids=["await", "nowait"])
async def test_timeout_then_usable(make_pair, local_mem, nowait):
    """timeout=1e-6 on a 64 MiB batch raises TransferTimeoutError (a TimeoutError);
    then the same peer moves the same ranges correctly."""
    p = await make_pair(regions=BIG_REGIONS)
    a = local_mem(p.eng, BIG)
    a.view[:] = pattern(1, BIG)
    b = local_mem(p.eng, BIG)
    b.view[:] = pattern(2, BIG)
    lengths = np.full(64, 1 * MiB, np.uint64)
    off = place(np.random.default_rng(3), lengths, BIG)
    raddrs = np.uint64(p.raddr("rw")) + off
    w = p.peer.write_nowait if nowait else p.peer.write
    r = p.peer.read_nowait if nowait else p.peer.read

    e = await expect_timeout(lambda: w(np.uint64(a.addr) + off, raddrs, lengths, timeout=1e-6))
    assert isinstance(e, TimeoutError) and isinstance(e, kvflow.KVFlowError)
    names_peer(e, p.target.address)
    # the same ranges, other data, no timeout: must land exactly
    await bounded(p.peer.write(np.uint64(b.addr) + off, raddrs, lengths), 60)
    await asyncio.sleep(0.2)  # a straggler of the timed-out write must not land after this
    shas = await bounded(p.target.sha_many("rw", zip(off.tolist(), lengths.tolist())))
    assert shas == [sha256(b.view[o : o + n]) for o, n in zip(off.tolist(), lengths.tolist())]

    # read side: time out into a, then read into a properly
    await bounded(p.target.fill("rw", 9))
    e = await expect_timeout(lambda: r(np.uint64(a.addr) + off, raddrs, lengths, timeout=1e-6))
    a.view[:] = 0
    await bounded(p.peer.read(np.uint64(a.addr) + off, raddrs, lengths), 60)
    await asyncio.sleep(0.2)
    remote = pattern(9, BIG)
    for o, n in zip(off.tolist(), lengths.tolist()):
        assert np.array_equal(a.view[o : o + n], remote[o : o + n])
    await assert_still_works(p, local_mem)


@both_ways
async def test_cancel_then_usable(make_pair, local_mem, direction):
    p = await make_pair(regions=BIG_REGIONS)
    a = local_mem(p.eng, BIG)
    a.view[:] = pattern(4, BIG)
    lengths = np.full(64, 1 * MiB, np.uint64)
    off = place(np.random.default_rng(6), lengths, BIG)
    args = (np.uint64(a.addr) + off, np.uint64(p.raddr("rw")) + off, lengths)
    start = p.peer.write_nowait if direction == "write" else p.peer.read_nowait

    t = start(*args)
    was_done = t.done()
    t.cancel()
    if was_done:  # finished synchronously: cancel() is a no-op, like asyncio.Future
        assert await bounded(t) is None
    else:
        await expect(kvflow.TransferCancelledError, lambda: t)
        assert t.done()
    assert isinstance(kvflow.TransferCancelledError("x"), kvflow.KVFlowError)

    # cancelling the task that awaits a transfer is ordinary asyncio cancellation
    task = asyncio.ensure_future((p.peer.write if direction == "write" else p.peer.read)(*args))
    await asyncio.sleep(0.001)
    task.cancel()
    try:
        await bounded(task, 60)
    except asyncio.CancelledError:
        assert task.cancelled(), "the task ended with something other than CancelledError"

    # the same peer, the same ranges: correct data
    await asyncio.sleep(0.2)
    if direction == "write":
        a.view[:] = pattern(40, BIG)
        await bounded(p.peer.write(*args), 60)
        shas = await bounded(p.target.sha_many("rw", zip(off.tolist(), lengths.tolist())))
        assert shas == [sha256(a.view[o : o + n]) for o, n in zip(off.tolist(), lengths.tolist())]
    else:
        await bounded(p.target.fill("rw", 41))
        a.view[:] = 0
        await bounded(p.peer.read(*args), 60)
        remote = pattern(41, BIG)
        for o, n in zip(off.tolist(), lengths.tolist()):
            assert np.array_equal(a.view[o : o + n], remote[o : o + n])
    await assert_still_works(p, local_mem)


# ---------------------------------------------------------------- peer dies


async def test_peer_killed_mid_transfer(xproc_provider, make_engine, make_target, local_mem):
    """SIGKILL the target while 32 transfers of 16 MiB are in flight: each one
    completes or fails with PeerLostError within a few seconds; nothing hangs;
    the engine still works with another target."""
    target = await make_target(regions=[{"name": "rw", "length": 64 * MiB, "access": 3}])
    eng = await make_engine()
    peer = await bounded(eng.connect(target.address))
    src = local_mem(eng, 16 * MiB)
    dst = local_mem(eng, 16 * MiB)
    await bounded(peer.write([src.addr], [target.raddr("rw")], [4096]))  # connection fully up

    def start(k):
        ra = target.raddr("rw", (k % 4) * 16 * MiB)
        return [asyncio.ensure_future(peer.write_nowait([src.addr], [ra], [16 * MiB])),
                asyncio.ensure_future(peer.read_nowait([dst.addr], [ra], [16 * MiB]))]

    transfers = [t for k in range(16) for t in start(k)]
    target.kill()
    # Keep 32 transfers in flight until the kill shows (a fast provider may
    # finish the first ones before the kernel has torn the process down).
    t0 = time.monotonic()
    results = []
    k = 16
    while transfers and time.monotonic() - t0 < 10 * TIME_SCALE:
        done, pending = await asyncio.wait(transfers, timeout=30 * TIME_SCALE,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert done, "no transfer finished or failed for 30 s after the kill"
        transfers = list(pending)
        for t in done:
            results.append(t.exception() if t.exception() is not None else None)
        if not any(isinstance(r, kvflow.KVFlowError) for r in results):
            for _ in done:
                ra = target.raddr("rw", (k % 4) * 16 * MiB)
                try:
                    transfers.append(asyncio.ensure_future(peer.write_nowait([src.addr], [ra], [16 * MiB])))
                except kvflow.PeerLostError as e:       # the loss showed between two refills: refused at once
                    results.append(e)
                    break
                k += 1
    first_error = time.monotonic() - t0
    results += await bounded(asyncio.gather(*transfers, return_exceptions=True), 30)
    elapsed = time.monotonic() - t0
    lost = [r for r in results if isinstance(r, kvflow.PeerLostError)]
    other = [r for r in results if r is not None and not isinstance(r, kvflow.PeerLostError)]
    assert not other, f"unexpected outcomes: {other[:3]}"
    assert lost, f"no transfer failed in {first_error:.1f} s after the kill"
    assert elapsed - first_error < 5 * TIME_SCALE, \
        f"in-flight transfers took {elapsed - first_error:.1f}s to fail after the first one did"
    assert first_error < 5 * TIME_SCALE, f"the kill took {first_error:.1f}s to show"
    names_peer(lost[0], target.address)

    # the dead peer fails fast from now on
    t0 = time.monotonic()
    await expect(kvflow.KVFlowError, lambda: peer.write([src.addr], [target.raddr("rw")], [4096]), timeout=15)
    assert time.monotonic() - t0 < 5 * TIME_SCALE

    target2 = await make_target()
    peer2 = await bounded(eng.connect(target2.address))
    await assert_still_works(Pair(xproc_provider, eng, target2, peer2), local_mem)


async def test_initiator_killed_mid_transfer(xproc_provider, make_engine, make_target, local_mem):
    """The other way round: a child process writes into this engine in a loop
    and is SIGKILLed. This engine stays up, its memory outside the region is
    intact, and it serves a new initiator."""
    victim = await make_engine()
    dst = local_mem(victim, 8 * MiB, name="rw")
    child = await make_target(regions=[{"name": "rw", "length": 8 * MiB, "access": 3}])
    await bounded(child.hammer(victim.address, dst.addr, 8 * MiB), 30)
    await asyncio.sleep(0.05)
    child.kill()
    await asyncio.sleep(0.5)

    target = await make_target()  # a new initiator for the victim: any target-shaped child works
    await bounded(target.fill("rw", 17))
    await bounded(target.notify(victim.address, b"still there?"))
    it = victim.notifications().__aiter__()
    got = await bounded(it.__anext__(), 15)
    while bytes(got[1]) != b"still there?":  # skip anything else queued
        got = await bounded(it.__anext__(), 15)
    assert got[0] == target.address
    await bounded(target.hammer(victim.address, dst.addr + 1, 1 * MiB), 30)
    await asyncio.sleep(0.1)
    expected = pattern(17, target.regions["rw"].length)[: 1 * MiB]
    assert np.array_equal(dst.view[1 : 1 + MiB], expected)


async def test_target_serves_initiators_one_after_another(provider, make_engine, make_target, local_mem):
    """Initiator engines come and go (prefill workers restart): after each one
    closes, the target serves the next, and its sockets/threads do not grow."""
    target = await make_target()
    for i in range(3):
        eng = await make_engine()
        peer = await bounded(eng.connect(target.address))
        await assert_still_works(Pair(provider, eng, target, peer), local_mem, seed=200 + i, timeout=10)
        await bounded(eng.close())
    if target.baseline:
        deadline = time.monotonic() + 3
        while True:
            now = await bounded(target.counters())
            grown = {k: (now[k], target.baseline[k]) for k in ("sockets", "threads") if now.get(k, 0) > target.baseline.get(k, 0)}
            if not grown or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert not grown, f"target resources (now, after start) with no initiator left: {grown}"


async def test_peer_close_then_reconnect(pair, local_mem):
    """peer.close() drops it from the connect() cache: connecting again gives a
    working peer; the closed one raises a KVFlowError instead of hanging."""
    p = pair
    src = local_mem(p.eng, 64 * KiB)
    await bounded(p.peer.close())
    await bounded(p.peer.close())  # idempotent
    await expect(kvflow.KVFlowError, lambda: p.peer.write([src.addr], [p.raddr("rw")], [100]), timeout=10)
    peer = await bounded(p.eng.connect(p.target.address))
    assert peer is not p.peer
    await assert_still_works(Pair(p.provider, p.eng, p.target, peer), local_mem)


async def test_connect_cancelled_while_a_connection_opens_closes_the_others(make_engine, monkeypatch):
    """connect() whose timeout runs out while one data connection is still
    opening (a rail that is down holds its attempt for seconds): the
    connections already open are closed by the connect, not left to the
    garbage collector (the gather's results are lost with the cancel), which
    would close them later with an "unclosed socket" ResourceWarning."""
    import gc
    import warnings

    from kvflow.providers import tcp as tcp_provider

    real = tcp_provider.open_data_connection
    opened_slowly = asyncio.Event()

    async def slow_express(loop, host, port, token, role, index, **kw):
        if role == tcp_provider.DATA_ROLE_DATA and index == 2:     # the express lane: never in time
            opened_slowly.set()
            await asyncio.sleep(30)
        return await real(loop, host, port, token, role, index, **kw)

    monkeypatch.setattr(tcp_provider, "open_data_connection", slow_express)
    target = await make_engine(protocols=("tcp",))
    eng = await make_engine(protocols=("tcp",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        await expect((kvflow.PeerUnreachableError, kvflow.TransferTimeoutError),
                     lambda: eng.connect(target.address, timeout=1.0), timeout=15)
        assert opened_slowly.is_set()
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
                and "socket" in str(w.message)]
    assert not unclosed, unclosed
    monkeypatch.setattr(tcp_provider, "open_data_connection", real)
    peer = await bounded(eng.connect(target.address))
    assert peer.transport == "tcp"
