"""Recovery's fast path: every recorded object restored at C speed.

StoreModel.restore_object restores one recorded object with its checks
(a valid key, segments that exist, extents free, no key twice): ~10 us of
Python per object, 11 s for a million. When the records are what a
master writes (the common case: every key unique and valid, every extent
on a restored segment, aligned, inside it, no two overlapping), those
checks hold for all of them at once, and this module checks them so, on
columns taken out of the entries with map/itemgetter and numpy, then
restores:
- each segment's allocator from its sorted extents in one pass
  (Allocator.reserve_many) and its key set;
- the objects as records.Recovered instances, made with one C-level call
  and made whole at their first touch (records.py), the index and the LRU
  order (the records' order, as restore_object keeps it) with dict and
  OrderedDict updates;
- what the model derives from objects: bytes used, namespaces' bytes,
  objects short of replicas, SSD-only objects to adopt.
Anything else (a malformed entry, a stale extent, a key twice, a model
not empty) makes restore() answer None before it changed anything, and
the caller restores one object at a time, with restore_object's checks.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np

from kvflow.errors import InvalidArgumentError

from .allocator import Allocator
from .record_form import Columns
from .records import NS_SEP, entry_pins, namespace_of, plain_keys, restored_class

__all__ = ["Restored", "restore"]

STEP = 1 << 15          # a segment's extents restored between two pauses


@dataclass
class Restored:
    kept: int
    dropped: int                    # SSD-only objects (left to adopt), as restore_object counts them
    members: dict[int, set[str]]    # record -> the object keys restored from it
    record_of: dict[str, int]
    stale: set[int]                 # records to rewrite: an entry was not restored


async def restore(model, parts: list[Columns], now: float, wall: float,
                  pause: Callable[[], Awaitable[None]]) -> Restored | None:
    """Restores the records' objects (`parts`: runs of records as columns,
    oldest first, each at most a few tens of thousands of objects) into
    `model` (which holds no object yet, its segments restored); None, with
    nothing changed, when they are not all plainly restorable. Works a
    part at a time and awaits `pause` between (the caller yields to the
    loop there when it is time): no step holds the loop for more than a
    part's work or a segment's STEP extents."""
    if model.objects or model._lru or any(s.alloc.used or s.alloc.fenced for s in model.segments.values()):
        return None
    # -- checked and built aside: the model changes only once all is good -------
    index: dict = {}
    extents: dict[int, tuple[list, list]] = {}       # segment -> its parts' offsets, lengths
    adopt: dict = {}
    n = 0
    for p in parts:
        if not plain_keys(p.keys):
            return None
        places: dict = {}
        cls = restored_class(places, p.entry, now, wall)
        objs = list(map(object.__new__, repeat(cls, len(p.keys))))
        places.update(zip(objs, range(len(objs))))
        index.update(zip(p.keys, objs))
        n += len(objs)
        if len(index) != n:
            return None                 # a key twice
        for sid in np.unique(p.sids).tolist():
            if sid not in model.segments:
                return None
            sel = p.sids == sid
            offs, lens = extents.setdefault(sid, ([], []))
            offs.append(p.offs[sel])
            lens.append(p.lens[sel])
        for i in np.flatnonzero(p.nrep == 0).tolist():
            # SSD-only when recorded: its holders' tiers report it again (restore_object)
            e = p.entry(i)
            try:
                want, soft_until = entry_pins(e, now, wall)
                adopt[e[0]] = (e[1], (bool(e[3]), e[4], e[5], 1 if want is None else max(1, int(p.want[i])),
                                      soft_until))
            except (TypeError, ValueError):
                return None
            places.pop(index.pop(e[0]), None)
            n -= 1
        await pause()
    allocs: dict[int, Allocator] = {}
    for sid, (offs, lens) in extents.items():
        alloc = allocs[sid] = Allocator(model.segments[sid].size)
        try:
            for _ in alloc.reserve_many(np.concatenate(offs), np.concatenate(lens), step=STEP):
                await pause()
        except InvalidArgumentError:
            return None

    # -- everything checked: the model changes from here on ----------------------
    model.objects = index
    for sid, alloc in allocs.items():
        model.segments[sid].alloc = alloc
        model._used += alloc.used
    model._seg_view = None
    lru, ns_bytes, segments = model._lru, model.ns_bytes, model.segments
    members: dict[int, set[str]] = {}
    record_of: dict[str, int] = {}
    stale: set[int] = set()
    for p in parts:
        keys = p.keys
        if len(extents) == 1 and int(p.nrep.max(initial=0)) == 1 and int(p.nrep.min(initial=1)) == 1:
            segments[next(iter(extents))].keys.update(keys)
        else:
            by_rep = np.repeat(np.array(keys, dtype=object), p.nrep)
            for sid in np.unique(p.sids).tolist():
                segments[sid].keys.update(by_rep[p.sids == sid].tolist())
        live = p.nrep > 0
        lru.update(zip(keys, repeat(None)) if live.all() else ((k, None) for k in keys if k in index))
        model._short.update(keys[i] for i in np.flatnonzero(live & (np.maximum(p.want, 1) > p.nrep)).tolist())
        if NS_SEP in "".join(keys):            # namespaces' bytes (model.charge), without making the objects
            for k, size, on in zip(keys, p.sizes.tolist(), live.tolist()):
                if on and NS_SEP in k and (ns := namespace_of(k)):
                    ns_bytes[ns] = ns_bytes.get(ns, 0) + size
        at = 0
        for rid, count in p.records:
            m = members[rid] = set(keys[at:at + count])
            at += count
            if adopt and not m.isdisjoint(adopt):
                m -= adopt.keys()
                stale.add(rid)
        record_of.update(zip(keys, chain.from_iterable(repeat(rid, c) for rid, c in p.records)))
        await pause()
    model._adoptable.update(adopt)
    for k in adopt:
        del record_of[k]
    return Restored(len(index), len(adopt), members, record_of, stale)
