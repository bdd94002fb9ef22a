"""Replay a request trace through the conductor on a simulated cluster.

    python -m kvflow.conductor.replay --trace FILE --policy kvcache --prefill 8 --decode 8 \\
        [--speedup X] [--slo-ttft S] [--slo-tbt S] [--rejection none|baseline|early|predictive] \\
        [--seed K] [--pool DRAM_GB,SSD_GB] [--json] [--plot DIR]

`--policy` and `--speedup` take comma-separated lists (every pair is
replayed; "all" is every policy). With `--json` the last line of output is
one JSON object: the run's summary, or {"runs": [...]} for several.
`--plot DIR` writes goodput_vs_load.png and ttft_cdf.png (needs
matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

from .admission import AdmissionSpec, parse_admission
from .metrics import summarize
from .policies import POLICIES, make_policy
from .pool import PoolConfig
from .sim import ClusterConfig, SimResult, Simulation
from .trace import TraceRequest, load_trace
from .types import RejectionMode

__all__ = ["main", "parse_pool", "replay_one"]


def parse_pool(s: str) -> PoolConfig:
    """`--pool DRAM_GB,SSD_GB`: a global KVCache pool of that many
    gigabytes of DRAM and of SSD over the whole cluster (SSD may be 0)."""
    try:
        dram, ssd = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pool wants DRAM_GB,SSD_GB, got {s!r}") from None
    if dram < 0 or ssd < 0:
        raise argparse.ArgumentTypeError(f"--pool sizes must be >= 0, got {s!r}")
    return PoolConfig.from_gb(dram, ssd)


def replay_one(trace: Sequence[TraceRequest], policy: str, *, prefill: int, decode: int,
               speedup: float = 1.0, slo_ttft_s: float = 30.0, slo_tbt_s: float = 0.1,
               rejection: str = "none", seed: int = 0, cache_blocks: int | None = -1,
               threshold: float | None = None, progress: bool = False,
               pool: PoolConfig | None = None,
               admission: AdmissionSpec | None = None) -> tuple[dict[str, object], SimResult]:
    """Replay once (with the global KVCache pool `pool`, if given, and the
    cost admission of `admission` if it covers `policy`); returns (summary,
    raw result)."""
    options = {} if threshold is None or policy != "kvcache" else {"kvcache_balancing_threshold": threshold}
    pol = make_policy(policy, seed=seed, **options)
    cfg = ClusterConfig(prefill=prefill, decode=decode, pool=pool) if cache_blocks == -1 else \
        ClusterConfig(prefill=prefill, decode=decode, cache_blocks=cache_blocks, pool=pool)
    sim = Simulation(trace, pol, cfg, speedup=speedup, slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s,
                     rejection=RejectionMode(rejection),
                     admission=admission.make(policy) if admission is not None else None)
    bar = _Progress(f"{policy} x{speedup:g}") if progress else None
    t0 = time.perf_counter()
    res = sim.run(bar.update if bar else None)
    if bar:
        bar.close()
    summary = summarize(res, policy=policy, slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s,
                        speedup=speedup, rejection=rejection)
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return summary, res


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.on = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        if not self.on or total == 0:
            return
        width = 30
        fill = int(width * done / total)
        sys.stderr.write(f"\r{self.label:<24} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}"
    return str(v)


_COLUMNS = ("policy", "speedup", "rate_rps", "completed", "rejected", "goodput_rps", "slo_attainment",
            "ttft_p50_s", "ttft_p90_s", "tbt_p90_s", "hit_ratio", "moved_bytes", "wasted_prefill_s", "wall_s")


def print_table(rows: list[dict[str, object]], out=sys.stdout) -> None:
    cells = [[_fmt(r[c]) for c in _COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(_COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths)), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {s!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"need positive numbers: {s!r}")
    return vals


def _admission(s: str) -> AdmissionSpec:
    try:
        return parse_admission(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _policies(s: str) -> list[str]:
    names = list(POLICIES) if s == "all" else [x for x in s.split(",") if x]
    for n in names:
        if n not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {n!r}; known: {', '.join(POLICIES)}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvflow.conductor.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a Mooncake trace (.jsonl)")
    ap.add_argument("--policy", type=_policies, default=["kvcache"], help="comma list, or all")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--speedup", type=_floats, default=[1.0], help="comma list of replay speeds")
    ap.add_argument("--slo-ttft", type=float, default=30.0, help="seconds (default 30)")
    ap.add_argument("--slo-tbt", type=float, default=0.1, help="seconds (default 0.1)")
    ap.add_argument("--rejection", choices=[m.value for m in RejectionMode], default="none")
    ap.add_argument("--threshold", type=float, default=None, help="kvcache_balancing_threshold")
    ap.add_argument("--cache-blocks", type=int, default=-1,
                    help="prefix cache per prefill instance, in blocks (default: 3M tokens; 0: none)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--pool", type=parse_pool, default=None, metavar="DRAM_GB,SSD_GB",
                    help="a global KVCache pool of that much DRAM and SSD over the cluster")
    ap.add_argument("--admission", type=_admission, default=None, metavar="cost[:BUDGET,LOAD][@POLICY,...]",
                    help="also refuse the dearest prefills under load (admission.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--plot", metavar="DIR", help="write PNG plots there")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        print("error: --prefill and --decode must be >= 1", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, args.limit)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not trace:
        print("error: the trace is empty", file=sys.stderr)
        return 2
    rows: list[dict[str, object]] = []
    results: dict[tuple[str, float], SimResult] = {}
    for pol in args.policy:
        for sp in args.speedup:
            summary, res = replay_one(trace, pol, prefill=args.prefill, decode=args.decode, speedup=sp,
                                      slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt,
                                      rejection=args.rejection, seed=args.seed, cache_blocks=args.cache_blocks,
                                      threshold=args.threshold, progress=True, pool=args.pool,
                                      admission=args.admission)
            rows.append(summary)
            results[(pol, sp)] = res
    print(f"trace {args.trace}: {len(trace)} requests, {args.prefill} prefill + {args.decode} decode,"
          f" SLO TTFT {args.slo_ttft:g} s TBT {args.slo_tbt * 1e3:g} ms, rejection {args.rejection}")
    print_table(rows)
    if args.plot:
        from .plot import plot_runs
        for path in plot_runs(rows, results, args.plot, slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt):
            print(f"wrote {path}")
    if args.json:
        # NaN (a percentile of nothing) is not JSON: null instead
        print(json.dumps(_nan_to_none(rows[0] if len(rows) == 1 else {"runs": rows}), allow_nan=False))
    return 0


def _nan_to_none(obj: object) -> object:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
