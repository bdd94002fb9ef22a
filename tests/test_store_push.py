"""The master pushes notices to a client unasked (Master.push, a frame with
id 0 on the client's own connection): a reader on another host waiting for
an SSD copy gets its holder to load it at once, not at the holder's next
cleaner poll. Over tcp to a standalone master, and with the master in the
process (LocalMasterLink)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvflow.store import StoreClient
from kvflow.store import ssd_agent

from _store_master import standalone_master

SEG = 4 << 20
OBJ = 512 << 10          # 8 objects fill a segment


def _data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, OBJ, dtype=np.uint8).tobytes()


async def _cold_keys(holder: StoreClient, n: int) -> dict[str, bytes]:
    """n objects put into the holder's segment (room for 8) and copied to
    its SSD: the first four, evicted from DRAM by the later ones, are only
    on SSD now ({key: bytes})."""
    vals = {}
    for i in range(n):
        vals[f"k{i}"] = _data(i)
        await holder.put(f"k{i}", vals[f"k{i}"])
        await holder.ssd_flush()
    cold = {f"k{i}": vals[f"k{i}"] for i in range(4)}
    for k in cold:
        # (a lease on an object without DRAM replicas holds no space; the
        # ones in DRAM are not asked: their leases would keep them from
        # being evicted to make room for the loads)
        assert not await holder.get_replicas(k), k
    return cold


@pytest.mark.parametrize("where", ["tcp", "in-process"])
async def test_a_reader_elsewhere_gets_an_ssd_copy_loaded_without_waiting_for_the_holders_poll(
        tmp_path, monkeypatch, where):
    # the holder's cleaner would look again only after 30 s: only the push makes it act
    monkeypatch.setattr(ssd_agent, "IDLE_POLL", float(__import__("os").environ.get("POLLX", "30")))
    if where == "tcp":
        async with standalone_master() as (addr, _):
            await _check(tmp_path, addr)
    else:
        await _check(tmp_path, None)


async def _check(tmp_path, master):
    async with StoreClient(master, segment_size=SEG, ssd_path=str(tmp_path), ssd_offload="eager",
                           ssd_promote=False, protocols=("tcp",)) as holder:
        far_master = master if master is not None else holder._embedded
        async with StoreClient(far_master, segment_size=0, host="elsewhere", protocols=("tcp",),
                               timeout=20.0) as far:
            cold = await _cold_keys(holder, 16)
            assert len(cold) >= 4
            keys = list(cold)[:4]
            t0 = time.monotonic()
            got = await far.batch_get(keys)
            took = time.monotonic() - t0
            assert got == [cold[k] for k in keys]
            for k in keys:
                assert await holder.get_replicas(k), k        # loaded into the holder's DRAM
            # without the push: the holder's next poll, 30 s on (the reader's
            # own wait, half its timeout, would end first: ReplicaUnavailableError)
            assert took < 3.0, took
