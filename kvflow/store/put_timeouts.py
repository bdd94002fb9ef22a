"""Puts that are never committed (a mixin of StoreModel, model.py): an
ALLOCATED object whose writer stays connected but sends no put_end (a
writer stuck for good) is revoked once it has been in progress for longer
than its writer's write window, and its space comes back.

Not at once, though. The writer may still be writing, and a revoke does
not reach it. A StoreClient starts a put's writes only within its write
window W (fence.py: the connect to a holder, then the transfer's timeout)
of sending the put_start (puts.py, direct.py), and each write ends within
W of its start (StoreClient.write_timeout, also for timeout=None), so
every write of the put is over by put_start + 2W. The revoke comes at
least W after the put_start reached the master, and the revoked put's
space is quarantined for one more W (as a forced removal's space is held
while a reader's lease runs: model.py's quarantine) before it is handed
out again; the key itself is free at once. So late writes land in space
no one else holds, the failover fence's guarantee for the same kind of
writes. The writer's late put_end gets PutRevokedError.

The master's monitor calls expire_puts each second; a put is timed from
the first time the monitor saw it in progress (at most a period after
its put_start), so it is never revoked early and put_start itself keeps
no clock.
"""
from __future__ import annotations

from .errors import PutRevokedError
from .records import Object, State

__all__ = ["PutTimeouts"]

# revoked puts remembered for their writers' late put_end (a bound: a
# writer that never comes back must not grow the table)
_REMEMBERED = 4096


class PutTimeouts:
    """State (set up by _init_put_timeouts): when each put in progress was
    first seen by the monitor, and the revoked ones not yet forgotten."""

    def _init_put_timeouts(self) -> None:
        self._put_seen: dict[str, tuple[Object, float]] = {}
        self._revoked: dict[tuple[str, str], float] = {}     # (writer, key) -> forgotten after
        self.puts_timed_out = 0

    def expire_puts(self, now: float) -> list[str]:
        """Revokes the puts in progress for longer than their writer's
        write window (their space quarantined for one more window);
        returns their keys."""
        seen = self._put_seen
        current: dict[str, tuple[Object, float]] = {}
        late = []
        for c in self.clients.values():
            for key in c.writing:
                obj = self.objects.get(key)
                if obj is None or obj.state is not State.ALLOCATED or obj.writer != c.id:
                    continue
                was = seen.get(key)
                since = was[1] if was is not None and was[0] is obj else now
                if now - since > c.window > 0:
                    late.append((obj, c.window))
                else:
                    current[key] = (obj, since)
        self._put_seen = current
        for obj, window in late:
            self._revoke_late(obj, now, window)
        if self._revoked:
            for k in [k for k, until in self._revoked.items() if until <= now]:
                del self._revoked[k]
        return [obj.key for obj, _ in late]

    def _revoke_late(self, obj: Object, now: float, window: float) -> None:
        """The put is revoked; its replicas' space stays allocated until
        now + window (release_quarantine frees it then)."""
        replicas, obj.replicas = obj.replicas, []
        for r in replicas:
            seg = self.segments.get(r.segment)
            if seg is not None:
                seg.keys.discard(obj.key)
        # a lease of no reader (id 0 is never handed out) that ends with the
        # writer's window: the quarantine frees the space once it has
        obj.leases = {0: now + window}
        self._quarantine.append((obj, replicas))
        self._delete(obj)
        self.puts_timed_out += 1
        if len(self._revoked) >= _REMEMBERED:
            self._revoked.pop(next(iter(self._revoked)))
        self._revoked[(obj.writer, obj.key)] = now + 2 * window

    def _revoked_put(self, client_id: str, key: object) -> None:
        """A put_end or revoke of no put in progress: PutRevokedError when
        the master revoked it for lasting too long."""
        if self._revoked and type(key) is str and (client_id, key) in self._revoked:
            raise PutRevokedError(f"the put of {key!r} was revoked: not committed within its writer's "
                                  f"write window", key=key)
