"""The global KVCache pool of the conductor: the replay's pool model (tiers,
LRU, demotion, segments, hot replicas), Algorithm 1 with the pool as a
source of prefixes, the replay with a pool, and the live link to a running
kvflow.store (one batch_exists round trip per request)."""
from __future__ import annotations

import argparse
import os

import pytest

from kvflow.conductor import Conductor, InstanceSpec, Request, Role
from kvflow.conductor.blocks import block_keys
from kvflow.conductor.estimators import PrefillModel
from kvflow.conductor.policies import Candidate, KVCacheCentric, RoundRobin, RoutingView
from kvflow.conductor.pool import PoolConfig, PoolModel, StorePoolIndex
from kvflow.conductor.replay import parse_pool, replay_one
from kvflow.conductor.sim import ClusterConfig, Simulation
from kvflow.conductor.trace import TraceRequest

MB = 1 << 20


def _pool(dram, ssd, **kw) -> PoolModel:
    kw.setdefault("block_bytes", 100 * MB)
    kw.setdefault("dram_Bps", 100 * MB)      # one block per second from DRAM
    kw.setdefault("ssd_Bps", 10 * MB)        # ten seconds from SSD
    return PoolModel(PoolConfig(dram, ssd, **kw))


# -- the pool model -------------------------------------------------------------

def test_pool_tiers_lru_demotion_and_drop():
    pool = _pool(2, 2, segments=1)
    assert pool.put([1, 2, 3]) == 3
    # a chain's head is hottest: its tail (3) is demoted first
    assert (1 in pool.dram, 2 in pool.dram, 3 in pool.ssd) == (True, True, True)
    assert pool.match([1, 2, 3, 4]) == 3 and pool.split([1, 2, 3]) == (2, 1)
    assert pool.put([1, 2]) == 0                      # held: only touched (dedup)
    pool.put([7, 8])
    # 1 and 2 went down to SSD, 3 (the coldest there) dropped
    assert sorted(pool.dram.keys()) == [7, 8] and sorted(pool.ssd.keys()) == [1, 2]
    assert 3 not in pool and pool.match([1, 2, 3]) == 2
    assert (pool.stats.written_blocks, pool.stats.demoted, pool.stats.dropped) == (5, 3, 1)
    # 1 and 2 stay on SSD (touched: 1, the head, the hottest); 9 pushes 8
    # down, which pushes 2 out
    assert pool.put([1, 2, 9]) == 0 + 1
    assert sorted(pool.dram.keys()) == [7, 9] and sorted(pool.ssd.keys()) == [1, 8]
    assert not set(pool.dram.keys()) & set(pool.ssd.keys())     # one tier per block


def test_pool_without_ssd_drops_what_dram_evicts():
    pool = _pool(2, 0)
    pool.put([1, 2, 3])
    assert pool.match([1, 2, 3]) == 2 and 3 not in pool and pool.stats.dropped == 1


def test_pool_fetch_costs_bytes_over_bandwidth_per_tier_and_promotes():
    pool = _pool(4, 4, segments=1)
    pool.put([1, 2, 3, 4, 5])            # 5 went to SSD
    assert pool.split([1, 2, 3, 4, 5]) == (4, 1)
    # one segment: the blocks queue on it, 1 s each from DRAM, 10 s from SSD
    assert pool.fetch(0.0, [1, 2]) == pytest.approx(2.0)
    assert pool.fetch(0.0, [5]) == pytest.approx(12.0)         # behind the two
    assert 5 in pool.dram                                       # promoted on the hit
    assert pool.stats.read_dram_blocks == 2 and pool.stats.read_ssd_blocks == 1
    # on an idle pool the conductor's estimate is the same
    assert pool.config.fetch_s(2, 0) == pytest.approx(2.0)
    with pytest.raises(KeyError):
        pool.fetch(0.0, [99])


def test_pool_spreads_blocks_over_segments_and_replicates_hot_ones():
    pool = _pool(None, 0, segments=4, hot_reads=2, max_replicas=2)
    keys = list(range(100, 140))
    pool.put(keys)
    homes = {pool.home(k) for k in keys}
    assert len(homes) == 4                                      # spread by key
    # 40 blocks over 4 segments read in parallel: far less than 40 s
    assert pool.fetch(0.0, keys) < 20.0
    hot = 7
    pool.put([hot])
    t0 = 1000.0
    assert pool.fetch(t0, [hot]) == pytest.approx(t0 + 1.0)
    # the second read makes a replica (its copy queues on the source)
    pool.fetch(t0 + 10, [hot])
    assert pool.replicas(hot) == 2 and pool.stats.replicas_made == 1
    # two reads at once now go to two segments: neither waits for the other
    a, b = pool.fetch(t0 + 100, [hot]), pool.fetch(t0 + 100, [hot])
    assert max(a, b) == pytest.approx(t0 + 101.0)
    # deterministic: the same calls, the same answers
    again = _pool(None, 0, segments=4, hot_reads=2, max_replicas=2)
    again.put(keys)
    assert [again.home(k) for k in keys] == [pool.home(k) for k in keys]


def test_pool_config_from_gb_and_parse():
    cfg = PoolConfig.from_gb(1.0, 2.0, block_bytes=1_000_000)
    assert (cfg.dram_blocks, cfg.ssd_blocks) == (1000, 2000)
    cfg = parse_pool("4000,16000")
    assert cfg.dram_blocks == int(4000e9 // cfg.block_bytes) and cfg.ssd_blocks > cfg.dram_blocks
    for bad in ("1", "a,b", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_pool(bad)
    with pytest.raises(ValueError):
        PoolConfig(-1)


# -- Algorithm 1 with the pool --------------------------------------------------

def _view(req, cands, pool_blocks, pool_s, best_src=None, best=0, transfer=lambda s, d, n: 0.0):
    return RoutingView(req, [Candidate(*c) for c in cands], best_src, best, PrefillModel(), transfer,
                       pool_blocks=pool_blocks, pool_s=pool_s)


def test_kvcache_fetches_from_the_pool_when_that_beats_recomputing():
    req = Request("r", 20 * 512, tuple(range(20)))
    idle = ("a", 0, 0.0, 0, 0, 0, 0, 0)
    busy = ("b", 0, 5.0, 3, 0, 0, 0, 0)
    fast = _view(req, [idle, busy], 20, lambda dst, lo, hi: 0.1)
    assert KVCacheCentric().choose(fast) == KVCacheCentric().choose(fast)
    c = KVCacheCentric().choose(fast)
    assert (c.instance, c.pool_upto, c.prefix_source) == ("a", 20, None)
    # a pool fetch slower than computing the prompt: recompute (explicitly)
    slow = _view(req, [idle, busy], 20, lambda dst, lo, hi: 1e3)
    c = KVCacheCentric().choose(slow)
    assert (c.instance, c.pool_upto) == ("a", 0)
    # the holder is busy, the pool has the prefix: the idle instance
    # fetches it from the pool rather than moving it from the holder
    held = ("h", 20, 30.0, 9, 0, 0, 20, 20)
    v = _view(req, [held, idle], 20, lambda dst, lo, hi: 0.2, "h", 20, lambda s, d, n: 5.0)
    c = KVCacheCentric().choose(v)
    assert (c.instance, c.pool_upto, c.prefix_source) == ("a", 20, None)
    # ... unless the move is the faster of the two
    v = _view(req, [held, idle], 20, lambda dst, lo, hi: 5.0, "h", 20, lambda s, d, n: 0.2)
    c = KVCacheCentric().choose(v)
    assert (c.instance, c.pool_upto, c.prefix_source) == ("a", 0, "h")
    # a policy that does not know the pool leaves it to the engine
    assert RoundRobin().choose(fast).pool_upto is None


def _conductor(policy, pool, **kw):
    c = Conductor(policy=policy, pool=pool, pool_config=pool.config if isinstance(pool, PoolModel) else None, **kw)
    for name in ("p0", "p1"):
        c.register(InstanceSpec(name, Role.PREFILL, cache_blocks=64))
    c.register(InstanceSpec("d0", Role.DECODE))
    return c


def test_conductor_routes_a_pool_fetch_and_caches_it_when_it_lands():
    pool = PoolModel(PoolConfig(None, 0))
    keys = tuple(range(1, 21))
    pool.put(keys[:16])
    c = _conductor(KVCacheCentric(), pool)
    d = c.route(Request("r", 20 * 512, keys), 0.0)
    assert d.pool_blocks == keys[:16] and d.prefix_source is None and d.prefix_blocks == 16
    assert 0 < d.est_pool_s < 1.0 and c.stats.pool_blocks == 16
    assert c.index.cache(d.prefill).match(keys) == 0        # not there until it lands
    c.on_pool_fetch_done("r", d.est_pool_s)
    assert c.index.cache(d.prefill).match(keys) == 16
    c.on_prefill_done("r", 2.0)
    assert c.index.cache(d.prefill).match(keys) == 20
    # the engine's default for a policy that does not know the pool: fetch
    # whatever it holds beyond the instance's own prefix
    rr = _conductor(RoundRobin(), pool)
    d = rr.route(Request("q", 20 * 512, keys), 0.0)
    assert len(d.pool_blocks) == 16
    rr.forget("q")                                          # pins released, nothing left booked
    assert not rr._flights


def _trace(n=60, sessions=7):
    """Sessions whose turns grow one block at a time, interleaved."""
    out = []
    for i in range(n):
        s, turn = i % sessions, i // sessions
        keys = tuple(s * 1000 + j for j in range(4 + turn))
        out.append(TraceRequest(i, i * 0.5, len(keys) * 512, 20, keys))
    return out


def test_replay_with_a_pool_reuses_across_instances_and_is_deterministic():
    trace = _trace()
    pool = PoolConfig(None, 0, segments=4)
    no = Simulation(trace, RoundRobin(), ClusterConfig(prefill=4, decode=1)).run()
    yes = Simulation(trace, RoundRobin(), ClusterConfig(prefill=4, decode=1, pool=pool)).run()
    def reused(res):
        return sum(o.reused_blocks for o in res.outcomes)
    # round robin spreads a session over every instance: without a pool a
    # turn rarely finds its prefix; with one it fetches it
    assert reused(yes) > 2 * reused(no)
    assert sum(o.pool_blocks for o in yes.outcomes) > 0 and yes.prefill_busy_s < no.prefill_busy_s
    # every prefix computed once anywhere is reused: the ideal of one
    # shared unlimited cache
    assert yes.prefill_busy_s == pytest.approx(yes.prefill_ideal_s)
    assert yes.pool is not None and yes.pool.written_blocks == len({k for r in trace for k in r.keys})
    again = Simulation(trace, RoundRobin(), ClusterConfig(prefill=4, decode=1, pool=pool)).run()
    assert [(o.ttft_s, o.reused_blocks, o.pool_blocks) for o in again.outcomes] == \
        [(o.ttft_s, o.reused_blocks, o.pool_blocks) for o in yes.outcomes]
    # every request completes; the pool's summary fields are there
    summary, _ = replay_one(trace, "kvcache", prefill=4, decode=1, pool=pool)
    assert summary["completed"] == len(trace) and summary["pool_written_blocks"] > 0
    assert 0.0 <= summary["pool_hit_ratio"] <= summary["hit_ratio"]


# -- the live link ----------------------------------------------------------------

class _CountingStore:
    def __init__(self, held):
        self.held, self.calls = set(held), []

    async def batch_exists(self, keys):
        self.calls.append(list(keys))
        return [k in self.held for k in keys]


async def test_store_pool_index_one_round_trip_per_request():
    tokens = list(range(5 * 16))
    keys = block_keys(tokens, 16)
    idx = StorePoolIndex(_CountingStore([]), namespace="m/")
    store = _CountingStore(idx.object_keys(keys[:3]) + idx.object_keys(keys[4:]))
    idx = StorePoolIndex(store, namespace="m/")
    assert await idx.prefix_blocks(keys) == 3        # a hole ends the prefix
    assert len(store.calls) == 1 and len(store.calls[0]) == 5 and idx.round_trips == 1
    assert await idx.prefix_blocks([]) == 0 and idx.round_trips == 1
    with pytest.raises(TypeError):
        StorePoolIndex(object())


async def test_store_pool_index_against_a_real_store_client():
    from kvflow.store import Master, StoreClient
    master = Master(seed=1)
    await master.start(None)
    client = await StoreClient(master, segment_size=4 << 20, protocols=("tcp",)).start()
    try:
        tokens = list(range(6 * 16))
        req = Request.from_tokens("live", tokens, block_tokens=16)
        idx = StorePoolIndex(client, namespace="kv/test/")
        assert await idx.prefix_blocks(req.keys) == 0
        for k in idx.object_keys(req.keys[:4]):           # a prefill wrote its first 4 blocks
            assert await client.put(k, b"x" * 1024) == 1
        await client.put(idx.object_keys(req.keys[5:])[0], b"y")   # and a block past a hole
        assert await idx.prefix_blocks(req.keys) == 4 and idx.round_trips == 2
        # the live conductor routes with it: the prefix comes from the pool
        c = Conductor()
        c.register(InstanceSpec("p0", Role.PREFILL, cache_blocks=64))
        c.register(InstanceSpec("d0", Role.DECODE))
        d = await c.route_with_pool(req, 0.0, idx)
        assert d.pool_blocks == req.keys[:4] and idx.round_trips == 3
        await client.remove_all()
        assert await idx.prefix_blocks(req.keys) == 0
    finally:
        await client.close()
        await master.close()


# -- the capacity tooling -----------------------------------------------------------

def test_capacity_bound_by_hand():
    from kvflow.conductor.capacity import capacity_bound
    model = PrefillModel()
    # four requests over 10 s: the second shares the first's two blocks
    trace = [TraceRequest(0, 0.0, 1024, 8, (1, 2)), TraceRequest(1, 1.0, 1536, 8, (1, 2, 3)),
             TraceRequest(2, 2.0, 512, 8, (9,)), TraceRequest(3, 10.0, 2048, 8, (5, 6, 7, 8))]
    costs = sorted([model.time(1024), model.time(1536, 1024), model.time(512), model.time(2048)])
    rate, work = capacity_bound(trace, prefill=2, target=0.75, slo_ttft_s=0.01)
    assert work == pytest.approx(sum(costs[:3]))
    assert rate == pytest.approx(4 * 2 / (work - 2 * 0.01))


def test_capacity_cli_with_a_pool(capsys):
    import json

    from kvflow.conductor import capacity
    conv = os.path.join(os.path.dirname(__file__), "data", "traces", "conversation_trace.jsonl.gz")
    assert capacity.main(["--trace", conv, "--limit", "80", "--policy", "kvcache,round_robin", "--pool", "400,1600",
                          "--tbt", "100", "--jobs", "1", "--rejection", "baseline", "--json"]) == 0
    out = capsys.readouterr().out
    assert "pool 2384 DRAM + 9536 SSD blocks" in out and "bound (any router" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["pool"] == [2384, 9536] and {c["tbt_s"] for c in last["capacity"]} == {0.1}
    assert all(c["rate_rps"] <= last["bound_rps"] for c in last["capacity"])
