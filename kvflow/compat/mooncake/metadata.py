"""Mooncake's metadata-server argument and segment names, mapped onto
kvflow's metadata stores (kvflow.metadata).

Mooncake's initialize() takes "P2PHANDSHAKE" (no server: a segment name is
the peer's "host:rpc_port"), "http://host:port/path" (its HTTP metadata
server), "etcd://host:port", "redis://host:port", or a bare "host:port",
which means etcd. With a server, a segment is named by the peer's
local_hostname as given to its initialize() ("10.0.0.2:12345", "node-7"),
and the name is looked up there. kvflow publishes each engine under a key
of its own made from that name (`segment_key`): kvflow's engine names are
never of the form host:port, which its connect() takes for an address."""
from __future__ import annotations

from urllib.parse import quote

from kvflow.compat.mooncake.codes import P2PHANDSHAKE
from kvflow.errors import InvalidArgumentError

# initialize_ext's metadata_type, Mooncake's names
METADATA_TYPES = ("etcd", "redis", "http")
SEGMENT_PREFIX = "mooncake-segment-"


def metadata_url(metadata_server: str, metadata_type: str | None = None) -> str | None:
    """kvflow's metadata URL for Mooncake's argument (None: P2PHANDSHAKE).
    Raises InvalidArgumentError for what kvflow cannot serve."""
    if not isinstance(metadata_server, str) or not metadata_server:
        raise InvalidArgumentError(f"metadata server {metadata_server!r}: expected {P2PHANDSHAKE!r}, "
                                   "http://host:port/path, etcd://host:port, redis://host:port or host:port")
    if metadata_server == P2PHANDSHAKE:
        return None
    scheme, sep, rest = metadata_server.partition("://")
    if not sep:
        scheme, rest = metadata_type or "etcd", metadata_server       # Mooncake's default: etcd
    elif metadata_type and metadata_type != scheme:
        raise InvalidArgumentError(f"metadata server {metadata_server!r} is not of type {metadata_type!r}")
    if scheme not in METADATA_TYPES:
        raise InvalidArgumentError(f"metadata server {metadata_server!r}: kvflow serves "
                                   f"{', '.join(METADATA_TYPES)} and {P2PHANDSHAKE!r}")
    if scheme == "etcd" and ("," in rest or ";" in rest):
        raise InvalidArgumentError(f"metadata server {metadata_server!r}: kvflow takes one etcd endpoint")
    return f"{scheme}://{rest}"


def segment_key(segment: str) -> str:
    """The kvflow engine name a Mooncake segment is published under."""
    return SEGMENT_PREFIX + quote(segment, safe="")
