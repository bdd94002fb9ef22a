"""A record's two forms in etcd, and the columns recovery reads from them.

The entry form (every master before this one): a msgpack array of
entries, one per object, [key, size, [[segment, offset, length], ...],
pinned, writer, token, want, soft_until] (6 to 8 fields: durable.py).
The packed form (written now): one msgpack map per record, a column per
field: the keys as an array of str, every integer column as one bytes
value of little-endian unsigned ints, as narrow as the record's largest
value allows (its first byte says the width: 1, 2, 4 or 8), the writers
once each with an index per object:

    {"v": 2, "k": [key, ...], "size": col, "nrep": col (replicas per
     object), "seg": col, "off": col, "len": col (every replica, object
     after object), "pin": col, "writers": [str, ...], "w": col (index
     into writers), "token": col, "want": col, "soft": col (the soft pin's
     wall-clock deadline in ms, 0: none; absent when every one is 0)}

Why: a million objects took 73 MB of entries (the writer's id again in
each), 0.5 s of msgpack decoding into ~7 million Python objects, and a
column extraction over them; the packed form is about half the bytes in
etcd, and its integers decode as numpy arrays with one call a column,
which is what recovery's fast path (bulk_restore.py) works on. A record
whose values do not fit (a negative or non-int one, a size past 2**63) is
written in the entry form, which every reader reads. Masters before this
one cannot read the packed form: upgrade standbys with (or before) the
leader.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import chain
from operator import itemgetter

import msgpack
import numpy as np

__all__ = ["VERSION", "pack", "Columns", "from_entries", "from_packed", "concat"]

VERSION = 2
PACK_LEAST = 32         # records of fewer objects are written as entries (pack())
_WIDTHS = ((1 << 8, 1, "B"), (1 << 16, 2, "H"), (1 << 32, 4, "I"), (1 << 63, 8, "Q"))     # int64 when read
_KEY, _REPS = itemgetter(0), itemgetter(2)


def _col(values: list) -> bytes | None:
    """values (non-negative ints) as one column; None when one is not."""
    if not values:
        return b"\x01"
    if set(map(type, values)) - {int} or min(values) < 0:
        return None
    top = max(values)
    for limit, width, code in _WIDTHS:
        if top < limit:
            return bytes([width]) + struct.pack(f"<{len(values)}{code}", *values)
    return None


def _uncol(b: bytes, n: int) -> np.ndarray:
    """A column of n values as int64 (ValueError when it does not hold n)."""
    width = b[0]
    if width not in (1, 2, 4, 8) or len(b) != 1 + width * n:
        raise ValueError(f"a column of {len(b)} bytes does not hold {n} values of {width}")
    a = np.frombuffer(b, dtype=f"<u{width}", offset=1)
    if width == 8 and n and int(a.max()) >= 1 << 63:
        raise ValueError("a column value past 2**63")      # never written so (pack)
    return a.astype(np.int64)


def pack(rows: list[tuple], *, least: int = PACK_LEAST) -> bytes:
    """A record of objects, each (key, size, [(segment, offset, length),
    ...], pinned, writer, token, want, soft deadline in wall seconds or
    0), in the packed form; in the entry form when a value does not fit
    it, or for fewer than `least` objects (a single put's record: 1.3 us
    and 70 bytes as entries, 18 us and 146 bytes packed; the columns pay
    from a few tens of objects on: 0.5 vs 0.8 us an object at 256, and
    2.6x fewer bytes)."""
    if len(rows) < least:
        return _entries(rows)
    writers: dict[str, int] = {}
    reps = [r[2] for r in rows]
    flat = list(chain.from_iterable(reps))
    soft = [int(round(r[7] * 1000)) if r[7] else 0 for r in rows]
    cols = {"size": [r[1] for r in rows], "nrep": list(map(len, reps)),
            "seg": [x[0] for x in flat], "off": [x[1] for x in flat], "len": [x[2] for x in flat],
            "pin": [int(bool(r[3])) for r in rows], "w": [writers.setdefault(r[4], len(writers)) for r in rows],
            "token": [r[5] for r in rows], "want": [r[6] for r in rows]}
    if any(soft):
        cols["soft"] = soft
    doc: dict = {"v": VERSION, "k": [r[0] for r in rows], "writers": list(writers)}
    for name, values in cols.items():
        b = _col(values)
        if b is None or not all(type(w) is str for w in writers):
            return _entries(rows)
        doc[name] = b
    return msgpack.packb(doc, use_bin_type=True)


def _entries(rows: list[tuple]) -> bytes:
    return msgpack.packb([[r[0], r[1], [list(x) for x in r[2]], r[3], r[4], r[5], r[6], r[7]] for r in rows],
                         use_bin_type=True)


class Columns:
    """The objects of a run of records, column by column: `keys`, `nrep`
    (replicas each), `sids`/`offs`/`lens` (every replica, object after
    object), `want`, `sizes` (int64 arrays), `records` ([(record id, objects in
    it)], in order), and `entry(i)`: object i as an entry-form list
    (records.Recovered makes an Object from it at its first touch)."""

    def __init__(self, keys: list[str], nrep: np.ndarray, sids: np.ndarray, offs: np.ndarray, lens: np.ndarray,
                 want: np.ndarray, sizes: np.ndarray, records: list[tuple[int, int]],
                 entry: Callable[[int], list]) -> None:
        self.keys, self.nrep, self.sids, self.offs, self.lens, self.want = keys, nrep, sids, offs, lens, want
        self.sizes = sizes
        self.records = records
        self.entry = entry


class _Packed:
    """What entry(i) of packed records needs beyond the checked columns
    (read through memoryviews: a Python int per index, not a numpy scalar)."""

    def __init__(self, keys, nrep, sids, offs, lens, want, sizes, pinned, writer, writers, token, soft) -> None:
        self.keys, self.nrep, self.sids, self.offs, self.lens, self.want = keys, nrep, sids, offs, lens, want
        self.sizes, self.writers = sizes, writers
        first = np.concatenate(([0], np.cumsum(nrep)[:-1])) if len(nrep) else nrep
        self._cols = tuple(memoryview(np.ascontiguousarray(a, dtype=np.int64))
                           for a in (first, nrep, sids, offs, lens, sizes, pinned, writer, token, want, soft))

    def entry(self, i: int) -> list:
        first, nrep, sids, offs, lens, sizes, pinned, writer, token, want, soft = self._cols
        j = first[i]
        end = j + nrep[i]
        reps = [[s, o, n] for s, o, n in zip(sids[j:end].tolist(), offs[j:end].tolist(), lens[j:end].tolist())]
        ms = soft[i]
        return [self.keys[i], sizes[i], reps, bool(pinned[i]), self.writers[writer[i]], token[i], want[i],
                ms / 1000 if ms else 0]


def _ints(col: list) -> np.ndarray | None:
    """col as int64, or None unless every value is an int (not a bool)."""
    if set(map(type, col)) - {int}:
        return None
    try:
        return np.array(col, dtype=np.int64)
    except OverflowError:
        return None


def from_entries(records: list[tuple[int, list]]) -> Columns | None:
    """Records in the entry form as columns; None when one is malformed
    (the caller restores them one object at a time, with every check)."""
    if any(type(e) is not list for _, e in records):
        return None
    entries = list(chain.from_iterable(e for _, e in records))
    n = len(entries)
    if n and (set(map(type, entries)) != {list} or min(map(len, entries)) < 6):
        return None
    reps = list(map(_REPS, entries))
    if set(map(type, reps)) - {list}:
        return None
    nrep = np.fromiter(map(len, reps), dtype=np.int64, count=n)
    flat = list(chain.from_iterable(reps))
    if flat and (set(map(type, flat)) != {list} or set(map(len, flat)) != {3}):
        return None
    sids, offs, lens = (_ints(list(map(itemgetter(i), flat))) for i in range(3))
    widths = set(map(len, entries)) or {6}
    if min(widths) > 6:
        want = _ints(list(map(itemgetter(6), entries)))
    elif max(widths) > 6:        # records from before want (as many as named) among newer ones
        want = _ints([e[6] if len(e) > 6 else len(e[2]) for e in entries])
    else:
        want = nrep
    sizes = _ints(list(map(itemgetter(1), entries)))
    if sids is None or offs is None or lens is None or want is None or sizes is None:
        return None
    return Columns(list(map(_KEY, entries)), nrep, sids, offs, lens, want, sizes,
                   [(rid, len(e)) for rid, e in records], entries.__getitem__)


_NAMES = ("size", "nrep", "pin", "w", "token", "want")


def _column(bufs: list, counts: list[int]) -> np.ndarray:
    """One column of many records (each's bytes, each's value count) as
    int64: one numpy decode when every record used the same width (the
    common case), else record by record. ValueError/TypeError when a
    record's bytes are not its count of values."""
    if not bufs:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, bufs)) - {bytes}:
        raise TypeError("a column is not bytes")
    widths = {b[:1] for b in bufs}
    if len(widths) != 1:
        return np.concatenate([_uncol(b, n) for b, n in zip(bufs, counts)])
    width = widths.pop()[0] if widths != {b""} else 0
    if width not in (1, 2, 4, 8) or list(map(len, bufs)) != [1 + width * n for n in counts]:
        raise ValueError("a column does not hold its record's values")
    a = np.frombuffer(b"".join([b[1:] for b in bufs]), dtype=f"<u{width}")
    if width == 8 and len(a) and int(a.max()) >= 1 << 63:
        raise ValueError("a column value past 2**63")      # never written so (pack)
    return a.astype(np.int64)


def from_packed(records: list[tuple[int, dict]]) -> Columns | None:
    """Records in the packed form as columns, each column decoded for all
    of them at once; None when one is malformed."""
    docs = [doc for _, doc in records]
    try:
        if set(map(type, docs)) != {dict} or any(doc.get("v") != VERSION or type(doc["k"]) is not list
                                                 or type(doc["writers"]) is not list for doc in docs):
            return None
        counts = [len(doc["k"]) for doc in docs]
        c = {name: _column([doc[name] for doc in docs], counts) for name in _NAMES}
        per_record = np.add.reduceat(c["nrep"], np.cumsum([0] + counts[:-1])) if c["nrep"].size else []
        nreps = [int(x) if n else 0 for x, n in zip(np.asarray(per_record).tolist(), counts)]
        for name in ("seg", "off", "len"):
            c[name] = _column([doc[name] for doc in docs], nreps)
        soft = [doc.get("soft", b"\x01" + bytes(n)) for doc, n in zip(docs, counts)]
        c["soft"] = _column(soft, counts)
        # each record's writer indexes into its own list: into all of them
        nw = [len(doc["writers"]) for doc in docs]
        first = np.repeat(np.cumsum([0] + nw[:-1]), counts)
        if c["w"].size and (c["w"] >= np.repeat(nw, counts)).any():
            return None
        c["w"] = c["w"] + first
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None
    keys = list(chain.from_iterable(doc["k"] for doc in docs))
    writers = list(chain.from_iterable(doc["writers"] for doc in docs))
    if set(map(type, keys)) - {str} or set(map(type, writers)) - {str}:
        return None
    p = _Packed(keys, c["nrep"], c["seg"], c["off"], c["len"], c["want"], c["size"], c["pin"], c["w"], writers,
                c["token"], c["soft"])
    return Columns(keys, p.nrep, p.sids, p.offs, p.lens, p.want, p.sizes, [(rid, n) for (rid, _), n in
                                                                           zip(records, counts)], p.entry)


def concat(parts: list[Columns]) -> tuple:
    """keys, nrep, sids, offs, lens, want, sizes of several runs, one after the other."""
    names = ("nrep", "sids", "offs", "lens", "want", "sizes")
    if len(parts) == 1:
        return (parts[0].keys, *(getattr(parts[0], a) for a in names))
    return (list(chain.from_iterable(p.keys for p in parts)),
            *(np.concatenate([getattr(p, a) for p in parts]) for a in names))

