"""Mooncake's HTTP metadata protocol as a kvflow store: the key-value
server of Mooncake's `mooncake_http_metadata_server` (mooncake/
http_metadata_server.py) and of `mooncake_master
--enable_http_metadata_server`: GET, PUT and DELETE on `<path>?key=<key>`,
raw bytes as values.

The protocol has no expiry and no listing. So a record stays until it is
removed (an engine that dies without close() leaves its record behind, as
Mooncake's own engines do; the next engine of that name overwrites it);
refresh() checks that what this store published is still there and is
published again otherwise (a restarted, empty server); remove() deletes the
record only while it still holds what this store published; list() raises.
"""
from __future__ import annotations

from urllib.parse import quote

from kvflow.errors import KVFlowError, PeerUnreachableError, ProtocolError
from kvflow.metadata import http
from kvflow.metadata.store import KEY_PREFIX, MAX_RECORD, STORE_TIMEOUT, MetadataStore

__all__ = ["HttpStore"]


class HttpStore(MetadataStore):
    def __init__(self, host: str, port: int, path: str = "/metadata", *,
                 timeout: float = STORE_TIMEOUT) -> None:
        self._host, self._port, self._path = host, port, path or "/metadata"
        self.url = f"http://{host}:{port}{self._path}"
        self.timeout = timeout
        self._published: dict[str, bytes] = {}

    async def _call(self, method: str, name: str, payload: bytes = b"") -> http.HttpReply:
        target = f"{self._path}?key={quote(KEY_PREFIX + name, safe='')}"
        reply = await http.request(self._host, self._port, method, target, payload, url=self.url,
                                   timeout=self.timeout, limit=MAX_RECORD + (64 << 10))
        if reply.status >= 500:
            raise PeerUnreachableError(f"metadata server {self.url}: {method} answered HTTP {reply.status}")
        if reply.status not in (200, 404):
            raise ProtocolError(f"metadata server {self.url}: {method} {name!r} answered HTTP {reply.status}: "
                                f"{reply.body[:200].decode('utf-8', 'replace')}")
        return reply

    async def publish(self, name: str, value: bytes, ttl: float) -> None:
        reply = await self._call("PUT", name, value)
        if reply.status != 200:
            raise ProtocolError(f"metadata server {self.url}: PUT {name!r} answered HTTP {reply.status}")
        self._published[name] = value

    async def refresh(self, name: str, ttl: float) -> bool:
        mine = self._published.get(name)
        return mine is not None and await self.lookup(name) == mine

    async def lookup(self, name: str) -> bytes | None:
        reply = await self._call("GET", name)
        return reply.body if reply.status == 200 else None

    async def list(self) -> dict[str, bytes]:
        raise KVFlowError(f"metadata server {self.url}: Mooncake's HTTP metadata protocol cannot list "
                          "its keys (look names up one by one)")

    async def remove(self, name: str) -> None:
        mine = self._published.pop(name, None)
        if mine is not None and await self.lookup(name) == mine:
            await self._call("DELETE", name)

    async def close(self) -> None:
        pass                    # no connection outlives a request
