"""The metadata store contract, the record an engine publishes, and the
factory that turns a metadata URL into a store.

A store only moves bytes under names (`kvflow/engines/<name>`), with a
time-to-live; what the bytes mean is `EngineRecord`'s business, so that a
backend is a few dozen lines of protocol and nothing else.
"""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import msgpack

from kvflow.errors import InvalidArgumentError, ProtocolError
from kvflow.control.wire import MAX_FRAME
from kvflow.control.descriptor import Descriptor

__all__ = ["KEY_PREFIX", "RECORD_VERSION", "STORE_TIMEOUT", "EngineRecord", "MetadataStore", "open_store"]

KEY_PREFIX = "kvflow/engines/"
RECORD_VERSION = 1
# Bound on one store operation (connect included): a metadata server that is
# down or black-holed costs a caller this long, never a hang.
STORE_TIMEOUT = 2.0
MAX_RECORD = MAX_FRAME           # a record holds one descriptor
_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")


@dataclass(frozen=True)
class EngineRecord:
    """What an engine publishes about itself. Only `address` is used to
    connect: the descriptor here is informational (listing, placement); the
    one from the handshake is authoritative for transfers."""

    name: str
    address: str
    incarnation: int
    descriptor: Descriptor

    def to_bytes(self) -> bytes:
        # "v" first so that a future layout can be told apart before the rest
        # is looked at; the name is the key and is not repeated.
        return msgpack.packb({"v": RECORD_VERSION, "address": self.address,
                              "incarnation": self.incarnation,
                              "descriptor": self.descriptor.to_wire()}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, name: str, data: bytes) -> "EngineRecord":
        """Raises ProtocolError for anything that is not a well-formed record."""
        if len(data) > MAX_RECORD:
            raise ProtocolError(f"metadata record {name!r}: {len(data)} bytes exceeds {MAX_RECORD}", peer=name)
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types
            raise ProtocolError(f"metadata record {name!r} is not msgpack: {e}", peer=name) from None
        if not isinstance(d, dict) or d.get("v", RECORD_VERSION) != RECORD_VERSION:
            raise ProtocolError(f"metadata record {name!r} is not a kvflow engine record "
                                f"(version {RECORD_VERSION})", peer=name)
        address, incarnation = d.get("address"), d.get("incarnation")
        if not isinstance(address, str) or not isinstance(incarnation, int) or isinstance(incarnation, bool):
            raise ProtocolError(f"metadata record {name!r}: address or incarnation missing or malformed",
                                peer=name)
        try:
            desc = Descriptor.from_wire(d.get("descriptor"))
        except ProtocolError as e:
            raise ProtocolError(f"metadata record {name!r}: {e}", peer=name) from None
        if desc.address != address or desc.incarnation != incarnation:
            raise ProtocolError(f"metadata record {name!r}: its descriptor is of another engine", peer=name)
        return cls(name, address, incarnation, desc)


class MetadataStore(abc.ABC):
    """One backend (Redis, etcd). Every method is bounded by `timeout`
    seconds and raises PeerUnreachableError when the server cannot be
    reached or does not answer in time, AuthenticationError when it refuses
    our credentials, ProtocolError when it answers something malformed.
    Values are opaque bytes; names are without KEY_PREFIX."""

    url: str
    timeout: float

    @abc.abstractmethod
    async def publish(self, name: str, value: bytes, ttl: float) -> None:
        """Stores `value` under `name`; it expires `ttl` s after the last
        publish or refresh."""

    @abc.abstractmethod
    async def refresh(self, name: str, ttl: float) -> bool:
        """Extends the life of what this store published under `name`;
        False when it is gone (expired, deleted, server restarted empty) and
        must be published again."""

    @abc.abstractmethod
    async def lookup(self, name: str) -> bytes | None:
        """The value under `name`, None when there is none."""

    @abc.abstractmethod
    async def list(self) -> dict[str, bytes]:
        """Every published name and value."""

    @abc.abstractmethod
    async def remove(self, name: str) -> None:
        """Deletes `name` if it still holds what this store published (a
        successor that took the name over keeps it)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections. Idempotent; does not remove anything."""

    def __repr__(self) -> str:
        return f"<kvflow.metadata.{type(self).__name__} {self.url}>"


def check_name(name: str) -> str:
    """Raises InvalidArgumentError for a name that cannot be a key."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"engine name {name!r}: 1..200 characters, no white space or control characters")
    return name


def open_store(url: str, *, timeout: float = STORE_TIMEOUT) -> MetadataStore | None:
    """The store for a metadata URL: None or "p2p" (no store), "redis://
    [[user]:password@]host:port[/db]", "etcd://host:port", or
    "http://host:port[/path]" (Mooncake's HTTP metadata server; path
    default /metadata). Opens nothing yet. Raises InvalidArgumentError for
    anything else."""
    if url is None or url == "p2p":
        return None
    if not isinstance(url, str):
        raise InvalidArgumentError(f"metadata must be None, 'p2p' or a URL, not {url!r}")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise InvalidArgumentError(f"metadata URL {url!r}: {e}") from None
    if parts.scheme not in ("redis", "etcd", "http") or not host or port is None or parts.query or \
            parts.fragment:
        raise InvalidArgumentError(
            f"metadata URL {url!r}: expected 'p2p', 'redis://host:port[/db]', 'etcd://host:port' or "
            "'http://host:port[/path]'")
    if parts.scheme == "http":
        if parts.username or parts.password:
            raise InvalidArgumentError(f"metadata URL {url!r}: the HTTP metadata server takes no credentials")
        from kvflow.metadata.http_store import HttpStore
        return HttpStore(host, port, parts.path or "/metadata", timeout=timeout)
    if parts.scheme == "redis":
        from kvflow.metadata.redis_store import RedisStore
        db_text = parts.path.lstrip("/")
        if db_text and not db_text.isdigit():
            raise InvalidArgumentError(f"metadata URL {url!r}: the database must be a number")
        return RedisStore(host, port, db=int(db_text or 0),
                          username=unquote(parts.username) if parts.username else None,
                          password=unquote(parts.password) if parts.password is not None else None,
                          timeout=timeout)
    if parts.path not in ("", "/") or parts.username or parts.password:
        raise InvalidArgumentError(f"metadata URL {url!r}: etcd takes no path or credentials here")
    from kvflow.metadata.etcd_store import EtcdStore
    return EtcdStore(host, port, timeout=timeout)

