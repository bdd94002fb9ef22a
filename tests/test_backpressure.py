"""A target that stops reading (SIGSTOP) while writes pile up: the
initiator's event loop must not block (inline sends never wait on a full
socket), what did not fit goes out later from the sender thread, and every
byte lands in order once the target runs again."""
from __future__ import annotations

import asyncio
import os
import signal
import time


from _batches import TIME_SCALE, bounded, pattern, sha256

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


async def test_a_failed_write_sends_nothing_after_it_raised(make_engine, make_target, local_mem):
    """A write that fails while its bytes sit in the sockets (the target
    stopped reading, SIGSTOP; then the peer is closed) sends none of them
    once it has raised. tcp sends payloads by page reference (vmsplice), so
    what the kernel still held would go out later with whatever the caller
    has put in its buffer since, and land after the write was reported
    failed. The connection is reset (its send queue dropped), not shut
    down: over a NIC nothing is referenced any more once the write has
    failed. What the target's socket had received before the reset (on
    loopback still the sender's pages: loopback hands the skbs over,
    uncopied) stays readable there after it, and the target, once it runs
    again, lands none of it: a connection its peer reset applies nothing
    more (sockio.c: sk_not_reset). Before the reset (a shutdown that sent
    the queue first) 2 MiB of 8 landed here against a receive queue of 248
    KiB; after it and before the target's check, up to that receive queue
    (tests/test_store_late_bytes.py: on the object given the space since)."""
    import numpy as np
    import kvflow
    size = 8 * MiB
    target = await make_target(protocols=("tcp",), xproc=True,
                               regions=[{"name": "rw", "length": size, "access": 3}])
    eng = await make_engine(protocols=("tcp",))
    peer = await bounded(eng.connect(target.address))
    src = local_mem(eng, size)
    src.view[:] = 0x11
    base = peer.region("rw").addr
    await bounded(target.fill("rw", 17))
    os.kill(target.proc.pid, signal.SIGSTOP)
    _until_stopped(target.proc.pid)         # else a thread still running lands its last recv's bytes
    try:
        t = peer.write_nowait([src.addr + k * MiB for k in range(8)], [base + k * MiB for k in range(8)],
                              [MiB] * 8)
        await asyncio.sleep(0.5)            # the sockets fill and stay full
        assert not t.done(), "the write cannot complete while the target is stopped"
        received = _receive_queue(target.proc.pid)
        await peer.close()
        try:
            await bounded(t, 10)
            raise AssertionError("the write completed toward a stopped target")
        except kvflow.KVFlowError:
            pass
        src.view[:] = 0x5A                  # the caller reuses its buffer
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)
    await asyncio.sleep(1.0)                # whatever is still on its way lands
    got = np.frombuffer(await bounded(target.get("rw", 0, size)), np.uint8)
    late = int(np.count_nonzero(got != pattern(17, size)))
    assert late == 0, (f"{late} bytes of the write landed on the target after it failed; its sockets had "
                       f"received {received}")


def _until_stopped(pid: int, timeout: float = 10.0) -> None:
    """Waits until every thread of process `pid` is stopped (state T):
    kill(SIGSTOP) returns before a thread running on another core, or one
    woken inside a recv, has stopped."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.001)


def _receive_queue(pid: int) -> int:
    """Bytes received and not read in the established tcp sockets of
    process `pid` (their Recv-Q, from `ss`)."""
    import subprocess
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if f"pid={pid}," in line)


async def test_a_task_cancelled_twice_still_waits_for_its_bytes(make_engine, make_target, local_mem):
    """The task awaiting a write is cancelled, and cancelled again while the
    write drains (as asyncio.timeout does around a cancelled task): it still
    raises only once nothing of the write can land (bounded by the drain
    grace, after which the connections carrying it are reset), not at the
    second cancel while its bytes may still be on the wire."""
    from kvflow.engine.transfer import DRAIN_GRACE
    target = await make_target(protocols=("tcp",), xproc=True,
                               regions=[{"name": "rw", "length": 32 * MiB, "access": 3}])
    eng = await make_engine(protocols=("tcp",))
    peer = await bounded(eng.connect(target.address))
    src = local_mem(eng, 32 * MiB)
    base = peer.region("rw").addr
    os.kill(target.proc.pid, signal.SIGSTOP)
    try:
        task = asyncio.get_running_loop().create_task(peer.write([src.addr], [base], [32 * MiB]))
        await asyncio.sleep(0.1)                # stuck behind the stopped target
        t0 = time.monotonic()
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()                           # again, while it waits for its bytes
        try:
            await bounded(task, 30)
        except asyncio.CancelledError:
            pass
        took = time.monotonic() - t0
        assert took >= 0.9 * DRAIN_GRACE, f"raised {took:.2f} s after the first cancel, bytes still in flight"
        assert took < (DRAIN_GRACE + 5) * TIME_SCALE
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)
    p2 = await bounded(eng.connect(target.address))
    await bounded(p2.write([src.addr], [base], [4096]))
