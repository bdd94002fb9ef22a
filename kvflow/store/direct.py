"""A StoreClient's puts and gets run on the caller's own thread, for a
synchronous API (the Mooncake one): the master's round trips on a blocking
socket of the caller's (`JoinedQuery`: another connection of the same
client, joined with its registration's token; one per concurrent call) and the bytes moved with
Peer.write_blocking/read_blocking, which submit and wait on the calling
thread. No hop to the client's event loop and back, which is most of a
small call's cost for such a caller (two eventfd hand-offs and the loop's
own wake-ups per master round trip).

The same protocol as the loop's funnels (puts.py, gets.py): a put is
put_start, the writes, put_end (readers never see an object before its
put_end); a get holds the read lease its batch_get_replicas granted until
its reads are done. Only the common case goes this way: a started client
on a tcp master, plain keys, every object one range of registered host
memory (put_from, get_into) or several (put_from_parts, get_into_parts:
consecutive offsets of its replica, as the loop's funnels map them), every
replica in DRAM. Each entry returns None where it cannot
serve a call before it changed anything (or after undoing what it did):
the caller then runs the loop's funnel, which gives every case its error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import math
import threading
import time
from collections.abc import Coroutine, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from kvflow.errors import KVFlowError

from .calls import (all_ok, in_regions, item_result, lease_outlasted, put_outlasted, replica_rows, single_columns,
                    writes_failed)
from .errors import BufferTooSmallError, MasterUnavailableError, SsdBusyError
from .follow import FollowingLink
from .gets import Gets
from .puts import wire_pin
from .records import plain_keys
from .rpc import BlockingQuery, TcpMasterLink
from .wire import encode

__all__ = ["JoinedPool", "JoinedQuery", "NotJoinedError", "put_from", "put_from_parts", "get_into", "get_into_parts",
           "put_bytes", "get_bytes"]

_first, _second = itemgetter(0), itemgetter(1)


class NotJoinedError(MasterUnavailableError):
    """A joined connection could not be made: nothing of the call reached
    the master. `refused`: the master answered (it knows no such client or
    no join), so the pool stops trying until the client registers again."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class JoinedQuery(BlockingQuery):
    """BlockingQuery on a connection that acts for the client (the
    master's `join`): puts and gets, not only queries. One call at a time;
    a broken connection is made and joined again by the next call."""

    def __init__(self, address: str, timeout: float, client_id: str, token: str) -> None:
        super().__init__(address, timeout)
        self.token = token
        self._client_id = client_id
        self._joined = False
        self._outer = threading.Lock()

    def call(self, method: str, *args: Any) -> Any:
        with self._outer:
            if self._sock is None or not self._joined:
                self.join()
            return super().call(method, *args)

    def join(self) -> None:
        """Connects and joins (NotJoinedError when either fails: nothing
        was asked of the master yet)."""
        self._joined = False
        try:
            super().call("join", self._client_id, self.token)
        except MasterUnavailableError as e:
            self.close()
            raise NotJoinedError(f"master {self.address}: join: {e}") from None
        except KVFlowError as e:        # the master answered no: a lost client, or one that knows no join
            self.close()
            raise NotJoinedError(f"master {self.address}: join: {e}", refused=True) from None
        self._joined = True

    def notify(self, method: str, *args: Any) -> bool:
        """A call nobody waits for (a lease release); False when it could
        not be sent."""
        with self._outer, self._lock:
            if self._sock is None or not self._joined:
                return False
            try:
                self._sock.sendall(encode([0, method, list(args)]))
            except OSError:
                self.close()
                return False
        return True


class JoinedPool:
    """A client's joined connections, one per call at a time: callers on
    several threads do not wait for each other's round trips (a durable
    master's put_end waits for etcd). A connection goes back idle after
    each call; closing the pool closes them all, the busy ones when their
    call ends."""

    def __init__(self, address: str, timeout: float, client_id: str, token: str) -> None:
        self.address, self.token = address, token
        self._args = (address, timeout, client_id, token)
        self._idle: list[JoinedQuery] = []
        self._lock = threading.Lock()
        self.closed = False
        self.refused = False        # the master refused a join: not asked again (until a new registration)

    def _take(self) -> JoinedQuery:
        with self._lock:
            return self._idle.pop() if self._idle else JoinedQuery(*self._args)

    def _give(self, q: JoinedQuery) -> None:
        with self._lock:
            if not self.closed:
                self._idle.append(q)
                return
        q.close()

    def call(self, method: str, *args: Any) -> Any:
        q = self._take()
        try:
            return q.call(method, *args)
        except NotJoinedError as e:
            self.refused = self.refused or e.refused
            raise
        finally:
            self._give(q)

    def notify(self, method: str, *args: Any) -> bool:
        q = self._take()
        try:
            return q.notify(method, *args)
        finally:
            self._give(q)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for q in idle:
            q.close()


def _query(client: Any) -> JoinedPool | None:
    """The client's joined connections, for a caller that may use them:
    not the loop's own thread, a started client on a tcp master whose
    leader is known."""
    link = client._link
    if client._closed or link is None or link.closed or not isinstance(link, (TcpMasterLink, FollowingLink)):
        return None
    address = link.address
    token = client._hello.get("beat_token")
    if address is None or not token or threading.get_ident() == client._loop_thread:
        return None
    q = client._joined
    if q is None or q.closed or q.address != address or q.token != token:
        if q is not None:
            q.close()
        q = client._joined = JoinedPool(address, client.timeout, client.client_id, token)
    return None if q.refused else q


def _timed(client: Any, q: JoinedPool, method: str, *args: Any) -> Any:
    t0 = time.perf_counter()
    ok = False
    try:
        out = q.call(method, *args)
        ok = True
        return out
    finally:
        client.counters.round_trip(method, time.perf_counter() - t0, ok)


def _on_loop(client: Any, coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs `coro` on the client's loop and waits for it (what the direct
    path hands back: a revoke, a put_end its own connection lost)."""
    try:
        fut = asyncio.run_coroutine_threadsafe(coro, client._loop)
    except RuntimeError:                # the loop is closed: the client is gone
        coro.close()
        raise MasterUnavailableError("the client's loop is closed") from None
    try:
        # bounded: a loop stopped before it ran `coro` never answers
        return fut.result(client.timeout + 5.0)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise MasterUnavailableError(f"the client's loop did not answer within {client.timeout + 5.0} s") from None


def _columns(client: Any, keys: Any, addrs: Any, sizes: Any) -> tuple[list, list, list] | None:
    try:
        starts, ends = client._regions()
    except RuntimeError:            # the regions changed under this thread's read: the loop decides
        return None
    cols = single_columns(keys, addrs, sizes, starts, ends)
    if cols is None or (client._prefix and not plain_keys(keys, user=True)):
        return None             # a key holding the namespace separator: the loop's funnel refuses it
    p = client._prefix
    return (list(map(p.__add__, keys)) if p else keys), cols[0], cols[1]


def _part_columns(client: Any, keys: Any, parts: Any) -> tuple[list, list, list] | None:
    """_columns of objects given as parts: (the master's names, per object
    its parts, per object its size: the sum of its parts) when every part
    is an (int address, int size) range of registered host memory under a
    plain key; None otherwise (the loop's funnel gives each its error)."""
    if type(parts) not in (list, tuple) or type(keys) not in (list, tuple) or not parts or len(keys) != len(parts):
        return None
    if not set(map(type, parts)) <= {list, tuple} or not all(parts):
        return None
    flat = list(chain.from_iterable(parts))
    if not set(map(type, flat)) <= {tuple, list} or set(map(len, flat)) != {2}:
        return None
    addrs, sizes = list(map(_first, flat)), list(map(_second, flat))
    if set(map(type, addrs)) != {int} or set(map(type, sizes)) != {int} or min(addrs) <= 0 or min(sizes) <= 0:
        return None
    try:
        starts, ends = client._regions()
    except RuntimeError:            # the regions changed under this thread's read: the loop decides
        return None
    if not plain_keys(keys) or not in_regions(addrs, sizes, starts, ends):
        return None
    if client._prefix and not plain_keys(keys, user=True):
        return None             # a key holding the namespace separator: the loop's funnel refuses it
    p = client._prefix
    totals = [sum(map(_second, ps)) for ps in parts]
    return (list(map(p.__add__, keys)) if p else keys), list(parts), totals


def _move(client: Any, op: str, by: dict[str, tuple[list, list, list]],
          start_by: float = math.inf) -> dict[str, KVFlowError]:
    """Each holder's entries (local, remote, length columns) moved on this
    thread (op "write": local -> remote); the holders that failed, with
    their error. This client's own segment is this process's memory: memmove.
    `start_by`: no holder's move starts later (a put's write window: the
    holders are written one after another here)."""
    failed: dict[str, KVFlowError] = {}
    own = client.engine.address
    for holder, (la, ra, ln) in by.items():
        if start_by < math.inf and time.monotonic() > start_by:
            failed[holder] = put_outlasted(f"{len(la)} objects on {holder}", client.write_window)
            continue
        if holder == own:
            for local, remote, n in zip(la, ra, ln):
                ctypes.memmove(remote, local, n) if op == "write" else ctypes.memmove(local, remote, n)
            continue
        if client._shm is not None and client._shm.copy(op, holder, la, ra, ln):
            continue                    # a same-host holder's segment mapped here (shmseg.py)
        try:
            peer = client.engine.peer(holder)
            if peer is None:            # connected once, on the loop (its connections live there)
                peer = _on_loop(client, client.engine.connect(holder, timeout=client._mover.connect_timeout))
            move, t = (peer.write_blocking, client.write_timeout) if op == "write" else (peer.read_blocking,
                                                                                        client.timeout)
            move(np.array(la, np.uint64), np.array(ra, np.uint64), np.array(ln, np.uint64), timeout=t)
        except KVFlowError as e:
            failed[holder] = e
    return failed


def put_from(client: Any, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], *,
             replica_num: int | None = None, preferred_segment: Any = None, pin: bool = False,
             soft_pin: float | bool | None = None) -> list | None:
    """batch_put_from on the calling thread: per key the replicas stored (0:
    it existed) or its error; None where this path does not serve the call
    (nothing of it was done: run batch_put_from on the loop)."""
    q = _query(client)
    cols = _columns(client, keys, addrs, sizes) if q is not None else None
    return _put(client, q, keys, cols, None, replica_num, preferred_segment, pin, soft_pin)


def put_from_parts(client: Any, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]], *,
                   replica_num: int | None = None, preferred_segment: Any = None, pin: bool = False,
                   soft_pin: float | bool | None = None) -> list | None:
    """batch_put_from_parts on the calling thread: each object its parts
    concatenated; put_from's results, None where it does not serve the
    call (nothing of it was done: run batch_put_from_parts on the loop)."""
    q = _query(client)
    cols = _part_columns(client, keys, parts) if q is not None else None
    if cols is None:
        return None
    names, parts, sizes = cols
    return _put(client, q, keys, (names, None, sizes), parts, replica_num, preferred_segment, pin, soft_pin)


def _put(client: Any, q: JoinedPool | None, keys: Sequence[str], cols: tuple | None, parts: list | None,
         replica_num: int | None, preferred_segment: Any, pin: bool, soft_pin: float | bool | None) -> list | None:
    """The put of put_from (`parts` None: `cols` holds each object's one
    range) and of put_from_parts (`parts`: each object's ranges)."""
    rn = client.replica_num if replica_num is None else replica_num
    if cols is None or type(rn) is not int or rn < 1 or client._ssd is not None:
        return None
    names, addrs, sizes = cols
    if preferred_segment is None and client.prefer_local:
        preferred_segment = client.segment_id
    pinned = wire_pin(pin, soft_pin)
    request = [[k, n, rn, preferred_segment, pinned] for k, n in zip(names, sizes)]
    token = next(client._put_tokens)
    # counted while it may write: a client re-attaching to a new leader waits
    # for none in progress before the leader lifts its fence (fence.py)
    with client._mover.thread_put():
        return _put_from(client, q, keys, names, addrs, sizes, parts, request, token, rn, preferred_segment, pin,
                         soft_pin)


def _put_from(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list | None,
              sizes: list, parts: list | None, request: list, token: int, rn: int, preferred_segment: Any,
              pin: bool, soft_pin: float | bool | None) -> list:
    sent = time.monotonic()     # its writes may start until sent + write window (put_timeouts.py)
    try:
        reply = _timed(client, q, "batch_put_start", request, token)
    except NotJoinedError:
        return None             # nothing was sent
    except MasterUnavailableError:
        # it may have reached the master and allocated: undone on the loop's link
        _on_loop(client, client._revoke(list(names), token))
        return None
    started, segs = replica_rows(reply)
    results: list[Any] = [None] * len(names)
    placed = all_ok(started)
    if placed is not None:
        writing = list(enumerate(placed))
    else:
        writing = []
        for i, item in enumerate(started):
            r = item_result(item, keys[i])
            if isinstance(r, KVFlowError):
                results[i] = r
            elif r is None:
                results[i] = 0                  # exists already: immutable, nothing to write
            else:
                writing.append((i, r))
    failed: dict[str, KVFlowError] = {}
    if writing:
        try:
            failed = _move(client, "write", _by_holder(writing, addrs, sizes, segs, parts),
                           sent + client.write_window)
        except BaseException:
            _on_loop(client, client._revoke([names[i] for i, _ in writing], token))
            raise
        none: list = []
        ends = [[names[i], [sid for sid, _ in reps if segs[sid][1] in failed] if failed else none]
                for i, reps in writing]
        try:
            ended = _timed(client, q, "batch_put_end", ends)
        except MasterUnavailableError:
            ended = _on_loop(client, client._call("batch_put_end", ends))
        kept = all_ok(ended)
        for j, (i, reps) in enumerate(writing):
            r = kept[j] if kept is not None else item_result(ended[j], keys[i])
            if r == 0:
                r = writes_failed(keys[i], reps, segs, failed)
            results[i] = r
    if parts is None:
        parts = [[(a, n)] for a, n in zip(addrs, sizes)]
    busy = [i for i, r in enumerate(results) if type(r) is SsdBusyError]
    if busy:            # the loop's funnel waits for the SSD tiers and puts them again
        redo = _on_loop(client, client.batch_put_from_parts([keys[i] for i in busy], [parts[i] for i in busy],
                                                            replica_num=rn, preferred_segment=preferred_segment,
                                                            pin=pin, soft_pin=soft_pin))
        for i, r in zip(busy, redo):
            results[i] = r
        done = [i for i in range(len(keys)) if i not in set(busy)]     # the busy ones: counted by that call
    else:
        done = range(len(keys))
    client.counters.done("put", ([keys[i] for i in done], [parts[i] for i in done]), {},
                         [results[i] for i in done])
    return results


def _by_holder(writing: list, addrs: list | None, sizes: list, segs: dict,
               parts: list | None = None) -> dict[str, tuple[list, list, list]]:
    """(index, [[segment, address], ...]) per object -> per holder engine
    the (local, remote, length) columns. `parts`: each object's ranges,
    written to consecutive offsets of each replica (else addrs, sizes: one
    range each)."""
    if parts is not None:
        by: dict[str, tuple[list, list, list]] = {}
        for i, reps in writing:
            for sid, remote in reps:
                cols = by.setdefault(segs[sid][1], ([], [], []))
                for a, n in parts[i]:
                    cols[0].append(a)
                    cols[1].append(remote)
                    cols[2].append(n)
                    remote += n
        return by
    if len(segs) == 1 and len(writing) == len(addrs) and set(map(len, map(itemgetter(1), writing))) == {1}:
        ((_, (_, engine, _)),) = segs.items()       # one holder, one replica each (the common case)
        return {engine: (addrs, [reps[0][1] for _, reps in writing], sizes)}
    by: dict[str, tuple[list, list, list]] = {}
    for i, reps in writing:
        for sid, remote in reps:
            holder = segs[sid][1]
            cols = by.get(holder)
            if cols is None:
                cols = by[holder] = ([], [], [])
            cols[0].append(addrs[i])
            cols[1].append(remote)
            cols[2].append(sizes[i])
    return by


def get_into(client: Any, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list | None:
    """batch_get_into on the calling thread: per key the object's size or
    its error; None where this path does not serve the call (an object
    only on SSD, a holder that failed: the loop's funnel reads them, from
    another replica)."""
    q = _query(client)
    cols = _columns(client, keys, addrs, sizes) if q is not None else None
    if cols is None:
        return None
    names, addrs, sizes = cols
    results = _read(client, q, keys, names, addrs, sizes)
    if results is not None:
        client.counters.done("get", (keys,), {}, results)
    return results


def get_into_parts(client: Any, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]]) -> list | None:
    """batch_get_into_parts on the calling thread: each object read into
    its parts in order (the last one filled as far as the object goes);
    get_into's results, None where it does not serve the call."""
    q = _query(client)
    cols = _part_columns(client, keys, parts) if q is not None else None
    if cols is None:
        return None
    names, parts, room = cols
    results = _read(client, q, keys, names, None, room, parts=parts)
    if results is not None:
        client.counters.done("get", (keys,), {}, results)
    return results


def _read(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list | None, sizes: list,
          staged: Any = None, parts: list | None = None) -> list | None:
    """The get: replicas and a lease, the reads, the lease released.
    `staged`: called with the objects' sizes once known, gives the
    addresses to read into (the local buffer), or None when there is no
    room (then no read: None is returned). `parts`: each object's ranges
    (`sizes` their sums), filled in order from offset 0 of its replica
    (else addrs, sizes: one range each)."""
    t0 = time.monotonic()       # before the lease is granted: a safe bound on its age
    try:
        reply = _timed(client, q, "batch_get_replicas", list(names))
    except MasterUnavailableError:
        return None             # a lease it granted runs out by itself
    held = client._lease_keeper.hold(reply.get("lease"), t0)      # renewed from the loop while the reads run
    try:
        found, segs = replica_rows(reply)
        fast = Gets._all_found(found, segs, (addrs, sizes)) if staged is None and parts is None else None
        if fast is not None and len(set(fast[1].holder)) == 1:
            # every object found with one DRAM replica fitting its buffer, on one holder (the common case)
            moves = fast[1]
            if _move(client, "read", {moves.holder[0]: (moves.local, moves.remote, moves.length)}):
                return None
            results = list(moves.length)
            if held.lapsed():
                results = [lease_outlasted(k, client.lease_ttl) for k in keys]
            return results
        results: list[Any] = [None] * len(names)
        holders = client._holders(segs)
        reading = []            # (index, size, holder, remote)
        for i, item in enumerate(found):
            r = item_result(item, keys[i])
            if isinstance(r, KVFlowError):
                results[i] = r
            elif not r[1]:
                return None     # on SSD only: the loop's funnel reads it there
            else:
                holder, remote = Gets._nearest(r[1], holders)[0]
                reading.append((i, r[0], holder, remote))
        if staged is not None:
            addrs = staged([n for _, n, _, _ in reading])
            if addrs is None:
                return None
            addrs = {e[0]: a for e, a in zip(reading, addrs)}
        by: dict[str, tuple[list, list, list]] = {}
        for i, n, holder, remote in reading:
            if staged is None and n > sizes[i]:
                results[i] = BufferTooSmallError(f"{keys[i]!r} is {n} bytes, the buffer {sizes[i]}", key=keys[i])
                continue
            cols = by.get(holder)
            if cols is None:
                cols = by[holder] = ([], [], [])
            results[i] = n
            if parts is not None:       # the loop's mapping (gets.py _read): parts in order, the last cut short
                for a, m in parts[i]:
                    m = min(m, n)
                    if m <= 0:
                        break
                    cols[0].append(a)
                    cols[1].append(remote)
                    cols[2].append(m)
                    remote += m
                    n -= m
                continue
            cols[0].append(addrs[i])
            cols[1].append(remote)
            cols[2].append(n)
        if by and _move(client, "read", by):
            return None         # a holder failed: the loop's funnel goes on to the other replicas
        if held.lapsed():
            for i, _, _, _ in reading:
                if isinstance(results[i], int):
                    results[i] = lease_outlasted(keys[i], client.lease_ttl)
        if staged is not None:
            results = [bytes(client._staging_view(addrs[i], r)) if type(r) is int else r for i, r in
                       enumerate(results)]
        return results
    finally:
        lease = reply.get("lease")
        client._lease_keeper.drop(lease)
        if lease and not q.notify("release_lease", lease):
            try:
                client._loop.call_soon_threadsafe(client._link.notify, "release_lease", lease)
            except RuntimeError:
                pass            # the client's loop is closed: the lease runs out by itself
        if staged is not None:
            staged(None)


def put_bytes(client: Any, keys: Sequence[str], values: Sequence[memoryview], **kw: Any) -> list | None:
    """batch_put of bytes (memoryviews of bytes) through the local buffer,
    on the calling thread; None where this path does not serve it (no
    room in the local buffer now, or put_from's cases)."""
    if client._staging_alloc is None or _query(client) is None:
        return None
    sizes = [len(v) for v in values]
    addrs = client._stage_now(sizes)
    if addrs is None:
        return None
    try:
        for a, v, n in zip(addrs, values, sizes):
            client._staging_view(a, n)[:] = v
        return put_from(client, keys, addrs, sizes, **kw)
    finally:
        client._unstage_now(addrs)


def get_bytes(client: Any, keys: Sequence[str]) -> list | None:
    """batch_get (the objects' bytes) through the local buffer, on the
    calling thread; None where this path does not serve it."""
    q = _query(client)
    if q is None or client._staging_alloc is None or type(keys) not in (list, tuple) or not keys:
        return None
    if not plain_keys(keys, user=True):
        return None
    names = list(map(client._prefix.__add__, keys)) if client._prefix else keys
    held: list = []

    def staged(sizes: list | None) -> list | None:
        if sizes is None:               # the call is over: the space goes back
            if held:
                client._unstage_now(held)
            return None
        got = client._stage_now(sizes)
        if got is not None:
            held.extend(got)
        return got

    results = _read(client, q, keys, names, [], [], staged)
    if results is not None:
        client.counters.done("get", (keys,), {}, results)
    return results
