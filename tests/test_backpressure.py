"""A target that stops reading (SIGSTOP) while writes pile up: the
initiator's event loop must not block (inline sends never wait on a full
socket), what did not fit goes out later from the sender thread, and every
byte lands in order once the target runs again."""
from __future__ import annotations

import asyncio
import os
import signal
import time


from _batches import bounded, pattern, sha256

MiB = 1 << 20


async def test_stalled_target_does_not_block_the_loop(make_engine, make_target, local_mem):
    target = await make_target(protocols=("tcp",), xproc=True,
                               regions=[{"name": "rw", "length": 32 * MiB, "access": 3}])
    eng = await make_engine(protocols=("tcp",))
    peer = await bounded(eng.connect(target.address))
    src = local_mem(eng, 32 * MiB)
    src.view[:] = pattern(7, 32 * MiB)
    base = peer.region("rw").addr

    os.kill(target.proc.pid, signal.SIGSTOP)
    try:
        # Batch sizes that take the inline path (spliced 256 KiB..1 MiB
        # payloads, copied small ones) and the sender-thread path; far more
        # than the socket buffers hold while nobody reads.
        transfers, slowest = [], 0.0
        off = 0
        for size in [256 << 10, 1 * MiB, 4096, 1 * MiB, 512 << 10] * 6 + [3 * MiB]:
            t0 = time.perf_counter()
            transfers.append(peer.write_nowait([src.addr + off], [base + off], [size]))
            slowest = max(slowest, time.perf_counter() - t0)
            off += size
        # The loop keeps running while the target is stopped.
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20
        assert slowest < 0.25, f"a submission blocked the loop for {slowest:.3f} s"
        assert not all(t.done() for t in transfers), "writes cannot complete while the target is stopped"
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)
    await bounded(asyncio.gather(*transfers), 60)
    shas = await bounded(target.sha_many("rw", [(0, off)]))
    assert shas == [sha256(src.view[:off])]


async def test_silent_peer_is_declared_lost_by_keepalive(make_engine, make_target, local_mem):
    """A peer that stops answering without closing anything (SIGSTOP: the
    kernel keeps its sockets open) is declared lost after `keepalive`
    seconds; writes in flight to it fail with PeerLostError instead of
    hanging, and the engine connects elsewhere as before."""
    import kvflow
    target = await make_target(protocols=("tcp",), xproc=True,
                               regions=[{"name": "rw", "length": 32 * MiB, "access": 3}])
    other = await make_target(protocols=("tcp",), regions=[{"name": "rw", "length": 1 * MiB, "access": 3}])
    eng = await make_engine(protocols=("tcp",), keepalive=1.0)
    peer = await bounded(eng.connect(target.address))
    lost = asyncio.Event()
    peer.on_lost(lambda _: lost.set())
    src = local_mem(eng, 32 * MiB)
    base = peer.region("rw").addr
    os.kill(target.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        transfers = [peer.write_nowait([src.addr + i * MiB], [base + i * MiB], [MiB]) for i in range(32)]
        results = await bounded(asyncio.gather(*transfers, return_exceptions=True), 30)
        took = time.monotonic() - t0
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, kvflow.PeerLostError) for r in failed), results
        assert took < 5, f"declared lost after {took:.1f} s (keepalive 1 s)"
        await bounded(lost.wait(), 5)
        assert not peer.alive
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)
    p2 = await bounded(eng.connect(other.address))
    await bounded(p2.write([src.addr], [p2.region("rw").addr], [4096]))


async def test_cancelling_many_queued_tcp_slices_at_once():
    """Regression: a sender thread that popped more than 64 slices of
    cancelled batches in one go overran its stack array (SIGSEGV)."""
    import numpy as np
    import kvflow
    async with kvflow.Engine(protocols=("tcp",)) as a, kvflow.Engine(protocols=("tcp",)) as b:
        src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        ls, rd = a.register(src), b.register(dst)
        peer = await bounded(a.connect(b.address))
        for _ in range(100):
            t = peer.write_nowait([ls.addr], [rd.addr], [64], counts=[512], local_strides=[1024],
                                  remote_strides=[2048])
            t.cancel()
            try:
                await bounded(t)
            except kvflow.TransferCancelledError:
                pass
        await bounded(peer.write([ls.addr], [rd.addr], [4096]))       # still works
        assert bytes(dst[:4096]) == bytes(src[:4096])
        assert a.counters()["slices_inflight"] == 0
