"""The failover write fence (a mixin of StoreModel, model.py): space a dead
master may have handed to writes still in flight is not handed out again
until those writes are over.

A put_start's reply lets its writer write into the space it names, and
that space is recorded in etcd only at put_end (durable.py). A master that
dies in between leaves writes in flight that its successor knows nothing
of: the new leader rebuilds each segment from the recorded objects, and
the space of those puts looks free. Such a write outlives its master by
at most its writer's write window: a StoreClient connects to a holder
within CONNECT_TIMEOUT and its transfer ends within its `timeout=`, both
counted from the put_start's reply, which came before the master died
(repairs', tasks' and SSD promotions' copies are made with the same
timeouts). So at recovery every free extent of every recovered segment is
fenced for the longest write window any client ever reported: each client
reports its own at register, and the master keeps the largest in etcd's
`meta` before it replies to that register, so the window is in etcd
before the client can write anything. A cluster whose `meta` does not say
(written before the fence) is fenced for the default client's window.

The fence ends sooner when every client that could be writing has said
its writes are over. Every registered client is recorded in etcd (`c/<id>`,
durable.py) before its register's reply, so the new leader knows them all;
a client re-attaching to a new leader first waits until no write of its
own is in progress (datapath.py's Mover.idle, bounded by its window) and
says so in its register (`drained`). Once every recorded client has, or
is lost (its process, and with it its writes, gone), the fence is lifted:
after a failover with every client alive, about when the last one is
back (its next call or heartbeat), not the whole window later.

While fenced, puts go to space that is free for sure: segments mounted
since, and extents freed since (removed or evicted objects were recorded
ones, never an in-flight put's). Eviction is what it would be without a
fence (the watermarks count fenced space as free, as it soon is): a put
that only fenced space could hold fails with SpaceFencedError, which a
StoreClient retries, backing off, for its own write window, so the put
waits for the fence's end instead of evicting the cache (a pool restarted
mostly free should not be emptied by its first puts). Repairs and copy
tasks that need fenced space wait for its end too. The fence is lifted by
the master's monitor (each second) or by the first put that needs it.

A client with no transfer timeout (`timeout=None`) reports the default
client's window, and its writes are held to it (StoreClient.write_timeout:
its reads alone wait as long as they take). A write is also started only
within its window of its put_start (puts.py, direct.py), so a writer
stalled between the reply and its writes does not start them late; the
same window bounds how long a put may stay uncommitted (put_timeouts.py).
"""
from __future__ import annotations

import math

from .allocator import ALIGN
from .errors import SpaceFencedError
from .records import Client

__all__ = ["CLIENT_TIMEOUT", "CONNECT_TIMEOUT", "DEFAULT_WRITE_WINDOW", "WriteFence", "write_window"]

# a StoreClient's defaults: seconds its calls' transfers may take (its
# `timeout=`), and seconds to connect to a holder's engine (datapath.py)
CLIENT_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0


def write_window(timeout: float | None, connect_timeout: float = CONNECT_TIMEOUT) -> float:
    """How long after its put_start's reply a client's write may still land."""
    t = timeout if isinstance(timeout, (int, float)) and 0 < timeout < math.inf else CLIENT_TIMEOUT
    return float(connect_timeout + t)


DEFAULT_WRITE_WINDOW = write_window(CLIENT_TIMEOUT)


class WriteFence:
    """State (set up by _init_fence): `write_window` (the longest reported,
    recorded in etcd's meta) and the fence's end (0: none)."""

    def _init_fence(self) -> None:
        self.write_window = 0.0
        self._fence_until = 0.0
        # the recorded clients that have not yet said their writes from before
        # the failover are over (None: not known, the window decides alone)
        self._fence_clients: set[str] | None = None
        self.dirty_clients: set[str] | None = None     # client records to write to etcd (track())

    def note_client(self, client_id: str, window: object, drained: bool) -> None:
        """A client registered: its write window, recorded (with the
        client) in etcd; `drained`: none of its writes is in progress."""
        self.clients[client_id].window = self.note_write_window(window)
        if self.dirty_clients is not None:
            self.dirty_clients.add(client_id)
        if drained:
            self._fence_client_done(client_id)

    def _fence_client_done(self, client_id: str) -> None:
        """The client's writes allowed by the old leader are over (it said
        so, or it is lost): the fence is lifted once no one is left."""
        waiting = self._fence_clients
        if waiting is not None:
            waiting.discard(client_id)
            if not waiting and self._fence_until:
                self._fence_until = -1.0        # due now: release_fence lifts it
                self.release_fence(0.0)

    def note_write_window(self, seconds: object) -> float:
        """A registering client's write window (returned); a client that
        does not say (an older one) has the default's."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            seconds = DEFAULT_WRITE_WINDOW
        if seconds > self.write_window:
            self.write_window = float(seconds)
        return float(seconds)

    def fence_free(self, now: float, window: float, clients: set[str] | None = None) -> int:
        """Recovery: every free extent is fenced until now + window, or
        until each of `clients` (the recorded ones; None: not known) has
        said its writes are over; returns the bytes."""
        n = sum(seg.alloc.fence() for seg in self.segments.values())
        self._fence_until = now + window if n else 0.0
        self._fence_clients = set(clients) if n and clients else None
        return n

    @property
    def fenced(self) -> int:
        """Bytes fenced now."""
        return sum(seg.alloc.fenced for seg in self.segments.values()) if self._fence_until else 0

    def fence_left(self, now: float) -> float:
        return max(0.0, self._fence_until - now) if self._fence_until else 0.0

    def release_fence(self, now: float) -> int:
        """Lifts the fence once its time is up; returns the bytes given back."""
        if not self._fence_until or now < self._fence_until:
            return 0
        self._fence_until = 0.0
        self._fence_clients = None
        return sum(seg.alloc.unfence() for seg in self.segments.values())

    def _fenced_out(self, key: str, size: int, now: float) -> bool:
        """A put found no room: True when the fence's end made some (place
        again); SpaceFencedError when fenced space could hold it (evicting
        would take what will be free anyway); False otherwise (evict)."""
        if not self._fence_until:
            return False
        if self.release_fence(now):
            return True
        need = (size + ALIGN - 1) // ALIGN * ALIGN
        if any(seg.alloc.fenced >= need for seg in self.segments.values()):
            raise SpaceFencedError(f"no space for {size} bytes for {self.fence_left(now):.1f} s more: free space "
                                   f"is fenced after a failover, until writes the old master allowed are over: "
                                   f"retry", key=key)
        return False

    def _client_gone(self, client_id: str) -> None:
        if self.dirty_clients is not None:
            self.dirty_clients.add(client_id)
        self._fence_client_done(client_id)

    def restore_client(self, client_id: str, window: float, host: str, engine: str, now: float) -> None:
        """A client recorded in etcd (recovery): as a segment's owner is, lost
        after the grace unless it registers again."""
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = Client(client_id, host, engine, now, recovered=True)
        c.window = float(window)
