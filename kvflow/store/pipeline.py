"""Several requests in flight on one joined connection (direct.py's
pipelined batches): a chunk's put_start or batch_get_replicas is sent
before the caller moves the previous chunk's bytes, so the master works
on it while the caller's thread is in a GIL-free write or read, and its
reply is waiting when the bytes are done.

The master answers a connection's requests in order, except that a reply
waiting for etcd (a durable master's put_end) may come after later ones:
replies are matched by their id. Any failure of the connection closes it
and raises MasterUnavailableError for every reply not yet read; the
caller decides what each of its chunks needs then (direct.py).
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from kvflow.errors import ProtocolError

from .errors import MasterUnavailableError, error_from_code
from .wire import FrameBuffer, encode

__all__ = ["Pipe"]


class Pipe:
    """Requests and their replies, apart, on one JoinedQuery's socket
    (held by one call: the pool gives a connection to one call at a time).
    `send` returns the request's id; `result(id)` waits for that reply
    and returns its value or raises its typed error."""

    def __init__(self, q: Any, counters: Any = None) -> None:
        self._q = q
        self._frames = FrameBuffer()
        self._replies: dict[int, list] = {}
        self._sent: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count(1)
        self._counters = counters
        self.broken: MasterUnavailableError | None = None

    def send(self, method: str, *args: Any) -> int:
        """Sends a request (MasterUnavailableError when it cannot be)."""
        self._check()
        rid = next(self._ids)
        try:
            self._q._sock.sendall(encode([rid, method, list(args)]))
        except (OSError, ValueError) as e:
            self._fail(e)
        self._sent[rid] = (method, time.perf_counter())
        return rid

    def notify(self, method: str, *args: Any) -> bool:
        """A request nobody waits for (a lease release); False when the
        connection is broken."""
        if self.broken is not None:
            return False
        try:
            self._q._sock.sendall(encode([0, method, list(args)]))
        except (OSError, ValueError) as e:
            self._fail(e, raise_=False)
            return False
        return True

    def result(self, rid: int) -> Any:
        """The reply to request `rid`: its value, or its error raised."""
        while rid not in self._replies:
            self._check()
            try:
                chunk = self._q._first(self._q._sock)       # polls a while, then sleeps in recv
                msgs = self._frames.feed(chunk)
            except (OSError, ValueError, ProtocolError) as e:
                self._fail(e)
            for msg in msgs:
                if not (isinstance(msg, list) and len(msg) == 3 and msg[0] in self._sent):
                    self._fail(ProtocolError("malformed reply"))
                self._replies[msg[0]] = msg
        _, failed, value = self._replies.pop(rid)
        method, t0 = self._sent.pop(rid)
        if self._counters is not None:
            self._counters.round_trip(method, time.perf_counter() - t0, not failed)
        if failed:
            code, message, key = value
            raise error_from_code(code, message, key)
        return value

    def finish(self) -> None:
        """The call is done with the connection: one with replies still
        unread is closed (its next user would read them as its own)."""
        if self._sent and self.broken is None:
            self._q.close()
            self.broken = MasterUnavailableError(f"master {self._q.address}: closed with replies unread")

    def _check(self) -> None:
        if self.broken is not None:
            raise MasterUnavailableError(str(self.broken))
        if self._q._sock is None:
            self._fail(ProtocolError("closed"))

    def _fail(self, e: BaseException, *, raise_: bool = True) -> None:
        self._q.close()
        self.broken = MasterUnavailableError(f"master {self._q.address}: {e or 'closed'}")
        if raise_:
            raise self.broken from None
