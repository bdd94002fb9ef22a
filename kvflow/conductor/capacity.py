"""Capacity, as the Mooncake paper measures it: the highest request rate at
which a policy still serves `--target` (90%) of the requests within the
SLOs, TTFT <= 30 s and TBT <= each of the thresholds I, II and III, found by
replaying the trace faster and faster (`--speedup`) and bisecting.

    python -m kvflow.conductor.capacity --trace FILE [--policy all] [--prefill 8 --decode 8]
        [--rejection none|baseline|early|predictive] [--pool DRAM_GB,SSD_GB] [--tbt MS,...] [--json]

By default replays run without rejection (every request is served, late or
not), so one replay gives the attainment at every TBT threshold: the
routing rules alone are compared. With `--rejection` every policy's choices
go through the same admission (Algorithm 1's SLO check: a request whose
estimated TTFT, or whose decode instance's TBT, misses its SLO is refused),
one replay per threshold; a refused request counts as one that missed.
With `--pool` every policy is given the same global KVCache pool (the
prefill engines fetch from it what it holds beyond their own prefix;
kvcache chooses by estimated TTFT between that, its local prefix, a move
from another instance and recomputing). `--tbt` limits the thresholds.
Policies run in parallel, one process each, up to the CPU count. Beside
the capacities it prints the yardsticks of `bounds.py`: bounds no router
can pass (with any pool) and, behind a gate, the gated ideal (an estimate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .metrics import TBT_THRESHOLDS_S, attainment
from .bounds import capacity_bound, gated_ideal_rps, largest_speedup, pool_bound_rps, shared_work_bound
from .policies import POLICIES
from .pool import PoolConfig
from .admission import AdmissionSpec, CostAdmission
from .replay import _admission, _policies, parse_pool, replay_one
from .trace import TraceRequest, load_trace
from .types import RejectionMode

__all__ = ["Capacity", "capacity_bound", "find_capacity", "main", "overload_study"]


@dataclass(frozen=True)
class Capacity:
    policy: str
    tbt_s: float
    speedup: float        # the highest speedup found meeting the target (0: not even the lowest tried)
    rate_rps: float       # requests per second at that speedup
    runs: int


def find_capacity(trace: list[TraceRequest], policy: str, *, prefill: int, decode: int,
                  slo_ttft_s: float = 30.0, thresholds: tuple[float, ...] = TBT_THRESHOLDS_S,
                  target: float = 0.9, precision: float = 0.02, lo: float = 0.25, hi: float = 64.0,
                  threshold: float | None = None, rejection: str = "none",
                  pool: PoolConfig | None = None, admission: AdmissionSpec | None = None) -> list[Capacity]:
    """The capacity of `policy` at each TBT threshold: the largest speedup
    whose replay meets both SLOs for `target` of the requests, within a
    factor `1 + precision`. Attainment is taken to fall as the speedup
    grows (more load); the search brackets by doubling, then bisects in log
    space. Without rejection a replay is reused across thresholds; with it
    the admission depends on the TBT SLO, so each threshold replays."""
    memo: dict[tuple[float, float], float] = {}
    span = trace[-1].arrival_s - trace[0].arrival_s

    def attain(sp: float, thr: float) -> float:
        if (sp, thr) not in memo:
            slo_tbt = min(thresholds) if rejection == "none" else thr
            _, res = replay_one(trace, policy, prefill=prefill, decode=decode, speedup=sp,
                                slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt, threshold=threshold,
                                rejection=rejection, pool=pool, admission=admission)
            for t in (thresholds if rejection == "none" else (thr,)):
                memo[(sp, t)] = attainment(res.outcomes, slo_ttft_s, t)
        return memo[(sp, thr)]

    def runs(thr: float) -> int:
        """Replays the search at `thr` used."""
        return len({sp for sp, t in memo if rejection == "none" or t == thr})

    out = []
    for thr in thresholds:
        a, _ = largest_speedup(lambda sp: attain(sp, thr) >= target, lo=lo, hi=hi, precision=precision)
        out.append(Capacity(policy, thr, a, len(trace) * a / span if a else 0.0, runs(thr)))
    return out


def overload_study(trace: list[TraceRequest], *, prefill: int, decode: int, slo_ttft_s: float = 30.0,
                   slo_tbt_s: float = 0.1, factor: float = 2.0, policy: str = "kvcache") -> dict[str, object]:
    """The paper's overload experiment: find where `least_loaded` first
    misses the SLOs (its capacity at `slo_tbt_s`), replay `policy` at
    `factor` times that rate under each rejection variant, and return what
    each rejected and wasted."""
    cap = find_capacity(trace, "least_loaded", prefill=prefill, decode=decode, slo_ttft_s=slo_ttft_s,
                        thresholds=(slo_tbt_s,))[0]
    speedup = cap.speedup * factor
    rows = {}
    for mode in ("baseline", "early", "predictive"):
        s, _ = replay_one(trace, policy, prefill=prefill, decode=decode, speedup=speedup,
                          slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s, rejection=mode)
        rows[mode] = {k: s[k] for k in ("rejected", "rejected_before_prefill", "rejected_at_decode",
                                        "wasted_prefill_s", "goodput_rps", "slo_attainment", "completed")}
    return {"least_loaded_capacity_speedup": cap.speedup, "speedup": speedup, "rate_rps": len(trace) * speedup /
            (trace[-1].arrival_s - trace[0].arrival_s), "variants": rows}


def _yardsticks(trace: list[TraceRequest], args: argparse.Namespace) -> dict[str, float]:
    """The bounds (`bounds.py`) for this trace and cluster; the gated
    ideal only behind a gate (it models the TTFT gate's refusals)."""
    bound, work = capacity_bound(trace, prefill=args.prefill, target=args.target, slo_ttft_s=args.slo_ttft)
    shared, shared_work = shared_work_bound(trace, prefill=args.prefill, target=args.target,
                                            slo_ttft_s=args.slo_ttft)
    out = {"bound_rps": bound, "bound_work_s": work,
           "pool_bound_rps": pool_bound_rps(trace, prefill=args.prefill, target=args.target,
                                            slo_ttft_s=args.slo_ttft),
           "shared_bound_rps": shared, "shared_work_s": shared_work}
    if args.rejection != "none":
        out["gated_ideal_rps"] = gated_ideal_rps(trace, prefill=args.prefill, target=args.target,
                                                 slo_ttft_s=args.slo_ttft, precision=args.precision)
        if args.admission is not None:
            adm = args.admission
            out["gated_ideal_cost_rps"] = gated_ideal_rps(
                trace, prefill=args.prefill, target=args.target, slo_ttft_s=args.slo_ttft,
                precision=args.precision, admission=lambda: CostAdmission(budget=adm.budget, load=adm.load))
    return out


def _print_yardsticks(y: dict[str, float], args: argparse.Namespace, best_other: float) -> None:
    print(f"bound (any router, cache, pool or admission): {y['bound_rps']:.2f} rps; the cheapest {args.target:.0%}"
          f" of the prefills, each with every earlier request's blocks cached, take {y['bound_work_s']:.0f} s")
    print(f"bound given the pool (a block reused only once a prefill that holds it is over): "
          f"{y['pool_bound_rps']:.2f} rps")
    print(f"bound with each block computed once, whoever computes it (a refused request leaves its blocks to the"
          f" next that needs them): {y['shared_bound_rps']:.2f} rps; the least such work for {args.target:.0%}"
          f" of the requests is {y['shared_work_s']:.0f} s")
    gated = y.get("gated_ideal_rps")
    if gated is not None:
        print(f"gated ideal (an estimate, not a bound: the same TTFT gate, one FIFO queue for all instances,"
              f" served blocks cached everywhere at once): {gated:.2f} rps")
    if "gated_ideal_cost_rps" in y:
        print(f"gated ideal behind the cost admission as well: {y['gated_ideal_cost_rps']:.2f} rps")
    if best_other > 0:
        want = 1.2 * best_other
        verdict = "above a bound: no router can reach it" if want > min(y["pool_bound_rps"],
                                                                        y["shared_bound_rps"]) else \
            "under the bounds"
        if gated is not None:
            verdict += "; above the gated ideal" if want > gated else "; under the gated ideal"
        print(f"1.2x the best other: {want:.2f} rps, {verdict}")


def _one(args: tuple) -> list[Capacity]:
    path, limit, policy, prefill, decode, slo_ttft, target, threshold, rejection, precision, pool, tbt, adm = args
    trace = load_trace(path, limit)
    return find_capacity(trace, policy, prefill=prefill, decode=decode, slo_ttft_s=slo_ttft,
                         target=target, threshold=threshold, rejection=rejection, precision=precision,
                         pool=pool, thresholds=tbt, admission=adm)


def _thresholds(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) / 1e3 for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of milliseconds: {s!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"need positive milliseconds: {s!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvflow.conductor.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policy", type=_policies, default=list(POLICIES))
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--slo-ttft", type=float, default=30.0)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--precision", type=float, default=0.02,
                    help="the search stops within this factor of the capacity (1 + precision)")
    ap.add_argument("--threshold", type=float, default=None, help="kvcache_balancing_threshold")
    ap.add_argument("--rejection", choices=[m.value for m in RejectionMode], default="none",
                    help="the admission every policy's choices go through (default none: routing alone)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--pool", type=parse_pool, default=None, metavar="DRAM_GB,SSD_GB",
                    help="give every policy the same global KVCache pool of that much DRAM and SSD")
    ap.add_argument("--admission", type=_admission, default=None, metavar="cost[:BUDGET,LOAD][@POLICY,...]",
                    help="also refuse the dearest prefills under load (admission.py); default for every policy")
    ap.add_argument("--tbt", type=_thresholds, default=TBT_THRESHOLDS_S, metavar="MS,...",
                    help="TBT thresholds in ms (default 100,200,300: I, II, III)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--overload", action="store_true",
                    help="instead: replay kvcache at twice least_loaded's capacity under each rejection variant")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.overload:
        study = overload_study(load_trace(args.trace, args.limit), prefill=args.prefill, decode=args.decode,
                               slo_ttft_s=args.slo_ttft)
        print(f"overload on {args.trace}: {args.prefill} prefill + {args.decode} decode; least_loaded first misses"
              f" at x{study['least_loaded_capacity_speedup']:.2f}; kvcache replayed at x{study['speedup']:.2f}"
              f" ({study['rate_rps']:.2f} requests/s)")
        print(f"{'rejection':>10} {'rejected':>8} {'before':>7} {'at decode':>9} {'wasted prefill s':>16}"
              f" {'goodput rps':>11} {'within SLO':>10}")
        for mode, r in study["variants"].items():    # type: ignore[union-attr]
            print(f"{mode:>10} {r['rejected']:>8} {r['rejected_before_prefill']:>7} {r['rejected_at_decode']:>9}"
                  f" {r['wasted_prefill_s']:>16.0f} {r['goodput_rps']:>11.2f} {r['slo_attainment']:>10.3f}")
        if args.json:
            print(json.dumps(study))
        return 0
    if not 0 < args.precision < 1:
        ap.error("--precision must be in (0, 1)")
    jobs = [(args.trace, args.limit, p, args.prefill, args.decode, args.slo_ttft, args.target, args.threshold,
             args.rejection, args.precision, args.pool, args.tbt, args.admission) for p in args.policy]
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(jobs)))) as pool:
        results = list(pool.map(_one, jobs))
    caps = {c.policy: c for r in results for c in r if c.tbt_s == args.tbt[0]}
    pool = "no pool" if args.pool is None else \
        f"pool {args.pool.dram_blocks} DRAM + {args.pool.ssd_blocks} SSD blocks"
    print(f"capacity on {args.trace}: {args.prefill} prefill + {args.decode} decode, >= {args.target:.0%}"
          f" of requests within TTFT {args.slo_ttft:g} s and TBT {'/'.join(f'{t * 1e3:g}' for t in args.tbt)} ms,"
          f" rejection {args.rejection}, {pool},"
          f" admission {'TTFT gate only' if args.admission is None else args.admission.describe()}"
          f" (requests/s; x speedup)")
    rows = []
    for r in results:
        line = f"{r[0].policy:>20}"
        for c in r:
            line += f"   {c.tbt_s * 1e3:>3.0f} ms: {c.rate_rps:7.2f} rps (x{c.speedup:.2f})"
            rows.append({"policy": c.policy, "tbt_s": c.tbt_s, "speedup": c.speedup, "rate_rps": c.rate_rps,
                         "runs": c.runs})
        print(line)
    trace = load_trace(args.trace, args.limit)
    yardsticks = _yardsticks(trace, args)
    best_other = 0.0
    if "kvcache" in caps:
        ours = caps["kvcache"].rate_rps
        others = {p: c.rate_rps for p, c in caps.items() if p != "kvcache"}
        if others:
            best = max(others, key=others.get)
            best_other = others[best]
            print(f"kvcache / best other ({best}): {ours / others[best]:.2f}x" if others[best] else
                  f"kvcache: {ours:.2f} rps, every other policy 0")
            if "least_loaded" in others and others["least_loaded"]:
                print(f"kvcache / least_loaded: {ours / others['least_loaded']:.2f}x")
    _print_yardsticks(yardsticks, args, best_other)
    if args.json:
        print(json.dumps({"rejection": args.rejection,
                          "admission": None if args.admission is None else args.admission.describe(),
                          "bound_rps": yardsticks["bound_rps"],
                          "pool_bound_rps": yardsticks["pool_bound_rps"],
                          "shared_bound_rps": yardsticks["shared_bound_rps"],
                          "gated_ideal_rps": yardsticks.get("gated_ideal_rps"),
                          "gated_ideal_cost_rps": yardsticks.get("gated_ideal_cost_rps"),
                          "pool": None if args.pool is None else [args.pool.dram_blocks, args.pool.ssd_blocks],
                          "capacity": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
