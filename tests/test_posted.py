"""Peer.post_write / post_read (kvflow.engine.posted): a thread posts and
polls, on local, tcp (the detached path: no loop hop) and a range the
initiator's copy of the peer's table lacks (the loop's path)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import kvflow
from kvflow.engine.thread import EngineThread

from _batches import TIME_SCALE

MiB = 1 << 20


@pytest.fixture(params=["local", "tcp"])
def pair(request):
    a = EngineThread(protocols=[request.param])
    b = EngineThread(protocols=[request.param])
    ea, eb = a.start(), b.start()
    src = np.random.default_rng(3).integers(0, 256, 64 * MiB, dtype=np.uint8)
    dst = np.zeros(64 * MiB, dtype=np.uint8)
    a.call_sync(ea.register, src)
    b.call_sync(eb.register, dst)
    peer = a.call(ea.connect(eb.address))
    yield a, b, peer, src, dst
    a.close()
    b.close()


def poll_until(t, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not t.poll():
        assert time.monotonic() < deadline, "the posted transfer did not finish"


def test_post_write_then_read_back(pair):
    a, b, peer, src, dst = pair
    offs = [0, 5 * 4096 + 3, MiB, 7 * MiB + 11]
    t = peer.post_write([src.ctypes.data + o for o in offs], [dst.ctypes.data + o for o in offs], [65536] * 4)
    poll_until(t)
    assert t.done() and t.poll()                                    # stays done
    for o in offs:
        assert np.array_equal(dst[o:o + 65536], src[o:o + 65536])
    back = np.zeros(65536, np.uint8)
    a.call_sync(a.engine.register, back)
    r = peer.post_read([back.ctypes.data], [dst.ctypes.data + offs[1]], [65536])
    r.wait(timeout=30)
    assert np.array_equal(back, src[offs[1]:offs[1] + 65536])


def test_bad_input_raises_before_anything_moves(pair):
    _, _, peer, src, dst = pair
    with pytest.raises(kvflow.InvalidArgumentError):
        peer.post_write([src.ctypes.data], [dst.ctypes.data], [0])
    # past the peer's memory: the loop's path asks the peer again, then it fails at the poll
    bad = peer.post_write([src.ctypes.data], [dst.ctypes.data + dst.nbytes - 10], [4096])
    with pytest.raises(kvflow.RemoteAccessError):
        bad.wait(timeout=30)
    other = np.zeros(4096, np.uint8)
    with pytest.raises(kvflow.UnregisteredMemoryError):
        peer.post_write([other.ctypes.data], [dst.ctypes.data], [4096])
    assert not dst.any()
    t = peer.post_write([src.ctypes.data], [dst.ctypes.data], [4096])    # still usable
    t.wait(timeout=30)
    assert np.array_equal(dst[:4096], src[:4096])


def test_cancel_drops_it(pair):
    _, _, peer, src, dst = pair
    n = 64
    first = peer.post_write([src.ctypes.data + i * MiB for i in range(n)], [dst.ctypes.data + i * MiB for i in range(n)],
                            [MiB] * n)
    second = peer.post_write([src.ctypes.data + i * MiB for i in range(n)],
                             [dst.ctypes.data + i * MiB for i in range(n)], [MiB] * n)
    second.cancel()
    with pytest.raises(kvflow.TransferCancelledError):
        second.wait(timeout=30)
    first.wait(timeout=60)
    assert np.array_equal(dst, src)


def test_a_poll_of_a_running_batch_returns_within_its_wait(pair):
    """poll() waits at most POLL_WAIT (50 us) for a batch still running:
    the native wait's 1 ms naps stop at its timeout (they once slept the
    whole millisecond). The shortest of the polls that found it running."""
    _, _, peer, src, dst = pair
    n = 16
    polls = []
    for _ in range(4):          # 4 x 64 MiB: long enough to poll it many times
        t = peer.post_write([src.ctypes.data + i * 4 * MiB for i in range(n)],
                            [dst.ctypes.data + i * 4 * MiB for i in range(n)], [4 * MiB] * n)
        while True:
            t0 = time.perf_counter()
            done = t.poll()
            if done:
                break
            polls.append(time.perf_counter() - t0)
    assert np.array_equal(dst, src)
    if len(polls) < 10:
        pytest.skip(f"the batches finished within {len(polls)} polls")
    # The old naps made every such poll last 1 ms or more. A poll that is
    # merely descheduled on these two shared cores (the transfer's own
    # threads run meanwhile) lasts as long too, often under CI's load (the
    # median: 1.4 ms in 1 run of 8; the 20th percentile: 1.1 ms in a CI
    # run): only the shortest poll tells the two apart.
    shortest = min(polls)
    assert shortest < 0.0009 * TIME_SCALE, f"shortest poll {shortest * 1e6:.0f} us over {len(polls)}"
