"""Receiver credits (Engine(receive_window=), kvflow/_native/credit.c): N
senders toward one receiver stay within its window.

What is in flight toward the receiver is measured twice: by the pool's own
books (held never above the window, no payload landing without a grant)
and independently by the kernel, sampling with `ss` the bytes queued in
the senders' and the receiver's sockets of its data port while the
transfer runs."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvflow
from kvflow import Priority
from _providers import params, skip_unavailable

MiB = 1 << 20
WINDOW = 1 * MiB
# What the samples may show beyond the window: frame headers (32 bytes a
# slice, and credit frames) travel outside the credits, at 256 KiB slices a
# few KiB; and one `ss` dump reads the sockets one after another, so bytes
# that move from a sender's notsent into the receiver's Recv-Q while it runs
# are counted on both sides. That double count can reach what is in flight,
# itself at most the window (CI runs saw 479 bytes over 64 KiB, then
# 1,311,040 bytes against 1 MiB + 128 KiB), so a sample is bounded by twice
# the window; the pool's own books (max_held <= window, no violations) are
# the exact check, and the contrast test without a window still queues far
# above this bound (8-20 MB).
HEADER_SLACK = 128 << 10
SAMPLE_BOUND = 2 * WINDOW + HEADER_SLACK


class Sampler:
    """Calls `_sample()` over and over in a thread while in use, keeping
    what it returns in `samples`."""

    pause = 0.0

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            if self.pause:
                time.sleep(self.pause)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


class SocketSampler(Sampler):
    """Samples the payload queued in the kernel toward the receiver's data
    port: what every sender's socket has not sent yet (its `notsent`;
    Send-Q would also count bytes sent and not yet acked, which sit in the
    receiver's queue too) plus what every receiver socket has received and
    not read (Recv-Q, where the local end is the port)."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def _sample(self) -> int:
        out = subprocess.run(["ss", "-tnHi", "state", "established"], capture_output=True, text=True,
                             check=True).stdout
        total, side = 0, None
        for line in out.splitlines():
            f = line.split()
            if not line[:1].isspace():            # a socket's line: Recv-Q Send-Q local peer
                side = None
                if len(f) >= 4 and f[3].endswith(f":{self.port}"):
                    side = "sender"
                elif len(f) >= 4 and f[2].endswith(f":{self.port}"):
                    total += int(f[0])
            elif side == "sender":                # its info line
                total += next((int(x[8:]) for x in f if x.startswith("notsent:")), 0)
        return total


class QpSampler(Sampler):
    """Samples the bytes the senders' rdma QPs have posted and not seen
    complete (each QP's inflight_bytes): on RC what is on its way into the
    receiver's memory, counted by the QPs' send queues, not by the credit
    books."""

    pause = 0.0005

    def __init__(self, channels: list) -> None:
        super().__init__()
        self.channels = channels

    def _sample(self) -> int:
        return sum(q["inflight_bytes"] for ch in self.channels for q in ch.qp_stats())


async def incast(window: int | None, *, nsend: int = 3, size: int = 48 * MiB, entries: int = 48,
                 sample: bool = True, protocol: str = "tcp", min_samples: int = 1):
    """nsend engines write `size` bytes each (one batch of `entries`
    entries) to one receiver at once, again (up to 8 rounds) until the
    sampler has taken `min_samples` samples during the writes; returns (receiver stats, samples of
    what is in flight toward it (tcp: the kernel's socket queues; rdma: the
    senders' QPs), the senders' per-connection or per-QP credit stats);
    every byte is checked."""
    recv = kvflow.Engine(protocols=[protocol], receive_window=window)
    await recv.start()
    senders = []
    try:
        dst = np.zeros(size * nsend, dtype=np.uint8)
        recv.register(dst)
        for i in range(nsend):
            e = kvflow.Engine(protocols=[protocol])
            senders.append(e)
            await e.start()
            src = (np.arange(size, dtype=np.uint32) * (i + 3) % 251).astype(np.uint8)
            e.register(src)
            peer = await e.connect(recv.address)
            senders[-1] = (e, src, peer)
        step = size // entries

        async def one(i, e, src, peer):
            await peer.write([src.ctypes.data + k * step for k in range(entries)],
                             [dst.ctypes.data + i * size + k * step for k in range(entries)],
                             [step] * entries, priority=Priority.LOW)

        if protocol == "tcp":
            sampler = SocketSampler(int(recv.data_address.rsplit(":", 1)[1]))
        else:
            sampler = QpSampler([peer._channel for _, _, peer in senders])
        if sample:
            with sampler:
                for _ in range(8):
                    await asyncio.gather(*(one(i, *s) for i, s in enumerate(senders)))
                    if len(sampler.samples) >= min_samples:
                        break
        else:
            await asyncio.gather(*(one(i, *s) for i, s in enumerate(senders)))
        for i, (_, src, _) in enumerate(senders):
            assert np.array_equal(dst[i * size:(i + 1) * size], src), f"sender {i}'s bytes differ"
        conns = [peer._channel.credit_stats() for _, _, peer in senders]
        if protocol == "tcp":
            # with the payload bytes each connection carried (the express
            # lane carries HIGH batches only: none here)
            conns = [[dict(c, bytes=k["bytes"]) for c, k in zip(per, peer.connections())]
                     for per, (_, _, peer) in zip(conns, senders)]
        if protocol == "rdma" and window:
            # the books settle: once the last completions are reported, what
            # the pool counts held is the senders' unspent credit
            deadline = time.monotonic() + 10
            while True:
                conns = [peer._channel.credit_stats() for _, _, peer in senders]
                unspent = sum(c["credit"] for per in conns for c in per)
                if recv.receive_window_stats()["held"] == unspent or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
        return recv.receive_window_stats(), sampler.samples, conns
    finally:
        for s in senders:
            await (s[0] if isinstance(s, tuple) else s).close()
        await recv.close()


def test_receive_window_is_validated():
    for bad in (1000, -1, True, 1.5 * MiB, "1M", 1 << 41):
        with pytest.raises(kvflow.InvalidArgumentError, match="receive_window"):
            kvflow.Engine(receive_window=bad)
    assert kvflow.Engine(receive_window=None).receive_window == 0
    assert kvflow.Engine(receive_window=0).receive_window == 0
    assert kvflow.Engine(receive_window=WINDOW).receive_window == WINDOW


async def test_three_senders_stay_within_the_window():
    stats, samples, conns = await incast(WINDOW)
    assert stats["violations"] == 0
    assert 0 < stats["max_held"] <= WINDOW
    assert stats["grants"] > 0 and stats["asks"] > 0
    # every connection of every sender that carried bytes was granted
    # credit: nobody starved
    for i, per in enumerate(conns):
        assert all(c["grants"] > 0 for c in per if c["bytes"]), (i, per)
        assert sum(1 for c in per if c["bytes"]) >= 2, (i, per)
    assert samples, "the sampler saw nothing"
    assert max(samples) <= SAMPLE_BOUND, (max(samples), sorted(samples)[-10:])


@pytest.mark.parametrize("protocol", params("rdma"))
async def test_rdma_three_senders_stay_within_the_window(protocol):
    """On rdma the target does not see one-sided writes land; its
    initiators report their completions. What the senders' QPs have posted
    and not seen complete never exceeds the window (each sample is exact:
    a QP's posted bytes, read under its lock), and neither does the pool's
    books' max_held."""
    skip_unavailable(protocol)
    stats, samples, conns = await incast(WINDOW, size=8 * MiB, entries=32, protocol=protocol)
    assert stats["violations"] == 0, stats
    assert 0 < stats["max_held"] <= WINDOW, stats
    assert stats["grants"] > 0 and stats["asks"] > 0, stats
    # each target QP is a holder; once the writes completed their initiators
    # reported every byte back, and what is still held is credit granted
    # and not spent (kept until a recall)
    assert stats["holders"] >= 3, stats
    assert stats["held"] == sum(c["credit"] for per in conns for c in per), (stats, conns)
    for i, per in enumerate(conns):
        assert per and all(c["grants"] > 0 for c in per), (i, per)
    assert samples and max(samples) > 0, "the sampler saw nothing in flight"
    # one sample reads the QPs one after another, so bytes can be counted on
    # one QP before they complete and on another that spent the credit they
    # freed (a 2-device VM run saw 1.5 MiB against 1 MiB): bounded by twice
    # the window, as tcp's; the pool's max_held above is the exact check
    assert max(samples) <= 2 * WINDOW, (max(samples), sorted(samples)[-10:])


@pytest.mark.parametrize("protocol", params("rdma"))
async def test_rdma_without_a_window_more_is_in_flight(protocol):
    """The contrast for the test above: without a window the same senders
    have more than that test's bound posted at once. Three times the bytes
    of that test (the same 256 KiB entries): with 8 MiB each, the Soft-RoCE
    VM under TCG sometimes ran the senders nearly one after another, and
    its sampler caught one QP's 2 MiB at most (1 run in 15)."""
    skip_unavailable(protocol)
    stats, samples, _ = await incast(None, size=24 * MiB, entries=96, protocol=protocol)
    assert stats is None
    assert max(samples) > 2 * WINDOW, max(samples)


async def test_without_a_window_the_kernel_queues_more():
    """The contrast that shows the sampler measures something: the same
    load without a window queues more than the window in the kernel. At
    least 5 samples: one `ss` dump can take as long as a whole round on a
    fast run (a CI run's sampler took one sample, early, at 0.7 MB)."""
    stats, samples, _ = await incast(None, min_samples=5)
    assert stats is None
    assert len(samples) >= 5, samples
    assert max(samples) > SAMPLE_BOUND, sorted(samples)[-10:]


@pytest.mark.parametrize("protocol", params("tcp", "rdma"))
async def test_connections_that_end_give_their_credit_back(protocol):
    """A sender SIGKILLed with credit granted: its tcp connections close
    (the kernel closes them), or its rdma control session ends and the
    target QPs paired with its QPs go; either way all it held returns."""
    skip_unavailable(protocol)
    recv = kvflow.Engine(protocols=[protocol], receive_window=WINDOW)
    await recv.start()
    try:
        dst = np.zeros(64 * MiB, dtype=np.uint8)
        recv.register(dst)
        child = subprocess.Popen([sys.executable, "-c", SENDER, recv.address, str(dst.ctypes.data), protocol],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        granted = 64 * MiB if protocol == "tcp" else 8 * MiB
        try:
            deadline = time.monotonic() + 60
            while True:
                st = recv.receive_window_stats()
                if st["holders"] >= 2 and st["held"] > 0 and st["granted_bytes"] > granted:
                    break
                assert child.poll() is None, child.communicate()
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.02)
            child.send_signal(signal.SIGKILL)    # dies with credit granted and bytes in flight
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        deadline = time.monotonic() + 10
        while (st := recv.receive_window_stats())["holders"]:
            assert time.monotonic() < deadline, st
            await asyncio.sleep(0.02)
        assert st["held"] == 0 and st["free"] == WINDOW and st["violations"] == 0, st
        # the whole window serves the next sender
        e = kvflow.Engine(protocols=[protocol])
        await e.start()
        try:
            src = np.full(32 * MiB, 7, dtype=np.uint8)
            e.register(src)
            peer = await e.connect(recv.address)
            await asyncio.wait_for(peer.write([src.ctypes.data], [dst.ctypes.data], [src.nbytes]), 30)
            assert (dst[:src.nbytes] == 7).all()
        finally:
            await e.close()
    finally:
        await recv.close()


SENDER = r"""
import asyncio, sys
import numpy as np
import kvflow
async def main(addr, dst, protocol):
    e = kvflow.Engine(protocols=[protocol])
    await e.start()
    src = np.ones(32 << 20, dtype=np.uint8)
    e.register(src)
    peer = await e.connect(addr)
    while True:
        await peer.write([src.ctypes.data + (k << 20) for k in range(32)],
                         [dst + (k << 20) for k in range(32)], [1 << 20] * 32)
asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


@pytest.mark.parametrize("protocol", params("tcp", "rdma"))
async def test_reads_priorities_and_cancel_with_a_window(protocol):
    """Reads need no credit; a HIGH write passes a LOW stream that waits
    for credit; a cancelled write queued behind the stream raises at once;
    the engine and the pool stay usable."""
    skip_unavailable(protocol)
    recv = kvflow.Engine(protocols=[protocol], receive_window=WINDOW)
    # An aging interval shorter than the gap between two grants to one
    # connection or QP: before the scheduler's fix (sched.c, issue 18) LOW
    # then took every grant and the HIGH write waited for the whole stream
    # (on rdma with 4 QPs every time; with the default 20 ms sometimes).
    e = kvflow.Engine(protocols=[protocol], qos_aging=0.001)
    # the Soft-RoCE VM is emulated and slow: a shorter stream there
    n = 64 if protocol == "tcp" else 48
    await recv.start()
    await e.start()
    try:
        dst = np.zeros(160 * MiB, dtype=np.uint8)
        dst[:MiB] = 9
        recv.register(dst)
        src = np.full(160 * MiB, 5, dtype=np.uint8)
        e.register(src)
        peer = await e.connect(recv.address)
        back = np.zeros(MiB, dtype=np.uint8)
        e.register(back)
        await peer.read([back.ctypes.data], [dst.ctypes.data], [MiB])
        assert (back == 9).all()
        base, rd = src.ctypes.data, dst.ctypes.data
        stream = peer.write_nowait([base + k * MiB for k in range(n)], [rd + k * MiB for k in range(n)],
                                   [MiB] * n, priority=Priority.LOW)
        doomed = peer.write_nowait([base + 64 * MiB], [rd + 64 * MiB], [n * MiB], priority=Priority.LOW)
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await peer.write([base + 128 * MiB], [rd + 128 * MiB], [64 << 10], priority=Priority.HIGH)
        high_s = time.perf_counter() - t0
        assert not stream.done(), "the stream ended before the HIGH write: no contention was measured"
        t0 = time.perf_counter()
        doomed.cancel()
        with pytest.raises(kvflow.TransferCancelledError):
            await doomed
        cancel_s = time.perf_counter() - t0
        await stream
        assert (dst[:n * MiB] == 5).all() and (dst[128 * MiB:128 * MiB + (64 << 10)] == 5).all()
        # generous bounds (a shared machine): the order, not the speed, is checked
        bound = 1.0 if protocol == "tcp" else 5.0
        assert high_s < bound and cancel_s < bound, (high_s, cancel_s)
        await peer.write([base], [rd], [32 * MiB])
        st = recv.receive_window_stats()
        assert st["violations"] == 0 and st["max_held"] <= WINDOW, st
    finally:
        await e.close()
        await recv.close()


@pytest.mark.parametrize("protocol", params("rdma"))
async def test_rdma_a_broken_qp_gives_its_credit_back(protocol):
    """A QP taken out of service mid-stream: its slices go to the other
    QPs, which spend credit for them again; the repair replaces its target
    QP, whose credit returns to the pool; every byte lands and the books
    balance afterwards."""
    skip_unavailable(protocol)
    recv = kvflow.Engine(protocols=[protocol], receive_window=WINDOW)
    e = kvflow.Engine(protocols=[protocol])
    await recv.start()
    await e.start()
    try:
        n = 16 * MiB
        dst = np.zeros(n, dtype=np.uint8)
        recv.register(dst)
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        e.register(src)
        peer = await e.connect(recv.address)
        ch = peer._channel
        nqps = len(ch.qp_stats())
        step = 256 << 10
        stream = peer.write_nowait([src.ctypes.data + k * step for k in range(n // step)],
                                   [dst.ctypes.data + k * step for k in range(n // step)], [step] * (n // step))
        deadline = time.monotonic() + 30
        while ch.credit_stats()[0]["grants"] == 0:
            assert time.monotonic() < deadline and not stream.done(), ch.credit_stats()
            await asyncio.sleep(0.002)
        assert ch.break_qp(0)
        await asyncio.wait_for(e._rdma._repair(peer.link, ch, 0), 60)
        await asyncio.wait_for(stream, 60)
        assert np.array_equal(dst, src)
        src[:] = np.roll(src, 7)
        await asyncio.wait_for(peer.write([src.ctypes.data], [dst.ctypes.data], [n]), 60)
        assert np.array_equal(dst, src)
        deadline = time.monotonic() + 10
        while True:
            st = recv.receive_window_stats()
            unspent = sum(c["credit"] for c in ch.credit_stats())
            if st["held"] == unspent or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        assert st["held"] == unspent, (st, ch.credit_stats())
        assert st["holders"] == nqps and st["violations"] == 0 and st["max_held"] <= WINDOW, st
    finally:
        await e.close()
        await recv.close()
