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
memory, every replica in DRAM. Each entry returns None where it cannot
serve a call before it changed anything (or after undoing what it did):
the caller then runs the loop's funnel, which gives every case its error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from kvflow.errors import KVFlowError

from .calls import (item_result, lease_outlasted, pipe_spans, put_ended, put_ends, put_started, replica_rows,
                    single_columns)
from .errors import BufferTooSmallError, MasterUnavailableError, SsdBusyError
from .follow import FollowingLink
from .gets import Gets
from .pipeline import Pipe
from .puts import wire_pin
from .records import plain_keys
from .rpc import BlockingQuery, TcpMasterLink
from .wire import encode

__all__ = ["JoinedPool", "JoinedQuery", "NotJoinedError", "put_from", "get_into", "put_bytes", "get_bytes"]


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

    @contextlib.contextmanager
    def piped(self, counters: Any) -> Iterator[Pipe]:
        """A joined connection held for one call's pipelined requests
        (NotJoinedError when it cannot be joined: nothing was sent)."""
        q = self._take()
        pipe = None
        try:
            with q._outer:
                if q._sock is None or not q._joined:
                    try:
                        q.join()
                    except NotJoinedError as e:
                        self.refused = self.refused or e.refused
                        raise
                pipe = Pipe(q, counters)
                yield pipe
        finally:
            if pipe is not None:
                pipe.finish()
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


def _move(client: Any, op: str, by: dict[str, tuple[list, list, list]]) -> dict[str, KVFlowError]:
    """Each holder's entries (local, remote, length columns) moved on this
    thread (op "write": local -> remote); the holders that failed, with
    their error. This client's own segment is this process's memory: memmove."""
    failed: dict[str, KVFlowError] = {}
    own = client.engine.address
    for holder, (la, ra, ln) in by.items():
        if holder == own:
            for local, remote, n in zip(la, ra, ln):
                ctypes.memmove(remote, local, n) if op == "write" else ctypes.memmove(local, remote, n)
            continue
        try:
            peer = client.engine.peer(holder)
            if peer is None:            # connected once, on the loop (its connections live there)
                peer = _on_loop(client, client.engine.connect(holder, timeout=client._mover.connect_timeout))
            move = peer.write_blocking if op == "write" else peer.read_blocking
            move(np.array(la, np.uint64), np.array(ra, np.uint64), np.array(ln, np.uint64), timeout=client.timeout)
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
    spans = pipe_spans(len(names), sizes)
    with client._mover.thread_put():
        if len(spans) > 1 and len(set(names)) == len(names):
            results = _put_piped(client, q, keys, names, addrs, sizes, request, token, spans)
        else:
            results = _put_from(client, q, keys, names, addrs, sizes, request, token)
        if results is None:
            return None
        return _put_done(client, keys, addrs, sizes, results, rn, preferred_segment, pin, soft_pin)


def _put_from(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list, sizes: list,
              request: list, token: int) -> list | None:
    """The put in one put_start, the writes, one put_end."""
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
    writing = put_started(started, range(len(names)), keys, results)
    if writing:
        try:
            failed = _move(client, "write", _by_holder(writing, addrs, sizes, segs))
        except BaseException:
            _on_loop(client, client._revoke([names[i] for i, _ in writing], token))
            raise
        ends = put_ends(names, writing, segs, failed)
        try:
            ended = _timed(client, q, "batch_put_end", ends)
        except MasterUnavailableError:
            ended = _on_loop(client, client._call("batch_put_end", ends))
        put_ended(ended, writing, keys, segs, failed, results)
    return results


def _put_piped(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list, sizes: list,
               request: list, token: int, spans: list[range]) -> list | None:
    """The put in chunks on one connection: chunk k+1's put_start is sent
    before chunk k's bytes are written (the master allocates while this
    thread is in the GIL-free write), chunk k's put_end right after them,
    its reply read at the end. Each object still becomes visible only at
    its own chunk's put_end, after its bytes were written. A lost
    connection: chunks written are committed on the loop's link, the
    others revoked there and put again by the loop's funnel."""
    results: list[Any] = [None] * len(names)
    starting: dict[int, int] = {}           # chunk -> its put_start's request id
    ending: list[tuple[int, list, list, dict, dict]] = []   # (rid, ends, writing, segs, failed)
    sent = 0                                # chunks whose put_start was (maybe) sent
    settled: set[int] = set()               # chunks written and put_end sent, or with nothing to write

    def start(c: int) -> None:
        nonlocal sent
        sent = c + 1
        starting[c] = pipe.send("batch_put_start", [request[i] for i in spans[c]], token)

    try:
        with q.piped(client.counters) as pipe:
            try:
                start(0)
                for k, span in enumerate(spans):
                    reply = pipe.result(starting.pop(k))
                    if k + 1 < len(spans):
                        start(k + 1)
                    started, segs = replica_rows(reply)
                    writing = put_started(started, span, keys, results)
                    if writing:
                        try:
                            failed = _move(client, "write", _by_holder(writing, addrs, sizes, segs))
                        except BaseException:
                            # what is allocated and not written goes back, on this connection:
                            # after its put_starts, whatever the master has done of them
                            _revoke_piped(client, pipe, [names[i] for c in [k, *starting] for i in spans[c]],
                                          token)
                            raise
                        ends = put_ends(names, writing, segs, failed)
                        ending.append((pipe.send("batch_put_end", ends), ends, writing, segs, failed))
                    settled.add(k)
                while ending:
                    rid, ends, done, segs, failed = ending[0]
                    put_ended(pipe.result(rid), done, keys, segs, failed, results)
                    ending.pop(0)
                return results
            except MasterUnavailableError:
                pass            # below, with the connection given back
    except NotJoinedError:
        return None             # nothing was sent
    # the connection broke: what each chunk needs, on the loop's link
    for _, ends, done, segs, failed in ending:          # written: committed (a put_end again is harmless)
        put_ended(_on_loop(client, client._call("batch_put_end", ends)), done, keys, segs, failed, results)
    unsure = [i for c in range(sent) if c not in settled for i in spans[c]]
    if unsure:          # allocated maybe, not written: only this call's allocations (its token) go
        _on_loop(client, client._revoke([names[i] for i in unsure], token))
    if not settled:
        return None             # nothing of it is done: the loop's funnel runs it all
    undone = unsure + [i for c in range(sent, len(spans)) for i in spans[c]]
    if undone:
        redo = _on_loop(client, client.batch_put_from_parts([keys[i] for i in undone],
                                                            [[(addrs[i], sizes[i])] for i in undone],
                                                            replica_num=request[0][2],
                                                            preferred_segment=request[0][3],
                                                            pin=request[0][4] is True, soft_pin=_soft(request[0][4])))
        for i, r in zip(undone, redo):
            results[i] = r
    return results


def _soft(pinned: Any) -> float | bool | None:
    """wire_pin's soft pin back as batch_put_from's soft_pin."""
    if type(pinned) is list:
        return True if pinned[1] is None else pinned[1]
    return None


def _revoke_piped(client: Any, pipe: Pipe, names: list, token: int) -> None:
    try:
        pipe.result(pipe.send("batch_put_revoke", names, token))
    except MasterUnavailableError:
        _on_loop(client, client._revoke(names, token))


def _put_done(client: Any, keys: Sequence[str], addrs: list, sizes: list, results: list, rn: int,
              preferred_segment: Any, pin: bool, soft_pin: float | bool | None) -> list:
    busy = [i for i, r in enumerate(results) if type(r) is SsdBusyError]
    if busy:            # the loop's funnel waits for the SSD tiers and puts them again
        redo = _on_loop(client, client.batch_put_from([keys[i] for i in busy], [addrs[i] for i in busy],
                                                      [sizes[i] for i in busy], replica_num=rn,
                                                      preferred_segment=preferred_segment, pin=pin,
                                                      soft_pin=soft_pin))
        for i, r in zip(busy, redo):
            results[i] = r
        done = [i for i in range(len(keys)) if i not in set(busy)]     # the busy ones: counted by that call
    else:
        done = range(len(keys))
    client.counters.done("put", ([keys[i] for i in done], [[(addrs[i], sizes[i])] for i in done]), {},
                         [results[i] for i in done])
    return results


def _by_holder(writing: list, addrs: list, sizes: list, segs: dict) -> dict[str, tuple[list, list, list]]:
    """(index, [[segment, address], ...]) per object -> per holder engine
    the (local, remote, length) columns."""
    if len(segs) == 1 and set(map(len, map(itemgetter(1), writing))) == {1}:
        ((_, (_, engine, _)),) = segs.items()       # one holder, one replica each (the common case)
        remote = [reps[0][1] for _, reps in writing]
        if len(writing) == len(addrs):
            return {engine: (addrs, remote, sizes)}
        at = list(map(itemgetter(0), writing))      # a chunk of the batch, or some existed
        return {engine: (list(map(addrs.__getitem__, at)), remote, list(map(sizes.__getitem__, at)))}
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
    spans = pipe_spans(len(names), sizes)
    if len(spans) > 1:
        results = _get_piped(client, q, keys, names, addrs, sizes, spans)
    else:
        results = _read(client, q, keys, names, addrs, sizes)
    if results is not None:
        client.counters.done("get", (keys,), {}, results)
    return results


def _get_piped(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list, sizes: list,
               spans: list[range]) -> list | None:
    """The get in chunks on one connection: chunk k+1's lookup is sent
    before chunk k's bytes are read; each chunk's lease is released (a
    notice nobody waits for) once its reads are done. None (every lease
    released) where a chunk is not served here: the loop's funnel then
    reads the whole batch."""
    results: list[Any] = [None] * len(names)
    asked: dict[int, tuple[int, float]] = {}        # chunk -> (request id, when it was sent)

    def ask(c: int) -> None:
        t0 = time.monotonic()       # before the lease is granted: a safe bound on its age
        asked[c] = (pipe.send("batch_get_replicas", [names[i] for i in spans[c]]), t0)

    try:
        with q.piped(client.counters) as pipe:
            try:
                ask(0)
                for k, span in enumerate(spans):
                    rid, t0 = asked.pop(k)
                    reply = pipe.result(rid)
                    try:
                        if k + 1 < len(spans):
                            ask(k + 1)
                        sub = _read_reply(client, [keys[i] for i in span], [addrs[i] for i in span],
                                          [sizes[i] for i in span], reply, t0)
                    finally:
                        lease = reply.get("lease")
                        if lease and not pipe.notify("release_lease", lease):
                            _release_on_loop(client, lease)
                    if sub is None:
                        break
                    results[span.start:span.stop] = sub
                else:
                    return results
                for rid, _ in asked.values():       # a lookup in flight: its lease goes too
                    lease = pipe.result(rid).get("lease")
                    if lease:
                        pipe.notify("release_lease", lease)
            except MasterUnavailableError:
                pass                # a lease granted and not released runs out by itself
    except NotJoinedError:
        pass
    return None


def _read(client: Any, q: JoinedPool, keys: Sequence[str], names: Sequence[str], addrs: list, sizes: list,
          staged: Any = None) -> list | None:
    """The get: replicas and a lease, the reads, the lease released.
    `staged`: called with the objects' sizes once known, gives the
    addresses to read into (the local buffer), or None when there is no
    room (then no read: None is returned)."""
    t0 = time.monotonic()       # before the lease is granted: a safe bound on its age
    try:
        reply = _timed(client, q, "batch_get_replicas", list(names))
    except MasterUnavailableError:
        return None             # a lease it granted runs out by itself
    try:
        return _read_reply(client, keys, addrs, sizes, reply, t0, staged)
    finally:
        lease = reply.get("lease")
        if lease and not q.notify("release_lease", lease):
            _release_on_loop(client, lease)
        if staged is not None:
            staged(None)


def _release_on_loop(client: Any, lease: int) -> None:
    try:
        client._loop.call_soon_threadsafe(client._link.notify, "release_lease", lease)
    except RuntimeError:
        pass            # the client's loop is closed: the lease runs out by itself


def _read_reply(client: Any, keys: Sequence[str], addrs: list, sizes: list, reply: dict, t0: float,
                staged: Any = None) -> list | None:
    """_read's reads, from the master's batch_get_replicas `reply` (the
    lease is the caller's to release)."""
    found, segs = replica_rows(reply)
    fast = Gets._all_found(found, segs, (addrs, sizes)) if staged is None else None
    if fast is not None and len(set(fast[1].holder)) == 1:
        # every object found with one DRAM replica fitting its buffer, on one holder (the common case)
        moves = fast[1]
        if _move(client, "read", {moves.holder[0]: (moves.local, moves.remote, moves.length)}):
            return None
        results = list(moves.length)
        if time.monotonic() - t0 >= client.lease_ttl:
            results = [lease_outlasted(k, client.lease_ttl) for k in keys]
        return results
    results: list[Any] = [None] * len(found)
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
        cols[0].append(addrs[i])
        cols[1].append(remote)
        cols[2].append(n)
        results[i] = n
    if by and _move(client, "read", by):
        return None         # a holder failed: the loop's funnel goes on to the other replicas
    if time.monotonic() - t0 >= client.lease_ttl:
        for i, _, _, _ in reading:
            if isinstance(results[i], int):
                results[i] = lease_outlasted(keys[i], client.lease_ttl)
    if staged is not None:
        results = [bytes(client._staging_view(addrs[i], r)) if type(r) is int else r for i, r in
                   enumerate(results)]
    return results


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
