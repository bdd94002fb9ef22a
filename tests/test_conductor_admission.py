"""Admission by cost (kvflow.conductor.admission) and the shared-work bound
(bounds.least_shared_work): the rule refuses the dearest prefills only
while the instances are loaded, keeps the cheap ones, and the replay's
capacity search gives it to the policies asked for; the bound equals a
brute force over every served set on small traces."""
from __future__ import annotations

import itertools
import math
import os
import random

import pytest

from kvflow.conductor.admission import AdmissionSpec, CostAdmission, parse_admission
from kvflow.conductor.bounds import capacity_bound, least_shared_work, shared_work_bound
from kvflow.conductor.estimators import PrefillModel
from kvflow.conductor.metrics import attainment
from kvflow.conductor.replay import replay_one
from kvflow.conductor.trace import TRACE_BLOCK_TOKENS, TraceRequest

CONV = os.path.join(os.path.dirname(__file__), "data", "traces", "conversation_trace.jsonl.gz")
B = TRACE_BLOCK_TOKENS


def test_cost_admission_refuses_the_dearest_only_under_load():
    a = CostAdmission(budget=0.1, load=0.5, window=100, warmup=10)
    # warming up: nothing refused, however dear and however loaded
    for i in range(10):
        assert a.refuse(1.0 + i * 0.01, wait_s=100.0, slo_ttft_s=30.0) is None
    for i in range(90):
        a.refuse(1.0 + (i % 10) * 0.01, wait_s=0.0, slo_ttft_s=30.0)
    assert a.threshold() == pytest.approx(1.09)
    # loaded (wait 15 s of a 30 s SLO): a dear one is refused, and says why
    why = a.refuse(5.0, wait_s=15.0, slo_ttft_s=30.0)
    assert why is not None and "5.00 s" in why and "10%" in why
    # a cheap one under the same load is admitted
    assert a.refuse(0.5, wait_s=20.0, slo_ttft_s=30.0) is None
    # the same dear one with the instances less loaded is admitted
    assert a.refuse(5.0, wait_s=14.9, slo_ttft_s=30.0) is None
    assert a.stats.seen == 103 and a.stats.refused == 1
    # the window slides: after 100 dear ones, 5 s is no longer the dearest tenth
    for _ in range(100):
        a.refuse(6.0, wait_s=0.0, slo_ttft_s=30.0)
    assert a.threshold() == 6.0 and a.refuse(5.0, wait_s=29.0, slo_ttft_s=30.0) is None


def test_cost_admission_arguments():
    for bad in ({"budget": 0.0}, {"budget": 1.0}, {"load": -1.0}, {"window": 0}, {"warmup": -1}):
        with pytest.raises(ValueError):
            CostAdmission(**bad)
    spec = parse_admission("cost:0.05,0.3@kvcache,llm_d")
    assert spec == AdmissionSpec(0.05, 0.3, ("kvcache", "llm_d"))
    assert spec.make("kvcache").budget == 0.05 and spec.make("round_robin") is None
    assert parse_admission("cost").make("round_robin").load == 0.5
    for bad in ("fifo", "cost:0.1", "cost:2,0.5", "cost@"):
        with pytest.raises(ValueError):
            parse_admission(bad)


def _mixed_trace(n: int = 300, every: int = 10, gap_s: float = 0.1) -> list[TraceRequest]:
    """Short prompts (one block, nothing shared) arriving every `gap_s`,
    and every `every`-th a long one (24 blocks, nothing shared)."""
    out = []
    for i in range(n):
        blocks = 24 if i % every == every - 1 else 1
        keys = tuple(1_000 * i + j for j in range(blocks))
        out.append(TraceRequest(i, i * gap_s, blocks * B, 16, keys))
    return out


def test_replay_refuses_the_long_prompts_and_keeps_the_short_ones():
    """One prefill instance fed twice what it can compute: the TTFT gate
    alone lets the queue fill to the SLO and admits a long prompt whenever
    it still fits; the cost rule refuses the long prompts (and only them)
    once the queue is a fifth of the SLO, so the short ones are served and
    wait less."""
    trace = _mixed_trace()
    m = PrefillModel()
    long_s, short_s = m.time(24 * B), m.time(B)
    # the work arrives faster than one instance computes it
    assert (long_s + 9 * short_s) / (10 * 0.1) > 1.5
    runs = {}
    # a budget over the long prompts' share (10%): the threshold is a short one's cost
    for name, adm in (("gate", None), ("cost", AdmissionSpec(budget=0.15, load=0.2))):
        _, res = replay_one(trace, "kvcache", prefill=1, decode=1, speedup=1.0, slo_ttft_s=10.0,
                            slo_tbt_s=1.0, rejection="baseline", admission=adm)
        runs[name] = res.outcomes
    long_ids = {r.index for r in trace if len(r.keys) > 1}
    cost = runs["cost"]
    by_cost = [o for o in cost if o.rejected == "prefill_cost"]
    assert by_cost and all(o.index in long_ids for o in by_cost)
    # all but those of the warm-up (the first 64 requests) and those the queue had room for
    assert len(by_cost) >= 0.6 * len(long_ids)
    shorts = [o for o in cost if o.index not in long_ids]
    assert all(not o.rejected for o in shorts) and attainment(shorts, 10.0, 1.0) == 1.0

    def short_wait(outs):
        return sorted(o.ttft_s for o in outs if not o.rejected and o.index not in long_ids)[-len(outs) // 10]
    assert short_wait(cost) < 0.75 * short_wait(runs["gate"])


def test_replay_under_light_load_refuses_nothing():
    trace = _mixed_trace(n=100, gap_s=5.0)
    _, res = replay_one(trace, "kvcache", prefill=1, decode=1, slo_ttft_s=10.0, slo_tbt_s=1.0,
                        rejection="baseline", admission=AdmissionSpec(budget=0.15, load=0.2))
    assert not any(o.rejected for o in res.outcomes)


def test_admission_is_given_to_the_policies_named():
    trace = _mixed_trace(n=200)
    spec = AdmissionSpec(budget=0.15, load=0.2, only=("kvcache",))
    _, rr = replay_one(trace, "round_robin", prefill=1, decode=1, slo_ttft_s=10.0, slo_tbt_s=1.0,
                       rejection="baseline", admission=spec)
    _, kv = replay_one(trace, "kvcache", prefill=1, decode=1, slo_ttft_s=10.0, slo_tbt_s=1.0,
                       rejection="baseline", admission=spec)
    assert not any(o.rejected == "prefill_cost" for o in rr.outcomes)
    assert any(o.rejected == "prefill_cost" for o in kv.outcomes)


def _union_work(trace: list[TraceRequest], served: tuple[int, ...], m: PrefillModel) -> float:
    """The compute of the union of the served requests' blocks, by brute force."""
    blocks: dict[tuple[int, ...], int] = {}
    for i in served:
        r = trace[i]
        for j in range(len(r.keys)):
            path = r.keys[:j + 1]
            n = min(B, r.tokens - j * B)
            blocks[path] = min(blocks.get(path, n), n)
    return sum(m.compute_time(len(p) * B - B + n, len(p) * B - B) for p, n in blocks.items())


def _small_tree_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    """Requests extending earlier ones' prefixes (turns, shared prompts), a
    random last-block length each."""
    out: list[TraceRequest] = []
    for i in range(n):
        if out and rng.random() < 0.7:
            base = rng.choice(out).keys
            base = base[:rng.randint(1, len(base))]
        else:
            base = ()
        keys = base + tuple(100 * i + j for j in range(rng.randint(1, 3)))
        tokens = (len(keys) - 1) * B + rng.randint(1, B)
        out.append(TraceRequest(i, float(i), tokens, 4, keys))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_least_shared_work_is_the_brute_force_minimum(seed):
    m = PrefillModel()
    trace = _small_tree_trace(random.Random(seed), 8)
    table = least_shared_work(trace, m)
    assert len(table) == len(trace) + 1 and table[0] == 0
    for j in range(1, len(trace) + 1):
        best = min(_union_work(trace, s, m) for s in itertools.combinations(range(len(trace)), j))
        assert table[j] == pytest.approx(best, rel=1e-12)


def test_shared_work_bound_charges_a_refused_turns_blocks_to_the_next():
    """Two conversations, each a long first turn and two cheap follow-ups.
    Serving 4 of 6 by `capacity_bound`'s count drops both first turns and
    keeps all four follow-ups at their cached cost; in truth those need
    the first turns' blocks computed, whoever computes them: the least work
    is each conversation's first two turns (attention is quadratic, so two
    17-block prompts beat an 18-block one and a 16-block one)."""
    m = PrefillModel()
    trace = []
    for c in range(2):
        first = tuple(1000 * c + j for j in range(16))
        trace += [TraceRequest(3 * c, 10.0 * c, 16 * B, 4, first),
                  TraceRequest(3 * c + 1, 10.0 * c + 1, 17 * B, 4, first + (1000 * c + 16,)),
                  TraceRequest(3 * c + 2, 10.0 * c + 2, 18 * B, 4, first + (1000 * c + 16, 1000 * c + 17))]
    rate, work = shared_work_bound(trace, prefill=1, target=4 / 6, slo_ttft_s=1.0, model=m)
    exact = 2 * m.compute_time(17 * B) + 4 * m.overhead_s
    assert exact < m.compute_time(18 * B) + m.compute_time(16 * B) + 4 * m.overhead_s
    assert work == pytest.approx(exact)
    _, loose = capacity_bound(trace, prefill=1, target=4 / 6, slo_ttft_s=1.0, model=m)
    assert loose < work / 5
    assert rate == pytest.approx(len(trace) / (work - 1.0))


def test_shared_work_bound_on_the_conversation_trace_is_above_every_capacity_measured():
    from kvflow.conductor.capacity import find_capacity
    from kvflow.conductor.trace import load_trace
    trace = load_trace(CONV, 400)
    bound, _ = shared_work_bound(trace, prefill=8)
    assert math.isfinite(bound)
    for policy, adm in (("kvcache", AdmissionSpec()), ("kvcache", None), ("round_robin", AdmissionSpec())):
        cap = find_capacity(trace, policy, prefill=8, decode=8, thresholds=(0.1,), rejection="baseline",
                            precision=0.05, admission=adm)[0]
        assert cap.rate_rps <= bound, (policy, adm, cap, bound)


def test_capacity_cli_names_the_admission_and_prints_the_shared_bound(capsys):
    import json
    from kvflow.conductor import capacity
    assert capacity.main(["--trace", CONV, "--limit", "120", "--policy", "kvcache,round_robin", "--tbt", "100",
                          "--jobs", "1", "--rejection", "baseline", "--admission", "cost:0.1,0.5@kvcache",
                          "--json"]) == 0
    out = capsys.readouterr().out
    assert "admission cost (budget 0.1, load 0.5) for kvcache" in out
    assert "each block computed once" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["admission"] == "cost (budget 0.1, load 0.5) for kvcache"
    assert all(c["rate_rps"] <= last["shared_bound_rps"] for c in last["capacity"])


def test_gated_ideal_behind_the_cost_admission_by_hand():
    """Four requests at once on one instance: cheap, dear, cheap, cheap,
    with an SLO that fits the first two and not a third behind them. The
    gate serves the first two; the cost rule (here refusing anything
    dearer than the median so far, at any load) refuses the dear one and
    serves the three cheap ones."""
    from kvflow.conductor.bounds import gated_ideal_attainment
    m = PrefillModel()
    c, dear = m.time(B), m.time(24 * B)
    slo = c + dear + c / 2
    trace = [TraceRequest(0, 0.0, B, 4, (1,)), TraceRequest(1, 0.0, 24 * B, 4, tuple(range(10, 34))),
             TraceRequest(2, 0.0, B, 4, (2,)), TraceRequest(3, 0.0, B, 4, (3,))]
    assert gated_ideal_attainment(trace, 1.0, prefill=1, slo_ttft_s=slo, model=m) == 0.5
    rule = lambda: CostAdmission(budget=0.5, load=0.0, warmup=1)      # noqa: E731
    assert gated_ideal_attainment(trace, 1.0, prefill=1, slo_ttft_s=slo, model=m, admission=rule) == 0.75


def test_least_shared_work_wants_chained_keys():
    trace = [TraceRequest(0, 0.0, 2 * B, 4, (1, 2)), TraceRequest(1, 1.0, 2 * B, 4, (3, 2))]
    with pytest.raises(ValueError, match="chained"):
        least_shared_work(trace)
