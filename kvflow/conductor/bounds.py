"""What no router can beat on a trace, given a global KVCache pool, and
what a perfectly balanced router could reach behind the admission gate
every router shares: the two yardsticks `capacity` prints beside the
measured capacities.

`pool_bound_rps` is a proof: an upper bound on any router's capacity, with
any cache, pool (of any size and bandwidth) and admission. A request
served within the SLOs was prefilled; its prefill starts no earlier than
its arrival and ends within `slo_ttft_s` of it; it reuses a block only
once a prefill that computed that block is over (an instance's cache gets
a block when its prefill ends, the pool later still, after the bytes
cross the link); reusing costs at least the prefill of the rest from the
cheapest tier (`PrefillModel.time`: the cached tokens load from the
instance's own DRAM). So at speedup s each request has a least prefill
cost, which only grows with s (its turns come closer together), and
serving `target` of the requests takes at least the cheapest `target` of
those costs within the prefill instances' span / s + `slo_ttft_s`
seconds each. Left out, so the bound stays valid but looser: the pool's
size and read bandwidth (a router may recompute instead), the decode side
(the TBT SLO), and that a prefill runs on one instance in order.

`shared_work_bound` is a proof too, from the other side: it drops the
arrival times but counts that a block's compute is paid once by some
prefill, so a refused request's blocks are not there for free for the
turns after it (both bounds above let any later request reuse them). It
is the least work over every choice of which `target` share to serve, a
knapsack over the tree of prefixes (`least_shared_work`).

`gated_ideal_rps` is not a proof: the capacity of one idealised router
behind the same gate as every policy's (`--rejection baseline`: a request
whose TTFT would pass the SLO is refused on arrival): the prefill
instances are one FIFO queue that any free instance takes from (perfect
balance), every block a served request computed is cached everywhere the
moment it is admitted, at no fetch cost (a perfect pool), and a refused
request computes nothing. It estimates what routing alone can reach when
the gate, not the router, chooses whom to refuse: a router may beat it by
refusing expensive requests on purpose (which `pool_bound_rps` allows).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from .admission import CostAdmission
from .estimators import PrefillModel
from .trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["capacity_bound", "gated_ideal_attainment", "gated_ideal_rps", "least_costs", "largest_speedup",
           "least_shared_work", "pool_bound_rps", "shared_work_bound"]


def capacity_bound(trace: Sequence[TraceRequest], *, prefill: int, target: float = 0.9, slo_ttft_s: float = 30.0,
                   model: PrefillModel | None = None) -> tuple[float, float]:
    """An upper bound on any router's capacity, with any cache or pool and
    any admission: (requests/s, seconds of prefill). A request served
    within the SLOs was prefilled, at best with every block of every
    earlier request cached (one unlimited cache shared by all: what
    `prefill_ideal_s` gives each prefilled request, here over the whole
    trace, so never more). Serving `target` of the requests takes at least
    the cheapest `target` of those prefills, and `prefill` instances have
    span / speedup + `slo_ttft_s` seconds each for them."""
    model = model or PrefillModel()
    seen: set[int] = set()
    costs = []
    for r in trace:
        n = 0
        for k in r.keys:
            if k not in seen:
                break
            n += 1
        costs.append(model.time(r.tokens, min(r.tokens, n * TRACE_BLOCK_TOKENS)))
        seen.update(r.keys)
    costs.sort()
    work = sum(costs[:math.ceil(target * len(costs))])
    # the speedup s at which prefill x (span / s + slo_ttft_s) = work; its
    # rate is n x s / span
    spare = work - prefill * slo_ttft_s
    return (len(trace) * prefill / spare if spare > 0 else math.inf), work


def least_shared_work(trace: Sequence[TraceRequest], model: PrefillModel | None = None) -> np.ndarray:
    """w[j]: the least prefill compute (seconds, overheads left out) of any
    schedule that serves j of the requests, whoever computes their blocks.

    A block is a prefix path (the request's keys up to it: the replay
    matches keys from the first on, so that is what a cache hit is). Every
    served request needs each of its blocks computed by some prefill,
    served or not, at least once; a prefill of n tokens over a cached p
    computes `linear * (n - p) + attention * (n**2 - p**2)`, the sum over
    the positions it computes of `linear + attention * (2i + 1)`, so any
    schedule spends at least the sum over the union of the served
    requests' blocks of each block's positions (the shortest tail of a
    block that ends requests differently). The blocks form a tree (a
    path's parent is the path one block shorter) with requests ending at
    nodes; the least union over j requests is a knapsack over that tree,
    solved exactly by merging the children's tables with (min, +).
    ValueError if a key stands after two different prefixes (the Mooncake
    traces' hash ids are chained: none does)."""
    model = model or PrefillModel()
    ids: dict[tuple[int, int], int] = {}
    key_node: dict[int, int] = {}
    parent, length, depth, ends = [-1], [0], [0], [0]
    for r in trace:
        v = 0
        for j, k in enumerate(r.keys):
            n = min(TRACE_BLOCK_TOKENS, r.tokens - j * TRACE_BLOCK_TOKENS)
            node = ids.get((v, k))
            if node is None:
                if k in key_node:
                    # the replay matches a key wherever it stands; a tree of
                    # paths would then charge twice what one compute serves
                    raise ValueError(f"request {r.index}: key {k} follows another prefix than before;"
                                     " the bound needs chained keys (a key names its prefix)")
                node = ids[(v, k)] = key_node[k] = len(parent)
                parent.append(v)
                length.append(n)
                depth.append(j)
                ends.append(0)
            elif n < length[node]:
                length[node] = n
            v = node
        ends[v] += 1
    tables: list[np.ndarray | None] = [None] * len(parent)
    root = np.zeros(1)
    # a node's children were made after it: higher ids first is bottom-up
    for v in range(len(parent) - 1, -1, -1):
        t = tables[v] if tables[v] is not None else np.zeros(1)
        tables[v] = None
        if ends[v]:
            t = _min_plus(t, np.zeros(ends[v] + 1))    # requests ending here need nothing more
        if v:
            p0 = depth[v] * TRACE_BLOCK_TOKENS
            t[1:] += model.compute_time(p0 + length[v], p0)
            up = tables[parent[v]]
            tables[parent[v]] = t if up is None else _min_plus(up, t)
        else:
            root = t
    return root


def _min_plus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c[k] = min over i + j = k of a[i] + b[j]."""
    if len(a) < len(b):
        a, b = b, a
    out = np.full(len(a) + len(b) - 1, np.inf)
    for i, bi in enumerate(b):
        np.minimum(out[i:i + len(a)], a + bi, out=out[i:i + len(a)])
    return out


def shared_work_bound(trace: Sequence[TraceRequest], *, prefill: int, target: float = 0.9,
                      slo_ttft_s: float = 30.0, model: PrefillModel | None = None) -> tuple[float, float]:
    """An upper bound on any router's capacity, with any cache, pool and
    admission: (requests/s, seconds of prefill). `capacity_bound` lets a
    request reuse every earlier request's blocks, served or not, so the
    turns after a refused one stay cheap; here a block costs its compute
    once, in whichever prefill, so refusing a request leaves its blocks to
    be paid for by the next that needs them (`least_shared_work`), and
    each served prefill costs at least the model's overhead. Serving
    `target` of the requests takes at least that work, and `prefill`
    instances have span / speedup + `slo_ttft_s` seconds each."""
    model = model or PrefillModel()
    need = math.ceil(target * len(trace))
    work = float(least_shared_work(trace, model)[need]) + model.overhead_s * need
    spare = work - prefill * slo_ttft_s
    return (len(trace) * prefill / spare if spare > 0 else math.inf), work


def least_costs(trace: Sequence[TraceRequest], speedup: float, *, slo_ttft_s: float = 30.0,
                model: PrefillModel | None = None) -> list[float]:
    """Each request's least prefill seconds if it is served within
    `slo_ttft_s` at `speedup` (inf: no schedule can serve it in time), by
    the argument of the module's docstring. A block's earliest existence
    is the earliest end of a prefill that holds it: its arrival plus its
    own least cost with no SLO (a late prefill still computes blocks)."""
    model = model or PrefillModel()
    t0 = trace[0].arrival_s if trace else 0.0
    ready: dict[int, float] = {}         # block key -> the earliest a prefill holding it can be over
    out = []
    for r in trace:
        arrive = (r.arrival_s - t0) / speedup
        # options: reuse the first n blocks, n from 0 up to what earlier
        # requests hold; each starts once its last block exists
        best_end, best_served = arrive + model.time(r.tokens, 0), math.inf
        if best_end - arrive <= slo_ttft_s:
            best_served = best_end - arrive
        for n, k in enumerate(r.keys, 1):
            at = ready.get(k)
            if at is None:
                break               # keys are chained: nothing past a block never computed
            cost = model.time(r.tokens, min(r.tokens, n * TRACE_BLOCK_TOKENS))
            end = max(arrive, at) + cost
            best_end = min(best_end, end)
            if end - arrive <= slo_ttft_s:
                best_served = min(best_served, cost)
        for k in r.keys:
            if best_end < ready.get(k, math.inf):
                ready[k] = best_end
        out.append(best_served)
    return out


def _served_within(costs: list[float], budget: float) -> int:
    """How many of `costs`, cheapest first, fit in `budget` seconds."""
    n, total = 0, 0.0
    for c in sorted(costs):
        if not math.isfinite(c) or total + c > budget:
            break
        total += c
        n += 1
    return n


def _span(trace: Sequence[TraceRequest]) -> float:
    return trace[-1].arrival_s - trace[0].arrival_s


def largest_speedup(ok: Callable[[float], bool], *, lo: float = 0.25, hi: float = 64.0,
                    precision: float = 0.02) -> tuple[float, float]:
    """Bracket the largest speedup for which `ok` holds, taking it to hold
    below some speedup and not above: from 1, doubling up to `hi` or
    halving down to `lo`, then bisecting in log space until the bracket is
    within a factor 1 + precision. Returns (a, b): `ok` holds at a (0.0:
    not even at `lo`) and not at b (inf: it still held at the last
    doubling under `hi`). The capacity search and the yardsticks all use
    it, so a capacity and the yardstick it is read against are found alike."""
    a = 1.0
    if ok(a):
        b = a * 2
        while b <= hi and ok(b):
            a, b = b, b * 2
        if b > hi:
            return a, math.inf
    else:
        b = a
        a = a / 2
        while a >= lo and not ok(a):
            b, a = a, a / 2
        if a < lo:
            return 0.0, b
    while b / a > 1 + precision:
        m = math.sqrt(a * b)
        if ok(m):
            a = m
        else:
            b = m
    return a, b


def pool_bound_rps(trace: Sequence[TraceRequest], *, prefill: int, target: float = 0.9,
                   slo_ttft_s: float = 30.0, model: PrefillModel | None = None) -> float:
    """An upper bound on any router's capacity, in requests/s, given a
    pool of any size (see the module's docstring). The served count it allows only falls as the
    speedup grows (least costs grow, the span shrinks), so the largest
    speedup allowing `target` of the requests is bracketed by bisection,
    and the bracket's upper end taken: the bound errs high, never low."""
    if len(trace) < 2:
        raise ValueError("a bound needs at least two requests (a span)")
    need = math.ceil(target * len(trace))
    span = _span(trace)

    def ok(s: float) -> bool:
        costs = least_costs(trace, s, slo_ttft_s=slo_ttft_s, model=model)
        return _served_within(costs, prefill * (span / s + slo_ttft_s)) >= need

    # the bracket's upper end: where the bound no longer allows the target
    _, s = largest_speedup(ok, lo=1e-3, hi=1e4, precision=0.002)
    # `capacity_bound` is this bound with every block there from the start
    # (no arrival times): never lower, but exact where a bracket is not
    return min(len(trace) * s / span,
               capacity_bound(trace, prefill=prefill, target=target, slo_ttft_s=slo_ttft_s, model=model)[0])


def gated_ideal_attainment(trace: Sequence[TraceRequest], speedup: float, *, prefill: int,
                           slo_ttft_s: float = 30.0, model: PrefillModel | None = None,
                           admission: Callable[[], CostAdmission] | None = None) -> float:
    """The share of requests the idealised gated router of the module's
    docstring serves within the TTFT SLO at `speedup`; with `admission` (a
    maker of a fresh `CostAdmission`), that rule refuses before the gate,
    as the conductor's does (on the instances' mean wait)."""
    model = model or PrefillModel()
    rule = admission() if admission is not None else None
    t0 = trace[0].arrival_s
    held: set[int] = set()
    free = [0.0] * prefill              # when each instance is done with what it was given
    served = 0
    for r in trace:
        now = (r.arrival_s - t0) / speedup
        n = 0
        for k in r.keys:
            if k not in held:
                break
            n += 1
        cost = model.time(r.tokens, min(r.tokens, n * TRACE_BLOCK_TOKENS))
        if rule is not None and rule.refuse(cost, sum(max(0.0, f - now) for f in free) / prefill,
                                            slo_ttft_s) is not None:
            continue
        start = max(now, free[0])
        if start + cost - now <= slo_ttft_s:
            heapq.heapreplace(free, start + cost)
            held.update(r.keys)
            served += 1
    return served / len(trace)


def gated_ideal_rps(trace: Sequence[TraceRequest], *, prefill: int, target: float = 0.9,
                    slo_ttft_s: float = 30.0, model: PrefillModel | None = None,
                    precision: float = 0.02, admission: Callable[[], CostAdmission] | None = None) -> float:
    """The idealised gated router's capacity, in requests/s, found as the
    policies' is (`largest_speedup`, with `capacity`'s precision)."""
    if len(trace) < 2:
        raise ValueError("a capacity needs at least two requests (a span)")
    s, _ = largest_speedup(lambda sp: gated_ideal_attainment(trace, sp, prefill=prefill, slo_ttft_s=slo_ttft_s,
                                                             model=model, admission=admission) >= target,
                           precision=precision)
    return len(trace) * s / _span(trace)
