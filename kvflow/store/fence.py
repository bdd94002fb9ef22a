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
(repairs' and tasks' copies are made with the same timeouts). So at
recovery every free extent of every recovered segment is fenced for the
longest write window any client ever reported: each client reports its
own at register, and the master keeps the largest in etcd's `meta` before
it replies to that register, so the window is in etcd before the client
can write anything. A cluster whose `meta` does not say (written before
the fence) is fenced for the default client's window.

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

Not fenced: a client with no transfer timeout (`timeout=None`) is fenced
as if it had the default one (its writes are not bounded at all).
"""
from __future__ import annotations

import math

from .allocator import ALIGN
from .errors import SpaceFencedError

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

    def note_write_window(self, seconds: object) -> None:
        """A registering client's write window; a client that does not say
        (an older one) has the default's."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            seconds = DEFAULT_WRITE_WINDOW
        if seconds > self.write_window:
            self.write_window = float(seconds)

    def fence_free(self, now: float, window: float) -> int:
        """Recovery: every free extent is fenced until now + window; returns the bytes."""
        n = sum(seg.alloc.fence() for seg in self.segments.values())
        self._fence_until = now + window if n else 0.0
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
