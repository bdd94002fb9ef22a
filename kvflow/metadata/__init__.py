"""Cluster metadata: where engines publish their records and find each
other by name (Redis, etcd, or Mooncake's HTTP metadata server), besides
peer-to-peer handshakes.

`Engine(metadata="redis://host:port[/db]" | "etcd://host:port" |
"http://host:port[/path]", name=...,
metadata_ttl=...)` publishes `kvflow/engines/<name>` and resolves names in
`connect()`; this package holds the record format (`EngineRecord`), the
backend contract (`MetadataStore`) and one class per backend. Nothing here
imports more than the standard library and msgpack.
"""
from kvflow.metadata.client import MetadataClient
from kvflow.metadata.store import KEY_PREFIX, STORE_TIMEOUT, EngineRecord, MetadataStore, check_name, open_store

__all__ = ["KEY_PREFIX", "STORE_TIMEOUT", "EngineRecord", "MetadataClient", "MetadataStore", "check_name",
           "open_store"]
