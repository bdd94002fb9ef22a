"""What a replay measured: one flat dict per run (the JSON line of
`replay --json`), and the SLO attainment the capacity search uses."""
from __future__ import annotations

import math
from collections.abc import Sequence

from .sim import RequestOutcome, SimResult
from .types import RejectReason

__all__ = ["summarize", "attainment", "percentile", "TBT_THRESHOLDS_S"]

_AT_DECODE = RejectReason.DECODE_FULL.value     # the one reason given after the prefill

#: The paper's TBT thresholds I, II and III.
TBT_THRESHOLDS_S = (0.1, 0.2, 0.3)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _meets(o: RequestOutcome, slo_ttft_s: float, slo_tbt_s: float) -> bool:
    return o.completed and o.ttft_s <= slo_ttft_s and o.tbt_s <= slo_tbt_s


def attainment(outcomes: Sequence[RequestOutcome], slo_ttft_s: float, slo_tbt_s: float) -> float:
    """Fraction of all requests (rejected ones included) that completed
    within both SLOs."""
    if not outcomes:
        return math.nan
    return sum(1 for o in outcomes if _meets(o, slo_ttft_s, slo_tbt_s)) / len(outcomes)


def summarize(result: SimResult, *, policy: str, slo_ttft_s: float, slo_tbt_s: float,
              speedup: float, rejection: str) -> dict[str, object]:
    outs = result.outcomes
    done = [o for o in outs if o.completed]
    ttft = [o.ttft_s for o in done]
    tbt = [o.tbt_s for o in done]
    # routed: everything but what the conductor refused before prefill
    routed = [o for o in outs if o.rejected in ("", _AT_DECODE)]
    blocks = sum(o.blocks for o in routed)
    reused = sum(o.reused_blocks for o in routed)
    span = result.span_s if result.span_s > 0 else math.nan
    good = sum(1 for o in outs if _meets(o, slo_ttft_s, slo_tbt_s))
    rejected = [o for o in outs if o.rejected]
    summary: dict[str, object] = {
        "policy": policy,
        "rejection": rejection,
        "speedup": speedup,
        "requests": len(outs),
        "rate_rps": len(outs) / span,
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_before_prefill": sum(1 for o in rejected if o.rejected != _AT_DECODE),
        "rejected_at_decode": sum(1 for o in rejected if o.rejected == _AT_DECODE),
        "goodput_rps": good / span,
        "slo_attainment": good / len(outs) if outs else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else math.nan,
        "tbt_p50_s": percentile(tbt, 50),
        "tbt_p90_s": percentile(tbt, 90),
        "hit_ratio": reused / blocks if blocks else 0.0,
        "moved_bytes": result.moved_bytes,
        "moved_requests": sum(1 for o in outs if o.moved_blocks),
        "pool_hit_ratio": sum(o.pool_blocks for o in routed) / blocks if blocks else 0.0,
        "wasted_prefill_s": result.wasted_prefill_s,
        "prefill_busy_s": result.prefill_busy_s,
        "prefill_ideal_s": result.prefill_ideal_s,
        "span_s": result.span_s,
    }
    if result.pool is not None:
        ps = result.pool
        summary.update(pool_written_blocks=ps.written_blocks, pool_read_dram_blocks=ps.read_dram_blocks,
                       pool_read_ssd_blocks=ps.read_ssd_blocks, pool_demoted=ps.demoted,
                       pool_dropped=ps.dropped, pool_replicas_made=ps.replicas_made)
    for thr in TBT_THRESHOLDS_S:
        summary[f"attainment_tbt_{int(thr * 1000)}ms"] = attainment(outs, slo_ttft_s, thr)
    return summary
