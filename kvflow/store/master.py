"""The master: the StoreModel behind one dispatcher, reachable two ways.

- Embedded: a client in the same process gets a `Session` and calls
  `dispatch()` directly (no socket, no encoding).
- Served: `await master.start("host:port")` listens for clients; each tcp
  connection is one session (`python -m kvflow.store master`).

Liveness: a session is the client's life. Its connection closing (the
process died: the kernel resets it) loses the client at once: its puts in
progress are revoked and its segments dropped. A client whose connection
stays open but who stops talking (SIGSTOP, a long GC pause, a starved
host) is lost only after `client_grace` seconds without a message
(default 60 s, where Mooncake drops a client after 10 s of missed
heartbeats and with it every object it holds). A master that was itself
stopped does not blame its clients for its own silence: when the monitor
wakes late, everyone's clock restarts.

Durability (`attach_journal`, a master given etcd): after each call the
model's changes go to the journal (durable.py), and the reply of a call
that changed durable state waits until etcd has every change staged so
far (a put_end only with `sync_commit`); a put_start's reply (and a
repair_start's, which hands out space to copy into) also waits for every
deletion staged before it (durable.py says why), and, past the time its
election lease certainly runs, for a keep-alive that shows it still leads
(election.py says why); other replies leave at once. A register's reply
waits too when its client's write window is the longest yet (recorded
for the failover fence: fence.py).
A journal that fails (etcd gone, this master fenced) stops the master:
`failed` is set and every waiting reply gets the DurabilityError.
"""
from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from kvflow.errors import InvalidArgumentError, KVFlowError, ProtocolError

from .errors import DurabilityError, ObjectBusyError, ObjectLeasedError, ObjectNotFoundError, error_code
from .metrics import MasterCounters, master_view
from .model import StoreModel
from .records import NS_SEP, plain_keys
from .ssd_master import SSD_METHODS, SsdCalls
from .wire import FrameBuffer, encode, item_error, item_ok

__all__ = ["Master", "Session", "METHODS"]

# what a client may call (each is Master._<name>(client id, now, *args))
METHODS = frozenset({"heartbeat", "mount", "unmount", "batch_put_start", "batch_put_end",
                     "batch_put_revoke", "batch_get_replicas", "release_lease", "renew_leases", "batch_exists",
                     "batch_size", "batch_remove", "remove_all", "remove_by_regex", "stats",
                     "batch_repair_start", "batch_repair_end", "set_quota", "create_copy_task",
                     "create_move_task", "query_task", "replica_desc"}) | frozenset(SSD_METHODS)

log = logging.getLogger("kvflow.store.master")

# the calls whose replies let a client write into space (a put's; a copy's; an SSD promotion's)
_HANDS_OUT = frozenset({"batch_put_start", "batch_repair_start", "batch_promote_start"})


class Session:
    """One client's connection to the master (or its in-process stand-in)."""

    def __init__(self, master: "Master", peer: str) -> None:
        self.master = master
        self.peer = peer
        self.client_id: str | None = None
        self.joined = False         # another connection of a client (join): its closing loses no one
        self.closed = False
        # sends the client a notice unasked, (method, args): set by the connection
        self.push: Callable[[str, list], None] | None = None

    def __repr__(self) -> str:
        return f"<Session {self.client_id or '-'} from {self.peer}>"

    def close(self) -> None:
        """The client is gone: the master forgets it and what it held."""
        if self.closed:
            return
        self.closed = True
        self.master._session_closed(self)


class Master(SsdCalls):
    """The pool's master. Options: `lease_ttl` (s a get protects an object),
    `client_grace` (s of silence before a connected client is lost),
    `heartbeat_interval` (what clients are told), `high_watermark` and
    `low_watermark` (eviction), `soft_pin_ttl` (s a soft pin lasts unless
    the put says), `clock` (monotonic seconds; tests)."""

    def __init__(self, *, lease_ttl: float = 5.0, client_grace: float = 60.0,
                 heartbeat_interval: float = 1.0, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, clock: Callable[[], float] = time.monotonic,
                 seed: int | None = None, soft_pin_ttl: float = 1800.0) -> None:
        if client_grace <= 0 or heartbeat_interval <= 0 or heartbeat_interval >= client_grace:
            raise InvalidArgumentError("need 0 < heartbeat_interval < client_grace")
        self.model = StoreModel(lease_ttl=lease_ttl, high_watermark=high_watermark,
                                low_watermark=low_watermark, seed=seed, soft_pin_ttl=soft_pin_ttl)
        self.client_grace = client_grace
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self.sessions: set[Session] = set()
        self.address: str | None = None
        self.calls = 0
        self.counters = MasterCounters()        # calls per method, lookups (metrics.py)
        self._server: asyncio.base_events.Server | None = None
        self._monitor: asyncio.Task | None = None
        self._connections: set[_MasterProtocol] = set()
        self._closed = False
        self.journal = None             # durable.Journal, when etcd keeps the index
        self.leadership = None          # election.Election, when this master leads a cluster
        self.sync_commit = True
        self.failed: asyncio.Future | None = None   # set (with the error) when durability is lost
        self.root_fs_dir = ""           # where clients that ask keep SSD tiers (--root-fs-dir)

    def __repr__(self) -> str:
        return (f"<Master {self.address or 'embedded'} clients={len(self.model.clients)} "
                f"objects={len(self.model.objects)}>")

    # -- lifecycle -------------------------------------------------------------
    async def start(self, listen: str | None = None, *, serving: bool = True) -> "Master":
        """Starts the liveness monitor and, with `listen` ("host:port", port
        0 picks one), the tcp server; `self.address` is where it listens.
        `serving=False` binds the address without listening (connections are
        refused) until `serve()`: a standby knows the address it will
        publish before it leads."""
        if self.failed is None:
            self.failed = asyncio.get_running_loop().create_future()
        if self._monitor is None and serving:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_clients())
        if listen is not None and self._server is None:
            host, _, port = listen.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgumentError(f"listen must be host:port, not {listen!r}")
            self._server = await asyncio.get_running_loop().create_server(self._connection, host, int(port),
                                                                          start_serving=serving)
            sock = self._server.sockets[0].getsockname()
            self.address = f"{host}:{sock[1]}"
        return self

    async def serve(self) -> None:
        """Starts accepting clients (after start(serving=False))."""
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_clients())
        if self._server is not None:
            await self._server.start_serving()

    def attach_journal(self, journal, *, sync_commit: bool = True) -> None:
        """From now on the model's changes are made durable by `journal`.
        `sync_commit`: a put_end replies once its objects are in etcd (else
        at once, the record following within one flush)."""
        self.journal = journal
        self.sync_commit = sync_commit
        journal.on_failure = self.durability_lost

    def durability_lost(self, e: DurabilityError) -> None:
        log.error("stopping: %s", e)
        if self.failed is not None and not self.failed.done():
            self.failed.set_exception(e)
            self.failed.exception()         # retrieved: the owner may be gone already
        for proto in list(self._connections):
            proto.transport.abort()         # clients go on to the next leader

    def _persist(self) -> None:
        if self.journal is not None:
            self.journal.stage()

    def durable(self, method: str, before: int) -> asyncio.Future | None:
        """The future a reply must wait for (None: reply at once): a call
        that staged changes waits for every change staged so far (a put_end
        only with sync_commit); a put_start for every deletion staged
        before it, so the space it hands out is free in etcd too."""
        j = self.journal
        if j is None:
            return None
        hands_out = method in _HANDS_OUT
        if j.seq != before and (self.sync_commit or method != "batch_put_end"):
            target = j.seq                  # this call's own changes (and all before them)
        elif hands_out:
            target = j.free_seq             # space freed before it may be handed out again (a copy's too)
        else:
            return None
        fut = None if j.committed >= target else j.wait(target)
        lead = self.leadership
        if hands_out and lead is not None and self.clock() >= lead.held_until:
            # the lease may have run out (this process was stopped): space is
            # handed out only once a keep-alive shows it still leads (election.py)
            renewal = lead.renewed()
            fut = renewal if fut is None else asyncio.gather(fut, renewal)
        return fut

    async def call(self, s: Session, method: str, args: list) -> Any:
        """dispatch(), then wait for durability where the reply must."""
        before = self.journal.seq if self.journal is not None else 0
        result = self.dispatch(s, method, args)
        fut = self.durable(method, before)
        if fut is not None:
            await fut
        return result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for proto in list(self._connections):
            proto.transport.abort()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.journal is not None:
            # what is staged still goes to etcd; clients whose connections
            # close with the master stay there (they were not lost, only
            # this master went away)
            journal, self.journal = self.journal, None
            await journal.close()
        for s in list(self.sessions):
            s.close()

    async def __aenter__(self) -> "Master":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def session(self, peer: str = "in-process") -> Session:
        s = Session(self, peer)
        self.sessions.add(s)
        return s

    def push(self, client_id: str, method: str, *args: Any) -> bool:
        """A notice to a client on its own (registered) connection, unasked:
        what it waits for otherwise until its next poll. False when it has
        no such connection (it polls, as before)."""
        for s in self.sessions:
            if s.client_id == client_id and not s.joined and not s.closed and s.push is not None:
                s.push(method, list(args))
                return True
        return False

    def _session_closed(self, s: Session) -> None:
        self.sessions.discard(s)
        if s.client_id is not None and not s.joined and not self._closed:
            for other in self.sessions:
                if other.client_id == s.client_id:
                    other.client_id = None          # its joined connections act for no one now
            dropped = self.model.client_lost(s.client_id)
            log.info("client %s gone (%s): %d objects dropped", s.client_id, s.peer, dropped)
            self._persist()

    async def _watch_clients(self) -> None:
        period = min(self.client_grace / 4, 1.0)
        last = self.clock()
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            if now - last > period + self.client_grace / 2:
                # this process was stopped or starved: the silence was ours
                for c in self.model.clients.values():
                    c.last_seen = now
            last = now
            self.model.expire_leases(now)
            for key in self.model.expire_puts(now):
                log.warning("put of %r not committed within its writer's write window: revoked", key)
            self.model.release_quarantine(now)
            self.model.release_fence(now)
            for cid in self.model.expire_clients(now, self.client_grace):
                log.warning("client %s silent for more than %.1f s: lost", cid, self.client_grace)
                for s in list(self.sessions):
                    if s.client_id == cid:
                        s.client_id = None          # already forgotten
                        self.sessions.discard(s)
            self._persist()

    # -- the tcp server --------------------------------------------------------
    def _connection(self) -> "_MasterProtocol":
        return _MasterProtocol(self)

    # -- the calls -------------------------------------------------------------
    def dispatch(self, s: Session, method: str, args: list) -> Any:
        """Runs one call for session `s`; raises the model's typed errors.
        Every message is a sign of life. With a journal, what the call
        changed is staged for etcd (whatever it raised)."""
        if self.journal is None:
            return self._dispatch(s, method, args)
        try:
            return self._dispatch(s, method, args)
        finally:
            self.journal.stage()

    def _dispatch(self, s: Session, method: str, args: list) -> Any:
        if s.closed:
            raise KVFlowError("session closed")
        self.calls += 1
        now = self.clock()
        if method == "register":
            if s.client_id is not None:
                raise InvalidArgumentError(f"this connection is client {s.client_id} already")
            # then (fence.py; older clients say neither): its write window,
            # and whether none of its writes is in progress
            client_id, host, engine, *fence = args
            c = self.model.register_client(client_id, host, engine, now)
            self.model.note_client(client_id, fence[0] if fence else None, len(fence) > 1 and fence[1] is True)
            c.beat_token = secrets.token_hex(16)
            s.client_id = client_id
            return {"lease_ttl": self.model.lease_ttl, "heartbeat": self.heartbeat_interval,
                    "grace": self.client_grace, "beat_token": c.beat_token, "root_fs_dir": self.root_fs_dir}
        if method == "beat":
            # a client's heartbeat thread, on a connection of its own: alive
            # even while its event loop is blocked (its kvflow engine's native
            # threads still serve its segment). The connection is nobody's
            # session: its closing loses no one.
            client_id, token = args
            c = self.model.clients.get(client_id)
            if c is not None and token and c.beat_token == token:
                c.last_seen = now
            return None
        if method == "join":
            # a second connection of a registered client, for its calls from
            # a caller's thread (the store's blocking path: puts and gets
            # without a hop to the client's loop), proven by the token its
            # registration got; the connection's closing loses no one
            client_id, token = args
            c = self.model.clients.get(client_id)
            if s.client_id is not None or c is None or not token or c.beat_token != token:
                raise InvalidArgumentError("join: no such client, or not its token")
            s.client_id, s.joined = client_id, True
            return None
        if s.client_id is None:
            if method in ("stats", "batch_exists"):      # observers need no identity
                self.counters.calls[method] += 1
                return getattr(self, f"_{method}")(None, now, *args)
            raise KVFlowError(f"{method}: register first (or this client was declared lost)")
        self.model.seen(s.client_id, now)
        if method not in METHODS:
            raise InvalidArgumentError(f"unknown method {method!r}")
        self.counters.calls[method] += 1
        return getattr(self, f"_{method}")(s.client_id, now, *args)

    def _heartbeat(self, cid: str, now: float) -> int | None:
        # how many objects short of replicas this client could copy (it then
        # asks for them: batch_repair_start); None when there are none
        return self.model.repairable(cid) or None

    def _batch_repair_start(self, cid: str, now: float, limit: int) -> dict:
        """Objects short of replicas to copy from the client's own segment
        into new replicas on other clients: [key, size, source address,
        [segment, address]] each, the segments' holders, and the lease
        keeping the sources (released by batch_repair_end)."""
        if type(limit) is not int or limit < 1:
            raise InvalidArgumentError(f"limit must be an int >= 1, not {limit!r}")
        jobs, lease = self.model.repair_start(cid, now, min(limit, 256))
        segments: dict = {}
        items = []
        for key, size, src, new in jobs:
            seg = self.model.segments[src.segment]
            items.append([key, size, seg.base + src.offset, self._replicas([new], segments)[0]])
        if not items:
            self.model.release_lease(lease, now)
        return {"segments": segments, "items": items, "lease": lease}

    def _batch_repair_end(self, cid: str, now: float, items: list, lease: int) -> list:
        """[[key, ok], ...] of a batch_repair_start: each new replica joins
        its object or is freed; the sources' lease ends."""
        def end(it: Any) -> int:
            if not (type(it) is list and len(it) == 2 and type(it[1]) is bool):
                raise InvalidArgumentError(f"a repair's end is [key, ok], not {it!r}")
            return self.model.repair_end(cid, it[0], it[1])
        out = _per_item(items if type(items) is list else [], end)
        if type(lease) is int:
            self.model.release_lease(lease, now)
        return out

    # -- copy and move tasks (tasks.py) -----------------------------------------
    def _create_copy_task(self, cid: str, now: float, key: str, targets: list) -> list:
        return list(self.model.create_copy_task(key, targets))

    def _create_move_task(self, cid: str, now: float, key: str, source: str, target: str) -> list:
        return list(self.model.create_move_task(key, source, target))

    def _query_task(self, cid: str, now: float, task_id: list) -> list:
        return self.model.query_task(task_id).row()

    def _replica_desc(self, cid: str, now: float, key: str) -> list:
        """Where the object's replicas are, by segment: [[segment name,
        address, size], ...] in memory, then [[client, size]] per SSD copy.
        No lease: a description, not a read."""
        obj = self.model.describe(key)
        segs = self.model.segments
        mem = [[segs[r.segment].name, segs[r.segment].base + r.offset, obj.size] for r in obj.replicas]
        return [mem, [[c, obj.size] for c in sorted(obj.ssd or ())]]

    def _mount(self, cid: str, now: float, name: str, base: int, size: int) -> int:
        return self.model.mount(cid, name, base, size)

    def _unmount(self, cid: str, now: float, segment: int) -> int:
        seg = self.model.segments.get(segment)
        if seg is not None and seg.client != cid:
            raise InvalidArgumentError(f"segment {segment} is not this client's")
        return self.model.unmount(segment)

    def _replicas(self, replicas: list, segments: dict, bases: dict | None = None) -> list:
        """[[segment id, address], ...]; each segment's holder goes into
        `segments` once per reply (segment id -> [client, engine, host]), not
        once per replica: a 64-key reply is a third of the bytes. `bases`:
        segment id -> base address, filled here and kept by the batch calls
        across one reply's keys: they build a one-replica object's row
        inline from it, and call this only for the rest."""
        model = self.model
        out = []
        for r in replicas:
            sid = r.segment
            seg = model.segments[sid]
            if sid not in segments:
                c = model.clients[seg.client]
                segments[sid] = [c.id, c.engine, c.host]
            if bases is not None:
                bases[sid] = seg.base
            out.append([sid, seg.base + r.offset])
        return out

    def _batch_put_start(self, cid: str, now: float, items: list, token: int = 0) -> dict:
        segments: dict = {}
        bases: dict = {}
        seen: set = set()
        put_start = self.model.put_start
        replicas = self._replicas
        out = []
        fast = self._put_start_fast(cid, now, items, token)
        # _per_item's loop, inline: this is the hottest call of a batch put
        for j, it in enumerate(items):
            if fast is not None and (r := fast[j]) is not None:
                sid = r.segment
                if sid not in bases:
                    self._replicas([r], segments, bases)
                out.append([0, [[sid, bases[sid] + r.offset]]])
                continue
            try:
                key, size, replica_num, preferred, pin = it
                if key in seen:     # a retried put_start returns its replicas again: not one key twice
                    raise ObjectBusyError(f"{key!r} appears twice in one put", key=key)
                seen.add(key)
                reps = put_start(cid, key, size, replica_num, now, preferred=preferred, pin=pin, token=token)
                if reps is None:
                    out.append([0, None])
                    continue
                if len(reps) == 1 and (base := bases.get((r := reps[0]).segment)) is not None:
                    out.append([0, [[r.segment, base + r.offset]]])     # _replicas' common case, inline
                else:
                    out.append([0, replicas(reps, segments, bases)])
            except KVFlowError as e:
                out.append(item_error(error_code(e), str(e)))
        return {"segments": segments, "items": out}

    def _put_start_fast(self, cid: str, now: float, items: list, token: int) -> list | None:
        """The model's put_start_one_segment for a batch of distinct keys
        (a key twice is the per-key loop's error), else None."""
        if type(items) is not list or len(items) < 2 or set(map(type, items)) != {list} \
                or set(map(len, items)) != {5}:
            return None
        try:
            if len(set(map(itemgetter(0), items))) != len(items):
                return None
        except TypeError:           # an unhashable key: its own error, per key
            return None
        return self.model.put_start_one_segment(cid, items, now, token)

    def _batch_put_end(self, cid: str, now: float, items: list) -> list:
        put_end = self.model.put_end
        out = []
        # last key first: a batch's keys are a prefix, head first, and each
        # object committed goes to the LRU's recent end, so the head ends
        # most recent and eviction takes the prefix's tail before its head
        for it in reversed(items):      # _per_item's loop, inline
            try:
                out.append([0, put_end(cid, it[0], it[1])])
            except KVFlowError as e:
                out.append(item_error(error_code(e), str(e)))
        out.reverse()
        return out

    def _batch_put_revoke(self, cid: str, now: float, keys: list, token: int | None = None) -> list:
        return _per_item(keys, lambda key: self.model.put_revoke(cid, key, token))

    def _batch_get_replicas(self, cid: str, now: float, keys: list) -> dict:
        segments: dict = {}
        lease = self.model.new_lease(now)

        get_replicas = self.model.get_replicas
        out = []
        replicas = self._replicas
        bases: dict = {}
        # last key first, as in _batch_put_end: each hit goes to the LRU's
        # recent end, and a prefix's head ends the most recent
        for key in reversed(keys):      # _per_item's loop, inline
            try:
                obj = get_replicas(key, now, lease)
                if obj.ssd:     # [size, DRAM replicas, SSD copies' holders]
                    out.append([0, [obj.size, replicas(obj.replicas, segments, bases), self._ssd_holders(obj)]])
                elif len(reps := obj.replicas) == 1 and (base := bases.get((r := reps[0]).segment)) is not None:
                    out.append([0, [obj.size, [[r.segment, base + r.offset]]]])     # _replicas' common case
                else:
                    out.append([0, [obj.size, replicas(reps, segments, bases)]])
            except KVFlowError as e:
                out.append(item_error(error_code(e), str(e)))
        out.reverse()
        misses = sum(map(itemgetter(0), out))      # an item's first field: 0 found, 1 its error
        self.counters.looked_up("get", len(out) - misses, misses)
        return {"segments": segments, "items": out, "lease": lease}

    def _release_lease(self, cid: str, now: float, lease: int) -> None:
        self.model.release_lease(lease, now)

    def _renew_leases(self, cid: str, now: float, leases: list) -> list:
        """The client's gets are still reading: each lease's seconds from
        now (0.0: gone, not renewed), bounded by the client's write window
        (read_leases.py)."""
        if type(leases) is not list:
            raise InvalidArgumentError(f"renew_leases takes a list of lease ids, not {leases!r}")
        bound = self.model.clients[cid].window
        return [self.model.renew_lease(lid, now, bound) for lid in leases]

    def _batch_exists(self, cid: str | None, now: float, keys: list) -> list:
        # the servers ask this before every put and get: one bool per key
        # (an [1, code, message] item only for a bad key) keeps it small
        if type(keys) is list:
            try:
                found = self.model.exist_many(keys)
            except TypeError:           # an unhashable key: the per-key path names it
                found = None
            if found is not None:
                hits = found.count(True)
                # only valid keys are ever stored, so a batch whose keys are
                # all found needs no check of them (no per-key call or try);
                # with misses, each must be a valid key (else its error)
                if hits == len(found) or plain_keys(keys):
                    self.counters.looked_up("exists", hits, len(found) - hits)
                    return found
        return _per_item(keys, self.model.exists, wrap=None)

    def _batch_size(self, cid: str, now: float, keys: list) -> list:
        return _per_item(keys, self.model.size)

    def _batch_remove(self, cid: str, now: float, keys: list, force: bool) -> list:
        return _per_item(keys, lambda key: self.model.remove(key, now, force=bool(force)))

    def _remove_all(self, cid: str, now: float, force: bool, ns: str = "") -> int:
        if type(ns) is not str:
            raise InvalidArgumentError(f"a namespace is a str, not {ns!r}")
        return self.model.remove_all(now, force=bool(force), ns=ns)

    def _set_quota(self, cid: str, now: float, ns: str, nbytes: int | None) -> None:
        self.model.set_quota(ns, nbytes)

    def _remove_by_regex(self, cid: str, now: float, pattern: str, force: bool, ns: str = "") -> int:
        # Mooncake's RemoveByRegex: every complete object whose key the
        # pattern matches anywhere (regex_search), leased ones skipped unless
        # force; puts in progress are left to their writers. One scan of the
        # index on the master's loop: O(objects), as Mooncake's.
        if type(pattern) is not str or type(ns) is not str:
            raise InvalidArgumentError("remove_by_regex: the pattern (and namespace) must be a str")
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise InvalidArgumentError(f"remove_by_regex: bad pattern {pattern!r}: {e}") from None
        gone = 0
        # a namespace's client matches its own keys, without their prefix
        prefix = ns + NS_SEP if ns else ""
        for key in [k for k in self.model.objects
                    if (regex.search(k) if not prefix else k.startswith(prefix) and regex.search(k[len(prefix):]))]:
            try:
                self.model.remove(key, now, force=bool(force))
            except (ObjectLeasedError, ObjectNotFoundError):
                continue            # leased, or not complete yet
            gone += 1
        return gone

    def metrics(self) -> dict:
        """Segments (capacity, used, replicas, tier), clients, objects,
        leases, evictions, lease waits, calls and lookups: metrics.py."""
        return master_view(self)

    def _stats(self, cid: str | None, now: float, detail: bool = False) -> dict:
        if detail:                  # kvflow-info --store: the whole view
            return self.metrics()
        m = self.model
        out = {"clients": len(m.clients), "segments": len(m.segments), "objects": len(m.objects),
               "capacity": m.capacity, "used": m.used, "evictions": m.evictions, "calls": self.calls,
               "ssd_objects": sum(len(c.ssd_keys) for c in m.clients.values()), "ssd_missed": m.ssd_missed,
               "fenced": m.fenced}
        if self.journal is not None:
            out["etcd_txns"] = self.journal.txns
            out["etcd_keys"] = self.journal.keys_written
        return out


class _MasterProtocol(asyncio.Protocol):
    """One client connection: frames in, dispatch, frames out, all in
    data_received (dispatch is synchronous, so replies leave in request
    order). A protocol instead of streams: no task and no await per
    request, which is most of a small call's cost on the master."""

    # a client that sends requests but never reads its replies is cut off
    # once this much is waiting to be sent to it
    MAX_PENDING_REPLIES = 256 << 20

    def __init__(self, master: Master) -> None:
        self.master = master
        self.frames = FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.session = self.master.session(f"{peer[0]}:{peer[1]}" if peer else "?")
        self.session.push = self._push
        self.master._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.master._connections.discard(self)
        self.session.close()

    def data_received(self, data: bytes) -> None:
        try:
            msgs = self.frames.feed(data)
        except ProtocolError as e:
            log.warning("dropping %s: %s", self.session.peer, e)
            self.transport.abort()
            return
        out = []
        for msg in msgs:
            if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[1], str)
                    and isinstance(msg[2], list)):
                log.warning("dropping %s: malformed request", self.session.peer)
                self.transport.abort()
                return
            rid, method, args = msg
            before = journal.seq if (journal := self.master.journal) is not None else 0
            if rid == 0:
                # a notice (a lease release): no reply is wanted; its errors are the sender's loss
                try:
                    self.master.dispatch(self.session, method, args)
                except (KVFlowError, TypeError, ValueError) as e:
                    log.debug("notice %s from %s failed: %s", method, self.session.peer, e)
                except Exception:
                    log.exception("notice %s from %s: the master failed", method, self.session.peer)
                continue
            try:
                reply = [rid, 0, self.master.dispatch(self.session, method, args)]
            except KVFlowError as e:
                reply = [rid, 1, [error_code(e), str(e), getattr(e, "key", None)]]
            except (TypeError, ValueError) as e:       # wrong arity or types from the wire
                reply = [rid, 1, ["invalid_argument", f"{method}: {e}", None]]
            except Exception as e:
                # A fault of the master's own (a bug): the call gets a typed
                # error ("internal": KVFlowError) and the client keeps its
                # link, its other calls' replies and its session. Letting it
                # escape data_received would make asyncio close the
                # connection, and the client would see MasterUnavailableError
                # for calls that did nothing wrong.
                log.exception("%s from %s: the master failed", method, self.session.peer)
                reply = [rid, 1, ["internal", f"{method}: the master failed ({type(e).__name__}: {e})", None]]
            if journal is not None and (fut := self.master.durable(method, before)) is not None:
                fut.add_done_callback(lambda f, reply=reply: self._durable_reply(reply, f))
                continue
            out.append(encode(reply))
        if out:
            self.transport.write(b"".join(out))
            if self.transport.get_write_buffer_size() > self.MAX_PENDING_REPLIES:
                log.warning("dropping %s: it does not read its replies", self.session.peer)
                self.transport.abort()

    def _push(self, method: str, args: list) -> None:
        if not self.transport.is_closing():
            self.transport.write(encode([0, method, args]))         # id 0: a notice, no reply wanted

    def _durable_reply(self, reply: list, fut: asyncio.Future) -> None:
        """A reply that waited for etcd: sent once its changes are durable;
        when they cannot be, the call fails with the DurabilityError."""
        e = fut.exception()             # retrieved even when the reply is dropped
        if self.transport.is_closing():
            return
        if e is not None:
            reply = [reply[0], 1, [error_code(e), str(e), None]]
        self.transport.write(encode(reply))


def _per_item(items: list, fn: Callable[[Any], Any], wrap: Callable[[Any], Any] | None = item_ok) -> list:
    """A batch call's reply: per item, fn(item) (wrapped, unless wrap is
    None) or the typed error it raised, so that one bad key fails alone."""
    out = []
    for it in items:
        try:
            v = fn(it)
            out.append(v if wrap is None else wrap(v))
        except KVFlowError as e:
            out.append(item_error(error_code(e), str(e)))
    return out
