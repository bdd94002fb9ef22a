"""The conductor live: examples/pd/routed.py's router (kvflow.conductor) in
front of two prefill servers with prefix caches of real KV pages and a
decode server, each its own process, the small transformer on CPU.

Checked: every request's greedy tokens equal single-process generation
(a reused, moved or misplaced page would change them); a conversation's
next turn reuses the pages of the previous one (and of another session's
shared system prompt queued just ahead of it); and a prefix replicated from
a busy server by kvflow really spares its compute on the replica.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="the PD example needs PyTorch (pip install torch)")
pytest.importorskip("aiohttp", reason="the PD example needs aiohttp")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _batches import TIME_SCALE  # noqa: E402
from examples.pd import routed, serve  # noqa: E402


def options(protocol: str, **kw) -> argparse.Namespace:
    ns = dict(host="127.0.0.1", port=0, protocol=protocol, device="cpu", layers=3, hidden=64, seed=11, pages=1024,
              page_size=16, slots=16, threads=1, cache_pages=512, prefill_servers=2, decode_servers=1,
              sessions=3, turns=3, prompt_tokens=384, max_new_tokens=5, check=False,
              transfer_timeout=60.0 * TIME_SCALE, request_timeout=120.0 * TIME_SCALE, slo_ttft=30.0)
    ns.update(kw)
    return argparse.Namespace(**ns)


reference = serve.reference_tokens


@pytest.mark.parametrize("protocol", ["tcp", "local"])
async def test_routed_conversations_reuse_and_replicate_real_kv(protocol):
    args = options(protocol)
    cluster = routed.RoutedCluster(args)
    try:
        await cluster.start(300 * TIME_SCALE)
        gen = lambda p: asyncio.wait_for(cluster.generate(p, args.max_new_tokens), 120 * TIME_SCALE)  # noqa: E731
        sessions = routed.conversations(args)
        results = []
        for turn in range(args.turns):
            replies = await asyncio.gather(*(gen(s[turn]) for s in sessions))
            results += [(s[turn], r) for s, r in zip(sessions, replies)]
        for prompt, r in results:
            assert r["tokens"] == reference(args, prompt), f"prompt of {len(prompt)} tokens"
            p = r["prefill"]
            assert p["cached_tokens"] + p["computed_tokens"] == len(prompt)
            assert p["cached_tokens"] % args.page_size == 0
        later = [r["prefill"] for _, r in results[args.sessions:]]
        # every later turn reuses at least the previous turn's full pages
        for (prompt, r), prev in zip(results[args.sessions:], results):
            assert r["prefill"]["cached_tokens"] >= len(prev[0]) // args.page_size * args.page_size - args.page_size
        assert sum(p["cached_tokens"] for p in later) > 0.8 * sum(len(x) for x, _ in results[args.sessions:])

        # Replication: a long unrelated prompt keeps the holder of A busy;
        # A's next turn goes to the idle server, which fetches A's pages
        # from the holder with kvflow and computes only the new tokens.
        a = sessions[0][-1] + [7, 8, 9] * 40
        first = await gen(a)
        holder = first["route"]["prefill"]
        long_prompt = [(i * 37) % 500 for i in range(2400)]
        busy = asyncio.ensure_future(gen(long_prompt))
        await asyncio.sleep(0.05 * TIME_SCALE)                   # the router has routed it
        nxt = a + [3, 1, 4, 1, 5] * 10
        r = await gen(nxt)
        await busy
        route, p = r["route"], r["prefill"]
        assert route["prefix_source"] == holder and route["prefill"] != holder, route
        assert p["moved_blocks"] > 0
        assert p["cached_tokens"] >= len(a) // args.page_size * args.page_size - args.page_size
        assert p["computed_tokens"] == len(nxt) - p["cached_tokens"] < len(nxt) // 4
        assert r["tokens"] == reference(args, nxt)
        # the replica is a cache entry now: the next turn there reuses it
        again = await gen(nxt + [2, 7] * 8)
        assert again["prefill"]["cached_tokens"] >= p["cached_tokens"]
        assert again["tokens"] == reference(args, nxt + [2, 7] * 8)
        stats = await cluster.stats()
        assert stats["moved_blocks"] >= p["moved_blocks"] and stats["rejected"] == {}
    finally:
        cluster.close()
