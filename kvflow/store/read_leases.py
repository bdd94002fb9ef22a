"""Read leases (a mixin of StoreModel, model.py): one per get call, over
the objects its lookup found, so they are neither evicted nor removed
while the call reads them.

A lease lasts `lease_ttl` from its grant. A reader whose reads are still
in progress renews it (leases.py, the client's side: at about a third of the
TTL, one call for every lease it holds), each renewal giving it the TTL
again from the master's now, so a slow but live read keeps its objects.
Renewals are bounded: a lease never lasts past its grant plus its
reader's write window (fence.py: the connect to a holder and the
transfer's timeout, the longest one of the reader's reads may take), so
a get stuck forever in a live process cannot pin objects forever. A
reader that stops renewing (dead, stopped) loses its lease when the TTL
runs out, as before renewals existed. A lease that ran out is never
renewed: its objects may have been removed and their space given away.
"""
from __future__ import annotations

from .records import Object

__all__ = ["ReadLeases"]


class ReadLeases:
    """State (set up by _init_leases): the live leases, id -> (until, the
    objects it covers), and each renewed lease's bound."""

    def _init_leases(self) -> None:
        self._leases: dict[int, tuple[float, list[Object]]] = {}
        self._next_lease = 1
        # lease id -> the time past which it is not renewed (set at its
        # first renewal: until - lease_ttl is its grant time only then)
        self._lease_bounds: dict[int, float] = {}
        self.lease_renewals = 0

    def new_lease(self, now: float) -> int:
        """A lease id for one get call's objects, valid until now + lease_ttl."""
        if len(self._leases) > 4096:
            self.expire_leases(now)
        lid = self._next_lease
        self._next_lease += 1
        self._leases[lid] = (now + self.lease_ttl, [])
        return lid

    def renew_lease(self, lease: int, now: float, bound: float) -> float:
        """The reader is still reading: the lease runs lease_ttl from `now`
        again, but never past its grant + max(`bound`, lease_ttl). Returns
        the seconds it runs from `now` (0.0: it is gone, released or run
        out, and is not renewed)."""
        entry = self._leases.get(lease) if type(lease) is int else None
        if entry is None:
            return 0.0
        until, objs = entry
        if until <= now:            # ran out: what it covered may be gone
            self._drop_lease(lease)
            return 0.0
        last = self._lease_bounds.get(lease)
        if last is None:
            last = self._lease_bounds[lease] = until - self.lease_ttl + max(float(bound), self.lease_ttl)
        new = min(now + self.lease_ttl, last)
        if new > until:
            self.lease_renewals += 1
            self._leases[lease] = (new, objs)
            for obj in objs:
                if lease in obj.leases:
                    obj.leases[lease] = new
            until = new
        return until - now

    def release_lease(self, lease: int, now: float) -> None:
        """The reader is done: its objects are no longer leased by it."""
        if self._drop_lease(lease) and self._quarantine:
            self.release_quarantine(now)

    def expire_leases(self, now: float) -> None:
        for lid in [lid for lid, (until, _) in self._leases.items() if until <= now]:
            self._drop_lease(lid)

    def _drop_lease(self, lease: int) -> bool:
        entry = self._leases.pop(lease, None)
        if entry is None:
            return False
        for obj in entry[1]:
            obj.leases.pop(lease, None)
        if self._lease_bounds:
            self._lease_bounds.pop(lease, None)
        return True
