"""What a master keeps in etcd, and how it gets there: the layout, the
records, a group-committing journal of changes, and recovery.

Layout, under `kvflow/store/<cluster>/`:

    leader          the leader's address, on its election lease (election.py)
    meta            {"next_segment": n}: segment ids are never reused, so a
                    stale record can never point into a newer segment
    s/<id>          a mounted segment: [client, host, engine, name, base, size]
    o/<key>         a COMPLETE object: [size, [[segment, offset, length], ...],
                    pinned, writer, token]

One key per object, not a log of records compacted into snapshots: the
state in etcd is always the index itself (recovery is one paged range, no
replay), and a record is rewritten only when its object changes. Puts in
progress, read leases and the LRU order are not recorded: a put in
progress at a crash is simply absent, so its space is free again when the
segments are rebuilt from the COMPLETE objects' extents.

Group commit: the master stages each call's changes (the keys, not their
values: a key staged twice in one flush is written once, with its state
at flush time) and one flusher task writes whatever is staged as one etcd
txn per `max_ops` keys (etcd's --max-txn-ops, 128 by default), the chunks
of one flush concurrently. A batch put_end of N <= 128 objects is one
round trip, and calls that arrive while a flush is in flight share the
next one. Every txn is fenced: it applies only while the leader key is
still the one this master created (`create_revision`), so a master that
lost its lease (stopped, partitioned) can never overwrite its successor's
records; a fenced or failed write is a DurabilityError and the master
stops (fail-stop: its memory could no longer be made durable).

Ordering (master.py applies it): a put_start's reply, which lets a client
write into space, is sent only once every deletion staged before it
(`free_seq`) and its own changes (evictions) are in etcd, so an object's
deletion is durable before its space can be handed to another put, and a
recovered record never points at bytes a later put overwrote. Other
changes (remove, mount) reply once durable; a put_end too with the
default `sync` commit (an acknowledged put survives a crash). With
`async` commit a put_end replies at once and its record follows within
one flush: a crash may forget the last few milliseconds of puts (misses,
never wrong bytes), and a put costs no etcd round trip.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re

import msgpack

from kvflow.errors import InvalidArgumentError

from .errors import DurabilityError
from .etcd import EtcdClient, b64
from .model import State, StoreModel

__all__ = ["Layout", "Journal", "recover"]

log = logging.getLogger("kvflow.store.durable")
_CLUSTER = re.compile(r"[A-Za-z0-9._-]{1,64}")


class Layout:
    """The etcd keys of one cluster."""

    def __init__(self, cluster: str) -> None:
        if not isinstance(cluster, str) or not _CLUSTER.fullmatch(cluster):
            raise InvalidArgumentError(f"cluster name {cluster!r}: 1-64 of A-Z a-z 0-9 . _ -")
        self.cluster = cluster
        self.root = f"kvflow/store/{cluster}/".encode()
        self.leader = self.root + b"leader"
        self.meta = self.root + b"meta"

    def obj(self, key: str) -> bytes:
        return self.root + b"o/" + key.encode()

    def seg(self, sid: int) -> bytes:
        return self.root + b"s/%d" % sid


def _pack(v: object) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


class Journal:
    """Writes a model's changes to etcd (see the module's doc)."""

    def __init__(self, etcd: EtcdClient, layout: Layout, model: StoreModel, *, fence_revision: int,
                 max_ops: int = 128) -> None:
        self.etcd = etcd
        self.layout = layout
        self.model = model
        self.fence_revision = fence_revision
        self.max_ops = max_ops
        self.seq = 0                # flushes asked for
        self.committed = 0          # flushes written
        self.free_seq = 0           # the last flush that deletes a record (space that may be reused)
        self.failed: DurabilityError | None = None
        self.txns = 0
        self.keys_written = 0
        self._objects: set[str] = set()
        self._segments: set[int] = set()
        self._meta = False
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._flusher: asyncio.Task | None = None
        self.on_failure = lambda e: None
        model.track()

    def __repr__(self) -> str:
        return f"<Journal {self.layout.cluster} on {self.etcd.address} seq={self.seq} committed={self.committed}>"

    def stage(self) -> bool:
        """Takes the model's dirty sets; True when something new is to be written."""
        m = self.model
        if not (m.dirty_objects or m.dirty_segments):
            return False
        self.seq += 1
        objects = m.objects
        if any((o := objects.get(k)) is None or o.state is not State.COMPLETE for k in m.dirty_objects):
            self.free_seq = self.seq
        self._objects |= m.dirty_objects
        if m.dirty_segments:
            self._segments |= m.dirty_segments
            self._meta = True
            self.free_seq = self.seq
        m.dirty_objects, m.dirty_segments = set(), set()
        if self._flusher is None and self.failed is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return True

    def wait(self, seq: int) -> asyncio.Future:
        """A future done once flush `seq` (and every one before) is in etcd;
        its exception is the DurabilityError that stopped the journal."""
        fut = asyncio.get_running_loop().create_future()
        if self.failed is not None:
            fut.set_exception(self.failed)
        elif seq <= self.committed:
            fut.set_result(None)
        else:
            self._waiters.append((seq, fut))
        return fut

    async def _flush(self) -> None:
        try:
            while self._objects or self._segments or self._meta:
                target = self.seq
                ops = self._ops()
                chunks = [ops[i:i + self.max_ops] for i in range(0, len(ops), self.max_ops)]
                await asyncio.gather(*(self._txn(c) for c in chunks))
                self.committed = target
                while self._waiters and self._waiters[0][0] <= target:
                    _, fut = self._waiters.popleft()
                    if not fut.done():
                        fut.set_result(None)
        except DurabilityError as e:
            self.failed = e
            for _, fut in self._waiters:
                if not fut.done():
                    fut.set_exception(e)
            self._waiters.clear()
            log.error("durability lost: %s", e)
            self.on_failure(e)
        finally:
            self._flusher = None

    def _ops(self) -> list[dict]:
        """The staged keys as etcd requests, with their state now."""
        m, lay = self.model, self.layout
        ops = []
        for key in self._objects:
            obj = m.objects.get(key)
            k = b64(lay.obj(key))
            if obj is None or obj.state is not State.COMPLETE:
                ops.append({"request_delete_range": {"key": k}})
            else:
                rec = [obj.size, [[r.segment, r.offset, r.length] for r in obj.replicas], obj.pinned,
                       obj.writer, obj.token]
                ops.append({"request_put": {"key": k, "value": b64(_pack(rec))}})
        for sid in self._segments:
            seg = m.segments.get(sid)
            k = b64(lay.seg(sid))
            if seg is None:
                ops.append({"request_delete_range": {"key": k}})
            else:
                c = m.clients.get(seg.client)
                rec = [seg.client, c.host if c else "", c.engine if c else "", seg.name, seg.base, seg.size]
                ops.append({"request_put": {"key": k, "value": b64(_pack(rec))}})
        if self._meta:
            ops.append({"request_put": {"key": b64(lay.meta),
                                        "value": b64(_pack({"next_segment": m.next_segment}))}})
        self._objects, self._segments, self._meta = set(), set(), False
        return ops

    async def _txn(self, ops: list[dict]) -> None:
        fence = [{"target": "CREATE", "key": b64(self.layout.leader), "result": "EQUAL",
                  "create_revision": str(self.fence_revision)}]
        doc = await self.etcd.txn(fence, ops)
        self.txns += 1
        self.keys_written += len(ops)
        if not doc.get("succeeded"):
            raise DurabilityError(f"etcd {self.etcd.address}: this master is no longer the leader of "
                                  f"cluster {self.layout.cluster!r}: its writes are fenced")

    async def close(self) -> None:
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)


async def recover(etcd: EtcdClient, layout: Layout, model: StoreModel, now: float) -> dict:
    """Rebuilds `model` (empty) from the records under `layout`: segments
    detached, their owners' clients recovered, COMPLETE objects in the
    order they were last written (the LRU order's best stand-in). Records
    that cannot be used are dropped from etcd at the first flush (the
    model marks them dirty). Returns counts."""
    kvs = await etcd.range_prefix(layout.root)
    segs, objs, meta = [], [], {}
    n_obj = len(layout.root) + 2
    for kv in kvs:
        k = kv["key"]
        if k == layout.leader:
            continue
        try:
            v = msgpack.unpackb(kv["value"], raw=False)
            if k == layout.meta:
                meta = v
            elif k.startswith(layout.root + b"s/"):
                segs.append((int(k[n_obj:]), v))
            elif k.startswith(layout.root + b"o/"):
                objs.append((kv["mod_revision"], k[n_obj:].decode(), v))
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            log.warning("skipping malformed record %r: %s", k[:80], e)
    for sid, (client, host, engine, name, base, size) in segs:
        model.restore_segment(sid, client, host, engine, name, base, size, now)
    kept = 0
    for _, key, (size, replicas, pinned, writer, token) in sorted(objs, key=lambda o: o[0]):
        if model.restore_object(key, size, replicas, pinned=pinned, writer=writer, token=token):
            kept += 1
        elif model.dirty_objects is not None:
            model.dirty_objects.add(key)
    if isinstance(meta, dict):
        model.skip_segment_ids(int(meta.get("next_segment", 1)))
    return {"segments": len(segs), "objects": kept, "dropped": len(objs) - kept}
