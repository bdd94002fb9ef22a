"""Prometheus metrics of a KVManager (optional: needs prometheus-client).

    from prometheus_client import REGISTRY, start_http_server
    from kvflow.connector.prometheus import register
    register(manager)            # read at scrape time, nothing to update
    start_http_server(9100)

Series (label `peer` = the other side's engine address, `role` = prefill or
decode): kvflow_connector_bytes_total, kvflow_connector_requests_total,
kvflow_connector_failures_total, kvflow_connector_latency_seconds_total
(divide by requests for the mean transfer latency).
"""
from __future__ import annotations

from typing import Any, Iterator

from kvflow.connector.manager import KVManager


class ManagerCollector:
    """A prometheus_client collector over KVManager.metrics()."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily
        role = self.manager.mode.value
        families = {
            "bytes": CounterMetricFamily("kvflow_connector_bytes", "KV bytes moved", labels=["role", "peer"]),
            "requests": CounterMetricFamily("kvflow_connector_requests", "requests transferred",
                                            labels=["role", "peer"]),
            "failures": CounterMetricFamily("kvflow_connector_failures", "requests failed", labels=["role", "peer"]),
            "latency": CounterMetricFamily("kvflow_connector_latency_seconds", "sum of transfer latencies",
                                           labels=["role", "peer"]),
        }
        if self.manager.closed:
            return iter(families.values())
        for peer, m in self.manager.metrics().items():
            families["bytes"].add_metric([role, peer], m["bytes"])
            families["requests"].add_metric([role, peer], m["requests"])
            families["failures"].add_metric([role, peer], m["failures"])
            families["latency"].add_metric([role, peer], m["latency_s"])
        return iter(families.values())


def register(manager: KVManager, registry: Any = None) -> ManagerCollector:
    """Registers the manager's metrics with `registry` (default: the global one)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    collector = ManagerCollector(manager)
    registry.register(collector)
    return collector
