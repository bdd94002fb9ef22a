"""Redis backend: a minimal RESP2 client over one asyncio stream.

Commands are serialised by a lock (one in flight): the store issues a few
commands per TTL period, so pipelining would buy nothing, and one reply per
request keeps resynchronisation trivial: any error mid-reply (timeout,
cancellation, garbage) drops the connection and the next command opens a
new one.
"""
from __future__ import annotations

import asyncio
from typing import Any

from kvflow.errors import AuthenticationError, PeerUnreachableError, ProtocolError
from kvflow.metadata.store import KEY_PREFIX, MAX_RECORD, STORE_TIMEOUT, MetadataStore

__all__ = ["RedisStore"]

MAX_ARRAY = 1 << 20
SCAN_COUNT = 256

# Delete the key only if it still holds our value: an engine that closes
# late must not take down the record of a successor under the same name.
_DELETE_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class _ServerError(Exception):
    """A `-ERR ...` reply: the stream is still in sync."""


def _command(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


async def _reply(reader: asyncio.StreamReader) -> Any:
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode(errors="replace")
    if kind == b"-":
        return _ServerError(rest.decode(errors="replace"))
    try:
        n = int(rest)
    except ValueError:
        raise ProtocolError(f"redis: malformed reply line {line[:60]!r}") from None
    if kind == b":":
        return n
    if kind == b"$":
        if n < 0:
            return None
        if n > MAX_RECORD:
            raise ProtocolError(f"redis: a {n}-byte value exceeds the record limit of {MAX_RECORD}")
        return (await reader.readexactly(n + 2))[:-2]
    if kind == b"*":
        if n < 0:
            return None
        if n > MAX_ARRAY:
            raise ProtocolError(f"redis: a {n}-element reply exceeds {MAX_ARRAY}")
        return [await _reply(reader) for _ in range(n)]
    raise ProtocolError(f"redis: unknown reply type {line[:60]!r}")


class RedisStore(MetadataStore):
    """Records are plain keys with a PX expiry; refresh is PEXPIRE (0 when
    the key is gone, so a server that restarted empty is noticed)."""

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout: float = STORE_TIMEOUT) -> None:
        self.url = f"redis://{host}:{port}/{db}"
        self.timeout = timeout
        self._host, self._port, self._db = host, port, db
        # AUTH [username] password (Redis 6 ACLs take the username)
        self._auth = (([username] if username else []) + [password]) if password is not None else []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._published: dict[str, bytes] = {}

    async def _open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        if self._auth:
            self._check("AUTH", await self._exchange(("AUTH", *self._auth)))
        if self._db:
            self._check("SELECT", await self._exchange(("SELECT", self._db)))

    async def _exchange(self, args: tuple[Any, ...]) -> Any:
        if self._writer is None:
            await self._open()
        assert self._reader is not None and self._writer is not None
        self._writer.write(_command(args))
        await self._writer.drain()
        return await _reply(self._reader)

    def _check(self, command: str, reply: Any) -> Any:
        if not isinstance(reply, _ServerError):
            return reply
        text = str(reply)
        if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise AuthenticationError(f"metadata server {self.url} refused us: {text}")
        if text.startswith(("LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN")):
            raise PeerUnreachableError(f"metadata server {self.url} is not ready: {text}")
        raise ProtocolError(f"metadata server {self.url}: {command} failed: {text}")

    async def _call(self, *args: Any) -> Any:
        async with self._lock:
            try:
                reply = await asyncio.wait_for(self._exchange_retrying(args), self.timeout)
            except asyncio.TimeoutError:
                self._drop()
                raise PeerUnreachableError(
                    f"metadata server {self.url} did not answer within {self.timeout:g} s") from None
            except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                self._drop()
                raise PeerUnreachableError(f"metadata server {self.url} unreachable: {e}",
                                           errno=getattr(e, "errno", None)) from None
            except BaseException:
                # a failed AUTH/SELECT, a malformed reply, or cancelled
                # mid-reply: the connection is unusable or out of step
                self._drop()
                raise
        return self._check(str(args[0]), reply)

    async def _exchange_retrying(self, args: tuple[Any, ...]) -> Any:
        # A kept connection may have died since its last use (the server
        # restarted, an idle timeout): one more try on a new connection, so
        # that this is not reported as the server being down. Every command
        # the store sends is idempotent, so a repeat is harmless.
        reused = self._writer is not None
        try:
            return await self._exchange(args)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
            self._drop()
            return await self._exchange(args)

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def publish(self, name: str, value: bytes, ttl: float) -> None:
        await self._call("SET", KEY_PREFIX + name, value, "PX", max(1, int(ttl * 1000)))
        self._published[name] = value

    async def refresh(self, name: str, ttl: float) -> bool:
        return await self._call("PEXPIRE", KEY_PREFIX + name, max(1, int(ttl * 1000))) == 1

    async def lookup(self, name: str) -> bytes | None:
        value = await self._call("GET", KEY_PREFIX + name)
        if value is not None and not isinstance(value, bytes):
            raise ProtocolError(f"metadata server {self.url}: GET returned {type(value).__name__}")
        return value

    async def list(self) -> dict[str, bytes]:
        keys: list[bytes] = []
        cursor = b"0"
        while True:
            reply = await self._call("SCAN", cursor, "MATCH", KEY_PREFIX + "*", "COUNT", SCAN_COUNT)
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], list)):
                raise ProtocolError(f"metadata server {self.url}: malformed SCAN reply")
            cursor, batch = reply
            keys.extend(k for k in batch if isinstance(k, bytes))
            if cursor == b"0":
                break
        keys = sorted(set(keys))
        if not keys:
            return {}
        values = await self._call("MGET", *keys)
        if not isinstance(values, list) or len(values) != len(keys):
            raise ProtocolError(f"metadata server {self.url}: malformed MGET reply")
        # A key that expired between SCAN and MGET comes back as None.
        return {k.decode(errors="replace")[len(KEY_PREFIX):]: v
                for k, v in zip(keys, values) if isinstance(v, bytes)}

    async def remove(self, name: str) -> None:
        value = self._published.pop(name, None)
        if value is not None:
            await self._call("EVAL", _DELETE_IF_SAME, 1, KEY_PREFIX + name, value)

    async def close(self) -> None:
        self._drop()
