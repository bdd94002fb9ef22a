"""Lost replicas made again: the master's side (a mixin of StoreModel,
model.py, which holds the state: `_short`, `_repairs`). An object whose put
asked for more replicas than it has left after a holder was lost is handed
to a client holding one of the others, with a new allocation on a client
holding none; the client (client.py, _make_replicas) copies its own replica
there over kvflow and reports it; the replica joins the object only then.
Copy and move tasks (tasks.py) travel the same way: a task's copies are
handed out here with the repairs, and end here."""
from __future__ import annotations

from .errors import ObjectNotFoundError
from .placement import place
from .records import Replica, State

__all__ = ["ReplicaRepair"]


class ReplicaRepair:
    # -- lost replicas made again ---------------------------------------------
    def repairable(self, client_id: str) -> int:
        """How many objects short of replicas the client holds a replica of
        (told in its heartbeat's reply: it then asks for the work)."""
        c = self.clients.get(client_id)
        if c is None:
            return 0
        n = self._tasks_waiting(client_id)
        if not self._short:
            return n
        for key in self._short:
            obj = self.objects.get(key)
            if obj is not None and key not in self._repairs and any(r.segment in c.segments for r in obj.replicas):
                n += 1
        return n

    def repair_start(self, client_id: str, now: float, limit: int) -> tuple[list, int]:
        """Up to `limit` objects short of replicas that this client holds a
        replica of: for each, a new replica allocated on a client that holds
        none (never by evicting) and the client's own replica to copy from.
        The objects are leased (lease returned) so that the source cannot be
        evicted or removed under the copy; the new replica is invisible until
        repair_end. Copy and move tasks of this client's come after the
        repairs (tasks.py). Returns ([(key, size, source, new), ...], lease)."""
        c = self._client(client_id)
        lease = self.new_lease(now)
        jobs: list = []
        for key in list(self._short):
            if len(jobs) >= limit:
                break
            obj = self.objects.get(key)
            if obj is None or obj.state is not State.COMPLETE or len(obj.replicas) >= obj.want:
                self._short.discard(key)
                continue
            if key in self._repairs:
                continue
            src = next((r for r in obj.replicas if r.segment in c.segments), None)
            if src is None:
                continue
            holders = {self.segments[r.segment].client for r in obj.replicas}
            segs = [s for s in (self._seg_view or self._segments_view())[0]
                    if s.attached and s.client not in holders and s.client in self.clients]
            chosen = place(segs, obj.size, 1, rng=self._rng)
            if not chosen:
                continue                    # no room on another client now: tried again later
            new = self._start_copy(client_id, obj, chosen[0], now, lease, None)
            assert new is not None          # place() chose a segment with room
            jobs.append((key, obj.size, src, new))
        if len(jobs) < limit and client_id in self._task_queue:
            jobs += self._task_jobs(client_id, now, lease, limit - len(jobs))
        return jobs, lease

    def _start_copy(self, client_id: str, obj, seg, now: float, lease: int, task) -> Replica | None:
        """A new replica of `obj` allocated on `seg` for `client_id` to copy
        into (a repair's, or `task`'s), invisible until repair_end; the
        object is under `lease` meanwhile, so its source replica stays. None
        when `seg` has no room."""
        off = seg.alloc.allocate(obj.size)
        if off is None:
            return None
        new = Replica(seg.id, off, seg.alloc.allocated_length(off))
        self._used += new.length
        self.get_replicas(obj.key, now, lease)
        self._repairs[obj.key] = (client_id, new, lease, obj, task)
        self.clients[client_id].repairing.add(obj.key)
        return new

    def repair_end(self, client_id: str, key: str, ok: bool) -> int:
        """The copy of a new replica of `key` finished (`ok`) or failed: the
        replica joins the object, or its space is freed. Returns 1 if it
        joined."""
        ent = self._repairs.get(key) if isinstance(key, str) else None
        if ent is None or ent[0] != client_id:
            raise ObjectNotFoundError(f"no copy of {key!r} in progress by this client", key=key)
        return self._end_repair(key, bool(ok))

    def _end_repair(self, key: str, ok: bool) -> int:
        cid, new, _, copied, task = self._repairs.pop(key)
        c = self.clients.get(cid)
        if c is not None:
            c.repairing.discard(key)
        joined = self._join(key, new, copied, ok, task is None)
        if task is not None:
            self._task_copied(task, ok, bool(joined))
        return joined

    def _join(self, key: str, new: Replica, copied, ok: bool, repair: bool) -> int:
        """The new replica joins the object (a repair's only while the object
        is still short of replicas: a task's adds one whatever it has), or
        its space is freed."""
        seg = self.segments.get(new.segment)
        if seg is None:
            return 0                        # its segment was dropped: its space went with it
        obj = self.objects.get(key)
        if ok and obj is copied and obj.state is State.COMPLETE and (len(obj.replicas) < obj.want or not repair) \
                and all(r.segment != seg.id for r in obj.replicas):
            obj.replicas.append(new)
            seg.keys.add(key)
            self.repaired += repair
            if len(obj.replicas) >= obj.want:
                self._short.discard(key)
            if self.dirty_objects is not None:
                self.dirty_objects.add(key)
            return 1
        self._used -= seg.alloc.release(new.offset)
        return 0
