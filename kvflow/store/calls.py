"""What a StoreClient's calls share: the Replica row, the timeout every
public call takes, and the small readers of the master's replies."""
from __future__ import annotations

import asyncio
import bisect
import functools
import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from kvflow.errors import InvalidArgumentError

from .errors import LeaseExpiredError, PutRevokedError, ReplicaUnavailableError, StoreTimeoutError, error_from_code
from .records import MAX_KEY_BYTES, plain_keys

__all__ = ["Parts", "Replica", "all_ok", "in_regions", "item_result", "one_part", "replica_rows", "single_columns",
           "single_parts", "with_timeout"]

_first = operator.itemgetter(0)
_second = operator.itemgetter(1)

Parts = Sequence[tuple[int, int]]


class Replica(tuple):
    """(segment id, client id, holder engine address, holder host, address)."""
    __slots__ = ()

    segment = property(lambda self: self[0])
    client = property(lambda self: self[1])
    engine = property(lambda self: self[2])
    host = property(lambda self: self[3])
    addr = property(lambda self: self[4])


def with_timeout(fn):
    """Gives a public call a keyword-only `timeout=` (seconds, None: the
    client's own per-step timeouts only). The whole call runs under it; on
    expiry it is cancelled, which undoes what it started (revokes a put's
    allocations, releases a get's lease, drains its transfers) before
    StoreTimeoutError is raised."""
    @functools.wraps(fn)
    async def call(self, *args: Any, timeout: float | None = None, **kw: Any) -> Any:
        if timeout is None:
            return await fn(self, *args, **kw)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, not {timeout!r}")
        cm = asyncio.timeout(timeout)
        try:
            async with cm:
                return await fn(self, *args, **kw)
        except TimeoutError:
            if cm.expired():
                raise StoreTimeoutError(f"{fn.__name__} did not finish within {timeout} s") from None
            raise
    return call


def replica_rows(reply: dict) -> tuple[list, dict]:
    """A put_start/get_replicas reply: its items, and its segments table
    (segment id -> [client, engine, host])."""
    return reply["items"], reply["segments"]


def one_part(key: Any, ps: Any, starts: list[int], ends: list[int]) -> int:
    """The size of an object given as one (int address, int size) part of
    registered host memory under a plain valid key; 0 for anything else
    (then the caller's full checks run and raise the right error)."""
    if type(key) is not str or not key or len(key) > MAX_KEY_BYTES // 4 or type(ps) is not list \
            or len(ps) != 1:
        return 0
    p = ps[0]
    if type(p) is not tuple or len(p) != 2:
        return 0
    a, n = p
    if type(a) is not int or type(n) is not int or a <= 0 or n <= 0:
        return 0
    i = bisect.bisect_right(starts, a) - 1
    if i < 0 or a + n > ends[i]:
        return 0
    return n


def single_parts(keys: Any, parts: Any, starts: list[int], ends: list[int]) -> tuple[list, list] | None:
    """one_part of a whole batch at once, the common case of the funnels:
    (addresses, sizes) when every object is one (int address, int size)
    part of registered host memory under a plain valid key; None when any
    one is not (then the per-key checks run and give each its error). In
    C (map, set, min): no Python frame per object."""
    if type(parts) not in (list, tuple) or not parts or type(keys) not in (list, tuple) \
            or len(keys) != len(parts):
        return None
    if set(map(type, parts)) != {list} or set(map(len, parts)) != {1}:
        return None
    firsts = list(map(_first, parts))
    if set(map(type, firsts)) != {tuple} or set(map(len, firsts)) != {2}:
        return None
    return single_columns(keys, list(map(_first, firsts)), list(map(_second, firsts)), starts, ends)


def single_columns(keys: Any, addrs: Any, sizes: Any, starts: list[int], ends: list[int]) -> tuple[list, list] | None:
    """single_parts of a batch given as columns (keys, addresses, sizes):
    (addresses, sizes) as lists when every object is one range of
    registered host memory under a plain valid key, else None."""
    if type(keys) not in (list, tuple) or type(addrs) not in (list, tuple) or type(sizes) not in (list, tuple):
        return None
    addrs, sizes = list(addrs) if type(addrs) is tuple else addrs, list(sizes) if type(sizes) is tuple else sizes
    if not addrs or len(addrs) != len(sizes) or len(keys) != len(addrs):
        return None
    if set(map(type, addrs)) != {int} or set(map(type, sizes)) != {int} or min(addrs) <= 0 or min(sizes) <= 0:
        return None
    if not plain_keys(keys):
        return None
    return (addrs, sizes) if in_regions(addrs, sizes, starts, ends) else None


def in_regions(addrs: list, sizes: list, starts: list[int], ends: list[int]) -> bool:
    """Whether every range (addrs[i], +sizes[i]) (positive ints) lies
    inside one of the sorted, disjoint regions (starts, ends)."""
    # the whole span of the batch inside one region (the common case: one
    # registered buffer): every range is; no search per range
    ends_at = list(map(operator.add, addrs, sizes))
    i = bisect.bisect_right(starts, min(addrs)) - 1
    if i >= 0 and max(ends_at) <= ends[i]:
        return True
    # else each range inside the region that starts at or before it (regions
    # never overlap); bisect_right 0 (before every region) reads the 0 in front
    limits = map([0, *ends].__getitem__, map(bisect.bisect_right, repeat(starts), addrs))
    return all(map(operator.le, ends_at, limits))


def all_ok(items: list) -> list | None:
    """The values of a batch reply's items when every one is [0, value]
    with a value that is not None (the common case: no per-item
    item_result); None otherwise."""
    if not items or set(map(len, items)) != {2} or set(map(_first, items)) != {0}:
        return None
    values = list(map(_second, items))
    return None if None in values else values


def item_result(item: Any, key: str) -> Any:
    if item is True or item is False:          # batch_exists' compact items
        return item
    if item[0] == 0:
        return item[1]
    return error_from_code(item[1], item[2], key)


def writes_failed(key: str, reps: Sequence, segs: dict, failed: dict) -> ReplicaUnavailableError:
    """A put whose every replica write failed (`reps`: its [segment,
    address] rows; `failed`: holder -> error): each holder's error named."""
    errs = "; ".join(f"{h}: {failed[h]}" for h in {segs[sid][1] for sid, _ in reps} if h in failed)
    return ReplicaUnavailableError(f"every replica write of {key!r} failed: {errs}", key=key)


def put_outlasted(key: str, window: float) -> PutRevokedError:
    """A put whose writes could not start within its write window of its
    put_start: the master may have revoked it and given its space away
    (put_timeouts.py), so nothing of it is written."""
    return PutRevokedError(f"the writes of {key!r} could not start within its {window} s write window", key=key)


def lease_outlasted(key: str, ttl: float) -> LeaseExpiredError:
    """A read that ended after its lease (the bytes may have been replaced)."""
    return LeaseExpiredError(f"reading {key!r} outlasted its {ttl} s lease", key=key)
