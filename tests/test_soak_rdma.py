"""The soak (tools/soak.py) over rdma: about 60 s of its randomised mixed
load (writes, reads, strided batches, notifications, cancels and timeouts)
from an in-process pair of engines over rdma, while either side's region is
deregistered and registered again (remote access errors, QP repairs). Runs
in the Soft-RoCE VM (marker rdma).

Besides the soak's own invariants (nothing corrupted, nothing hung, every
failure explained by a fault), the resource counters: nothing in flight
once the load stopped, MRs and QPs back to their value after start() and
the lane's registration (the engines' own buffers and the window, no QP)
once the peer closed, and zero of each once
the engines closed. KVFLOW_SOAK_SECONDS changes the length; the table is
printed (pytest -s).
"""
from __future__ import annotations

import os
import sys

import pytest

import kvflow
from kvflow.providers.rdma import provider as rdma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import soak  # noqa: E402

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.slow,
    pytest.mark.skipif(not kvflow.features["rdma"], reason="kvflow built without libibverbs"),
    pytest.mark.skipif(not rdma.device_names(), reason="no RDMA device on this host (run in the Soft-RoCE VM)"),
]

SECONDS = float(os.environ.get("KVFLOW_SOAK_SECONDS", "60"))
SEED = 11


async def test_rdma_soak_counters_return_to_zero():
    res = await soak.soak(SECONDS, SEED, faults_on=("dereg",), lanes_on=("rdma",), log=print)
    print("\n" + soak.table(res))
    t = res.tally
    # corruption, hangs, unexplained failures, fence violations, loop
    # errors, leaks (counters above their start values once the peer
    # closed), descriptors, RSS: the soak's own verdict
    assert res.problems() == [], res.problems()
    for name, c in res.counters["load stopped"].items():
        assert c["slices_inflight"] == 0 and c["batches"] == 0, (name, c)
        assert c["qps"] > 0, (name, c)                 # connected: both sides count their QPs
    for name, c in res.counters["peers closed"].items():
        start = res.counters["after start"][name]
        # the engine's own buffers and the lane's window on each device; no QP
        assert start["mrs"] > 0 and start["qps"] == 0, (name, start)
        assert c["mrs"] == start["mrs"] and c["qps"] == 0, (name, start, c)
    for name, c in res.counters["closed"].items():
        assert not any(c.values()), (name, c)
    assert not res.leaks, res.leaks
    # the load happened, over rdma
    assert res.lanes == ["pair-rdma (rdma)"], res.lanes
    assert t.outcomes["write ok"] > 0 and t.outcomes["read ok"] > 0, dict(t.outcomes)
    assert t.bytes_verified > 0
