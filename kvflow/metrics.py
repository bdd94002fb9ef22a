"""Prometheus export of `engine.metrics()` (prometheus-client is optional:
`pip install prometheus-client`).

    from prometheus_client import start_http_server
    kvflow.metrics.register_prometheus(engine)      # the default registry
    start_http_server(9400)

Metric names (labels peer, provider, op unless said):

| name | kind | what |
|---|---|---|
| kvflow_batches_total | counter | batches finished (succeeded or failed) |
| kvflow_bytes_total | counter | bytes of the batches that succeeded |
| kvflow_batch_failures_total | counter | failed batches |
| kvflow_failures_by_kind_total | counter | failed batches by kind (labels peer, provider, kind: ELOST, ECANCELLED, ...) |
| kvflow_batch_latency_seconds | histogram | submission to completion, succeeded batches (buckets: powers of two of us) |
| kvflow_moved_slices_total | counter | slices handed to another tcp connection when one failed (peer, provider) |
| kvflow_connection_failures_total | counter | tcp data connections or rdma QPs that failed (peer, provider) |
| kvflow_repairs_total | counter | tcp data connections rebuilt, rdma QPs brought back (peer, provider) |
| kvflow_connection_queued_slices, kvflow_connection_queued_bytes | gauge | per tcp data connection or rdma QP (labels peer, provider, connection): slices and bytes waiting for it |
| kvflow_connection_inflight_slices | gauge | per tcp data connection or rdma QP: slices sent and not acknowledged (tcp), work requests posted and not retired (rdma) |
| kvflow_peer_inflight_batches, kvflow_peer_inflight_bytes | gauge | batches submitted toward the peer and not finished (queued or on the wire), and their bytes |
| kvflow_inflight_batches, kvflow_inflight_slices | gauge | what is in flight now, the whole engine (no labels) |
| kvflow_receive_window_bytes, kvflow_receive_window_held_bytes | gauge | the receive window and what is granted of it |
| kvflow_receive_window_violations_bytes_total | counter | payload that landed without credit |
| kvflow_staging_slots, kvflow_staging_slots_in_use | gauge | per staging pool made (label pool): slots, in use now |
| kvflow_staging_slots_max_in_use | gauge | per staging pool (outgoing, inbox, relay_inbox): the most in use at once |
| kvflow_staging_leases | gauge | leases of an inbox's slots held now (label pool: inbox, relay_inbox) |

Every scrape reads the native counters at once; nothing is kept here.
The KVCache pool's own metrics: kvflow/store/metrics.py (docs/metrics.md).
"""
from __future__ import annotations

from typing import Any, Iterator

__all__ = ["EngineCollector", "register_prometheus", "summary"]


def _size(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{int(n)} B"


def summary(engine: Any, peer: str) -> str:
    """One line of what the engine's native counters saw toward `peer`
    (engine.metrics()): batches, bytes, failures, latency; what a bench or
    an example prints at its end."""
    m = engine.metrics()["peers"].get(peer)
    if m is None:
        return "metrics: none (the peer's channel is closed)"
    parts = []
    for op in ("write", "read"):
        s = m[op]
        if not s["batches"]:
            continue
        lat = "" if s["latency_mean_us"] is None else (
            f", latency mean {s['latency_mean_us']:.0f} us, p50 <{s['latency_p50_us']:.0f} us, "
            f"p99 <{s['latency_p99_us']:.0f} us")
        parts.append(f"{op} {s['batches']} batches, {_size(s['bytes'])}, {s['failed']} failed{lat}")
    failures = ", ".join(f"{k} {v}" for k, v in sorted(m["failures"].items()))
    return (f"metrics ({m['provider']}): " + ("; ".join(parts) or "no batches")
            + (f"; failures: {failures}" if failures else ""))


class EngineCollector:
    """A prometheus_client collector for one engine (several engines: one
    collector each, with a distinct `engine` label value)."""

    def __init__(self, engine: Any, name: str | None = None) -> None:
        self.engine = engine
        self.name = name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m = self.engine.metrics()
        extra = ["engine"] if self.name else []
        tag = [self.name] if self.name else []
        op_labels = extra + ["peer", "provider", "op"]
        batches = CounterMetricFamily("kvflow_batches", "batches finished", labels=op_labels)
        nbytes = CounterMetricFamily("kvflow_bytes", "bytes of the batches that succeeded", labels=op_labels)
        failed = CounterMetricFamily("kvflow_batch_failures", "failed batches", labels=op_labels)
        kinds = CounterMetricFamily("kvflow_failures_by_kind", "failed batches by kind",
                                    labels=extra + ["peer", "provider", "kind"])
        latency = HistogramMetricFamily("kvflow_batch_latency_seconds", "submission to completion",
                                        labels=op_labels)
        moved = CounterMetricFamily("kvflow_moved_slices", "slices moved to another tcp connection",
                                    labels=extra + ["peer", "provider"])
        conn_failures = CounterMetricFamily("kvflow_connection_failures",
                                            "tcp data connections or rdma QPs that failed",
                                            labels=extra + ["peer", "provider"])
        repairs = CounterMetricFamily("kvflow_repairs", "tcp data connections rebuilt, rdma QPs brought back",
                                      labels=extra + ["peer", "provider"])
        conn_labels = extra + ["peer", "provider", "connection"]
        c_slices = GaugeMetricFamily("kvflow_connection_queued_slices", "slices waiting for the connection",
                                     labels=conn_labels)
        c_bytes = GaugeMetricFamily("kvflow_connection_queued_bytes", "bytes waiting for the connection",
                                    labels=conn_labels)
        c_inflight = GaugeMetricFamily("kvflow_connection_inflight_slices",
                                       "slices on the connection, not acknowledged", labels=conn_labels)
        q_batches = GaugeMetricFamily("kvflow_peer_inflight_batches", "batches submitted, not finished",
                                      labels=op_labels)
        q_bytes = GaugeMetricFamily("kvflow_peer_inflight_bytes", "bytes of the batches submitted, not finished",
                                    labels=op_labels)
        for peer, pm in sorted(m["peers"].items()):
            for op in ("write", "read"):
                s = pm[op]
                labels = tag + [peer, pm["provider"], op]
                batches.add_metric(labels, s["batches"])
                q_batches.add_metric(labels, s["inflight_batches"])
                q_bytes.add_metric(labels, s["inflight_bytes"])
                nbytes.add_metric(labels, s["bytes"])
                failed.add_metric(labels, s["failed"])
                cumulative, buckets = 0, []
                for bound, n in s["latency_buckets"]:
                    cumulative += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e6), cumulative))
                mean = s["latency_mean_us"] or 0.0
                latency.add_metric(labels, buckets, sum_value=mean * cumulative / 1e6)
            for kind, n in sorted(pm["failures"].items()):
                kinds.add_metric(tag + [peer, pm["provider"], kind], n)
            moved.add_metric(tag + [peer, pm["provider"]], pm["moved_slices"])
            conn_failures.add_metric(tag + [peer, pm["provider"]], pm["connection_failures"])
            repairs.add_metric(tag + [peer, pm["provider"]], pm["repairs"])
            for c in pm["connections"]:
                labels = tag + [peer, pm["provider"], str(c["index"])]
                c_slices.add_metric(labels, c["queued_slices"])
                c_bytes.add_metric(labels, c["queued_bytes"])
                c_inflight.add_metric(labels, c["inflight_slices"])
        yield from (batches, nbytes, failed, kinds, latency, moved, conn_failures, repairs, q_batches, q_bytes,
                    c_slices, c_bytes, c_inflight)
        for key in ("batches", "slices"):
            g = GaugeMetricFamily(f"kvflow_inflight_{key}", f"{key} in flight now", labels=extra)
            g.add_metric(tag, m["inflight"][key])
            yield g
        rw = m["receive_window"]
        if rw is not None:
            for name, key, what in (("kvflow_receive_window_bytes", "window", "the receive window"),
                                    ("kvflow_receive_window_held_bytes", "held", "granted, not landed")):
                g = GaugeMetricFamily(name, what, labels=extra)
                g.add_metric(tag, rw[key])
                yield g
            c = CounterMetricFamily("kvflow_receive_window_violations_bytes", "payload landed without credit",
                                    labels=extra)
            c.add_metric(tag, rw["violations"])
            yield c
        yield from _staging(m["staging"], extra, tag)


def _staging(staging: dict[str, Any], extra: list[str], tag: list[str]) -> Iterator[Any]:
    """The staging pools' gauges (engine.staging_stats()), one sample per
    pool the engine has made."""
    from prometheus_client.core import GaugeMetricFamily

    labels = extra + ["pool"]
    families = {key: GaugeMetricFamily(name, what, labels=labels) for key, name, what in (
        ("slots", "kvflow_staging_slots", "host bounce slots in the pool"),
        ("in_use", "kvflow_staging_slots_in_use", "slots filled or lent now"),
        ("max_in_use", "kvflow_staging_slots_max_in_use", "the most slots in use at once"),
        ("leases", "kvflow_staging_leases", "leases of the inbox's slots held now"))}
    for pool, figures in sorted(staging.items()):
        if figures is None:
            continue
        for key, family in families.items():
            if key in figures:
                family.add_metric(tag + [pool], figures[key])
    yield from families.values()


def register_prometheus(engine: Any, registry: Any = None, name: str | None = None) -> EngineCollector:
    """Registers an EngineCollector for `engine` with `registry` (default:
    prometheus_client's) and returns it. ImportError without
    prometheus-client."""
    from prometheus_client import REGISTRY

    collector = EngineCollector(engine, name)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
