"""tools/incast.py: the emulated rail-optimised cluster (network
namespaces, a tbf-limited NIC per rank, a leaf bridge per rail, a spine
router between leaves) with real kvflow engines in every rank. Checks
what the cluster must get right for the relay to be judged on it: every
byte lands and is verified, cross-rail flows really cross the spine, and
rail-aligned ones never do. (Timing is reported by the tool, not
asserted: these machines are shared.)"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import faults  # noqa: E402
import incast  # noqa: E402

pytestmark = [pytest.mark.netns]
WHY = faults.netns_unavailable()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=WHY))


def _args(**kw) -> argparse.Namespace:
    base = dict(strategy="naive", pattern="pp-tp", nodes=2, rails=2, layers=4, shard_kib=256, nic_mbit=400,
                spine_mbit=None, oversubscription=2.0, json=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_flows_of_the_seed_pattern():
    flows = incast.make_flows("pp-tp", rails=2, layers=4, shard=100)
    assert [(f.src, f.dst) for f in flows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    f = flows[1]                     # prefill rank 0 (layers 0, 1) -> decode rank 1 (shard 1)
    assert f.local == [100, 300] and f.remote == [0, 100] and f.lengths == [100, 100]
    assert [f.dst for f in incast.make_flows("aligned", 2, 4, 100)] == [0, 1]
    seed = incast.make_flows("incast", 4, 8, 100)                # the seed's pp0, pp2, pp3 -> tp0
    assert [(f.src, f.dst) for f in seed] == [(0, 0), (2, 0), (3, 0)]
    assert seed[1].remote == [400, 500] and seed[1].local == [0, 400]
    staggered = incast.schedule(flows, "staggered", 2)
    assert [f.dst for _, f in staggered[1]] == [1, 0]           # round k: (p + k) mod R
    assert incast.schedule(flows, "recv_relay", 2) == incast.schedule(flows, "naive", 2)   # the engines reroute
    with pytest.raises(ValueError, match="one of"):
        incast.schedule(flows, "relay", 2)


@pytest.mark.parametrize("strategy", ["naive", "staggered"])
def test_every_byte_verified_and_cross_rail_crosses_the_spine(strategy):
    res = asyncio.run(incast.run(_args(strategy=strategy)))
    assert res["bytes_verified"] == res["bytes_sent"] == 2 * 2 * 2 * (256 << 10)
    cross = res["bytes_sent"] // 2                  # half the flows change rails
    assert res["spine_bytes"] >= cross              # payload plus headers, through the spine
    assert res["completion_p99_s"] > 0 and res["drops"] >= 0
    assert res["transports"] == ["tcp"]             # the nodes are distinct hosts to kvflow


def test_send_relay_keeps_the_payload_off_the_spine():
    """The relay as built (kvflow.paths.relay): each cross-rail flow goes
    through the prefill node's rank on the destination's rail (cross-memory
    attach inside the node, whose ranks share a pid namespace), so only
    the relay's control messages cross the spine."""
    res = asyncio.run(incast.run(_args(strategy="send_relay")))
    assert res["bytes_verified"] == res["bytes_sent"]
    cross = res["bytes_sent"] // 2
    assert res["relayed_bytes"] == cross
    assert res["spine_bytes"] < cross // 20         # under 5% of what naive puts there


def test_recv_relay_keeps_payload_and_control_off_the_spine():
    """The receive side: each cross-rail flow goes over its sender's rail to
    the decode node's rank on that rail (leases and forwards too), which
    copies it to the destination inside the node: the spine carries only
    the connections' handshakes."""
    res = asyncio.run(incast.run(_args(strategy="recv_relay")))
    assert res["bytes_verified"] == res["bytes_sent"]
    cross = res["bytes_sent"] // 2
    assert res["relayed_bytes"] == cross
    assert res["spine_bytes"] < cross // 20


def test_rail_aligned_flows_never_touch_the_spine():
    res = asyncio.run(incast.run(_args(pattern="aligned")))
    assert res["bytes_verified"] == res["bytes_sent"] > 0
    assert res["spine_bytes"] < 4096               # nothing but stray control frames, if any
