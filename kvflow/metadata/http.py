"""A minimal HTTP/1.1 client over asyncio streams, for the metadata stores
that speak HTTP (etcd's JSON gateway, Mooncake's HTTP metadata server): one
request per connection, `Connection: close`, the body read to the end,
chunked bodies decoded. No HTTP library: a few methods on small bodies."""
from __future__ import annotations

import asyncio

from kvflow.errors import PeerUnreachableError, ProtocolError

__all__ = ["HttpReply", "request"]


class HttpReply:
    """A response: status, lower-case headers, the body (de-chunked)."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def _dechunk(body: bytes, url: str) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.find(b"\r\n", pos)
        try:
            size = int(body[pos:eol].split(b";")[0], 16)
        except ValueError:
            raise ProtocolError(f"metadata server {url}: malformed chunked body") from None
        if size == 0 or eol < 0:
            return bytes(out)            # trailers (grpc-gateway sends some) are ignored
        out += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def parse(raw: bytes, url: str) -> HttpReply:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ProtocolError(f"metadata server {url}: truncated HTTP response")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise ProtocolError(f"metadata server {url}: not an HTTP response: {lines[0][:60]!r}") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body, url)
    return HttpReply(status, headers, body)


async def _exchange(host: str, port: int, head: bytes, payload: bytes, url: str, limit: int) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + payload)
        await writer.drain()
        chunks, size = [], 0
        while chunk := await reader.read(1 << 16):
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"metadata server {url}: answer exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


async def request(host: str, port: int, method: str, target: str, payload: bytes = b"", *,
                  url: str, timeout: float, limit: int,
                  content_type: str = "application/octet-stream") -> HttpReply:
    """One request to host:port (target: the path and query). Raises
    PeerUnreachableError when the server cannot be reached or does not
    answer within `timeout` s, ProtocolError for a malformed or too large
    answer (over `limit` bytes)."""
    head = (f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    try:
        raw = await asyncio.wait_for(_exchange(host, port, head, payload, url, limit), timeout)
    except asyncio.TimeoutError:
        raise PeerUnreachableError(f"metadata server {url} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise PeerUnreachableError(f"metadata server {url} unreachable: {e}", errno=e.errno) from None
    return parse(raw, url)
