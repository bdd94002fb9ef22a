"""A Peer's eight entry points (write, read, their _nowait, _blocking and
post_ forms) go through one submission path (Peer._submit) and take the
same options: strided entries, priority, deadline and after everywhere;
timeout everywhere but post_ (the polling thread owns the wait there:
PostedTransfer.wait(timeout))."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvflow
from _batches import bounded

KIB = 1024
PIECES, PIECE, LSTRIDE, RSTRIDE = 8, 256, 1024, 512      # 8 pieces of 256 B, every 1 KiB here, every 512 B there
STRIDED = {"counts": [PIECES], "local_strides": [LSTRIDE], "remote_strides": [RSTRIDE]}


async def _pair(make_engine, protocol):
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    return a, b, await bounded(a.connect(b.address))


def _posted(p: kvflow.PostedTransfer) -> None:
    while not p.poll():
        pass


@pytest.mark.parametrize("protocol", ["local", "tcp"])
async def test_every_entry_point_takes_strided_entries_and_qos(make_engine, protocol):
    a, b, peer = await _pair(make_engine, protocol)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 64 * KIB, dtype=np.uint8)
    dst = np.zeros(64 * KIB, np.uint8)
    s, d = a.register(src), b.register(dst)
    loop = asyncio.get_running_loop()
    opts = {**STRIDED, "priority": kvflow.Priority.HIGH, "deadline": 1.0}

    def landed(off: int) -> bool:
        return all(np.array_equal(dst[off + RSTRIDE * k: off + RSTRIDE * k + PIECE], src[LSTRIDE * k: LSTRIDE * k + PIECE])
                   for k in range(PIECES))

    writes = {
        "write": lambda r: peer.write([s.addr], [r], [PIECE], timeout=10, **opts),
        "write_nowait": lambda r: peer.write_nowait([s.addr], [r], [PIECE], timeout=10, **opts),
        "write_blocking": lambda r: loop.run_in_executor(
            None, lambda: peer.write_blocking([s.addr], [r], [PIECE], timeout=10, **opts)),
        "post_write": lambda r: loop.run_in_executor(
            None, lambda: _posted(peer.post_write([s.addr], [r], [PIECE], **opts))),
    }
    for i, (name, call) in enumerate(writes.items()):
        off = i * 8 * KIB
        await bounded(call(d.addr + off))
        assert landed(off), name
    back = np.zeros(64 * KIB, np.uint8)
    k_ = a.register(back)
    reads = {
        "read": lambda l: peer.read([l], [d.addr], [PIECE], timeout=10, **opts),
        "read_nowait": lambda l: peer.read_nowait([l], [d.addr], [PIECE], timeout=10, **opts),
        "read_blocking": lambda l: loop.run_in_executor(
            None, lambda: peer.read_blocking([l], [d.addr], [PIECE], timeout=10, **opts)),
        "post_read": lambda l: loop.run_in_executor(
            None, lambda: _posted(peer.post_read([l], [d.addr], [PIECE], **opts))),
    }
    for i, (name, call) in enumerate(reads.items()):
        off = i * 16 * KIB
        await bounded(call(k_.addr + off))
        for k in range(PIECES):
            assert np.array_equal(back[off + LSTRIDE * k: off + LSTRIDE * k + PIECE],
                                  dst[RSTRIDE * k: RSTRIDE * k + PIECE]), name


@pytest.mark.parametrize("protocol", ["local", "tcp"])
async def test_every_entry_point_checks_its_options_alike(make_engine, protocol):
    """Strides without counts, a bad priority, an entry outside the peer's
    memory: each entry point refuses them the same way, before anything
    moves; a strided entry's error names the entry, not the piece."""
    a, b, peer = await _pair(make_engine, protocol)
    src = a.register(np.ones(16 * KIB, np.uint8))
    dst = b.register(np.zeros(16 * KIB, np.uint8))
    loop = asyncio.get_running_loop()
    calls = {
        "write": lambda la, ra, ln, **kw: peer.write(la, ra, ln, **kw),
        "write_nowait": lambda la, ra, ln, **kw: peer.write_nowait(la, ra, ln, **kw),
        "write_blocking": lambda la, ra, ln, **kw: loop.run_in_executor(
            None, lambda: peer.write_blocking(la, ra, ln, **kw)),
        "post_write": lambda la, ra, ln, **kw: loop.run_in_executor(
            None, lambda: _posted(peer.post_write(la, ra, ln, **kw))),
    }
    one = ([src.addr], [dst.addr], [PIECE])
    # the 3rd piece of entry 1 runs past the peer's region: the error names entry 1
    two = ([src.addr, src.addr], [dst.addr, dst.addr + 15 * KIB], [PIECE, PIECE])
    for name, call in calls.items():
        with pytest.raises(kvflow.InvalidArgumentError, match="counts, local_strides and remote_strides"):
            await bounded(call(*one, local_strides=[LSTRIDE]))
        with pytest.raises(kvflow.InvalidArgumentError, match="priority"):
            await bounded(call(*one, priority="urgent"))
        with pytest.raises(kvflow.RemoteAccessError) as e:
            await bounded(call(*two, counts=[1, 8], local_strides=[0, LSTRIDE], remote_strides=[0, RSTRIDE]))
        assert e.value.index == 1, name
    await bounded(peer.write([src.addr], [dst.addr], [PIECE]))      # still usable


async def test_after_on_blocking_and_posted_needs_cuda(make_engine):
    """after= reaches the blocking and posted forms too: the batch runs on
    the loop once the event completed (here: no CUDA, refused as write()
    refuses it)."""
    import kvflow.cuda
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here: tests/test_cuda.py waits for real events")
    a, b, peer = await _pair(make_engine, "tcp")
    src = a.register(np.ones(4096, np.uint8))
    dst = b.register(np.zeros(4096, np.uint8))
    loop = asyncio.get_running_loop()
    with pytest.raises(kvflow.ProviderUnavailableError, match="CUDA is not usable here"):
        await bounded(loop.run_in_executor(
            None, lambda: peer.write_blocking([src.addr], [dst.addr], [4096], after=object())))
    with pytest.raises(kvflow.ProviderUnavailableError, match="CUDA is not usable here"):
        await bounded(loop.run_in_executor(
            None, lambda: peer.post_write([src.addr], [dst.addr], [4096], after=object()).wait(10)))
    await bounded(loop.run_in_executor(None, lambda: peer.write_blocking([src.addr], [dst.addr], [4096])))
