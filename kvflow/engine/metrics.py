"""Engine-level metrics: `engine.metrics()`.

Per peer (and the provider carrying it) and per operation: batches,
bytes, failures by kind, and a latency histogram, counted in the native
core once per batch as it finishes (kvf_chan_stats: relaxed atomics, no
Python per batch); tcp connections' bytes, moves and rebuilds; the
receive window's pool; what is in flight; the native resources; the
staged paths' host slots (outgoing, inbox, relay inbox).
kvflow.metrics exports the same numbers to Prometheus. Read through the
engine's and the peers' public read-outs only (engine.peers,
engine.pending_batches(), engine.counters(), engine.staging_stats(),
peer.channel_stats(), peer.connections())."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow._core import STATUS

if TYPE_CHECKING:
    from kvflow.engine.engine import Engine
    from kvflow.engine.peer import Peer

__all__ = ["BUCKETS_US", "engine_metrics", "peer_metrics", "percentile_us"]

# Upper bounds (us) of the native latency buckets: bucket i is under 2^(i+1) us.
BUCKETS_US = [float(2 ** (i + 1)) for i in range(27)] + [float("inf")]
_STATUS_NAMES = {code: name for name, code in STATUS.items()}


def percentile_us(buckets: list[int], q: float) -> float | None:
    """The q-quantile (0..1) from the buckets, as the upper bound of the
    bucket it falls in (so within a factor of two); None without samples."""
    total = sum(buckets)
    if not total:
        return None
    want, seen = q * total, 0
    for bound, n in zip(BUCKETS_US, buckets):
        seen += n
        if seen >= want:
            return bound
    return BUCKETS_US[-1]


def _op_summary(s: dict[str, Any]) -> dict[str, Any]:
    buckets = s["latency_buckets"]
    ok = sum(buckets)
    return {"batches": s["batches"], "bytes": s["bytes"], "failed": s["failed"],
            "inflight_batches": s["inflight_batches"], "inflight_bytes": s["inflight_bytes"],
            "latency_mean_us": s["latency_sum_ns"] / ok / 1000 if ok else None,
            "latency_p50_us": percentile_us(buckets, 0.50), "latency_p99_us": percentile_us(buckets, 0.99),
            "latency_buckets": list(zip(BUCKETS_US, buckets))}


def peer_metrics(peer: "Peer") -> dict[str, Any] | None:
    """One peer's numbers, or None once its channel is closed."""
    stats = peer.channel_stats()
    if stats is None:
        return None
    conns = peer.connections()
    return {"provider": peer.transport,
            "write": _op_summary(stats["write"]), "read": _op_summary(stats["read"]),
            "failures": {_STATUS_NAMES.get(code, str(code)): n for code, n in stats["failures_by_status"].items()},
            "connections": conns,
            "moved_slices": sum(c.get("moved", 0) for c in conns),
            "connection_failures": sum(c.get("failures", 0) for c in conns),
            "repairs": sum(c.get("rebuilt", 0) + c.get("repairs", 0) for c in conns)}


def engine_metrics(engine: "Engine") -> dict[str, Any]:
    peers = {}
    for peer in engine.peers:
        m = peer_metrics(peer)
        if m is not None:
            peers[peer.address] = m
    counters = engine.counters()
    return {"peers": peers,
            "inflight": {"batches": engine.pending_batches(),
                         "slices": counters.get("slices_inflight", 0)},
            "resources": counters,
            "receive_window": engine.receive_window_stats(),
            "staging": engine.staging_stats()}
