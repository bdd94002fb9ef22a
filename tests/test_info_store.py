"""kvflow-info --store against a standalone master the test starts
(`python -m kvflow.store master`): what it prints follows the pool, and
an in-process client's embedded master is shown through the same report."""
from __future__ import annotations

import asyncio
import json
import shutil
import sys

import numpy as np
import pytest
from _metadata_servers import MetadataServer, _unavailable
from _store_master import ROOT, standalone_master, store_env

from kvflow.cli.info import format_store, store_report
from kvflow.store import Master, MasterUnavailableError, StoreClient



async def _info(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.cli.info", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_info_shows_segments_objects_clients_and_leases_of_a_standalone_master():
    async with standalone_master() as (address, _), \
            StoreClient(address, segment_size=8 << 20, protocols=("tcp",)) as a, \
            StoreClient(address, segment_size=4 << 20, protocols=("tcp",)) as b:
        data = np.ones(100_000, np.uint8)
        reg = a.register_buffer(data)
        keys = [f"info/{i}" for i in range(5)]
        assert await a.batch_put_from(keys, [reg.addr] * 5, [100_000] * 5, replica_num=2) == [2] * 5
        await b.get_replicas(keys[0])           # a lease left to run out

        rc, out, err = await _info("--store", address, "--json")
        assert rc == 0, err
        report = json.loads(out)
        assert report["address"] == address
        segs = {s["client"]: s for s in report["segments"]}
        assert set(segs) == {a.client_id, b.client_id}
        assert (segs[a.client_id]["capacity"], segs[b.client_id]["capacity"]) == (8 << 20, 4 << 20)
        assert all(s["replicas"] == 5 and s["used"] >= 500_000 and s["tier"] == "dram" for s in segs.values())
        assert report["capacity"] == 12 << 20 and report["used"] == sum(s["used"] for s in segs.values())
        assert report["objects"] == {"dram": 5} and report["puts_in_progress"] == 0
        assert {c["id"] for c in report["clients"]} == {a.client_id, b.client_id}
        assert report["leases"] == 1
        assert report["lookups"]["get"] == {"hit": 1, "miss": 0}

        rc, out, err = await _info("--store", address)
        assert rc == 0, err
        assert f"kvflow.store master {address}" in out
        assert "capacity 12.0 MiB" in out and "objects 5 (dram 5)" in out and "leases 1 " in out
        assert "segments (2)" in out and "clients (2)" in out
        assert a.client_id in out and b.client_id in out


async def test_info_on_a_master_that_is_not_there_says_so():
    rc, out, err = await _info("--store", "127.0.0.1:1", "--timeout", "2")
    assert rc == 1 and "127.0.0.1:1" in err and "unreachable" in err and not out


async def test_info_finds_the_leader_of_an_etcd_cluster(tmp_path):
    if shutil.which("etcd") is None:
        _unavailable("etcd is not installed (Debian: etcd-server)")
    etcd = MetadataServer("etcd", tmp_path)
    etcd.start()
    spec = f"etcd://127.0.0.1:{etcd.port}/info"
    try:
        async with standalone_master("--etcd", f"127.0.0.1:{etcd.port}", "--cluster", "info") as (address, _), \
                StoreClient(spec, segment_size=2 << 20, protocols=("tcp",)) as a:
            await a.put("durable", b"d" * 2000)
            rc, out, err = await _info("--store", spec, "--json")
            assert rc == 0, err
            report = json.loads(out)
            assert report["address"] == address and report["objects"] == {"dram": 1}
            assert [s["client"] for s in report["segments"]] == [a.client_id]
    finally:
        etcd.kill()


async def test_the_embedded_master_in_process():
    master = Master(seed=1)
    async with StoreClient(master, segment_size=2 << 20, protocols=("tcp",)) as a:
        await a.put("e", b"z" * 4000)
        for source in (a, master):
            report = await store_report(source)
            assert report["objects"] == {"dram": 1} and len(report["segments"]) == 1
            assert report["segments"][0]["client"] == a.client_id
        text = format_store(report)
        assert text.startswith("kvflow.store master in this process") and "objects 1 (dram 1)" in text
    with pytest.raises(MasterUnavailableError):
        await store_report("127.0.0.1:1", timeout=2)
