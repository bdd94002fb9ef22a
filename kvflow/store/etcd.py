"""The master's etcd client: the v3 API through etcd's HTTP/JSON gateway
(what kvflow.metadata's EtcdStore speaks), on kept-alive connections.

kvflow.metadata.http opens one connection per request, which suits an
engine publishing a record every few seconds; the master writes on every
put commit, where a TCP handshake and teardown per request would double
the cost, so this client keeps a few HTTP/1.1 connections open and sends
one request at a time on each (no pipelining: the gateway answers in
order, but a timed-out request would leave its answer in the way).

Every request is bounded by `timeout`; anything that goes wrong (refused,
reset, silent, a gRPC error status, a malformed answer) is a
DurabilityError naming the server, never a hang.
"""
from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from kvflow.errors import InvalidArgumentError

from .errors import DurabilityError

__all__ = ["EtcdClient", "b64", "unb64", "prefix_end", "parse_address"]

MAX_ANSWER = 256 << 20       # a recovery range of a large index, in JSON and base64
GRPC_NOT_FOUND = 5
PAGE_BYTES = 4 << 20         # a recovery page's values, in base64 (range_prefix)


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with prefix."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"etcd address must be host:port, not {address!r}")
    return host, int(port)


class LeaseNotFound(DurabilityError):
    """gRPC NOT_FOUND: an unknown or expired lease."""


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """(status, body, whether the server keeps the connection)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if "content-length" in headers:
            n = int(headers["content-length"])
            if n > MAX_ANSWER:
                raise ValueError(f"answer of {n} bytes")
            body = await self.reader.readexactly(n)
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            parts, size = [], 0
            while True:
                n = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if n == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":
                        pass            # trailers
                    break
                size += n
                if size > MAX_ANSWER:
                    raise ValueError(f"answer over {MAX_ANSWER} bytes")
                parts.append((await self.reader.readexactly(n + 2))[:-2])
            body = b"".join(parts)
        else:
            raise ValueError("answer without a length")
        return status, body, headers.get("connection", "").lower() != "close"

    def close(self) -> None:
        self.writer.close()


class EtcdClient:
    """etcd at host:port. `timeout`: seconds per request (connect included)."""

    def __init__(self, address: str, *, timeout: float = 2.0, connections: int = 8) -> None:
        self.host, self.port = parse_address(address)
        self.address = f"{self.host}:{self.port}"
        self.timeout = timeout
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(connections)
        self.requests = 0

    def __repr__(self) -> str:
        return f"<EtcdClient {self.address}>"

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.address}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        async with self._slots:
            # a kept connection the server closed while idle fails at once:
            # one more try on a fresh one (every request here is idempotent)
            for attempt in (0, 1):
                reused = bool(self._idle)
                try:
                    async with asyncio.timeout(self.timeout):
                        conn = self._idle.pop() if reused else await self._open()
                        try:
                            status, raw, keep = await conn.exchange(request)
                        except BaseException:
                            conn.close()
                            raise
                except TimeoutError:
                    raise DurabilityError(f"etcd {self.address}: {path} got no answer within "
                                          f"{self.timeout:g} s") from None
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                        IndexError) as e:
                    if reused and attempt == 0:
                        continue
                    raise DurabilityError(f"etcd {self.address} unreachable: {e!r}") from None
                break
            self.requests += 1
            if keep:
                self._idle.append(conn)
            else:
                conn.close()
        try:
            doc = json.loads(raw.strip().split(b"\n", 1)[0] or b"{}")
        except ValueError:
            raise DurabilityError(f"etcd {self.address}: {path}: answer is not JSON (HTTP {status})") from None
        if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
            doc = doc["result"]                 # a stream's first message (lease keep-alive)
        elif isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            doc = doc["error"]
        if not isinstance(doc, dict):
            raise DurabilityError(f"etcd {self.address}: {path}: answer is not a JSON object")
        code = doc.get("code")
        if status == 200 and not code:
            return doc
        message = f"etcd {self.address}: {path}: {doc.get('message') or doc.get('error') or status}"
        raise (LeaseNotFound if code == GRPC_NOT_FOUND else DurabilityError)(message)

    async def _open(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return _Connection(reader, writer)

    # -- the calls the master makes ---------------------------------------------
    async def txn(self, compare: list, success: list, failure: list = ()) -> dict:
        return await self.post("/v3/kv/txn", {"compare": compare, "success": success, "failure": list(failure)})

    async def range_prefix(self, prefix: bytes, *, page: int = 5000, page_bytes: int = PAGE_BYTES) -> list[dict]:
        """Every kv under `prefix` ({key, value, create_revision,
        mod_revision}, decoded), read in pages at one revision: at most
        `page` keys, and about `page_bytes` of values. A master's records
        are up to 1 MiB each (15 KiB for a batch of 256 small objects):
        5,000 of them in one answer (80 MB of JSON at 1M objects) took the
        gateway longer than a request's timeout, so each page's key count
        is sized from the bytes per key seen so far, starting small."""
        out: list[dict] = []
        start, end, rev = prefix, prefix_end(prefix), 0
        limit, seen_keys, seen_bytes = min(page, 64), 0, 0
        while True:
            req: dict[str, Any] = {"key": b64(start), "range_end": b64(end), "limit": limit}
            if rev:
                req["revision"] = rev
            doc = await self.post("/v3/kv/range", req)
            rev = rev or int(doc.get("header", {}).get("revision", 0))
            kvs = doc.get("kvs") or []
            for kv in kvs:
                value = kv.get("value", "")
                seen_bytes += len(value) + len(kv["key"])
                out.append({"key": unb64(kv["key"]), "value": unb64(value),
                            "create_revision": int(kv.get("create_revision", 0)),
                            "mod_revision": int(kv.get("mod_revision", 0))})
            if not doc.get("more") or not kvs:
                return out
            seen_keys += len(kvs)
            limit = max(1, min(page, int(page_bytes * seen_keys / max(seen_bytes, 1))))
            start = out[-1]["key"] + b"\0"

    async def get(self, key: bytes) -> dict | None:
        doc = await self.post("/v3/kv/range", {"key": b64(key)})
        kvs = doc.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return {"key": key, "value": unb64(kv.get("value", "")),
                "create_revision": int(kv.get("create_revision", 0)), "lease": int(kv.get("lease", 0))}

    async def grant(self, ttl: int) -> int:
        doc = await self.post("/v3/lease/grant", {"TTL": max(1, int(ttl))})
        return int(doc["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL (0: it expired)."""
        doc = await self.post("/v3/lease/keepalive", {"ID": lease})
        return int(doc.get("TTL") or 0)

    async def revoke(self, lease: int) -> None:
        try:
            await self.post("/v3/lease/revoke", {"ID": lease})
        except LeaseNotFound:
            pass

    async def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
