"""What a master keeps in etcd, and how it gets there: the layout, the
records, a group-committing journal of changes, and recovery.

Layout, under `kvflow/store/<cluster>/`:

    leader          the leader's address, on its election lease (election.py)
    meta            {"next_segment": n, "write_window": s}: segment ids are
                    never reused, so a stale record can never point into a
                    newer segment; write_window: the longest a client's
                    write may outlast its put_start's reply, the failover
                    fence's length (fence.py)
    s/<id>          a mounted segment: [client, host, engine, name, base, size]
    r/<id>          a record of COMPLETE objects, those one flush committed
                    together (a batch put): [[key, size, [[segment, offset,
                    length], ...], pinned, writer, token, want, soft_until],
                    ...]: `want` the replicas its put asked for (repair.py
                    makes lost ones again), `soft_until` its soft pin's end
                    in wall-clock seconds (time.time(); 0: none). An entry
                    may have more fields than a reader knows (later ones are
                    ignored) or fewer: records written before want and
                    soft_until (6 fields) recover with want = the replicas
                    they name and no soft pin. A record of 32 objects or
                    more is written now in the packed form (record_form.py:
                    a column per field, 40% of the bytes, decoded a column
                    at a time); both forms are read. Masters before the
                    packed form cannot read it: upgrade standbys first
    c/<id>          a registered client: [write window, host, engine],
                    written before its register's reply, deleted when it is
                    lost: who may have writes in flight at a failover
                    (fence.py)
    t/<hi>.<lo>     a copy or move task (tasks.py's Task.record()): written
                    when it is created, as a target's copy joins, and when
                    it finishes; deleted when it is no longer queryable
    quotas          {namespace: bytes}, every quota (set_quota); rewritten
                    whole at each change, which is rare (a client's attach
                    says its quota again, a no-op when unchanged)

A record per flush, not a key per object: etcd's cost grows with the keys
a txn touches (about 25 us per key through its JSON gateway here: a
64-key txn took 2.6 ms, a one-key txn 0.9 ms), so a batch put of 64
objects is one key written. When objects of a record go (removed,
evicted, their segment dropped) the record is rewritten with the rest, or
deleted with its last one; objects of one batch tend to go together (one
LRU age). A put's pins and want count ride in its object's entry: they
never change after the put, so they cost no write of their own (a
64-object record grows by 2-10 bytes an entry). A soft pin's end is
recorded as a wall-clock deadline, not a TTL: a TTL would restart at
every rewrite and recovery. A new leader on another host reads it with
its own clock, so the pin ends off by the hosts' clock skew (NTP keeps
that to milliseconds; soft pins last minutes), and a deadline already
past at recovery is no pin. Readers before want and soft_until cannot
read 8-field entries: upgrade standbys with (or before) the leader. The
state in etcd is always the index itself, not a log: recovery is one
paged range, no replay, nothing to compact. Puts in
progress, read leases and the LRU order are not recorded: a put in
progress at a crash is simply absent, so its space is free again when the
segments are rebuilt from the recorded extents.

Group commit: the master stages each call's changed keys; one flusher
task writes whatever is staged, records with their state at flush time,
as txns of at most `max_ops` keys (etcd's --max-txn-ops, 128 by default)
and MAX_TXN_BYTES, the txns of one flush concurrently. Calls that arrive
while a flush is in flight share the next one. Every txn is fenced: it
applies only while the leader key is still the one this master created
(`create_revision`), so a master that lost its lease (stopped,
partitioned) can never overwrite its successor's records; a fenced or
failed write is a DurabilityError and the master stops (fail-stop: its
memory could no longer be made durable).

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
import gc
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable

import msgpack

from kvflow.errors import InvalidArgumentError

from .errors import DurabilityError
from . import bulk_restore, record_form
from .etcd import EtcdClient, b64
from .fence import DEFAULT_WRITE_WINDOW
from .model import State, StoreModel
from .records import entry_pins

__all__ = ["Layout", "Journal"]

log = logging.getLogger("kvflow.store.durable")
_CLUSTER = re.compile(r"[A-Za-z0-9._-]{1,64}")

# one txn's body stays under etcd's 1.5 MiB request limit (values travel in
# base64 inside JSON); a new record holds at most RECORD_KEYS objects and
# RECORD_BYTES of keys, so that it fits one txn on its own
MAX_TXN_BYTES = 1 << 20
RECORD_KEYS = 256
RECORD_BYTES = 256 << 10
YIELD_S = 0.05          # the longest recovery holds the loop at a time (the election's keep-alive runs)
BULK_RECORDS = 128      # records decoded into columns at a time by recovery's fast path (up to 32k objects)


class Layout:
    """The etcd keys of one cluster."""

    def __init__(self, cluster: str) -> None:
        if not isinstance(cluster, str) or not _CLUSTER.fullmatch(cluster):
            raise InvalidArgumentError(f"cluster name {cluster!r}: 1-64 of A-Z a-z 0-9 . _ -")
        self.cluster = cluster
        self.root = f"kvflow/store/{cluster}/".encode()
        self.leader = self.root + b"leader"
        self.meta = self.root + b"meta"
        self.quotas = self.root + b"quotas"

    def record(self, rid: int) -> bytes:
        return self.root + b"r/%d" % rid

    def seg(self, sid: int) -> bytes:
        return self.root + b"s/%d" % sid

    def client(self, cid: str) -> bytes:
        return self.root + b"c/" + cid.encode()

    def task(self, tid: tuple[int, int]) -> bytes:
        return self.root + b"t/%d.%d" % tid


def _pack(v: object) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


class Journal:
    """Writes a model's changes to etcd (see the module's doc)."""

    def __init__(self, etcd: EtcdClient, layout: Layout, model: StoreModel, *, fence_revision: int,
                 max_ops: int = 128, clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd = etcd
        self.clock = clock          # the model's clock (its `now`): soft pins' ends are on it
        self.layout = layout
        self.model = model
        self.fence_revision = fence_revision
        self.max_ops = max_ops
        self.seq = 0                # flushes asked for
        self.committed = 0          # flushes written
        self.free_seq = 0           # the last flush that deletes an object (space that may be reused)
        self.failed: DurabilityError | None = None
        self.txns = 0
        self.keys_written = 0
        self._record_of: dict[str, int] = {}        # object key -> its record
        self._members: dict[int, set[str]] = {}     # record -> the object keys in it
        self._next_record = 1
        self._records: set[int] = set()             # records to write (or delete) at the next flush
        self._segments: set[int] = set()
        self._tasks: set[tuple[int, int]] = set()  # copy and move tasks to write (or delete)
        self._clients: set[str] = set()             # client records to write (or delete)
        self._meta = False
        self._window = 0.0          # the write window in etcd's meta (fence.py)
        self._quotas = False
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._flusher: asyncio.Task | None = None
        self.on_failure = lambda e: None
        model.track()

    def __repr__(self) -> str:
        return f"<Journal {self.layout.cluster} on {self.etcd.address} seq={self.seq} committed={self.committed}>"

    def stage(self) -> bool:
        """Takes the model's dirty sets; True when something new is to be written."""
        m = self.model
        if m.write_window > self._window:
            self._window = m.write_window
            self._meta = True
            self.seq += 1
        elif not (m.dirty_objects or m.dirty_segments or m.dirty_quotas or m.dirty_tasks or m.dirty_clients):
            return False
        else:
            self.seq += 1
        if m.dirty_tasks:
            self._tasks |= m.dirty_tasks
            m.dirty_tasks = set()
        if m.dirty_clients:
            self._clients |= m.dirty_clients
            m.dirty_clients = set()
        if m.dirty_quotas:
            self._quotas, m.dirty_quotas = True, False
        objects, record_of = m.objects, self._record_of
        new: list[str] = []
        for key in m.dirty_objects:
            o = objects.get(key)
            rid = record_of.get(key)
            if o is not None and o.state is State.COMPLETE:
                if rid is None:
                    new.append(key)
                else:
                    self._records.add(rid)          # rewritten (a replica went)
            elif rid is not None:
                del record_of[key]
                self._members[rid].discard(key)
                self._records.add(rid)
                self.free_seq = self.seq
        if new:
            self._new_records(new)
        if m.dirty_segments:
            self._segments |= m.dirty_segments
            self._meta = True
            self.free_seq = self.seq
        m.dirty_objects, m.dirty_segments = set(), set()
        self._start_flush()
        return True

    def _start_flush(self) -> None:
        if self._flusher is None and self.failed is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def flush_recovered(self) -> None:
        """Writes what recovery found stale (records to rewrite or delete)."""
        if self._records and self._flusher is None and self.failed is None:
            self.seq += 1
            self.free_seq = self.seq
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def _new_records(self, keys: list[str]) -> None:
        members: set[str] = set()
        size = 0
        for key in keys:
            if len(members) >= RECORD_KEYS or size + len(key) > RECORD_BYTES:
                self._add_record(members)
                members, size = set(), 0
            members.add(key)
            size += len(key) * 4 + 64
        self._add_record(members)

    def _add_record(self, members: set[str]) -> int:
        rid = self._next_record
        self._next_record += 1
        self._members[rid] = members
        for key in members:
            self._record_of[key] = rid
        self._records.add(rid)
        return rid

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
            while self._records or self._segments or self._meta or self._quotas or self._tasks or self._clients:
                target = self.seq
                await asyncio.gather(*(self._txn(c) for c in self._chunks(self._ops())))
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

    def _ops(self) -> list[tuple[dict, int]]:
        """The staged records and segments as etcd requests (with their
        state now) and each one's size."""
        m, lay = self.model, self.layout
        ops = []
        wall = time.time() - self.clock() if self._records else 0.0    # the model's clock -> wall clock
        for rid in self._records:
            k = b64(lay.record(rid))
            rec = []
            for key in self._members.get(rid, ()):
                obj = m.objects.get(key)
                if obj is not None and obj.state is State.COMPLETE:
                    rec.append((key, obj.size, [(r.segment, r.offset, r.length) for r in obj.replicas],
                                obj.pinned, obj.writer, obj.token, obj.want,
                                obj.soft_until + wall if obj.soft_until else 0))
            if rec:
                v = b64(record_form.pack(rec))
                ops.append(({"request_put": {"key": k, "value": v}}, len(v)))
            else:
                self._members.pop(rid, None)
                ops.append(({"request_delete_range": {"key": k}}, 0))
        for sid in self._segments:
            seg = m.segments.get(sid)
            k = b64(lay.seg(sid))
            if seg is None:
                ops.append(({"request_delete_range": {"key": k}}, 0))
            else:
                c = m.clients.get(seg.client)
                rec = [seg.client, c.host if c else "", c.engine if c else "", seg.name, seg.base, seg.size]
                ops.append(({"request_put": {"key": k, "value": b64(_pack(rec))}}, 0))
        for tid in self._tasks:
            task = m.tasks.get(tid)
            k = b64(lay.task(tid))
            if task is None:
                ops.append(({"request_delete_range": {"key": k}}, 0))
            else:
                v = b64(_pack(task.record()))
                ops.append(({"request_put": {"key": k, "value": v}}, len(v)))
        for cid in self._clients:
            c = m.clients.get(cid)
            k = b64(lay.client(cid))
            if c is None:
                ops.append(({"request_delete_range": {"key": k}}, 0))
            elif not c.recovered:
                ops.append(({"request_put": {"key": k, "value": b64(_pack([c.window, c.host, c.engine]))}}, 0))
        if self._meta:
            ops.append(({"request_put": {"key": b64(lay.meta),
                                         "value": b64(_pack({"next_segment": m.next_segment,
                                                             "write_window": self._window}))}}, 0))
        if self._quotas:
            ops.append(({"request_put": {"key": b64(lay.quotas), "value": b64(_pack(dict(m.quotas)))}}, 0))
        self._records, self._segments, self._meta, self._quotas = set(), set(), False, False
        self._tasks, self._clients = set(), set()
        return ops

    def _chunks(self, ops: list[tuple[dict, int]]) -> list[list[dict]]:
        chunks: list[list[dict]] = []
        cur: list[dict] = []
        size = 0
        for op, n in ops:
            if cur and (len(cur) >= self.max_ops or size + n > MAX_TXN_BYTES):
                chunks.append(cur)
                cur, size = [], 0
            cur.append(op)
            size += n + 128
        if cur:
            chunks.append(cur)
        return chunks

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

    async def recover(self, now: float) -> dict:
        """Rebuilds the model (empty) from the records under the layout:
        segments detached, their owners' clients recovered, COMPLETE
        objects in the order their records were last written (the LRU
        order's best stand-in). Objects that cannot be restored (their
        segments are gone, their extents taken) leave their records at the
        first flush. Returns counts."""
        t0 = time.monotonic()
        kvs = await self.etcd.range_prefix(self.layout.root)
        read_s = time.monotonic() - t0
        # the rebuild makes a few objects per recorded object and frees
        # none: with the cyclic collector on, its collections scan the
        # growing index again and again (0.5 of 1.2 s at 100k objects);
        # nothing the rebuild makes is garbage, so it runs with it off
        enabled = gc.isenabled()
        gc.disable()
        try:
            counts = await self._rebuild(kvs, now)
            counts["read_s"] = read_s
            return counts
        finally:
            if enabled:
                gc.enable()

    async def _restore_bulk(self, records: list[tuple[int, int, object]], now: float, wall: float,
                            pause: Callable[[], Awaitable[None]]) -> bulk_restore.Restored | None:
        """bulk_restore.restore() of the records (sorted), in runs of one
        form each; None when a run is malformed or the records are not
        plainly restorable (then restore_object decides, one at a time)."""
        parts = []
        for packed, run in itertools.groupby(records, key=lambda r: type(r[2]) is dict):
            run = [(rid, v) for _, rid, v in run]
            for lo in range(0, len(run), BULK_RECORDS):         # a slice's columns between two pauses
                chunk = run[lo:lo + BULK_RECORDS]
                cols = record_form.from_packed(chunk) if packed else record_form.from_entries(chunk)
                if cols is None:
                    return None
                parts.append(cols)
                await pause()
        return await bulk_restore.restore(self.model, parts, now, wall, pause) if parts else None

    async def _rebuild(self, kvs: list[dict], now: float) -> dict:
        """recover()'s work on the kvs read. It yields to the loop every
        YIELD_S: the election's lease is kept alive by a task on this loop,
        and a rebuild of 1M objects (about 8 s) held the loop past the
        lease's TTL, so the new leader lost its lease before it served.
        Nothing else touches the model meanwhile (the master does not
        serve until recovery is done). Records that a master wrote
        (every extent on a recorded segment, no key twice) are restored
        at C speed, their objects made at first touch (bulk_restore.py:
        11 s for 1M objects before); anything else one object at a time."""
        lay, model = self.layout, self.model
        segs, records, tasks, clients, meta, quotas = [], [], [], [], {}, {}
        n = len(lay.root) + 2
        due = time.monotonic() + YIELD_S

        async def pause() -> None:
            nonlocal due
            if time.monotonic() > due:
                await asyncio.sleep(0)
                due = time.monotonic() + YIELD_S

        for kv in kvs:
            await pause()
            k = kv["key"]
            if k == lay.leader:
                continue
            try:
                v = msgpack.unpackb(kv["value"], raw=False)
                if k == lay.meta:
                    meta = v
                elif k == lay.quotas:
                    quotas = v
                elif k.startswith(lay.root + b"s/"):
                    segs.append((int(k[n:]), v))
                elif k.startswith(lay.root + b"r/"):
                    records.append((kv["mod_revision"], int(k[n:]), v))
                elif k.startswith(lay.root + b"c/"):
                    clients.append((k[n:].decode(), v))
                elif k.startswith(lay.root + b"t/"):
                    hi, lo = k[n:].split(b".")
                    tasks.append((v[8], int(lo), (int(hi), int(lo)), v))     # created ms, then sequence
            except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
                log.warning("skipping malformed record %r: %s", k[:80], e)
        for sid, (client, host, engine, name, base, size) in segs:
            model.restore_segment(sid, client, host, engine, name, base, size, now)
        for cid, (window, host, engine) in clients:
            model.restore_client(cid, window, host, engine, now)
        kept = dropped = 0
        wall = time.time()
        records.sort(key=lambda r: r[0])
        self._next_record = max([self._next_record] + [rid + 1 for _, rid, _ in records])
        bulk = await self._restore_bulk(records, now, wall, pause)
        if bulk is not None:
            kept, dropped = bulk.kept, bulk.dropped
            self._members.update(bulk.members)
            self._record_of.update(bulk.record_of)
            self._records |= bulk.stale
            records = []            # restored: the loop below is restore_object's, one at a time
        for _, rid, entries in records:
            await pause()
            if type(entries) is dict:       # the packed form, as entries
                cols = record_form.from_packed([(rid, entries)])
                if cols is None:
                    log.warning("skipping malformed record %d", rid)
                    continue
                entries = [cols.entry(i) for i in range(len(cols.keys))]
            members = self._members[rid] = set()
            for entry in entries:
                key, size, replicas, pinned, writer, token = entry[:6]
                want, soft_until = entry_pins(entry, now, wall)    # want None: a record from before want
                if model.restore_object(key, size, replicas, pinned=pinned, writer=writer, token=token,
                                        want=want, soft_until=soft_until):
                    members.add(key)
                    self._record_of[key] = rid
                    kept += 1
                else:
                    dropped += 1
            if len(members) != len(entries):
                self._records.add(rid)              # rewritten (or deleted) at the first flush
        for *_, tid, rec in sorted(tasks, key=lambda t: t[:2]):
            try:
                model.restore_task(tid, rec)
            except (ValueError, TypeError) as e:
                log.warning("skipping malformed task %r: %s", tid, e)
        window = 0.0
        if isinstance(meta, dict):
            model.skip_segment_ids(int(meta.get("next_segment", 1)))
            window = meta.get("write_window", 0.0)
        # what the clients' writes allowed by the dead master may still
        # land in: fenced for the longest write window recorded (fence.py),
        # the default client's when none is (a cluster from before the fence)
        if window:
            model.note_write_window(window)
        self._window = model.write_window
        fence_s = model.write_window or DEFAULT_WRITE_WINDOW
        # lifted sooner once every recorded client says its writes are over
        # (none recorded: a cluster from before the records; the window alone)
        fenced = model.fence_free(now, fence_s, {cid for cid, _ in clients})
        restored = 0
        for ns, nbytes in (quotas.items() if isinstance(quotas, dict) else ()):
            try:
                model.set_quota(ns, nbytes)
                restored += 1
            except InvalidArgumentError as e:
                log.warning("skipping malformed quota %r: %s", ns, e)
        model.dirty_quotas = False                  # what etcd holds already
        return {"segments": len(segs), "objects": kept, "dropped": dropped, "quotas": restored, "tasks": len(tasks),
                "fenced": fenced, "fence_s": fence_s if fenced else 0.0}
