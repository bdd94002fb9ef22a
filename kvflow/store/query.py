"""batch_exists answered on threads of the master's own, off its event loop.

The servers ask whether their pages are in the pool before every put and
get (SGLang's and vLLM's store code dedup with one batch_exists), from a
synchronous caller: StoreClient.batch_exists_blocking sends it on a
blocking socket of its own. Served by the master's asyncio loop, each such
call paid the loop's wake-up and dispatch, about 40 us on these cores, more
than the lookup of 128 keys. Here a thread per query connection waits in a
blocking recv and answers from the model directly: a membership test of
each key in the model's LRU index, which the loop's thread only changes
under the GIL, so each key's answer is the object's state at some instant
of the call, as it would be on the loop.

Read-only and identity-free: the connection registers as no client, and
only batch_exists is served (anything else is an invalid_argument reply).
The master tells its clients the port at register ("query_port"); a
standby opens it only once it leads."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable

from kvflow.errors import KVFlowError, ProtocolError

from .errors import error_code
from .wire import FrameBuffer, encode

__all__ = ["QueryServer"]

log = logging.getLogger(__name__)


class QueryServer:
    """Listens on `host`, port 0 (`port` once started); `answer(keys)` is
    the master's batch_exists."""

    def __init__(self, host: str, answer: Callable[[list], list]) -> None:
        self._answer = answer
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvflow-store-query", daemon=True)

    def start(self) -> "QueryServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                          # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvflow-store-query-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        frames = FrameBuffer()
        try:
            while not self._closed:
                data = conn.recv(1 << 16)
                if not data:
                    return
                out = [encode(self._reply(msg)) for msg in frames.feed(data)]
                if out:
                    conn.sendall(b"".join(out))
        except ProtocolError as e:
            log.warning("kvflow.store: a query connection sent garbage: %s", e)
        except OSError:
            pass                                # the client went, or the master closes
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _reply(self, msg: Any) -> list:
        if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[2], list)):
            return [0, 1, ["invalid_argument", "malformed request", None]]
        rid, method, args = msg
        if method != "batch_exists" or len(args) != 1 or not isinstance(args[0], list):
            return [rid, 1, ["invalid_argument", f"{method!r}: this port answers batch_exists(keys) only", None]]
        try:
            return [rid, 0, self._answer(args[0])]
        except KVFlowError as e:
            return [rid, 1, [error_code(e), str(e), getattr(e, "key", None)]]
