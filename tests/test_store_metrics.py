"""The pool's metrics against real StoreClients (kvflow engines, an
embedded master): each counter moves by what the calls did, the master's
view follows its segments, and both reach Prometheus."""
from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import sys
import urllib.request

import numpy as np
import pytest

from kvflow.store import Master, ObjectLeasedError, ObjectNotFoundError, StoreClient
from kvflow.store.metrics import Histogram, register_prometheus

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rt(client: StoreClient, method: str) -> int:
    h = client.metrics()["round_trips"].get(method)
    return h["count"] if h else 0


async def test_client_counters_follow_puts_gets_exists_and_round_trips():
    master = Master(seed=1)
    async with StoreClient(master, segment_size=8 << 20, protocols=("tcp",)) as a, \
            StoreClient(master, segment_size=0, protocols=("tcp",)) as b:
        n, size = 8, 10_000
        src = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros(n * size, np.uint8)
        ra, rb = a.register_buffer(src), b.register_buffer(dst)
        keys = [f"m/{i}" for i in range(n)]
        assert await a.batch_put_from(keys, [ra.addr + i * size for i in range(n)], [size] * n) == [1] * n
        assert await a.batch_put_from(keys[:3], [ra.addr] * 3, [size] * 3) == [0] * 3      # existed
        m = a.metrics()
        assert m["kind"] == "client" and m["calls"]["put"] == 2
        assert m["puts"] == {"stored": n, "existed": 3}
        assert m["bytes"]["put"] == {"dram": n * size}
        assert _rt(a, "batch_put_start") == 2 and _rt(a, "batch_put_end") == 1    # nothing to write: no commit

        got = await b.batch_get_into(keys + ["absent"], [rb.addr + i * size for i in range(n)] + [rb.addr],
                                     [size] * (n + 1))
        assert got[:n] == [size] * n and isinstance(got[n], ObjectNotFoundError)
        assert np.array_equal(dst, src)
        assert await b.get(keys[0]) == src[:size].tobytes()
        m = b.metrics()
        assert m["hits"]["get"] == n + 1 and m["misses"]["get"] == 1 and m["errors"]["get"] == 0
        assert m["bytes"]["get"] == {"dram": (n + 1) * size}
        assert _rt(b, "batch_get_replicas") == 2            # one round trip per get call, any batch

        many = keys + [f"none/{i}" for i in range(120)]
        before = _rt(b, "batch_exists")
        assert await b.batch_exists(many) == [True] * n + [False] * 120
        assert _rt(b, "batch_exists") == before + 1         # 128 keys: one round trip
        m = b.metrics()
        assert m["hits"]["exists"] == n and m["misses"]["exists"] == 120
        h = m["round_trips"]["batch_exists"]
        assert h["count"] == 1 and 0 < h["mean_us"] <= h["p50_us"] * 2 and h["sum_seconds"] > 0
        assert sum(c for _, c in h["buckets"]) == 1

        out = await b.batch_remove(keys[:2] + ["absent"])
        assert out[:2] == [None, None] and isinstance(out[2], ObjectNotFoundError)
        assert b.metrics()["misses"]["remove"] == 1
        view = master.metrics()
        assert view["lookups"]["get"] == {"hit": n + 1, "miss": 1}
        assert view["lookups"]["exists"] == {"hit": n, "miss": 120}
        assert view["calls_by_method"]["batch_put_start"] == 2


async def test_master_view_evictions_and_lease_waits():
    master = Master(seed=2, high_watermark=0.9, low_watermark=0.5)
    async with StoreClient(master, segment_size=1 << 20, protocols=("tcp",)) as a:
        view = master.metrics()
        seg, = view["segments"]
        assert (seg["tier"], seg["capacity"], seg["used"], seg["replicas"]) == ("dram", 1 << 20, 0, 0)
        assert [c["id"] for c in view["clients"]] == [a.client_id]
        assert view["clients"][0]["segments"] == [seg["id"]]

        value = bytes(100_000)
        assert await a.put("held", value) == 1
        await a.get_replicas("held")                # a lease nobody releases (until the TTL)
        with pytest.raises(ObjectLeasedError):
            await a.remove("held")
        assert master.metrics()["lease_waits"]["remove"] == 1
        assert a.metrics()["lease_waits"]["remove"] == 1
        assert master.metrics()["leases"] >= 1

        for i in range(20):                         # 2 MB into 1 MiB: eviction, the leased one kept
            assert await a.put(f"fill/{i}", value) == 1
        view = master.metrics()
        assert view["evictions"]["dram"] > 0
        assert view["evicted_bytes"]["dram"] >= view["evictions"]["dram"] * 100_000
        assert view["lease_waits"]["evict"] > 0
        assert await a.exists("held")
        seg, = view["segments"]
        assert seg["used"] == view["used"] == view["tiers"]["dram"]["used"] <= 0.9 * (1 << 20)
        assert seg["replicas"] == view["objects"]["dram"] == 20 + 1 - view["evictions"]["dram"]

        await a.remove("held", force=True)          # leased: gone now, its space held for the reader
        view = master.metrics()
        assert view["lease_waits"]["quarantine"] == 1 and view["quarantined_bytes"] > 0
        # the same view over the wire, as kvflow-info reads it
        wire = await a.stats(detail=True)
        assert wire["segments"] == view["segments"] and wire["objects"] == view["objects"]


def test_histogram_buckets_are_powers_of_two_of_microseconds():
    h = Histogram()
    for s in (0.5e-6, 3e-6, 3e-6, 100e-6, 100.0):
        h.add(s)
    snap = h.snapshot()
    counts = dict(snap["buckets"])
    assert counts[2.0] == 1 and counts[4.0] == 2 and counts[128.0] == 1 and counts[float("inf")] == 1
    assert snap["count"] == 5 and snap["p50_us"] == 4.0 and snap["p99_us"] == float("inf")


async def test_prometheus_export_of_a_client_and_its_master():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    master = Master(seed=3)
    async with StoreClient(master, segment_size=4 << 20, protocols=("tcp",)) as a:
        register_prometheus(a, registry, name="a")
        register_prometheus(master, registry)
        value = lambda name, **labels: registry.get_sample_value(name, labels)
        assert await a.put("p", b"x" * 5000) == 1
        assert await a.get("p") == b"x" * 5000
        assert await a.batch_exists(["p", "q"]) == [True, False]
        assert value("kvflow_store_puts_total", store="a", result="stored") == 1
        assert value("kvflow_store_bytes_total", store="a", op="put", tier="dram") == 5000
        assert value("kvflow_store_bytes_total", store="a", op="get", tier="dram") == 5000
        assert value("kvflow_store_hits_total", store="a", op="exists") == 1
        assert value("kvflow_store_misses_total", store="a", op="exists") == 1
        assert value("kvflow_store_master_round_trips_total", store="a", method="batch_exists") == 1
        assert value("kvflow_store_master_round_trip_seconds_count", store="a", method="batch_get_replicas") == 1
        sid = str(master.metrics()["segments"][0]["id"])
        assert value("kvflow_store_segment_capacity_bytes", segment=sid, client=a.client_id, tier="dram") == 4 << 20
        assert value("kvflow_store_segment_used_bytes", segment=sid, client=a.client_id, tier="dram") >= 5000
        assert value("kvflow_store_segment_fenced_bytes", segment=sid, client=a.client_id, tier="dram") == 0
        seg = next(iter(master.model.segments.values()))
        held = seg.alloc.fence()            # as a recovering leader does (fence.py): the free space held back
        assert held == (4 << 20) - seg.alloc.used
        assert value("kvflow_store_segment_fenced_bytes", segment=sid, client=a.client_id, tier="dram") == held
        seg.alloc.unfence()
        assert value("kvflow_store_segment_fenced_bytes", segment=sid, client=a.client_id, tier="dram") == 0
        assert value("kvflow_store_master_objects", tier="dram") == 1
        assert value("kvflow_store_master_clients") == 1
        assert value("kvflow_store_evictions_total", tier="dram") == 0
        assert value("kvflow_store_master_lookups_total", op="exists", result="miss") == 1
        await a.remove("p")
        assert value("kvflow_store_master_objects", tier="dram") == 0
        assert value("kvflow_store_tier_used_bytes", tier="dram") == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_standalone_master_serves_its_metrics_over_http():
    pytest.importorskip("prometheus_client")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0", "--metrics-port", str(port),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "ready" in line, line
        async with StoreClient(line.split()[-1], segment_size=2 << 20, protocols=("tcp",)) as a:
            await a.put("h", b"y" * 3000)
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
        assert "kvflow_store_master_clients 1.0" in text
        assert 'kvflow_store_master_objects{tier="dram"} 1.0' in text
        assert f'kvflow_store_segment_capacity_bytes{{client="{a.client_id}",segment="1",tier="dram"}}' in text
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
