"""engine.metrics() and its Prometheus export: the numbers of real
transfers, counted by the native core."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvflow
from _batches import bounded
from _providers import params, skip_unavailable

MiB = 1 << 20


@pytest.mark.parametrize("protocol", ["tcp", "local"])
async def test_counts_bytes_failures_and_latency(make_engine, protocol):
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    src, dst = np.ones(256 * MiB, np.uint8), np.zeros(256 * MiB, np.uint8)
    a.register(src)
    b.register(dst)
    peer = await bounded(a.connect(b.address))
    for _ in range(7):
        await peer.write([src.ctypes.data, src.ctypes.data + MiB], [dst.ctypes.data, dst.ctypes.data + MiB],
                         [65536, 4096])
    await peer.read([src.ctypes.data], [dst.ctypes.data], [8192])
    if protocol == "tcp":        # the calling thread's own path (detached batches) is counted too
        await asyncio.to_thread(peer.write_blocking, [src.ctypes.data], [dst.ctypes.data], [4096])
    # one cancelled batch, counted as a failure of kind ECANCELLED
    n = 128
    first = peer.write_nowait([src.ctypes.data + i * MiB for i in range(n)],
                              [dst.ctypes.data + i * MiB for i in range(n)], [MiB] * n)
    second = peer.write_nowait([src.ctypes.data + i * MiB for i in range(n)],
                               [dst.ctypes.data + i * MiB for i in range(n)], [MiB] * n)
    # both queued toward the peer: 256 MiB submitted and not finished (the
    # first may have started, none of it can have finished by now)
    q = a.metrics()["peers"][b.address]["write"]
    assert q["inflight_batches"] >= 1 and q["inflight_bytes"] >= n * MiB
    second.cancel()
    with pytest.raises(kvflow.TransferCancelledError):
        await bounded(second)
    await bounded(first)
    m = a.metrics()
    pm = m["peers"][b.address]
    assert pm["provider"] == protocol
    w, r = pm["write"], pm["read"]
    blocking = 1 if protocol == "tcp" else 0
    assert w["batches"] == 7 + blocking + 2 and w["failed"] == 1
    assert w["bytes"] == 7 * (65536 + 4096) + blocking * 4096 + n * MiB
    assert (r["batches"], r["bytes"], r["failed"]) == (1, 8192, 0)
    assert pm["failures"] == {"ECANCELLED": 1}
    assert sum(c for _, c in w["latency_buckets"]) == w["batches"] - w["failed"]
    assert 0 < w["latency_mean_us"] < 60e6 and w["latency_p50_us"] <= w["latency_p99_us"]
    assert m["inflight"] == {"batches": 0, "slices": 0}
    assert (w["inflight_batches"], w["inflight_bytes"], r["inflight_batches"], r["inflight_bytes"]) == (0, 0, 0, 0)
    assert m["receive_window"] is None and m["resources"]["batches"] == 0
    # no GPU memory, no relay group: no staging pool made (tests/test_staging.py reads them made)
    assert m["staging"] == {"outgoing": None, "inbox": None, "relay_inbox": None}
    # the target counts nothing of it: it initiated nothing
    assert b.metrics()["peers"] == {}


async def test_prometheus_export(make_engine):
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvflow.metrics import register_prometheus

    a = await make_engine(protocols=["tcp"])
    b = await make_engine(protocols=["tcp"], receive_window=4 * MiB)
    src, dst = np.ones(MiB, np.uint8), np.zeros(MiB, np.uint8)
    a.register(src)
    b.register(dst)
    peer = await bounded(a.connect(b.address))
    for _ in range(3):
        await peer.write([src.ctypes.data], [dst.ctypes.data], [MiB])
    registry = prometheus_client.CollectorRegistry()
    register_prometheus(a, registry, name="prefill-0")
    register_prometheus(b, registry, name="decode-0")
    labels = {"engine": "prefill-0", "op": "write", "peer": b.address, "provider": "tcp"}
    value = registry.get_sample_value
    assert value("kvflow_batches_total", labels) == 3
    assert value("kvflow_bytes_total", labels) == 3 * MiB
    assert value("kvflow_batch_latency_seconds_count", labels) == 3
    assert value("kvflow_batch_latency_seconds_bucket", {**labels, "le": "+Inf"}) == 3
    assert 0 < value("kvflow_batch_latency_seconds_sum", labels) < 60
    assert value("kvflow_batch_failures_total", labels) == 0
    assert value("kvflow_peer_inflight_batches", labels) == 0 and value("kvflow_peer_inflight_bytes", labels) == 0
    assert value("kvflow_receive_window_bytes", {"engine": "decode-0"}) == 4 * MiB
    assert value("kvflow_receive_window_violations_bytes_total", {"engine": "decode-0"}) == 0
    assert value("kvflow_inflight_batches", {"engine": "prefill-0"}) == 0
    text = prometheus_client.generate_latest(registry).decode()      # the exposition itself renders
    assert "# TYPE kvflow_batch_latency_seconds histogram" in text


@pytest.mark.parametrize("protocol", params("tcp", "rdma"))
async def test_connection_queues_are_reported(make_engine, protocol):
    """Per tcp data connection or rdma QP: what waits for it and what is on
    it, up while a batch streams and back to zero after; engine.metrics()
    works on every provider (on rdma it once raised: the channel's per-QP
    list stood where the batch numbers were read)."""
    skip_unavailable(protocol)
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    n = 32
    src, dst = np.ones(n * MiB, np.uint8), np.zeros(n * MiB, np.uint8)
    a.register(src)
    b.register(dst)
    peer = await bounded(a.connect(b.address))
    await bounded(peer.write([src.ctypes.data], [dst.ctypes.data], [4096]))
    seen = 0
    t = peer.write_nowait([src.ctypes.data + i * MiB for i in range(n)],
                          [dst.ctypes.data + i * MiB for i in range(n)], [MiB] * n)
    while not t.done():
        conns = a.metrics()["peers"][b.address]["connections"]
        seen = max(seen, sum(c["queued_slices"] + c["inflight_slices"] for c in conns))
        await asyncio.sleep(0)
    await bounded(t)
    pm = a.metrics()["peers"][b.address]
    assert pm["provider"] == protocol and pm["write"]["batches"] == 2 and pm["write"]["failed"] == 0
    conns = pm["connections"]
    assert conns and all(c["up"] for c in conns), conns
    assert seen > 0, "no queued or in-flight slice seen while 32 MiB streamed"
    assert all(c["queued_slices"] == c["queued_bytes"] == c["inflight_slices"] == 0 for c in conns), conns
    assert pm["repairs"] == 0 and pm["connection_failures"] == 0
    assert sum(c["bytes"] for c in conns) >= n * MiB
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    from kvflow.metrics import register_prometheus
    register_prometheus(a, registry=registry)
    text = prometheus.generate_latest(registry).decode()
    assert "kvflow_connection_queued_slices{" in text and "kvflow_repairs_total{" in text
