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
