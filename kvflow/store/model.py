"""The master's metadata, in memory and synchronous: clients, their
segments (each with an Allocator), objects (key -> size, replicas, state),
read leases, pins, and eviction. No I/O and no clock of its own: every
call that needs the time takes `now` (monotonic seconds), so tests drive
leases, liveness and LRU without sleeping.

Invariants the tests hold:
- a reader sees only COMPLETE objects (ALLOCATED ones are invisible to
  get_replicas, exists and size);
- every allocated byte belongs to exactly one replica of one object, so
  when every object is gone every segment is one free extent again;
- a leased or pinned object is never evicted, and a leased one never removed
  (unless forced, or its holder is lost).

Durability (a master given etcd): with `track()` on, every call that
changes what must survive a restart (a COMPLETE object's replicas, a
segment, a quota) names the key or segment in `dirty_objects`/`dirty_segments`
(or sets `dirty_quotas`); an object's record holds its pins and want count,
which never change after its put;
the master writes their current state (or their absence) to etcd after
the call. Puts in progress, leases and the LRU order are never recorded.
`restore_segment`/`restore_object` rebuild the index from those records:
restored segments are detached (read from, placed into only for what the
attached ones cannot hold) until their owner mounts them again, and restored clients are lost after the
grace unless they register again.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from kvflow.errors import InvalidArgumentError

from .allocator import ALIGN, Allocator
from .batch_puts import BatchPuts
from .errors import (NoSpaceError, ObjectBusyError, ObjectExistsError, ObjectLeasedError, ObjectNotFoundError,
                     QuotaExceededError, SegmentError, SsdBusyError, StoreError)
from .fence import WriteFence
from .placement import place
from .put_timeouts import PutTimeouts
from .read_leases import ReadLeases
from .records import MAX_KEY_BYTES, NS_SEP, Client, Object, Replica, Segment, State, check_key, namespace_of
from .repair import ReplicaRepair
from .ssd_model import SsdState
from .tasks import ReplicaTasks

__all__ = ["State", "Client", "Segment", "Replica", "Object", "StoreModel", "check_key", "MAX_KEY_BYTES"]


def _soft_pin_seconds(pin: Any, default: float) -> float:
    """["soft", seconds or None] -> seconds (InvalidArgumentError otherwise)."""
    if not (isinstance(pin, (list, tuple)) and len(pin) == 2 and pin[0] == "soft"):
        raise InvalidArgumentError(f"pin must be a bool or [\"soft\", seconds], not {pin!r}")
    ttl = pin[1]
    if ttl is None:
        return default
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise InvalidArgumentError(f"a soft pin's seconds must be > 0, not {ttl!r}")
    return float(ttl)


class StoreModel(SsdState, ReplicaRepair, ReplicaTasks, WriteFence, ReadLeases, PutTimeouts, BatchPuts):
    """The pool's metadata. `high_watermark`/`low_watermark`: fractions of
    the pool's capacity; a put that would take the pool above the high one
    first evicts least-recently-used objects down to the low one.
    `lease_ttl`: seconds a get_replicas protects an object from eviction
    and removal."""

    def __init__(self, *, lease_ttl: float = 5.0, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, seed: int | None = None, soft_pin_ttl: float = 1800.0) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise InvalidArgumentError("watermarks must satisfy 0 < low <= high <= 1")
        if lease_ttl <= 0:
            raise InvalidArgumentError("lease_ttl must be > 0")
        if not soft_pin_ttl > 0:
            raise InvalidArgumentError("soft_pin_ttl must be > 0")
        self.lease_ttl = lease_ttl
        self.soft_pin_ttl = soft_pin_ttl        # a soft pin's default life (Mooncake's: 30 min)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.clients: dict[str, Client] = {}
        self.segments: dict[int, Segment] = {}
        self.objects: dict[str, Object] = {}
        # COMPLETE objects by last access, least recent first: eviction walks
        # it from the front, a hit moves the key to the back (O(1) each).
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._next_segment = 1
        self._capacity = 0
        self._used = 0
        self._rng = random.Random(seed)
        self.evictions = 0
        # namespaces (tenants: a model, a TP rank): the bytes of their objects
        # (each object's size once, whatever its replicas and tiers; puts in
        # progress included) and their quotas
        self.ns_bytes: dict[str, int] = {}
        self.quotas: dict[str, int] = {}
        # COMPLETE objects with fewer replicas than their put asked for (a
        # holder was lost), and the new replicas being copied: key ->
        # (copying client, the allocation, the lease on its sources, the
        # object copied: a new object of the same key never gets its bytes)
        self._short: set[str] = set()
        # (and the copy or move task it is part of, None for a repair: tasks.py)
        self._repairs: dict[str, tuple[str, Replica, int, Object, Any]] = {}
        self._init_tasks()
        self._init_fence()          # space fenced after a failover (fence.py)
        self.repaired = 0
        self.soft_evictions = 0     # soft-pinned objects evicted because nothing else could go
        self.evicted_bytes = 0
        # what a read lease held back (metrics.py): a remove refused, a
        # leased object eviction skipped, a forced removal's space held
        self.lease_waits = {"remove": 0, "evict": 0, "quarantine": 0}
        # forced removals of leased objects: the key is gone at once, but the
        # space is freed only when its leases end or are released, so a
        # reader still copying it never sees a new object's bytes
        self._quarantine: list[tuple[Object, list[Replica]]] = []
        self._init_leases()         # read leases and their renewals (read_leases.py)
        self._init_put_timeouts()   # puts never committed (put_timeouts.py)
        # what changed since the master last wrote to etcd (None: not tracked)
        self.dirty_objects: set[str] | None = None
        self.dirty_segments: set[int] | None = None
        self.dirty_quotas: bool | None = None
        # SSD tier (ssd_agent.py): COMPLETE objects whose only copies are on
        # SSD (not in the LRU order, which holds DRAM replicas), and per
        # client the keys whose SSD copy it should delete (a removal, remove_all)
        self._ssd_only: set[str] = set()
        self.ssd_drops: dict[str, list[str]] = {}
        self.ssd_loads: dict[str, dict[str, None]] = {}     # per holder: keys readers on other hosts want
        self.ssd_missed = 0         # evicted with no SSD copy though their holder has a tier
        self._ssd_clients: set[str] = set()
        self._ssd_held = False      # an eviction skipped an object an eager tier is copying
        # SSD-only objects recovered from etcd, waiting for a tier to adopt
        # them: key -> (size, (pinned, writer, token, want, soft_until));
        # forgotten two client graces after the monitor first sees them
        self._adoptable: dict[str, tuple[int, tuple[bool, str, int, int, float]]] = {}
        self._adopt_since: float | None = None
        # (segments, all attached, largest capacity), rebuilt after any
        # change to the segments (mount, restore, re-attach, drop): a put
        # reads it per key instead of walking every segment three times
        self._seg_view: tuple[list[Segment], bool, int] | None = None

    def track(self) -> None:
        """Starts recording changes for durability (see the module's doc)."""
        self.dirty_objects, self.dirty_segments, self.dirty_tasks, self.dirty_clients = set(), set(), set(), set()
        self.dirty_quotas = False

    @property
    def next_segment(self) -> int:
        return self._next_segment

    def skip_segment_ids(self, next_id: int) -> None:
        """New segments get ids from `next_id` on (recovery: never reuse an id)."""
        self._next_segment = max(self._next_segment, int(next_id))

    # -- capacity --------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        """Bytes allocated over every segment (kept as allocations come and
        go: a put asks for it, and a sum over segments per key was a third
        of put_start's time)."""
        return self._used

    # -- clients and segments --------------------------------------------------
    def register_client(self, client_id: str, host: str, engine: str, now: float) -> Client:
        if not isinstance(client_id, str) or not client_id:
            raise InvalidArgumentError("client id must be a non-empty str")
        old = self.clients.get(client_id)
        if old is not None:
            if not old.recovered:
                raise StoreError(f"client {client_id} is already registered")
            # its owner is back after a master restart or failover: the same
            # client (its restored segments wait for it to mount them again)
            old.recovered, old.host, old.engine, old.last_seen = False, str(host), str(engine), now
            return old
        c = Client(client_id, str(host), str(engine), now)
        self.clients[client_id] = c
        return c

    def seen(self, client_id: str, now: float) -> None:
        c = self.clients.get(client_id)
        if c is not None:
            c.last_seen = now

    def mount(self, client_id: str, name: str, base: int, size: int) -> int:
        c = self._client(client_id)
        if not isinstance(base, int) or not isinstance(size, int) or base <= 0 or size <= 0:
            raise SegmentError(f"bad segment {name!r}: base {base!r}, size {size!r}")
        for s in c.segments:
            seg = self.segments[s]
            if seg.name != name:
                continue
            if not seg.attached and seg.base == base and seg.size == size:
                seg.attached = True         # re-attached after a restart: same id, same objects
                self._seg_view = None
                return seg.id
            raise SegmentError(f"client {client_id} already mounted a segment named {name!r}")
        sid = self._next_segment
        self._next_segment += 1
        seg = self.segments[sid] = Segment(sid, client_id, str(name), base, size, Allocator(size))
        self._capacity += seg.alloc.capacity
        self._seg_view = None
        c.segments.add(sid)
        if self.dirty_segments is not None:
            self.dirty_segments.add(sid)
        return sid

    # -- recovery from durable records -----------------------------------------
    def restore_segment(self, sid: int, client_id: str, host: str, engine: str, name: str, base: int,
                        size: int, now: float) -> Segment:
        """A segment recorded in etcd, detached until its owner mounts it again."""
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = Client(client_id, host, engine, now, recovered=True)
        seg = self.segments[sid] = Segment(sid, client_id, name, base, size, Allocator(size), attached=False)
        self._capacity += seg.alloc.capacity
        self._seg_view = None
        c.segments.add(sid)
        self._next_segment = max(self._next_segment, sid + 1)
        return seg

    def restore_object(self, key: str, size: int, replicas: list, *, pinned: bool = False,
                       writer: str = "", token: int = 0, want: int | None = None,
                       soft_until: float = 0.0) -> bool:
        """A COMPLETE object recorded in etcd ([[segment, offset, length], ...]).
        Replicas on segments that are not restored, or whose extent another
        record holds, are left out (and the record rewritten); False when
        none is left (the record is deleted). `want`: the replicas its put
        asked for (None, a record that did not say: as many as it names);
        short of them, the object is made whole again by repair.
        `soft_until`: its soft pin's end, on this model's clock."""
        check_key(key)
        if not replicas and key not in self.objects:
            # SSD-only when recorded (SSD copies are not in etcd): its
            # holders' tiers report it again at their attach (ssd_add with
            # adopt), and it comes back with what its put asked for
            self._adoptable[key] = (size, (bool(pinned), writer, token, 1 if want is None else max(1, int(want)),
                                           float(soft_until)))
            return False
        reps = []
        for sid, off, length in replicas:
            self._next_segment = max(self._next_segment, int(sid) + 1)   # ids are never reused
            seg = self.segments.get(sid)
            if seg is None:
                continue
            try:
                seg.alloc.reserve(off, length)
            except InvalidArgumentError:
                continue
            self._used += length
            seg.keys.add(key)
            reps.append(Replica(sid, off, length))
        if len(reps) != len(replicas) and self.dirty_objects is not None:
            self.dirty_objects.add(key)
        if not reps or key in self.objects:
            for r in reps:
                self._free(key, r)
            return False
        want = len(replicas) if want is None else max(1, int(want))
        self.objects[key] = obj = Object(key, size, reps, State.COMPLETE, writer, pinned=bool(pinned), token=token,
                                         want=want, soft_until=float(soft_until))
        self._lru[key] = None
        self.charge(obj)
        if len(reps) < want:
            self._short.add(key)            # a replica went before (or at) the failover
        return True

    def unmount(self, segment_id: int) -> int:
        """Removes a segment and every replica on it; objects left with no
        replica are gone. Returns how many objects were dropped."""
        seg = self.segments.get(segment_id)
        if seg is None:
            raise SegmentError(f"no segment {segment_id}")
        return self._drop_segment(seg)

    def client_lost(self, client_id: str) -> int:
        """The client's process is gone (its connection closed, or it was
        silent past the grace): its puts in progress are revoked and its
        segments dropped. Returns the number of objects dropped."""
        c = self.clients.pop(client_id, None)
        if c is None:
            return 0
        self._client_gone(client_id)        # its record leaves etcd; the fence waits no more for it
        for key in list(c.writing):
            obj = self.objects.get(key)
            if obj is not None and obj.state is State.ALLOCATED and obj.writer == client_id:
                self._delete(obj)
        for key in list(c.repairing):         # its copies in progress will never end
            self._end_repair(key, False)
        self._tasks_client_lost(client_id)
        dropped = 0
        for key in list(c.ssd_keys):          # its SSD copies are unreachable now
            dropped += self.ssd_drop(client_id, key, c)
        self._ssd_clients.discard(client_id)
        self.ssd_drops.pop(client_id, None)
        self.ssd_loads.pop(client_id, None)
        for sid in list(c.segments):
            dropped += self._drop_segment(self.segments[sid])
        return dropped

    def expire_clients(self, now: float, grace: float) -> list[str]:
        """Clients silent for more than `grace` seconds are lost."""
        dead = [c.id for c in self.clients.values() if now - c.last_seen > grace]
        for cid in dead:
            self.client_lost(cid)
        if self._adoptable:
            if self._adopt_since is None:
                self._adopt_since = now
            elif now - self._adopt_since > 2 * grace:     # their holders are back, or lost
                self._adoptable.clear()
                self._adopt_since = None
        return dead

    # -- puts: allocate, then commit -------------------------------------------
    def put_start(self, client_id: str, key: str, size: int, replica_num: int, now: float, *,
                  preferred: int | str | list | None = None, pin: bool | list = False,
                  token: int = 0) -> list[Replica] | None:
        """Allocates up to `replica_num` replicas of `size` bytes on distinct
        segments (distinct clients first) and records the object as
        ALLOCATED: invisible until put_end. `pin`: True, never evicted (a
        hard pin); ["soft", seconds or None], a soft pin: evicted only when
        nothing unpinned can go, for that long (None: soft_pin_ttl). Returns the replicas, or None
        when a COMPLETE object with this key exists (objects are immutable:
        the put is a no-op success). A put_start repeated with the same
        nonzero `token` (a retried request) returns the replicas it allocated
        the first time. ObjectBusyError when another put of the
        key is in progress; NoSpaceError when nothing fits even after
        eviction."""
        c = self.clients.get(client_id) or self._client(client_id)
        if type(key) is not str or not key or len(key) > MAX_KEY_BYTES // 4:
            check_key(key)
        if type(size) is not int or size <= 0:
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise InvalidArgumentError(f"object size must be a positive int, not {size!r}", )
        if type(replica_num) is not int or replica_num < 1:
            if not isinstance(replica_num, int) or replica_num < 1:
                raise InvalidArgumentError(f"replica_num must be an int >= 1, not {replica_num!r}")
        if preferred is not None and type(preferred) is not int:
            preferred = self.preferred_ids(preferred)       # segments by name (Mooncake's preferred_segments)
        old = self.objects.get(key)
        if old is not None:
            if old.state is State.COMPLETE:
                if old.size != size:
                    raise ObjectExistsError(f"{key!r} exists with {old.size} bytes, not {size}", key=key)
                self._touch(key)
                return None
            if token and old.writer == client_id and old.token == token and old.size == size:
                # the same call's put_start again (its reply was lost and the
                # link retried it): the same replicas, nothing allocated twice
                return old.replicas
            raise ObjectBusyError(f"a put of {key!r} is in progress", key=key)
        ns = namespace_of(key) if NS_SEP in key else ""
        if ns and ns in self.quotas and self.ns_bytes.get(ns, 0) + size > self.quotas[ns]:
            self._evict_namespace(ns, self.ns_bytes.get(ns, 0) + size - self.quotas[ns], now)
            if self.ns_bytes.get(ns, 0) + size > self.quotas[ns]:
                raise QuotaExceededError(f"namespace {ns!r}: {self.ns_bytes.get(ns, 0)} of its {self.quotas[ns]} "
                                         f"bytes in use, nothing of its own evictable for {size} more", key=key)
        view = self._seg_view or self._segments_view()
        if size > view[2]:
            # larger than every segment: no eviction could help, so none is done
            raise NoSpaceError(f"no segment can hold {size} bytes ({len(self.segments)} segments, "
                               f"the largest {max((s.size for s in self.segments.values()), default=0)})",
                               key=key)
        cap = self._capacity
        need = size * min(replica_num, len(self.segments))
        self._ssd_held = False
        if cap and self._used + need > self.high_watermark * cap:
            # space of forced removals whose readers are done comes back first
            self.release_quarantine(now)
            if self._used + need > self.high_watermark * cap:
                self._evict(self._used + need - int(self.low_watermark * cap), now)
        segs, attached, _ = view
        if attached and replica_num == 1 and preferred is None and len(segs) <= 2:
            # place()'s common case inline: one replica, at most two segments
            need = (size + ALIGN - 1) // ALIGN * ALIGN
            if len(segs) == 1:          # one segment: no list comprehension's frame
                fitting = [segs[0]] if need <= segs[0].alloc.largest_free else []
            else:
                fitting = [s for s in segs if need <= s.alloc.largest_free]
            if len(fitting) == 2:
                chosen = place(fitting, size, 1, rng=self._rng)
            else:
                chosen = fitting
        else:
            chosen = self._place(size, replica_num, preferred)
        if not chosen and self.release_quarantine(now):
            chosen = self._place(size, replica_num, preferred)
        if not chosen and self._fence_until and self._fenced_out(key, size, now):
            chosen = self._place(size, replica_num, preferred)
        while not chosen and self._evict_one(now):      # fragmentation: evict until one fits
            chosen = self._place(size, replica_num, preferred)
        if not chosen:
            largest = max((s.alloc.largest_free for s in self.segments.values()), default=0)
            if self._ssd_held:
                self._ssd_held = False
                raise SsdBusyError(f"no space for {size} bytes until SSD tiers copy the objects they hold "
                                   f"(eager mode): retry", key=key)
            raise NoSpaceError(f"no segment can hold {size} bytes (largest free extent {largest}, "
                               f"{len(self.segments)} segments)", key=key)
        replicas = []
        for seg in chosen:
            off = seg.alloc.allocate(size)
            assert off is not None          # place() returned only segments where it fits
            length = seg.alloc.allocated_length(off)
            self._used += length
            replicas.append(Replica(seg.id, off, length))
            seg.keys.add(key)
        if type(pin) is bool or not pin:
            self.objects[key] = Object(key, size, replicas, State.ALLOCATED, client_id, pinned=bool(pin),
                                       token=token, want=replica_num)
        else:
            self.objects[key] = Object(key, size, replicas, State.ALLOCATED, client_id, token=token,
                                       soft_until=now + _soft_pin_seconds(pin, self.soft_pin_ttl),
                                       want=replica_num)
        c.writing.add(key)
        if ns:
            self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + size
        return replicas

    def put_end(self, client_id: str, key: str, failed_segments: list[int] | tuple = ()) -> int:
        """The writer wrote every replica but those on `failed_segments`:
        those are freed, the rest become COMPLETE and visible. Returns the
        number of replicas kept (0: the object is gone, as after a revoke).
        A put_end repeated after it succeeded (a retried request, possibly
        at a new master that recovered the object) returns the same count."""
        obj = self.objects.get(key) if isinstance(key, str) else None
        if obj is None or obj.state is not State.ALLOCATED or obj.writer != client_id:
            if obj is not None and obj.state is State.COMPLETE and obj.writer == client_id:
                return len(obj.replicas)
            self._revoked_put(client_id, key)       # revoked for lasting too long: says so
            obj = self._pending(client_id, key)     # raises the key's error
        if type(failed_segments) in (list, tuple) and not failed_segments:
            keep = obj.replicas             # every replica written (the common case)
        else:
            failed = set(failed_segments)
            keep = []
            for r in obj.replicas:
                if r.segment in failed:
                    self._free(key, r)
                else:
                    keep.append(r)
            obj.replicas = keep
        self.clients[client_id].writing.discard(key)
        if not keep:
            del self.objects[key]
            self._uncharge(obj)
            return 0
        obj.state = State.COMPLETE
        self._lru[key] = None
        if self.dirty_objects is not None:
            self.dirty_objects.add(key)
        if self._ssd_clients:
            self._ssd_note(obj)
        return len(keep)

    def put_revoke(self, client_id: str, key: str, token: int | None = None) -> None:
        """The put failed: its allocations are freed and the key is free again.
        With `token`, only a put_start made with that token is revoked (a
        call that gave up on its own put_start's reply revokes whatever that
        put_start allocated, and nothing another call of the client holds)."""
        obj = self._pending(client_id, key)
        if token is not None and obj.token != token:
            raise ObjectNotFoundError(f"no put of {key!r} in progress by this call", key=key)
        self._delete(obj)

    # -- reads (the leases themselves: read_leases.py) ----------------------------
    def get_replicas(self, key: str, now: float, lease: int | None = None) -> Object:
        """The COMPLETE object (size, replicas), under read lease `lease`
        (a new one of its own if None) until now + lease_ttl.
        ObjectNotFoundError otherwise."""
        # a stored key was valid at its put: check_key only for a miss
        obj = self.objects.get(key) if type(key) is str else None
        if obj is None or obj.state is not State.COMPLETE:
            obj = self._complete(key)       # raises the key's error
        if lease is None or lease not in self._leases:
            lease = self.new_lease(now)
        until, objs = self._leases[lease]
        obj.leases[lease] = until
        objs.append(obj)
        if key in (lru := self._lru):       # _touch, inline
            lru.move_to_end(key)
        return obj

    def exists(self, key: str) -> bool:
        check_key(key)
        obj = self.objects.get(key)
        return obj is not None and obj.state is State.COMPLETE

    def exist_many(self, keys: list[str]) -> list[bool]:
        """exists() of each of `keys`, without checking them: a key that
        is not a valid one is not found (TypeError for an unhashable one).
        The LRU order holds exactly the COMPLETE objects' keys."""
        lru = self._lru
        if self._ssd_only:
            ssd = self._ssd_only
            return [k in lru or k in ssd for k in keys]
        return list(map(lru.__contains__, keys))     # no Python frame per key

    def size(self, key: str) -> int:
        return self._complete(key).size

    # -- removal and eviction --------------------------------------------------
    def remove(self, key: str, now: float, *, force: bool = False) -> None:
        """ObjectLeasedError while a get's lease runs, unless `force`: then
        the key is gone at once and its space is freed when the lease ends."""
        obj = self._complete(key)
        if obj.leased(now):
            if not force:
                self.lease_waits["remove"] += 1
                raise ObjectLeasedError(f"{key!r} is leased to a reader for at most "
                                        f"{obj.lease_end() - now:.3f} s more", key=key)
            self._quarantine.append((obj, obj.replicas))
            self.lease_waits["quarantine"] += 1
            for r in obj.replicas:            # no longer an object's replica
                seg = self.segments.get(r.segment)
                if seg is not None:
                    seg.keys.discard(key)
            obj.replicas = []
        self._delete(obj)

    def remove_all(self, now: float, *, force: bool = False, ns: str = "") -> int:
        """Removes every COMPLETE object not under a lease (every one with
        `force`, leased ones' space freed when their leases end), of
        namespace `ns` only when given; puts in progress are left to their
        writers. Returns how many were removed."""
        gone = 0
        prefix = ns + NS_SEP if ns else ""
        for key in [*self._lru, *self._ssd_only]:
            if prefix and not key.startswith(prefix):
                continue
            obj = self.objects[key]
            if force or not obj.leased(now):
                self.remove(key, now, force=force)
                gone += 1
        return gone

    def release_quarantine(self, now: float) -> int:
        """Frees the space of forced removals whose leases have ended or
        were released; returns the bytes freed. Called when a put needs
        space, at a lease release, and by the master's monitor."""
        if not self._quarantine:
            return 0
        freed = 0
        keep = []
        for obj, replicas in self._quarantine:
            if obj.leased(now):
                keep.append((obj, replicas))
                continue
            for r in replicas:
                seg = self.segments.get(r.segment)
                if seg is not None:           # a dropped segment's space went with it
                    self._used -= seg.alloc.release(r.offset)
                    freed += r.length
        self._quarantine = keep
        return freed

    def evictable(self, obj: Object, now: float) -> bool:
        return obj.state is State.COMPLETE and not obj.pinned and not obj.leased(now)

    def _evict(self, nbytes: int, now: float) -> int:
        """Evicts least-recently-used objects until `nbytes` bytes were freed
        or nothing evictable is left; returns the bytes freed."""
        freed = 0
        victims = []
        waiting = []        # SSD copies wanted but not written yet: evicted last (the cleaner may catch up)
        soft = []           # soft-pinned: only when nothing else is left
        for key in self._lru:                 # oldest first; no copy of the whole order
            if freed >= nbytes:
                break
            obj = self.objects[key]
            if self.evictable(obj, now):
                if obj.soft_until > now:
                    soft.append(obj)
                    continue
                if self._ssd_clients and self._ssd_wanted(obj):
                    waiting.append(obj)
                    continue
                freed += sum(r.length for r in obj.replicas)
                victims.append(obj)
            elif obj.leases and not obj.pinned:
                self.lease_waits["evict"] += 1
        for obj in waiting:
            if freed >= nbytes:
                break
            if self._ssd_strict(obj):
                self._ssd_held = True
                continue        # "eager": never lost for want of its copy; the put waits (SsdBusyError)
            freed += sum(r.length for r in obj.replicas)
            victims.append(obj)
            self.ssd_missed += 1
        for obj in soft:
            if freed >= nbytes:
                break
            freed += sum(r.length for r in obj.replicas)
            victims.append(obj)
            self.soft_evictions += 1
        for obj in victims:
            if obj.ssd:
                self._drop_dram(obj)          # still readable: from its SSD copies
            else:
                self._delete(obj)
        self.evictions += len(victims)
        self.evicted_bytes += freed
        return freed

    def _evict_one(self, now: float) -> bool:
        return self._evict(1, now) > 0

    # -- helpers ---------------------------------------------------------------
    def _place(self, size: int, replica_num: int, preferred: int | list[int] | None) -> list[Segment]:
        """place() over the attached segments; segments restored from etcd
        whose owners have not mounted them again are used only for what
        the attached ones cannot hold (right after a failover, before the
        holders are back: gets already read from them, and a write to a
        holder that is gone fails like any other, per replica)."""
        segs, attached, _ = self._seg_view or self._segments_view()
        if attached:
            return place(segs, size, replica_num, preferred=preferred, rng=self._rng)
        chosen = place([s for s in segs if s.attached], size, replica_num, preferred=preferred, rng=self._rng)
        if len(chosen) < replica_num:
            taken = {s.id for s in chosen}
            chosen += place([s for s in segs if not s.attached and s.id not in taken], size,
                            replica_num - len(chosen), preferred=preferred, rng=self._rng)
        return chosen

    def _segments_view(self) -> tuple[list[Segment], bool, int]:
        segs = list(self.segments.values())
        self._seg_view = (segs, all(s.attached for s in segs), max((s.alloc.capacity for s in segs), default=0))
        return self._seg_view

    def _client(self, client_id: str) -> Client:
        c = self.clients.get(client_id)
        if c is None:
            raise StoreError(f"client {client_id!r} is not registered (or was declared lost)")
        return c

    def _complete(self, key: str) -> Object:
        check_key(key)
        obj = self.objects.get(key)
        if obj is None or obj.state is not State.COMPLETE:
            raise ObjectNotFoundError(f"no object {key!r}", key=key)
        return obj

    def _pending(self, client_id: str, key: str) -> Object:
        check_key(key)
        obj = self.objects.get(key)
        if obj is None or obj.state is not State.ALLOCATED or obj.writer != client_id:
            raise ObjectNotFoundError(f"no put of {key!r} in progress by {client_id}", key=key)
        return obj

    # -- namespaces and quotas ------------------------------------------------
    def set_quota(self, ns: str, nbytes: int | None) -> None:
        """Namespace `ns` may hold at most `nbytes` of objects (None: no
        quota). A put over it first evicts the namespace's own least
        recently used objects (never another tenant's), else fails with
        QuotaExceededError."""
        if type(ns) is not str or not ns or NS_SEP in ns or len(ns) > 256:
            raise InvalidArgumentError(f"a namespace is a non-empty str of at most 256 characters, not {ns!r}")
        if nbytes is not None and (type(nbytes) is not int or nbytes <= 0):
            raise InvalidArgumentError(f"a quota is a positive int of bytes or None, not {nbytes!r}")
        if self.quotas.get(ns) == nbytes:
            return                  # a client re-attaching says it again: nothing to write
        if nbytes is None:
            self.quotas.pop(ns, None)
        else:
            self.quotas[ns] = nbytes
        if self.dirty_quotas is not None:
            self.dirty_quotas = True

    def charge(self, obj: Object) -> None:
        """An object came into being outside put_start (recovery, SSD
        adoption): its namespace's bytes count it."""
        ns = namespace_of(obj.key) if NS_SEP in obj.key else ""
        if ns:
            self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + obj.size

    def _uncharge(self, obj: Object) -> None:
        if NS_SEP in obj.key:
            ns = namespace_of(obj.key)
            left = self.ns_bytes.get(ns, 0) - obj.size
            if left > 0:
                self.ns_bytes[ns] = left
            else:
                self.ns_bytes.pop(ns, None)

    def _evict_namespace(self, ns: str, nbytes: int, now: float) -> int:
        """Removes the namespace's least recently used evictable objects
        (soft-pinned ones last) until `nbytes` of its bytes are free."""
        prefix = ns + NS_SEP
        plain, soft, freed = [], [], 0
        for key in self._lru:
            if key.startswith(prefix):
                obj = self.objects[key]
                if self.evictable(obj, now):
                    (soft if obj.soft_until > now else plain).append(obj)
        for obj in plain + soft:
            if freed >= nbytes:
                break
            freed += obj.size
            self._delete(obj)
            self.evictions += 1
        return freed

    def _touch(self, key: str) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def _free(self, key: str, r: Replica) -> None:
        seg = self.segments.get(r.segment)
        if seg is not None:          # a dropped segment's space went with it
            self._used -= seg.alloc.release(r.offset)
            seg.keys.discard(key)

    def _delete(self, obj: Object) -> None:
        if obj.state is State.COMPLETE and self.dirty_objects is not None:
            self.dirty_objects.add(obj.key)
        for r in obj.replicas:
            self._free(obj.key, r)
        if obj.ssd is not None or obj.promoting:
            self._ssd_forget(obj)
        if self.objects.pop(obj.key, None) is obj:
            self._uncharge(obj)
        self._lru.pop(obj.key, None)
        self._short.discard(obj.key)
        w = self.clients.get(obj.writer)
        if w is not None:
            w.writing.discard(obj.key)

    def _drop_segment(self, seg: Segment) -> int:
        dropped = 0
        for key in list(seg.keys):
            obj = self.objects.get(key)
            if obj is None:
                continue
            obj.replicas = [r for r in obj.replicas if r.segment != seg.id]
            if not obj.replicas and obj.ssd and obj.state is State.COMPLETE:
                self._lru.pop(key, None)      # its SSD copies remain
                self._ssd_only.add(key)
            elif not obj.replicas:
                self._delete(obj)
                dropped += 1
            elif obj.state is State.COMPLETE:
                if len(obj.replicas) < obj.want:
                    self._short.add(key)      # made again by a holder of another replica
                if self.dirty_objects is not None:
                    self.dirty_objects.add(key)
        del self.segments[seg.id]
        self._seg_view = None
        if self.dirty_segments is not None:
            self.dirty_segments.add(seg.id)
        self._capacity -= seg.alloc.capacity
        self._used -= seg.alloc.used       # its space goes with it, live or quarantined
        c = self.clients.get(seg.client)
        if c is not None:
            c.segments.discard(seg.id)
        return dropped
