"""The handshake server: the target side of every control connection.

A client says hello (its nonce, address and keepalive), gets a challenge,
proves the shared secret (when there is one: kvflow.control.auth), and is
welcomed with a session token (the native core accepts data connections
that show it) and this engine's descriptor. The session then carries
pings, notifications, descriptor requests and providers' own messages
(rdma_connect) until the client says bye, its host stops answering for
longer than its keepalive (kvflow.control.liveness: the kernel's view; a
client that is only slow or stopped keeps its session), or it sends
something malformed: then it is dropped, and the server stays up.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
from typing import Any, Awaitable, Callable

from kvflow.control.auth import NONCE_BYTES, check_proof, proof
from kvflow.control.descriptor import Descriptor
from kvflow.control.liveness import ReachWatch, keep_probing, look_interval
from kvflow.control.wire import clip, encode, field, read_message
from kvflow.errors import AuthenticationError, ProtocolError
from kvflow.tasks import cancel_and_wait

__all__ = ["HANDSHAKE_TIMEOUT", "MAX_KEEPALIVE", "MIN_KEEPALIVE", "PRE_AUTH_FRAME", "SESSION_BUFFER_LIMIT",
           "ControlServer"]

log = logging.getLogger("kvflow")

HANDSHAKE_TIMEOUT = 10.0
MIN_KEEPALIVE, MAX_KEEPALIVE = 0.05, 3600.0
PRE_AUTH_FRAME = 64 << 10          # hello and auth frames are small
SESSION_BUFFER_LIMIT = 64 << 20    # unread control data after which a session is dropped

# handler(peer address, session, message) -> the reply (sent with the request's
# "rid"), an awaitable of it (sent when done, while the session reads on), or
# None (a message that wants no answer)
Handler = Callable[[str, Any, dict[str, Any]], "dict[str, Any] | Awaitable[dict[str, Any]] | None"]


class ControlServer:
    """Serves control sessions for one engine. `describe()` is the
    engine's descriptor now; `add_token`/`remove_token` tell the native
    core which session tokens data connections may show; `deliver(peer,
    data)` takes a notification; `handlers` answer providers' messages by
    type; `drop_session(session)` is called when a session ends (providers
    drop what they made for it)."""

    def __init__(self, *, secret: bytes | None, describe: Callable[[], Descriptor],
                 add_token: Callable[[bytes], Any], remove_token: Callable[[bytes], Any],
                 deliver: Callable[[str, bytes], None], handlers: dict[str, Handler],
                 drop_session: Callable[[Any], None]) -> None:
        self._secret = secret
        self._describe = describe
        self._add_token = add_token
        self._remove_token = remove_token
        self._deliver = deliver
        self.handlers = handlers          # message type -> handler; the engine fills it once its providers run
        self._drop_session = drop_session
        self._server: asyncio.base_events.Server | None = None
        self.sessions: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port; returns the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stops listening and ends every session."""
        if self._server is not None:
            self._server.close()
        for w in list(self.sessions):
            w.close()
        await cancel_and_wait(list(self._tasks))

    def push(self, frame: bytes) -> None:
        """Sends `frame` to every session; one whose peer stopped reading
        (more than SESSION_BUFFER_LIMIT unread) is dropped instead."""
        for w in list(self.sessions):
            if w.is_closing():
                continue
            if w.transport.get_write_buffer_size() > SESSION_BUFFER_LIMIT:
                log.warning("kvflow: dropping a control session that does not read its updates")
                w.close()
                continue
            w.write(frame)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        token = b""
        try:
            welcomed = await self._welcome(reader, writer)
            if welcomed is None:
                return
            token, peer_addr, silence = welcomed
            self.sessions.add(writer)
            await self._session(reader, writer, peer_addr, silence)
        except ProtocolError as e:
            log.info("kvflow: dropping control connection: %s", e)
            try:
                writer.write(encode({"t": "error", "code": "protocol", "message": str(e)}))
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            self.sessions.discard(writer)
            self._drop_session(writer)
            if token:
                self._remove_token(token)
            writer.close()

    def _answer_later(self, writer: asyncio.StreamWriter, rid: Any, reply: Awaitable[dict[str, Any]]) -> None:
        async def answer() -> None:
            try:
                out = await reply
            except ProtocolError as e:
                out = {"t": "error", "code": "protocol", "message": str(e)}
            except Exception as e:             # the handler failed: say so, the session stays
                log.warning("kvflow: a control handler failed: %s", e)
                out = {"t": "error", "code": "internal", "message": f"{type(e).__name__}: {e}"}
            if not writer.is_closing():
                writer.write(encode({**out, "rid": rid}))

        task = asyncio.get_running_loop().create_task(answer())
        self._tasks.add(task)     # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)   # type: ignore[arg-type]

    async def _welcome(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                       ) -> tuple[bytes, str, float | None] | None:
        """The handshake: (session token, the client's address, the silence
        after which it is gone), or None when its proof failed (told so)."""
        hello = await asyncio.wait_for(read_message(reader, max_size=PRE_AUTH_FRAME), HANDSHAKE_TIMEOUT)
        if hello["t"] != "hello":
            raise ProtocolError(f"expected hello, got {clip(hello['t'])}")
        cnonce = field(hello, "nonce", bytes)
        peer_addr = field(hello, "address", str)
        if len(cnonce) != NONCE_BYTES:
            raise ProtocolError("hello: bad nonce")
        snonce = os.urandom(NONCE_BYTES)
        sproof = proof(self._secret, b"server", cnonce, snonce) if self._secret else b""
        writer.write(encode({"t": "challenge", "nonce": snonce, "auth": bool(self._secret), "proof": sproof}))
        auth = await asyncio.wait_for(read_message(reader, max_size=PRE_AUTH_FRAME), HANDSHAKE_TIMEOUT)
        if auth["t"] != "auth":
            raise ProtocolError(f"expected auth, got {auth['t']!r}")
        if self._secret:
            try:
                check_proof(self._secret, b"client", snonce, cnonce, auth.get("proof"))
            except AuthenticationError:
                writer.write(encode({"t": "error", "code": "auth", "message": "secret mismatch"}))
                await writer.drain()
                log.warning("kvflow: %s failed authentication", peer_addr)
                return None
        token = os.urandom(16)
        self._add_token(token)
        writer.write(encode({"t": "welcome", "token": token, "descriptor": self._describe().to_wire()}))
        # A client with a keepalive whose host answers nothing for that
        # long is gone: its session is dropped (kvflow.control.liveness).
        # A value no engine would send (under MIN_KEEPALIVE) is ignored:
        # it would make this loop wake for nothing.
        silence = hello.get("keepalive")
        if not isinstance(silence, (int, float)) or isinstance(silence, bool) or \
                not MIN_KEEPALIVE <= silence <= MAX_KEEPALIVE:
            silence = None
        return token, peer_addr, silence

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer_addr: str,
                       silence: float | None) -> None:
        watch = look = None
        sock = writer.get_extra_info("socket")
        if silence is not None and sock is not None:
            keep_probing(sock, silence)
            watch, look = ReachWatch(sock, silence), look_interval(silence)
        while True:
            try:
                msg = await read_message(reader, idle_timeout=look)
            except asyncio.TimeoutError:
                if watch is None or reader.exception() is not None:
                    return          # ETIMEDOUT from the kernel: its keepalive probes went unanswered
                # a look, between frames: the client's kernel answers (it
                # may be stopped or starved: it keeps its session), or not
                if not watch.look():
                    continue
                log.warning("kvflow: %s answered nothing for %.3g s: dropping its session", peer_addr, silence)
                return
            t = msg["t"]
            if t == "ping":
                writer.write(encode({"t": "pong"}))
            elif t == "notify":
                self._deliver(peer_addr, field(msg, "data", bytes))
            elif t == "describe":
                writer.write(encode({"t": "descriptor", "descriptor": self._describe().to_wire()}))
                await writer.drain()      # a peer that asks but never reads gets no more
            elif t in self.handlers:
                reply = self.handlers[t](peer_addr, writer, msg)
                if reply is None:                   # a message that wants no answer
                    continue
                if inspect.isawaitable(reply):      # answered when done; the session reads on
                    self._answer_later(writer, msg.get("rid"), reply)
                    continue
                writer.write(encode({**reply, "rid": msg.get("rid")}))
                await writer.drain()
            elif t == "bye":
                return
            else:
                raise ProtocolError(f"unexpected message {clip(t)}")
