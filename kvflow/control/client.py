"""The initiator's side of a control connection: the handshake (dial) and
the session that follows (ControlSession): requests and their replies,
pushes from the peer (its regions, its descriptor), and noticing that the
peer is gone (kvflow.control.liveness: its kernel stopped answering, never
because it was slow)."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from kvflow.control.auth import NONCE_BYTES, check_proof, proof
from kvflow.control.descriptor import Descriptor
from kvflow.control.liveness import ReachWatch, keep_probing, look_interval
from kvflow.control.wire import clip, encode, field, read_message
from kvflow.errors import AuthenticationError, PeerLostError, PeerUnreachableError, ProtocolError
from kvflow.tasks import cancel_and_wait

__all__ = ["ControlSession", "dial"]

log = logging.getLogger("kvflow")


async def dial(address: str, host: str, port: int, *, secret: bytes | None, me: str, keepalive: float
               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Descriptor, bytes]:
    """Connects to the engine at `address` (host, port) and runs the
    handshake: (reader, writer, its descriptor, the session token). Raises
    PeerUnreachableError (nobody there, or not kvflow), AuthenticationError,
    ProtocolError; the connection is closed when it raises."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        raise PeerUnreachableError(f"cannot reach {address}: {e.strerror or e}", peer=address,
                                   errno=e.errno) from None
    try:
        desc, token = await _handshake(address, reader, writer, secret, me, keepalive)
    except BaseException:
        writer.close()
        raise
    return reader, writer, desc, token


async def _handshake(address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     secret: bytes | None, me: str, keepalive: float) -> tuple[Descriptor, bytes]:
    cnonce = os.urandom(NONCE_BYTES)
    writer.write(encode({"t": "hello", "nonce": cnonce, "address": me, "keepalive": keepalive}))
    try:
        ch = await read_message(reader)
        if ch["t"] == "error":
            raise ProtocolError(f"{address} refused the handshake: {ch.get('message')}", peer=address)
        if ch["t"] != "challenge":
            raise ProtocolError(f"{address}: expected challenge, got {ch['t']!r}", peer=address)
        snonce = field(ch, "nonce", bytes)
        if bool(ch.get("auth")) != bool(secret):
            raise AuthenticationError(
                f"{address}: " + ("the peer requires a secret and none was set" if ch.get("auth")
                                  else "a secret is set but the peer has none"), peer=address)
        if secret:
            try:
                check_proof(secret, b"server", cnonce, snonce, ch.get("proof"))
            except AuthenticationError:
                raise AuthenticationError(f"{address}: secret mismatch", peer=address) from None
        writer.write(encode({"t": "auth", "proof": proof(secret, b"client", snonce, cnonce) if secret else b""}))
        welcome = await read_message(reader)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise PeerUnreachableError(f"{address} closed the handshake ({e.__class__.__name__}); "
                                   "is it a kvflow engine?", peer=address) from None
    except ProtocolError as e:
        if e.peer is None:
            # The first reply was not a kvflow frame at all.
            raise PeerUnreachableError(f"{address} does not speak kvflow ({e})", peer=address) from None
        raise
    if welcome["t"] == "error":
        if welcome.get("code") == "auth":
            raise AuthenticationError(f"{address}: secret mismatch", peer=address)
        raise ProtocolError(f"{address} refused the handshake: {welcome.get('message')}", peer=address)
    if welcome["t"] != "welcome":
        raise ProtocolError(f"{address}: expected welcome, got {welcome['t']!r}", peer=address)
    token = field(welcome, "token", bytes)
    desc = Descriptor.from_wire(welcome.get("descriptor"))
    return desc, token


class ControlSession:
    """One peer's control connection, after the handshake. `on_regions(msg)`
    takes a "regions" push, `on_descriptor(desc)` a fresh descriptor;
    `replies` are the message types that answer a request() (matched by
    "rid"). `lost` is set once the connection ended; `on_ended()` runs
    then, and `on_lost()` after it unless the session was closed from here
    (close(): the caller knows)."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 replies: frozenset[str], on_regions: Callable[[dict[str, Any]], None],
                 on_descriptor: Callable[[Descriptor], None], on_ended: Callable[[], None],
                 on_lost: Callable[[], None]) -> None:
        self.address = address
        self._reader = reader
        self._writer = writer
        self._replies_types = replies
        self._on_regions = on_regions
        self._on_descriptor = on_descriptor
        self._on_ended = on_ended
        self._on_lost = on_lost
        self._rid = 0
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._on_unreachable: Callable[[], None] | None = None
        self._connecting = True
        self.lost = False
        self.unreachable = False      # it ended because the peer's host stopped answering

    # ------------------------------------------------------------ requests
    def send(self, msg: dict[str, Any]) -> None:
        # lost: the reader ended (the peer closed or vanished) though our end
        # may not be closing yet; a request sent now would never be answered
        if self.lost or self._writer.is_closing():
            raise PeerLostError(f"control connection to {self.address} is closed", peer=self.address)
        self._writer.write(encode(msg))

    async def drain(self) -> None:
        await self._writer.drain()

    async def request(self, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Sends a request and waits for the reply with the same "rid"
        (read by the session's one reader, which runs from listen() on:
        requests made while the peer is still connecting, and those of
        tasks started meanwhile, share it). Raises PeerLostError when the
        connection ends first; while connecting, ProtocolError for a
        malformed or unexpected reply."""
        self._rid += 1
        rid = self._rid
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        try:
            self.send({**msg, "rid": rid})
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(rid, None)

    # ------------------------------------------------------------ lifecycle
    def listen(self) -> None:
        """Starts the reader: pushes and replies are taken from now on
        (while connecting, a message the session does not expect fails
        the waiting requests with ProtocolError)."""
        loop = asyncio.get_running_loop()
        self._reader_task = loop.create_task(self._read())

    def start(self, keepalive: float, on_unreachable: Callable[[], None]) -> None:
        """The peer is in service: with keepalive > 0 the connection is
        watched (kvflow.control.liveness), and `on_unreachable()` runs, just
        before the session ends, when the peer's host has answered nothing
        for `keepalive` seconds. A peer that is only slow is never taken
        for gone, and nothing here needs this loop to run on time: no
        pings are sent."""
        self._connecting = False
        if keepalive:
            sock = self._writer.get_extra_info("socket")
            if sock is not None:
                keep_probing(sock, keepalive)
                self._on_unreachable = on_unreachable
                self._watch_task = asyncio.get_running_loop().create_task(
                    self._watch(ReachWatch(sock, keepalive)))

    def abort(self) -> None:
        """Drops the connection at once (ends the reader: the session is lost)."""
        self._writer.transport.abort()

    async def close(self) -> None:
        """Says bye and closes the connection. Idempotent."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        if not self._writer.is_closing():
            try:
                self._writer.write(encode({"t": "bye"}))
            except Exception:
                pass
            self._writer.close()
        await cancel_and_wait([self._reader_task])
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass

    def close_now(self) -> None:
        """Closes the connection without waiting (a peer that never came up)."""
        self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()

    async def _watch(self, watch: ReachWatch) -> None:
        interval = look_interval(watch.grace)
        while not self.lost:
            await asyncio.sleep(interval)
            if watch.look():
                log.warning("kvflow: peer %s answered nothing for %.3g s: its host is taken for gone",
                            self.address, watch.grace)
                self._ended_unreachable()
                self.abort()                       # ends _read → on_lost
                return

    def _ended_unreachable(self) -> None:
        if not self.unreachable:
            self.unreachable = True
            if self._on_unreachable is not None:
                self._on_unreachable()

    async def _read(self) -> None:
        error: Exception | None = None
        try:
            while True:
                msg = await read_message(self._reader)
                t = msg["t"]
                if t == "pong":
                    continue
                if t == "regions":
                    self._on_regions(msg)
                elif t == "descriptor":
                    self._on_descriptor(Descriptor.from_wire(msg.get("descriptor")))
                elif t in self._replies_types:
                    w = self._replies.get(msg.get("rid"))   # type: ignore[arg-type]
                    if w is not None and not w.done():
                        w.set_result(msg)
                elif t == "bye":
                    break
                elif self._connecting:
                    raise ProtocolError(f"{self.address}: unexpected {clip(t)} while connecting", peer=self.address)
                else:
                    raise ProtocolError(f"unexpected message {clip(t)} from {self.address}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except TimeoutError:
            # ETIMEDOUT from the kernel: its keepalive probes went unanswered
            self._ended_unreachable()
        except OSError:
            pass
        except (ProtocolError, ValueError, OverflowError) as e:
            if self._connecting and isinstance(e, ProtocolError):
                error = e if e.peer is not None else ProtocolError(f"{self.address}: {e}", peer=self.address)
            else:
                log.warning("kvflow: dropping control connection to %s: %s", self.address, e)
        except asyncio.CancelledError:
            return
        finally:
            self.lost = True
            for w in list(self._replies.values()):
                if not w.done():
                    w.set_exception(error or PeerLostError(f"peer {self.address} is gone", peer=self.address))
            self._on_ended()
        self._on_lost()
