"""kvflow._testing, the shipped engine pair with its balance check: a pair
moves bytes on each provider available here and closes clean; a transfer
left unreaped at the end, and an engine checked before it is closed, are
reported as unbalanced."""
from __future__ import annotations

import numpy as np
import pytest

from _batches import bounded
from _providers import params, skip_unavailable
from kvflow import Engine
from kvflow._testing import UnbalancedError, check_closed, closed_leaks, engine_pair


@pytest.mark.parametrize("provider", params("tcp", "local", "rdma"))
async def test_a_pair_moves_bytes_and_closes_balanced(provider):
    skip_unavailable(provider)
    async with engine_pair(provider, size=1 << 20, seed=3) as p:
        assert p.peer.transport == provider
        # engine.devices(): rdma's verbs devices, in service; none for the others
        rows = p.a.devices()
        assert all(r["provider"] == "rdma" and r["state"] == "up" and r["why"] is None for r in rows), rows
        assert bool(rows) == (provider == "rdma")
        await bounded(p.peer.write([p.local.addr], [p.remote.addr], [p.size]))
        assert np.array_equal(p.dst, p.src)
        half = p.size // 2
        p.src[:] = 0
        await bounded(p.peer.read([p.local.addr], [p.remote.addr + half], [half]))
        assert np.array_equal(p.src[:half], p.dst[half:])
    assert not closed_leaks(p.a.counters()) and not closed_leaks(p.b.counters())


async def test_a_transfer_left_unreaped_is_reported():
    with pytest.raises(UnbalancedError, match="still in flight at the end: .*batches"):
        async with engine_pair("tcp", idle_wait_s=0.2) as p:
            t = p.peer.post_write([p.local.addr], [p.remote.addr], [p.size])
            assert t is not None                  # posted, never awaited
    assert not closed_leaks(p.a.counters())       # closing reclaimed it all the same


async def test_an_open_engine_is_not_closed_clean():
    e = Engine(listen="127.0.0.1:0", protocols=("tcp",))
    await e.start()
    try:
        with pytest.raises(UnbalancedError, match="native resources left after close"):
            check_closed(e)
    finally:
        await e.close()
    check_closed(e)
