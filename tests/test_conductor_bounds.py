"""The capacity yardsticks of kvflow.conductor.bounds: the bound given a
pool (a proof, checked against every policy's measured capacity and
against hand-computed values) and the gated ideal (an estimate, checked
by hand)."""
from __future__ import annotations

import json
import os

import pytest

from kvflow.conductor.bounds import (
    capacity_bound, gated_ideal_attainment, gated_ideal_rps, least_costs, pool_bound_rps,
)
from kvflow.conductor.capacity import find_capacity
from kvflow.conductor.estimators import PrefillModel
from kvflow.conductor.policies import POLICIES
from kvflow.conductor.pool import PoolConfig
from kvflow.conductor.trace import TraceRequest, load_trace

CONV = os.path.join(os.path.dirname(__file__), "data", "traces", "conversation_trace.jsonl.gz")

# a first turn of two blocks at 0 s and its next turn, one block longer, at 1 s
_TURNS = [TraceRequest(0, 0.0, 1024, 8, (1, 2)), TraceRequest(1, 1.0, 1536, 8, (1, 2, 3))]


def test_least_costs_reuse_only_what_a_finished_prefill_holds():
    m = PrefillModel()
    c0, reuse, full = m.time(1024), m.time(1536, 1024), m.time(1536)
    slo = (full + c0 - 0.01 + reuse) / 2          # between the whole prompt's prefill and a reuse at 100x
    # slowly: the first turn is done long before the next arrives
    assert least_costs(_TURNS, 1.0, slo_ttft_s=slo) == pytest.approx([c0, reuse])
    # 100x: the next turn arrives 10 ms in, waits for the first's prefill
    # (c0 - 0.01 s) to reuse it, and then misses the SLO: it must compute
    # its whole prompt instead
    assert c0 - 0.01 + reuse > slo and full <= slo
    assert least_costs(_TURNS, 100.0, slo_ttft_s=slo) == pytest.approx([c0, full])
    # with an SLO under the whole prompt's prefill, not at all
    assert least_costs(_TURNS, 100.0, slo_ttft_s=(full + reuse) / 2)[1] == float("inf")


def test_pool_bound_by_hand():
    """Two instances, every request served: the second turn cannot be
    served without reusing the first's blocks (its own prefill alone
    passes the SLO), and it can reuse them only while it arrives at
    least c0 + reuse - slo after the first: speedup 1 / (c0 + reuse - slo).
    The work alone (no arrival times) allows any speedup."""
    m = PrefillModel()
    c0, reuse, full = m.time(1024), m.time(1536, 1024), m.time(1536)
    slo = (c0 + full) / 2
    assert c0 < slo < full and c0 + reuse > slo and (c0 + reuse) / 2 < slo
    assert capacity_bound(_TURNS, prefill=2, target=1.0, slo_ttft_s=slo)[0] == float("inf")
    rate = pool_bound_rps(_TURNS, prefill=2, target=1.0, slo_ttft_s=slo)
    exact = 2 * 1 / (c0 + reuse - slo)            # 2 requests x speedup / 1 s of trace
    assert exact <= rate <= exact * 1.003         # rounded up, never down


def test_gated_ideal_by_hand():
    m = PrefillModel()
    c = m.time(4096)
    # five requests at once, distinct blocks, two instances, an SLO between
    # two and three prefills: two start at once, two wait one prefill, the
    # fifth would wait two: refused
    slo = (m.time(12288, 4096) + 3 * c) / 2
    assert 2 * c < slo < 3 * c and m.time(12288, 4096) < slo < m.time(12288)
    trace = [TraceRequest(i, 0.0, 4096, 8, tuple(range(10 * i, 10 * i + 8))) for i in range(5)]
    # later, a request of 24 blocks: within the SLO only if its first 8 are held
    later = tuple(range(100, 116))
    trace.append(TraceRequest(5, 1000.0, 12288, 8, trace[0].keys + later))
    assert gated_ideal_attainment(trace, 1.0, prefill=2, slo_ttft_s=slo) == pytest.approx(5 / 6)
    # the fifth was refused: it computed nothing, so a later request that
    # shares its blocks pays for them, and misses
    trace[5] = TraceRequest(5, 1000.0, 12288, 8, trace[4].keys + later)
    assert gated_ideal_attainment(trace, 1.0, prefill=2, slo_ttft_s=slo) == pytest.approx(4 / 6)
    # three instances: nobody waits two prefills
    assert gated_ideal_attainment(trace, 1.0, prefill=3, slo_ttft_s=slo) == pytest.approx(1.0)
    # faster: the sixth arrives with the others, behind them
    assert gated_ideal_attainment(trace, 1e6, prefill=3, slo_ttft_s=slo) == pytest.approx(5 / 6)
    rate = gated_ideal_rps(trace, prefill=3, slo_ttft_s=slo, target=1.0)
    assert rate > 0 and gated_ideal_attainment(trace, rate * 1000 / 6, prefill=3, slo_ttft_s=slo) == 1.0
    with pytest.raises(ValueError):
        gated_ideal_rps(trace[:1], prefill=1)


@pytest.mark.parametrize("pool", [None, PoolConfig.from_gb(400, 1600)], ids=["no pool", "pool"])
def test_no_policy_passes_the_bound(pool):
    """The bound is a proof: every policy's measured capacity, with the
    pool or without, behind the gate or not, is at most it."""
    trace = load_trace(CONV, 400)
    bound = pool_bound_rps(trace, prefill=8)
    assert bound <= capacity_bound(trace, prefill=8)[0] + 1e-9
    for policy in POLICIES:
        for rejection in ("baseline", "none"):
            cap = find_capacity(trace, policy, prefill=8, decode=8, thresholds=(0.1,), rejection=rejection,
                                precision=0.05, pool=pool)[0]
            # the search stops within 5% below a capacity: its upper end
            # is the capacity's most
            assert cap.rate_rps <= bound, (policy, rejection, cap, bound)


def test_capacity_cli_prints_the_bounds(capsys):
    from kvflow.conductor import capacity
    assert capacity.main(["--trace", CONV, "--limit", "120", "--policy", "kvcache,round_robin", "--pool", "400,0",
                          "--tbt", "100", "--jobs", "1", "--rejection", "baseline", "--json"]) == 0
    out = capsys.readouterr().out
    assert "bound given the pool" in out and "gated ideal (an estimate, not a bound" in out
    assert "1.2x the best other" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert 0 < last["gated_ideal_rps"] and last["pool_bound_rps"] <= last["bound_rps"]
    assert all(c["rate_rps"] <= last["pool_bound_rps"] for c in last["capacity"])
