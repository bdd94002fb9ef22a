"""kvflow.connector: SGLang-shaped prefill/decode roles over real engines.

Every test runs a real BootstrapServer (aiohttp on loopback) and real
KVManagers (kvflow engines on their own loop threads); pages are checked
byte for byte on the decode side, and guard pages around them stay zero.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="the connector's bootstrap server needs aiohttp")

from kvflow.connector import (BootstrapServer, DisaggregationMode, KVArgs, KVManager, KVPoll,  # noqa: E402
                              KVReceiver, KVSender, KVTransferError)
from kvflow.connector import layout, messages  # noqa: E402
from kvflow.errors import KVFlowError  # noqa: E402
from _batches import TIME_SCALE  # noqa: E402
from _providers import PROTOCOLS as _PROTOCOLS, closed_leaks, params, skip_unavailable  # noqa: E402

LAYERS = 4
PAGES = 64
ITEM = 2048          # bytes of one page of one buffer
AUX_ITEM = 64
AUX_SLOTS = 8
PROTOCOLS = params(*_PROTOCOLS)
HERE = os.path.dirname(os.path.abspath(__file__))
T = 10 * TIME_SCALE      # seconds a step may take (stretched under the VM's emulation)


HEAD_BYTES = 64      # one KV head of one token
TOTAL_HEADS = 2


class Pool:
    """A rank's KV pool in numpy: 2*LAYERS buffers (MHA, NHD pages of
    [16 tokens, heads, HEAD_BYTES]) or LAYERS (MLA)."""

    def __init__(self, mla: bool = False, seed: int | None = None, rank: int = 0, tp: int = 1) -> None:
        n = LAYERS if mla else 2 * LAYERS
        self.heads = layout.rank_heads(rank, tp, TOTAL_HEADS) if not mla else (0, TOTAL_HEADS)
        self.item = ITEM if mla else 16 * self.heads[1] * HEAD_BYTES
        rng = np.random.default_rng(seed)
        self.bufs = [rng.integers(0, 255, PAGES * self.item, dtype=np.uint8) if seed is not None
                     else np.zeros(PAGES * self.item, np.uint8) for _ in range(n)]
        self.aux = np.zeros(AUX_SLOTS * AUX_ITEM, np.uint8)
        self.args = KVArgs(engine_rank=rank, tp_size=tp,
                           kv_data_ptrs=[b.ctypes.data for b in self.bufs],
                           kv_data_lens=[b.nbytes for b in self.bufs], kv_item_lens=[self.item] * n,
                           aux_data_ptrs=[self.aux.ctypes.data], aux_data_lens=[self.aux.nbytes],
                           aux_item_lens=[AUX_ITEM], page_size=16, kv_head_num=self.heads[1],
                           total_kv_head_num=TOTAL_HEADS)

    def page(self, buf: int, p: int) -> np.ndarray:
        return self.bufs[buf][p * self.item:(p + 1) * self.item]

    def head(self, buf: int, p: int, token: int, h: int) -> np.ndarray:
        """Head h (a model-wide index) of one token of page p."""
        off = p * self.item + (token * self.heads[1] + h - self.heads[0]) * HEAD_BYTES
        return self.bufs[buf][off:off + HEAD_BYTES]


def assert_moved(src: Pool, dst: Pool, src_pages, dst_pages, buffers=None) -> None:
    touched = set()
    for b in buffers if buffers is not None else range(len(src.bufs)):
        for sp, dp in zip(src_pages, dst_pages):
            assert np.array_equal(src.page(b, sp), dst.page(b, dp)), f"buffer {b} page {sp}->{dp}"
            touched.add((b, dp))
    for b in range(len(dst.bufs)):          # nothing else was written
        for p in range(PAGES):
            if (b, p) not in touched:
                assert not dst.page(b, p).any(), f"stray bytes in buffer {b} page {p}"


@pytest.fixture
def bootstrap():
    srv = BootstrapServer().start_in_thread()
    yield srv
    srv.stop_thread()


@pytest.fixture
def managers():
    made: list[KVManager] = []

    def make(pool: Pool, mode: DisaggregationMode, **kw) -> KVManager:
        m = KVManager(pool.args, mode, **kw)
        made.append(m)
        return m
    yield make
    for m in made:
        m.close()
        assert m._thread.loop_errors == [], m._thread.loop_errors
        assert not closed_leaks(m.engine.counters()), m.engine.counters()


def pair(bootstrap, managers, protocol, *, mla=False, **kw):
    skip_unavailable(protocol)
    src, dst = Pool(mla, seed=1), Pool(mla)
    p = managers(src, DisaggregationMode.PREFILL, is_mla_backend=mla, bootstrap_addr=bootstrap.address,
                 protocols=(protocol,), **kw)
    d = managers(dst, DisaggregationMode.DECODE, is_mla_backend=mla, protocols=(protocol,), **kw)
    return src, dst, p, d


# ---------------------------------------------------------------- address math

def test_page_runs_group_contiguous_pages():
    s, d, n = layout.page_runs(np.array([3, 4, 5, 9, 10, 11, 12]), np.array([20, 21, 22, 40, 41, 50, 51]))
    assert s.tolist() == [3, 9, 11] and d.tolist() == [20, 40, 50] and n.tolist() == [3, 2, 2]
    s, d, n = layout.page_runs(np.arange(1000), np.arange(1000) + 7)
    assert n.tolist() == [1000]                     # a whole prompt: one run
    with pytest.raises(Exception, match="differ in length"):
        layout.page_runs(np.arange(3), np.arange(4))


def test_kv_entries_are_one_per_run_per_buffer():
    runs = layout.page_runs(np.arange(10), np.arange(10) + 5)
    la, ra, ln = layout.kv_entries([1000, 2000], [10, 10], [50000, 60000], [10, 10], [0, 1], runs)
    assert la.tolist() == [1000, 2000] and ra.tolist() == [50050, 60050] and ln.tolist() == [100, 100]


def test_tp_mapping():
    assert layout.source_ranks(3, 4, 2, mla=True) == [(1, 0, 0)]
    assert layout.target_count(0, 1, 4, mla=True) == 4
    assert layout.source_ranks(1, 2, 2, mla=False, total_heads=8) == [(1, 4, 4)]
    assert layout.source_ranks(0, 1, 2, mla=False, total_heads=8) == [(0, 0, 4), (1, 4, 4)]
    assert layout.source_ranks(3, 4, 2, mla=False, total_heads=8) == [(1, 6, 2)]
    assert layout.target_count(1, 2, 4, mla=False, total_heads=8) == 2
    # 2 KV heads over prefill TP 4 (each head on two ranks): decode ranks spread over the copies
    assert layout.source_ranks(0, 1, 4, mla=False, total_heads=2) == [(0, 0, 1), (2, 1, 1)]
    assert layout.source_ranks(1, 2, 4, mla=False, total_heads=2) == [(3, 1, 1)]
    with pytest.raises(Exception, match="do not split"):
        layout.rank_heads(0, 3, 8)


def test_head_sliced_entries_are_strided_not_per_token():
    runs = layout.page_runs(np.arange(4), np.arange(4) + 10)
    la, ra, ln, cnt, ls, rs = layout.head_sliced_entries(
        [0], [16 * 2 * 64], [1 << 20], [16 * 1 * 64], [0], runs, 16, (0, 2), (1, 1), (1, 1))
    assert la.tolist() == [64] and ra.tolist() == [(1 << 20) + 10 * 16 * 64]
    assert ln.tolist() == [64] and cnt.tolist() == [4 * 16] and ls.tolist() == [128] and rs.tolist() == [64]


def test_messages_reject_malformed():
    assert messages.decode(b"not msgpack \xc1") is None
    assert messages.decode(messages.encode("done", 1, rank=0, bytes=1, at=0.0))["t"] == "done"
    with pytest.raises(Exception, match="must be"):
        messages.decode(messages.encode("done", 1, rank="x", bytes=1, at=0.0))
    with pytest.raises(Exception, match="bad kind"):
        messages.decode(messages.encode("nope", 1))


# ---------------------------------------------------------------- transfers

@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_chunked_send_moves_pages_and_aux(bootstrap, managers, protocol):
    src, dst, p, d = pair(bootstrap, managers, protocol)
    src.aux[3 * AUX_ITEM:4 * AUX_ITEM] = 42
    room = 1001
    src_pages, dst_pages = [3, 4, 5, 9, 10, 11, 12], [20, 21, 22, 23, 40, 41, 2]
    r = KVReceiver(d, bootstrap.address, room)
    r.init(prefill_dp_rank=0)
    s = KVSender(p, bootstrap.address, room)
    s.init(len(src_pages), aux_index=3)
    r.send_metadata(dst_pages, aux_index=5)
    s.send(src_pages[:3])
    assert s.poll() != KVPoll.Success               # not the last chunk
    s.send(src_pages[3:])
    assert await r.wait(T) == KVPoll.Success
    assert await s.wait(T) == KVPoll.Success
    assert_moved(src, dst, src_pages, dst_pages)
    assert (dst.aux[5 * AUX_ITEM:6 * AUX_ITEM] == 42).all() and dst.aux[:5 * AUX_ITEM].sum() == 0
    # runs contiguous on both sides: [3,4,5]->[20..22], [9]->[23], [10,11]->[40,41], [12]->[2]
    assert s.metric.entries == 4 * 2 * LAYERS + 1
    assert r.metric.transfer_total_bytes == s.metric.transfer_total_bytes == 7 * ITEM * 2 * LAYERS + AUX_ITEM
    assert p.metrics()[d.address]["requests"] == 1
    assert d.metrics()[p.address]["bytes"] == r.metric.transfer_total_bytes
    s.clear(), r.clear()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_layerwise_send_streams_each_layer(bootstrap, managers, protocol):
    src, dst, p, d = pair(bootstrap, managers, protocol)
    room = 1002
    pages = np.arange(8, 40)
    dpages = np.arange(30, 62)
    r = KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0)
    r.send_metadata(dpages, aux_index=1)
    s = KVSender(p, bootstrap.address, room)
    s.init(len(pages), aux_index=0)
    for layer in range(LAYERS):
        s.send_layer(layer, pages)
        # each layer lands on its own, before the request finishes
        k = layout.layer_buffers(layer, 2 * LAYERS, False)
        deadline = time.monotonic() + T
        while not np.array_equal(dst.page(k[1], 61), src.page(k[1], 39)):
            assert time.monotonic() < deadline, f"layer {layer} did not land"
            await asyncio.sleep(0.005)
        assert r.poll() != KVPoll.Success
    s.finish()
    assert await r.wait(T) == KVPoll.Success
    assert_moved(src, dst, pages, dpages)
    assert s.metric.entries == 2 * LAYERS + 1       # one run per buffer, plus aux
    assert r.metric.exposed_s is not None and r.metric.exposed_s < 5 * TIME_SCALE


async def test_request_priority_from_the_server_or_from_its_size(bootstrap, managers):
    """KVSender.init(priority=) passes the server's class to every write;
    without one the request's KV size picks it (KVManager(priority_bytes=):
    shortest first)."""
    import kvflow
    src, dst, p, d = pair(bootstrap, managers, "tcp", priority_bytes=(4 * ITEM * 2 * LAYERS, 16 * ITEM * 2 * LAYERS))
    sizes = {1101: (4, None, kvflow.Priority.HIGH), 1102: (8, None, kvflow.Priority.NORMAL),
             1103: (16, None, kvflow.Priority.LOW), 1104: (16, kvflow.Priority.HIGH, kvflow.Priority.HIGH)}
    for room, (n, given, want) in sizes.items():
        pages = np.arange(n)
        r = KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0)
        r.send_metadata(pages + 20, aux_index=1)
        s = KVSender(p, bootstrap.address, room)
        s.init(n, aux_index=0, priority=given)
        assert s.priority == want, (room, s.priority)
        s.send(pages)
        assert await r.wait(T) == KVPoll.Success
        assert await s.wait(T) == KVPoll.Success
        assert_moved(src, dst, pages, pages + 20)
        s.clear(), r.clear()
    s = KVSender(p, bootstrap.address, 1105)
    with pytest.raises(KVFlowError, match="priority"):
        s.init(1, priority=7)
    s.abort()
    with pytest.raises(KVFlowError, match="priority_bytes"):
        managers(Pool(False), DisaggregationMode.DECODE, protocols=("tcp",), priority_bytes=(2, 1))


async def test_mla_prefill_tp1_feeds_decode_tp2(bootstrap, managers):
    src = Pool(mla=True, seed=2)
    p = managers(src, DisaggregationMode.PREFILL, is_mla_backend=True, bootstrap_addr=bootstrap.address)
    dsts = [Pool(mla=True, rank=i, tp=2) for i in range(2)]
    ds = [managers(x, DisaggregationMode.DECODE, is_mla_backend=True) for x in dsts]
    room = 1003
    rs = [KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0) for d in ds]
    rs[0].send_metadata([1, 2, 3], aux_index=0)
    s = KVSender(p, bootstrap.address, room)
    s.init(3, aux_index=0)
    s.send([10, 11, 12])                      # queued until both decode ranks sent metadata
    await asyncio.sleep(0.2)
    assert s.poll() == KVPoll.Bootstrapping
    rs[1].send_metadata([7, 8, 9], aux_index=0)
    for r in rs:
        assert await r.wait(T) == KVPoll.Success
    assert_moved(src, dsts[0], [10, 11, 12], [1, 2, 3])
    assert_moved(src, dsts[1], [10, 11, 12], [7, 8, 9])


def assert_heads_moved(srcs: list[Pool], dst: Pool, src_pages, dst_pages) -> None:
    for b in range(len(dst.bufs)):
        for sp, dp in zip(src_pages, dst_pages):
            for t in range(16):
                for h in range(dst.heads[0], dst.heads[0] + dst.heads[1]):
                    src = next(x for x in srcs if x.heads[0] <= h < x.heads[0] + x.heads[1])
                    assert np.array_equal(src.head(b, sp, t, h), dst.head(b, dp, t, h)), (b, sp, t, h)
    moved = {(b, p) for b in range(len(dst.bufs)) for p in dst_pages}
    for b in range(len(dst.bufs)):
        for p in range(PAGES):
            if (b, p) not in moved:
                assert not dst.page(b, p).any(), f"stray bytes in buffer {b} page {p}"


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
async def test_mha_different_tp_moves_head_slices(bootstrap, managers, prefill_tp, decode_tp):
    srcs = [Pool(seed=10 + i, rank=i, tp=prefill_tp) for i in range(prefill_tp)]
    ps = [managers(x, DisaggregationMode.PREFILL, bootstrap_addr=bootstrap.address, protocols=("tcp",))
          for x in srcs]
    dsts = [Pool(rank=i, tp=decode_tp) for i in range(decode_tp)]
    ds = [managers(x, DisaggregationMode.DECODE, protocols=("tcp",)) for x in dsts]
    room = 1004
    src_pages, dst_pages = [5, 6, 7, 20], [30, 31, 32, 33]
    rs = [KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0) for d in ds]
    for r in rs:
        r.send_metadata(dst_pages, aux_index=0)
    ss = [KVSender(p, bootstrap.address, room) for p in ps]
    for s in ss:
        s.init(len(src_pages), aux_index=0)
        s.send(src_pages)
    for r in rs:
        assert await r.wait(T) == KVPoll.Success
    for s in ss:
        assert await s.wait(T) == KVPoll.Success
        # runs [5,6,7]->[30..32] and [20]->[33]: 2 strided entries per buffer, plus aux, per decode rank fed
        assert s.metric.entries == max(1, decode_tp // prefill_tp) * (2 * 2 * LAYERS + 1)
    for d in dsts:
        assert_heads_moved(srcs, d, src_pages, dst_pages)


# ---------------------------------------------------------------- failures

async def test_decode_abort_reaches_prefill_and_room_can_be_retried(bootstrap, managers):
    src, dst, p, d = pair(bootstrap, managers, "tcp")
    room = 1005
    r = KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0)
    r.send_metadata(np.arange(16), aux_index=0)
    s = KVSender(p, bootstrap.address, room)
    s.init(16, aux_index=0)
    s.send_layer(0, np.arange(16))
    deadline = time.monotonic() + T
    while r.poll() != KVPoll.Transferring:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    r.abort()
    assert await s.wait(5) == KVPoll.Failed          # the prefill side learns within seconds
    assert time.monotonic() - t0 < 3
    with pytest.raises(KVTransferError, match="aborted by decode"):
        s.failure_exception()
    assert r.poll() == KVPoll.Failed
    while not r.release_safe:                        # the prefill side acknowledged: pages reusable
        assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.01)
    s.clear(), r.clear()
    # retry with the same room
    dst.bufs[0][:] = 0
    r2 = KVReceiver(d, bootstrap.address, room, prefill_dp_rank=0)
    s2 = KVSender(p, bootstrap.address, room)
    s2.init(16, aux_index=0)
    r2.send_metadata(np.arange(16, 32), aux_index=0)
    s2.send(np.arange(16))
    assert await r2.wait(T) == KVPoll.Success
    assert np.array_equal(dst.bufs[1][16 * ITEM:32 * ITEM], src.bufs[1][:16 * ITEM])


async def test_prefill_abort_reaches_decode(bootstrap, managers):
    _, _, p, d = pair(bootstrap, managers, "local")
    r = KVReceiver(d, bootstrap.address, 1006, prefill_dp_rank=0)
    r.send_metadata([0, 1], aux_index=0)
    s = KVSender(p, bootstrap.address, 1006)
    s.init(2, aux_index=0)
    deadline = time.monotonic() + T
    while s.poll() == KVPoll.Bootstrapping:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    s.abort()
    assert await r.wait(5) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="aborted by prefill"):
        r.failure_exception()
    deadline = time.monotonic() + 5
    while not r.release_safe:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_decode_times_out_and_tells_prefill(bootstrap, managers):
    _, _, p, d = pair(bootstrap, managers, "tcp", transfer_timeout=0.5)
    r = KVReceiver(d, bootstrap.address, 1007, prefill_dp_rank=0)
    r.send_metadata([0, 1], aux_index=0)
    s = KVSender(p, bootstrap.address, 1007)
    s.init(2, aux_index=0)                           # prefill never sends
    assert await r.wait(5) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="no data from prefill within 0.5 s"):
        r.failure_exception()
    assert await s.wait(5) == KVPoll.Failed


async def test_prefill_without_decode_metadata_times_out(bootstrap, managers):
    _, _, p, _ = pair(bootstrap, managers, "tcp", bootstrap_timeout=0.3)
    s = KVSender(p, bootstrap.address, 1008)
    s.init(2, aux_index=0)
    assert await s.wait(5) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="no decode metadata"):
        s.failure_exception()


async def test_unknown_prefill_group_fails_after_bootstrap_timeout(bootstrap, managers):
    d = managers(Pool(), DisaggregationMode.DECODE, bootstrap_timeout=0.3)
    r = KVReceiver(d, bootstrap.address, 1009, prefill_dp_rank=3)
    assert await r.wait(5) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="did not register"):
        r.failure_exception()


async def test_bootstrap_server_unreachable_fails_cleanly(managers):
    d = managers(Pool(), DisaggregationMode.DECODE)
    r = KVReceiver(d, "127.0.0.1:1", 1010, prefill_dp_rank=0)
    assert await r.wait(T) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="unreachable"):
        r.failure_exception()


async def test_garbage_connector_message_is_dropped(bootstrap, managers):
    src, dst, p, d = pair(bootstrap, managers, "tcp")
    evil = managers(Pool(), DisaggregationMode.DECODE)

    async def send_garbage():
        peer = await evil.engine.connect(p.address)
        await peer.notify(messages.encode("meta", 5, addr=1))      # wrong types
        await peer.notify(b"\x93\x01\x02")                          # not a connector message
    evil._thread.call(send_garbage())
    r = KVReceiver(d, bootstrap.address, 1011, prefill_dp_rank=0)
    s = KVSender(p, bootstrap.address, 1011)
    s.init(1, aux_index=0)
    r.send_metadata([9], aux_index=0)
    s.send([4])
    assert await r.wait(T) == KVPoll.Success
    assert_moved(src, dst, [4], [9])


async def test_bootstrap_server_routes(bootstrap):
    import aiohttp
    url = f"http://{bootstrap.address}"
    rec = {"dp_rank": 0, "tp_rank": 1, "tp_size": 2, "address": "h:1", "mla": False, "incarnation": 1}
    async with aiohttp.ClientSession() as http:
        assert (await http.get(url + "/health")).status == 200
        assert (await http.put(url + "/route", json={"tp_rank": "x"})).status == 400
        assert (await http.put(url + "/route", data=b"\xff garbage")).status == 400
        assert (await http.put(url + "/route", json=rec)).status == 200
        assert (await http.get(url + "/route?dp_rank=0")).status == 404     # rank 0 missing
        assert (await http.put(url + "/route", json={**rec, "tp_rank": 0, "address": "h:0"})).status == 200
        body = await (await http.get(url + "/route?dp_rank=0")).json()
        assert body["tp_size"] == 2 and body["ranks"]["0"]["address"] == "h:0"
        assert (await http.delete(url + "/route?dp_rank=0&tp_rank=0&address=h:0")).status == 200
        assert (await http.get(url + "/route?dp_rank=0")).status == 404
        assert (await http.get(url + "/health")).status == 200              # still serving


PREFILL_CHILD = r"""
import sys, time, numpy as np
sys.path.insert(0, {here!r})
from test_connector import Pool
from kvflow.connector import KVManager, KVSender, DisaggregationMode
pool = Pool(seed=5)
m = KVManager(pool.args, DisaggregationMode.PREFILL, bootstrap_addr={boot!r}, protocols=("tcp",))
s = KVSender(m, {boot!r}, 1012)
s.init(16, aux_index=0)
print("ready", flush=True)
time.sleep(60)
"""


async def test_prefill_killed_fails_decode_promptly(bootstrap, managers):
    d = managers(Pool(), DisaggregationMode.DECODE, protocols=("tcp",))
    child = subprocess.Popen([sys.executable, "-c", PREFILL_CHILD.format(here=HERE, boot=bootstrap.address)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        r = KVReceiver(d, bootstrap.address, 1012, prefill_dp_rank=0)
        r.send_metadata(np.arange(16), aux_index=0)
        deadline = time.monotonic() + T
        while r.poll() != KVPoll.Transferring:
            assert time.monotonic() < deadline and r.poll() != KVPoll.Failed
            await asyncio.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert await r.wait(T) == KVPoll.Failed
        assert time.monotonic() - t0 < 3
        with pytest.raises(KVTransferError, match="was lost"):
            r.failure_exception()
        assert r.release_safe                                 # a dead prefill writes nothing more
    finally:
        child.kill()
        child.wait()


async def test_prometheus_metrics(bootstrap, managers):
    prometheus_client = pytest.importorskip("prometheus_client", reason="optional: pip install prometheus-client")
    from kvflow.connector.prometheus import register
    src, dst, p, d = pair(bootstrap, managers, "tcp")
    registry = prometheus_client.CollectorRegistry()
    register(p, registry)
    register(d, registry)
    r = KVReceiver(d, bootstrap.address, 1013, prefill_dp_rank=0)
    s = KVSender(p, bootstrap.address, 1013)
    s.init(2, aux_index=0)
    r.send_metadata([3, 4], aux_index=1)
    s.send([0, 1])
    assert await r.wait(T) == KVPoll.Success
    assert await s.wait(T) == KVPoll.Success
    want = 2 * ITEM * 2 * LAYERS + AUX_ITEM
    labels = {"role": "prefill", "peer": d.address}
    assert registry.get_sample_value("kvflow_connector_bytes_total", labels) == want
    assert registry.get_sample_value("kvflow_connector_requests_total", labels) == 1
    assert registry.get_sample_value("kvflow_connector_bytes_total", {"role": "decode", "peer": p.address}) == want
    assert b"kvflow_connector_failures_total" in prometheus_client.generate_latest(registry)
