"""Mooncake's HTTP metadata server, the one `mooncake_master
--enable_http_metadata_server` and `mooncake_http_metadata_server` run:
GET, PUT and DELETE on `/metadata?key=<key>`, raw bytes as values, kept in
memory (a restart starts empty, as Mooncake's does).

The answers are Mooncake's (mooncake/http_metadata_server.py): 200 with the
value, 404 "metadata not found", 400 without a key or for a second PUT of a
key holding "rpc_meta" (Mooncake refuses to overwrite a transfer engine's
RPC record), 405 for another method. kvflow's own client of the protocol
is kvflow.metadata.http_store.HttpStore.

Runs on the caller's event loop: the compat master serves it beside the
store master, one loop, no thread."""
from __future__ import annotations

import asyncio
import logging
import sys
from urllib.parse import parse_qs, urlsplit

__all__ = ["HttpMetadataServer"]

log = logging.getLogger("kvflow.compat.mooncake")

MAX_HEAD = 64 << 10
MAX_BODY = 64 << 20         # a transfer engine's record is a few KiB; a bound keeps one client from filling memory
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large"}


class HttpMetadataServer:
    """`async with HttpMetadataServer(host, port) as s:` serves until closed;
    `s.port` is the port bound (port 0 picks one), `s.store` the records."""

    def __init__(self, host: str = "0.0.0.0", port: int = 8080) -> None:
        self.host, self.port = host, port
        self.store: dict[str, bytes] = {}
        self._server: asyncio.base_events.Server | None = None

    def __repr__(self) -> str:
        state = "serving" if self._server is not None else "closed"
        return f"<HttpMetadataServer {self.host}:{self.port} {state} {len(self.store)} keys>"

    async def start(self) -> None:
        """Listens. Raises OSError when the address is taken."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def __aenter__(self) -> HttpMetadataServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def answer(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        """One request's status and body (no I/O: the whole protocol)."""
        url = urlsplit(target)
        if url.path.rstrip("/") != "/metadata":
            return 404, b"not found"
        key = parse_qs(url.query, keep_blank_values=True).get("key", [""])[0].strip()
        if not key:
            return 400, b"metadata key is required"
        if method == "GET":
            value = self.store.get(key)
            return (404, b"metadata not found") if value is None else (200, value)
        if method == "PUT":
            if "rpc_meta" in key and key in self.store:
                return 400, b"Duplicate rpc_meta key not allowed"
            self.store[key] = body
            return 200, b"metadata updated"
        if method == "DELETE":
            if self.store.pop(key, None) is None:
                return 404, b"metadata not found"
            return 200, b"metadata deleted"
        return 405, b"Method not allowed"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # HTTP/1.1 with keep-alive: one request after another on the
        # connection until the client closes it or asks to
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                if len(head) > MAX_HEAD:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, *_ = lines[0].split(" ") + ["", ""]
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY:
                    status, body = 413, b"too large"
                    close = True
                else:
                    payload = await reader.readexactly(length) if length else b""
                    status, body = self.answer(method, target, payload)
                    close = headers.get("connection", "").lower() == "close"
                extra = "Connection: close\r\n" if close else ""
                writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n{extra}\r\n".encode("latin-1") + body)
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as e:
            log.debug("kvflow.compat.mooncake: HTTP metadata server: %s", e)
        finally:
            writer.close()


def main(argv: list[str] | None = None) -> int:
    """`mooncake_http_metadata_server [--host H] [--port P]`: serves until
    SIGINT/SIGTERM."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="mooncake_http_metadata_server (kvflow)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    args = p.parse_args(argv)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with HttpMetadataServer(args.host, args.port) as server:
            print(f"kvflow HTTP metadata server ready on http://{args.host}:{server.port}/metadata", flush=True)
            await stop.wait()

    try:
        asyncio.run(serve())
    except OSError as e:
        print(f"mooncake_http_metadata_server (kvflow): {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
