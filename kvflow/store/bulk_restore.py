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

import bisect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np

from kvflow.errors import InvalidArgumentError

from .allocator import Allocator
from .record_form import Columns, concat
from .records import NS_SEP, namespace_of, plain_keys, restored_class

__all__ = ["Restored", "restore"]

STEP = 1 << 17          # objects made between two pauses


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
    oldest first) into `model` (which holds no object yet, its segments
    restored); None, with nothing changed, when they are not all plainly
    restorable. `pause` is awaited between steps (the caller yields to the
    loop there when it is time)."""
    if model.objects or model._lru or any(s.alloc.used or s.alloc.fenced for s in model.segments.values()):
        return None
    keys, nrep, sids, offs, lens, want, sizes = concat(parts)
    n = len(keys)
    if not n or not plain_keys(keys):
        return None
    await pause()
    # the allocators, built aside: the model changes only once all are good
    allocs: dict[int, tuple[Allocator, np.ndarray]] = {}
    for sid in np.unique(sids).tolist():
        seg = model.segments.get(sid)
        if seg is None:
            return None
        sel = sids == sid
        alloc = Allocator(seg.size)
        try:
            alloc.reserve_many(offs[sel], lens[sel])
        except InvalidArgumentError:
            return None
        allocs[sid] = (alloc, sel)
        await pause()
    # the index, built aside too (a key twice: one at a time decides)
    index: dict = {}
    places: list[dict] = []
    classes = []
    for p in parts:
        places.append({})
        classes.append(restored_class(places[-1], p.entry, now, wall))
    bases = [0]
    for p in parts:
        bases.append(bases[-1] + len(p.keys))
    for j, p in enumerate(parts):
        for lo in range(0, len(p.keys), STEP):
            hi = min(len(p.keys), lo + STEP)
            objs = list(map(object.__new__, repeat(classes[j], hi - lo)))
            places[j].update(zip(objs, range(lo, hi)))
            index.update(zip(p.keys[lo:hi], objs))
            await pause()
    if len(index) != n:
        return None
    live = nrep > 0
    ssd_only = np.flatnonzero(~live).tolist()
    adopt = {}
    for i in ssd_only:
        # SSD-only when recorded: its holders' tiers report it again (restore_object)
        j = bisect.bisect_right(bases, i) - 1
        e = parts[j].entry(i - bases[j])
        deadline = e[7] if len(e) > 7 else 0
        try:
            adopt[e[0]] = (e[1], (bool(e[3]), e[4], e[5], max(1, int(want[i])) if len(e) > 6 else 1,
                                  float(now + deadline - wall if deadline and deadline > wall else 0.0)))
        except (TypeError, ValueError):
            return None
        places[j].pop(index.pop(e[0]), None)
    await pause()

    # -- everything checked: the model changes from here on ----------------------
    model.objects = index
    for sid, (alloc, sel) in allocs.items():
        seg = model.segments[sid]
        seg.alloc = alloc
        model._used += alloc.used
        if len(allocs) == 1 and not ssd_only and int(nrep.max()) == 1:
            seg.keys.update(keys)
        else:
            seg.keys.update(np.repeat(np.array(keys, dtype=object), nrep)[sel].tolist())
    model._seg_view = None
    await pause()
    lru = model._lru
    for lo in range(0, n, STEP):
        lru.update(zip(keys[lo:lo + STEP], repeat(None)) if not ssd_only else
                   ((k, None) for k in keys[lo:lo + STEP] if k in index))
        await pause()
    short = np.flatnonzero(live & (np.maximum(want, 1) > nrep)).tolist()
    model._short.update(keys[i] for i in short)
    if NS_SEP in "".join(keys):            # namespaces' bytes (model.charge), without making the objects
        ns_bytes = model.ns_bytes
        for k, size, on in zip(keys, sizes.tolist(), live.tolist()):
            if on and NS_SEP in k and (ns := namespace_of(k)):
                ns_bytes[ns] = ns_bytes.get(ns, 0) + size
    model._adoptable.update(adopt)
    await pause()
    members: dict[int, set[str]] = {}
    stale: set[int] = set()
    at = 0
    for p in parts:
        for rid, count in p.records:
            m = members[rid] = set(keys[at:at + count])
            at += count
            if adopt and not m.isdisjoint(adopt):
                m -= adopt.keys()
                stale.add(rid)
    record_of: dict[str, int] = {}
    at = 0
    for p in parts:
        record_of.update(zip(keys[at:at + len(p.keys)], chain.from_iterable(repeat(rid, c) for rid, c in p.records)))
        at += len(p.keys)
        await pause()
    for k in adopt:
        del record_of[k]
    return Restored(len(index), len(ssd_only), members, record_of, stale)
