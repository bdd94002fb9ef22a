"""The master's put_start of a whole batch in the pool's common case (a
mixin of StoreModel, model.py): one pass over the batch, one allocation
run for all of it (allocator.allocate_run), none of put_start's per-key
placement and eviction. A 64-key put_start is the master's costliest call
of a batch put; this is most of its time (one segment: 64 keys ~270 ->
~180 us on these hosts)."""
from __future__ import annotations

from .allocator import ALIGN
from .records import MAX_KEY_BYTES, NS_SEP, Object, Replica, State, namespace_of

__all__ = ["BatchPuts"]


class BatchPuts:
    def put_start_one_segment(self, client_id: str, items: list, now: float, token: int) -> list | None:
        """put_start of a batch's items ([key, size, replica_num, preferred,
        pin]) in the pool's common case, without put_start's per-key
        checks and placement: one attached segment, room for the whole
        batch below the high watermark (no eviction). Per item its replica
        (a Replica), or None where put_start itself must answer (a key that
        exists or is in progress, a pin, replicas > 1, a namespace with a
        quota, no free extent that fits, a bad key or size); None for the
        whole batch when it is not this case."""
        view = self._seg_view or self._segments_view()
        segs, attached, _ = view
        c = self.clients.get(client_id)
        if len(segs) != 1 or not attached or c is None:
            return None
        seg = segs[0]
        try:
            need = sum(it[1] for it in items if type(it[1]) is int) + ALIGN * len(items)
        except (TypeError, IndexError, KeyError):
            return None             # a malformed item: put_start's own checks answer it
        cap = self._capacity
        if cap and self._used + need > self.high_watermark * cap:
            return None
        objects, quotas = self.objects, self.quotas
        out: list = [None] * len(items)
        todo = []           # (index, key, size, namespace) of the common case
        for j, (key, size, replica_num, preferred, pin) in enumerate(items):
            if replica_num != 1 or pin is not False or type(key) is not str or not key \
                    or len(key) > MAX_KEY_BYTES // 4 or type(size) is not int or size <= 0 or key in objects \
                    or (preferred is not None and type(preferred) is not int) or type(replica_num) is not int:
                continue
            ns = namespace_of(key) if NS_SEP in key else ""
            if not (ns and ns in quotas):
                todo.append((j, key, size, ns))
        if not todo:
            return out
        alloc = seg.alloc
        offsets = alloc.allocate_run([t[2] for t in todo])
        sid, seg_keys, writing, lengths, allocated = seg.id, seg.keys, c.writing, alloc._used, State.ALLOCATED
        for n, (j, key, size, ns) in enumerate(todo):
            off = offsets[n] if offsets is not None else alloc.allocate(size)
            if off is None:
                continue
            length = lengths[off]
            self._used += length
            r = Replica(sid, off, length)
            seg_keys.add(key)
            objects[key] = Object(key, size, [r], allocated, client_id, token=token)
            writing.add(key)
            if ns:
                self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + size
            out[j] = r
        return out

