"""etcd backend: the v3 API through etcd's HTTP/JSON gateway (five POST
endpoints, one request per connection: kvflow.metadata.http).

A record is a key attached to a lease of ceil(ttl) seconds (etcd leases are
whole seconds); refresh is one lease keep-alive plus a count of the key, so
that both an expired lease and a key deleted under a live lease (a server
restarted from an empty data dir, an operator's delete) lead to a fresh
publish. remove() revokes the lease, which deletes exactly the keys this
store attached to it and never a successor's record.

The gateway speaks JSON with int64 as strings and bytes as base64; gRPC
status codes arrive in an error body, {"error", "code"}.
"""
from __future__ import annotations

import base64
import json
import math
from typing import Any

from kvflow.errors import AuthenticationError, KVFlowError, PeerUnreachableError, ProtocolError
from kvflow.metadata import http
from kvflow.metadata.http import HttpReply
from kvflow.metadata.store import KEY_PREFIX, MAX_RECORD, STORE_TIMEOUT, MetadataStore

__all__ = ["EtcdStore"]

MAX_RESPONSE = 2 * MAX_RECORD + (1 << 20)    # base64 of a full record, plus JSON around it
# gRPC status codes (google.golang.org/grpc/codes) the gateway reports.
GRPC_DEADLINE, GRPC_NOT_FOUND, GRPC_PERMISSION, GRPC_UNAVAILABLE, GRPC_UNAUTHENTICATED = 4, 5, 7, 14, 16


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with prefix."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _NotFound(KVFlowError):
    """gRPC NOT_FOUND (an unknown or expired lease)."""


def _decode_body(reply: HttpReply, url: str) -> tuple[int, Any]:
    # A streaming endpoint (lease keep-alive) answers newline-delimited
    # messages; we send one request and read the first answer.
    first = reply.body.strip().split(b"\n", 1)[0]
    try:
        doc = json.loads(first) if first else {}
    except ValueError:
        raise ProtocolError(f"metadata server {url}: answer is not JSON (HTTP {reply.status})") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"metadata server {url}: answer is not a JSON object (HTTP {reply.status})")
    return reply.status, doc


class EtcdStore(MetadataStore):
    """One lease per store (one store per engine)."""

    def __init__(self, host: str, port: int, *, timeout: float = STORE_TIMEOUT) -> None:
        self.url = f"etcd://{host}:{port}"
        self.timeout = timeout
        self._host, self._port = host, port
        self._lease: str | None = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await http.request(self._host, self._port, "POST", path, json.dumps(body).encode(),
                                   url=self.url, timeout=self.timeout, limit=MAX_RESPONSE,
                                   content_type="application/json")
        status, doc = _decode_body(reply, self.url)
        if "result" in doc and isinstance(doc["result"], dict):
            doc = doc["result"]
        elif "error" in doc and isinstance(doc["error"], dict):     # a stream's error
            doc = doc["error"]
        code = doc.get("code")
        if status == 200 and not code:
            return doc
        message = f"metadata server {self.url}: {path}: {doc.get('message') or doc.get('error') or status}"
        if code == GRPC_NOT_FOUND:
            raise _NotFound(message)
        if code in (GRPC_UNAUTHENTICATED, GRPC_PERMISSION) or status == 401:
            raise AuthenticationError(message)
        if code in (GRPC_DEADLINE, GRPC_UNAVAILABLE) or status >= 500:
            raise PeerUnreachableError(message)
        raise ProtocolError(message)

    async def _grant(self, ttl: float) -> str:
        doc = await self._post("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        lease = doc.get("ID")
        if not isinstance(lease, (str, int)) or not str(lease).isdigit():
            raise ProtocolError(f"metadata server {self.url}: lease grant without an ID")
        return str(lease)

    async def publish(self, name: str, value: bytes, ttl: float) -> None:
        if self._lease is None:
            self._lease = await self._grant(ttl)
        put = {"key": _b64((KEY_PREFIX + name).encode()), "value": _b64(value)}
        try:
            await self._post("/v3/kv/put", {**put, "lease": self._lease})
        except _NotFound:        # the lease expired (or the server lost it): take a new one
            self._lease = await self._grant(ttl)
            await self._post("/v3/kv/put", {**put, "lease": self._lease})

    async def refresh(self, name: str, ttl: float) -> bool:
        if self._lease is None:
            return False
        try:
            doc = await self._post("/v3/lease/keepalive", {"ID": self._lease})
        except _NotFound:
            doc = {}
        if int(doc.get("TTL") or 0) <= 0:       # expired or unknown: its keys are gone
            self._lease = None
            return False
        doc = await self._post("/v3/kv/range", {"key": _b64((KEY_PREFIX + name).encode()), "count_only": True})
        return int(doc.get("count") or 0) > 0

    def _values(self, doc: dict[str, Any]) -> dict[str, bytes]:
        out = {}
        kvs = doc.get("kvs") or []
        if not isinstance(kvs, list):
            raise ProtocolError(f"metadata server {self.url}: malformed range answer")
        for kv in kvs:
            try:
                key = base64.b64decode(kv["key"]).decode()
                out[key[len(KEY_PREFIX):]] = base64.b64decode(kv.get("value", ""))
            except (KeyError, TypeError, ValueError):
                raise ProtocolError(f"metadata server {self.url}: malformed key or value in a range answer") \
                    from None
        return out

    async def lookup(self, name: str) -> bytes | None:
        doc = await self._post("/v3/kv/range", {"key": _b64((KEY_PREFIX + name).encode())})
        return self._values(doc).get(name)

    async def list(self) -> dict[str, bytes]:
        prefix = KEY_PREFIX.encode()
        doc = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        return self._values(doc)

    async def remove(self, name: str) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await self._post("/v3/lease/revoke", {"ID": lease})
            except _NotFound:
                pass            # expired already: nothing left to delete

    async def close(self) -> None:
        pass                    # no connection outlives a request
