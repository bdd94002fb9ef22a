"""The SSD tier's metadata: the master's side (a mixin of StoreModel,
model.py, which holds the state; ssd_master.py makes the calls, ssd_agent.py
is the client)."""
from __future__ import annotations

from kvflow.errors import InvalidArgumentError

from .records import Client, Object, Replica, State, check_key

__all__ = ["SsdState"]


class SsdState:
    # -- the SSD tier (ssd_agent.py runs its client side) -----------------------
    # An object's copies are its DRAM replicas and, in obj.ssd, the clients
    # holding a copy on their SSD. A client's tier copies the objects of its
    # own segment ("eager": all of them; "evict": those nearest eviction,
    # ssd_candidates) and reports each copy once it is on disk (ssd_add); an
    # eviction then frees only the DRAM replicas of an object with an SSD
    # copy, which stays readable (ssd-only) until a get promotes it back to
    # DRAM (promote_start/promote_end). The master cannot wait for a disk
    # inside an eviction, so the copy is made ahead of it: an object whose
    # copy is still wanted is evicted after every other candidate, and only
    # then lost (counted in ssd_missed).
    def ssd_attach(self, client_id: str, directory: str, mode: str) -> None:
        if mode not in ("evict", "eager"):
            raise InvalidArgumentError(f"ssd mode must be 'evict' or 'eager', not {mode!r}")
        c = self._client(client_id)
        c.ssd_dir, c.ssd_mode = str(directory), mode
        self._ssd_clients.add(client_id)
        if mode == "eager":             # what its segment holds already
            for sid in c.segments:
                for key in self.segments[sid].keys:
                    obj = self.objects.get(key)
                    if obj is not None and obj.state is State.COMPLETE:
                        c.ssd_pending[key] = None

    def _ssd_note(self, obj: Object) -> None:
        """An object landed in segments (put_end, promote_end): eager tiers
        among their holders will copy it (ssd_candidates reads this queue
        instead of walking the whole LRU order)."""
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None and seg.client in self._ssd_clients:
                c = self.clients[seg.client]
                if c.ssd_mode == "eager":
                    c.ssd_pending[obj.key] = None

    def _ssd_wanted(self, obj: Object) -> bool:
        """Whether a holder of one of obj's DRAM replicas has a tier and no copy yet."""
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None and seg.client in self._ssd_clients and (not obj.ssd or seg.client not in obj.ssd) \
                    and (not obj.ssd_declined or seg.client not in obj.ssd_declined):
                return True
        return False

    def _ssd_strict(self, obj: Object) -> bool:
        """Whether a holder that wants a copy of obj runs "eager" (every
        object copied, none lost: a put that needs its space fails with
        NoSpaceError until the copy is on disk, Mooncake's -200 that its
        callers retry)."""
        for r in obj.replicas:
            seg = self.segments.get(r.segment)
            c = self.clients.get(seg.client) if seg is not None else None
            if c is not None and c.ssd_mode == "eager" and (not obj.ssd or c.id not in obj.ssd) \
                    and (not obj.ssd_declined or c.id not in obj.ssd_declined):
                return True
        return False

    def ssd_add(self, client_id: str, key: str, size: int, *, adopt: bool = False) -> bool:
        """The client holds a complete, synced SSD copy of `key`. With `adopt`
        (a restarted client's files), an object the pool does not know is
        created from it (COMPLETE, SSD-only). False: not recorded (the key is
        gone, or exists with another size): the client deletes its file."""
        c = self._client(client_id)
        check_key(key)
        obj = self.objects.get(key)
        if obj is None:
            if not adopt or not isinstance(size, int) or size <= 0:
                return False
            obj = self.objects[key] = Object(key, size, [], State.COMPLETE, client_id)
            meta = self._adoptable.pop(key, None) if self._adoptable else None
            if meta is not None and meta[0] == size:    # recovered from etcd: what its put asked for
                obj.pinned, obj.writer, obj.token, obj.want, obj.soft_until = meta[1]
            self.charge(obj)
            self._ssd_only.add(key)
        elif obj.state is not State.COMPLETE or obj.size != size:
            return False
        if obj.ssd is None:
            obj.ssd = set()
        obj.ssd.add(client_id)
        c.ssd_keys.add(key)
        return True

    def ssd_drop(self, client_id: str, key: str, c: Client | None = None, *, declined: bool = False) -> int:
        """The client's copy of `key` is gone (its tier evicted it, or the
        client is lost). `declined`: its tier let it go (full), so it is not
        offered to that tier again. Returns 1 when the object went with it."""
        c = c or self.clients.get(client_id)
        if c is not None:
            c.ssd_keys.discard(key)
        obj = self.objects.get(key)
        if declined and obj is not None:
            if obj.ssd_declined is None:
                obj.ssd_declined = set()
            obj.ssd_declined.add(client_id)
        if obj is None or not obj.ssd or client_id not in obj.ssd:
            return 0
        obj.ssd.discard(client_id)
        if not obj.ssd and not obj.replicas:
            self._delete(obj)
            return 1
        return 0

    def ssd_candidates(self, client_id: str, now: float, limit: int, *, eager: bool,
                       mark: float) -> tuple[int, list[Object]]:
        """Objects in the client's segments it should copy to its SSD, oldest
        first, at most `limit`, under a new read lease (returned; released by
        the client once written, so none is evicted or removed mid-copy).
        "evict" mode: only among the oldest objects whose DRAM bytes exceed
        `mark` x capacity (those the next evictions take); "eager": any."""
        c = self._client(client_id)
        if not c.segments:
            return 0, []
        out: list[Object] = []
        if eager:
            # the queue of what landed in its segments, oldest first; keys
            # gone, copied, declined or moved off its segments just leave it
            while c.ssd_pending and len(out) < limit:
                key = next(iter(c.ssd_pending))
                del c.ssd_pending[key]
                obj = self.objects.get(key)
                if obj is None or obj.state is not State.COMPLETE or (obj.ssd and client_id in obj.ssd) \
                        or (obj.ssd_declined and client_id in obj.ssd_declined):
                    continue
                if any(r.segment in c.segments for r in obj.replicas):
                    out.append(obj)
            budget = 0
        else:
            budget = self._used - int(mark * self._capacity)
        seen = 0
        for key in self._lru:
            if seen >= budget or len(out) >= limit:
                break
            obj = self.objects[key]
            seen += sum(r.length for r in obj.replicas)
            if (obj.ssd and client_id in obj.ssd) or (obj.ssd_declined and client_id in obj.ssd_declined):
                continue
            if any(r.segment in c.segments for r in obj.replicas):
                out.append(obj)
        if not out:
            return 0, []
        lease = self.new_lease(now)
        until, objs = self._leases[lease]
        for obj in out:
            obj.leases[lease] = until
            objs.append(obj)
        return lease, out

    def take_ssd_drops(self, client_id: str) -> list[str]:
        return self.ssd_drops.pop(client_id, [])

    def ssd_request(self, key: str) -> bool:
        """A reader on another host wants an SSD-only object: its first
        holder is asked (at its next ssd_sync) to load it into DRAM."""
        obj = self._complete(key)
        if obj.replicas or obj.promoting or not obj.ssd:
            return False
        cid = next(iter(obj.ssd))
        self.ssd_loads.setdefault(cid, {})[key] = None
        return True

    def promote_start(self, client_id: str, key: str, now: float,
                      preferred: int | None = None) -> list[Replica] | None:
        """DRAM space for an SSD-only object read by `client_id` (one
        replica, placed as a put's; evicting as a put would). None when there
        is nothing to do (it has DRAM replicas, or a promotion runs)."""
        self._client(client_id)
        obj = self._complete(key)
        if obj.replicas or obj.promoting:
            return None
        need = obj.size
        cap = self._capacity
        if cap and self._used + need > self.high_watermark * cap:
            self._evict(self._used + need - int(self.low_watermark * cap), now)
        chosen = self._place(obj.size, 1, preferred)
        if not chosen:
            return None                         # no room: it stays on SSD
        seg = chosen[0]
        off = seg.alloc.allocate(obj.size)
        assert off is not None
        length = seg.alloc.allocated_length(off)
        self._used += length
        seg.keys.add(key)
        obj.promoting = [Replica(seg.id, off, length)]
        return obj.promoting

    def promote_end(self, client_id: str, key: str, ok: bool) -> bool:
        """The promoter wrote the DRAM replica (ok) or gave up: attached, or freed."""
        obj = self.objects.get(key) if isinstance(key, str) else None
        if obj is None or not obj.promoting:
            return False
        reps, obj.promoting = obj.promoting, None
        if not ok or obj.replicas:
            for r in reps:
                self._free(key, r)
            return False
        obj.replicas = reps
        self._ssd_only.discard(key)
        self._lru[key] = None
        self._ssd_note(obj)
        if self.dirty_objects is not None:
            self.dirty_objects.add(key)
        return True

    def _drop_dram(self, obj: Object) -> None:
        """Eviction of an object with an SSD copy: its DRAM space only."""
        for r in obj.replicas:
            self._free(obj.key, r)
        obj.replicas = []
        self._lru.pop(obj.key, None)
        self._ssd_only.add(obj.key)
        if self.dirty_objects is not None:
            self.dirty_objects.add(obj.key)

    def _ssd_forget(self, obj: Object) -> None:
        """The object is gone: its holders delete their SSD copies (told at
        their next ssd_sync), a promotion's space is freed."""
        self._ssd_only.discard(obj.key)
        for cid in obj.ssd or ():
            c = self.clients.get(cid)
            if c is not None and obj.key in c.ssd_keys:
                c.ssd_keys.discard(obj.key)
                self.ssd_drops.setdefault(cid, []).append(obj.key)
        obj.ssd = None
        if obj.promoting:
            for r in obj.promoting:
                self._free(obj.key, r)
            obj.promoting = None
