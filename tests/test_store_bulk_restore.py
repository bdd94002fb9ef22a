"""Recovery's fast path (bulk_restore.py, record_form.py, Allocator.reserve_many,
records.Recovered) against the one-object-at-a-time restore it replaces:
the same model from the same records, in the entry form older masters
wrote and in the packed form, and everything that falls back to the
per-object path (a stale extent, a key twice, a malformed record)."""
from __future__ import annotations

import asyncio
import random
import time

import msgpack
import pytest

from kvflow.errors import InvalidArgumentError
from kvflow.store import record_form
from kvflow.store.allocator import ALIGN, Allocator
from kvflow.store.durable import Journal, Layout
from kvflow.store.model import StoreModel
from kvflow.store.records import NS_SEP, Object, Recovered, State

LAY = Layout("bulk")
NOW = 1000.0
SEG_SIZE = 1 << 20


class _NoEtcd:
    """Recovery reads no etcd itself (recover() hands _rebuild the kvs)."""
    address = "nowhere"


def _segments(n: int = 2) -> list[dict]:
    return [{"key": LAY.seg(sid), "value": msgpack.packb([f"c{sid}", "h", f"e{sid}", f"s{sid}", 1 << 30, SEG_SIZE]),
             "mod_revision": 1} for sid in range(1, n + 1)]


def _entries(n: int, *, seed: int = 1, ns: bool = True, old: bool = False) -> list[list]:
    """n objects' entries over two segments: some with two replicas, some
    short of their want, soft pins, pins, namespaced keys, SSD-only ones."""
    rng = random.Random(seed)
    nxt = {1: 0, 2: 0}
    out = []
    wall = time.time()
    for i in range(n):
        size = rng.choice([1, 64, 100, 256, 4000])
        length = (size + ALIGN - 1) // ALIGN * ALIGN
        sids = [1, 2] if i % 7 == 0 else [1 + i % 2]
        if i % 23 == 5:
            sids = []                                   # SSD-only when recorded
        reps = []
        for sid in sids:
            reps.append([sid, nxt[sid], length])
            nxt[sid] += length + (ALIGN if i % 5 == 0 else 0)       # gaps: free extents between
        key = (f"ns{i % 3}{NS_SEP}k{i}" if ns and i % 4 == 0 else f"key/{i:06d}")
        want = 2 if i % 11 == 0 else len(reps) or 1
        soft = wall + 600 if i % 13 == 0 else (wall - 5 if i % 17 == 0 else 0)
        e = [key, size, reps, i % 9 == 0, f"writer{i % 3}", 100 + i, want, soft]
        out.append(e[:6] if old else e)
    return out


def _kvs(entries: list[list], *, packed: bool, per: int = 50, first_rid: int = 1) -> list[dict]:
    kvs = []
    for j, lo in enumerate(range(0, len(entries), per)):
        rec = entries[lo:lo + per]
        v = record_form.pack([tuple(e) + (1, 0)[len(e) - 6:] if len(e) < 8 else tuple(e) for e in rec]) \
            if packed else msgpack.packb(rec, use_bin_type=True)
        kvs.append({"key": LAY.record(first_rid + j), "value": v, "mod_revision": 10 + first_rid + j})
    return kvs


def _recover(kvs: list[dict]) -> tuple[StoreModel, Journal, dict]:
    model = StoreModel()
    journal = Journal(_NoEtcd(), LAY, model, fence_revision=1)
    counts = asyncio.run(journal._rebuild(kvs, NOW))
    return model, journal, counts


def _one_at_a_time(kvs: list[dict]) -> StoreModel:
    """The reference: each recorded object through restore_object, as
    recovery did before its fast path."""
    model = StoreModel()
    model.track()
    wall = time.time()
    for kv in kvs:
        if kv["key"].startswith(LAY.root + b"s/"):
            client, host, engine, name, base, size = msgpack.unpackb(kv["value"])
            model.restore_segment(int(kv["key"].rsplit(b"/", 1)[1]), client, host, engine, name, base, size, NOW)
    for kv in sorted((kv for kv in kvs if b"/r/" in kv["key"]), key=lambda kv: kv["mod_revision"]):
        v = msgpack.unpackb(kv["value"])
        entries = v if isinstance(v, list) else [record_form.from_packed([(0, v)]).entry(i) for i in range(len(v["k"]))]
        for e in entries:
            deadline = e[7] if len(e) > 7 else 0
            model.restore_object(e[0], e[1], e[2], pinned=e[3], writer=e[4], token=e[5],
                                 want=e[6] if len(e) > 6 else None,
                                 soft_until=NOW + deadline - wall if deadline and deadline > wall else 0.0)
    model.fence_free(NOW, 15.0)         # as recovery does (fence.py)
    return model


def _state(model: StoreModel) -> dict:
    def obj(o: Object) -> tuple:
        return (o.key, o.size, [(r.segment, r.offset, r.length) for r in o.replicas], o.state, o.writer,
                o.pinned, o.soft_until > 0, o.want, o.token, o.ssd, o.leases)
    allocs = {sid: (s.alloc._by_offset, s.alloc._size, s.alloc._by_size, s.alloc._used, s.alloc.used,
                    s.alloc.fenced, sorted(s.keys)) for sid, s in model.segments.items()}
    return {"objects": {k: obj(o) for k, o in model.objects.items()}, "lru": list(model._lru),
            "allocs": allocs, "used": model.used, "capacity": model.capacity, "ns": model.ns_bytes,
            "short": model._short, "adopt": {k: (v[0], v[1][:4], v[1][4] > 0) for k, v in model._adoptable.items()}}


def _same(model: StoreModel, ref: StoreModel) -> None:
    """model's state is ref's (soft pins' ends to within the seconds
    between the two recoveries' wall clocks)."""
    assert _state(model) == _state(ref)
    for k, o in model.objects.items():
        assert abs(o.soft_until - ref.objects[k].soft_until) < 5
    for k, v in model._adoptable.items():
        assert abs(v[1][4] - ref._adoptable[k][1][4]) < 5


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("old", [False, True])
def test_bulk_restore_equals_one_at_a_time(packed, old):
    entries = _entries(700, old=old)
    kvs = _segments() + _kvs(entries, packed=packed)
    model, journal, counts = _recover(kvs)
    assert any(type(o) is not Object and isinstance(o, Recovered) for o in model.objects.values())
    ref = _one_at_a_time(kvs)
    _same(model, ref)
    ssd_only = sum(1 for e in entries if not e[2])
    assert counts["objects"] == len(entries) - ssd_only and counts["dropped"] == ssd_only
    # the journal knows each kept key's record; records with an SSD-only entry are rewritten
    assert set(journal._record_of) == set(model.objects)
    assert journal._records == {1 + i // 50 for i, e in enumerate(entries) if not e[2]}
    for seg in model.segments.values():
        seg.alloc.check()


def test_mixed_forms_and_lazy_objects_serve():
    """Entry-form records (an older master's) then packed ones (a newer
    one's): both restored; the lazy objects act as Objects for gets,
    removes, eviction and a segment's drop, and the space they free is
    allocated again."""
    entries = _entries(600, ns=True)
    kvs = _segments() + _kvs(entries[:300], packed=False) + _kvs(entries[300:], packed=True, first_rid=100)
    model, journal, counts = _recover(kvs)
    ref = _one_at_a_time(kvs)
    _same(_recover(kvs)[0], ref)
    live = [e for e in entries if e[2]]
    key = live[0][0]
    assert type(model.objects[key]) is not Object
    got = model.get_replicas(key, NOW)
    assert type(got) is Object and got.state is State.COMPLETE and got.key == key
    assert [(r.segment, r.offset, r.length) for r in got.replicas] == [tuple(r) for r in live[0][2]]
    victim = live[1]
    model.remove(victim[0], NOW)
    assert victim[0] not in model.objects and victim[0] not in model._lru
    seg = model.segments[victim[2][0][0]]
    assert victim[2][0][1] not in seg.alloc._used
    model.fence_free(NOW, 0.0)
    model.release_fence(NOW + 1)
    seg.alloc.check()
    model.unmount(2)
    for seg in model.segments.values():
        seg.alloc.check()
    assert all(all(r.segment == 1 for r in o.replicas) for o in model.objects.values())
    ref.remove(victim[0], NOW)
    ref.unmount(2)
    assert sorted(model.objects) == sorted(ref.objects) and model.used == ref.used
    assert model.ns_bytes == ref.ns_bytes


@pytest.mark.parametrize("spoil", ["overlap", "key twice", "no segment", "unaligned", "odd size", "bad packed"])
def test_fallback_to_one_at_a_time(spoil):
    """Records the fast path cannot take whole are restored one object at
    a time, with restore_object's checks (the result equals the reference)."""
    entries = _entries(200, ns=False)
    extra = []
    if spoil == "overlap":
        extra = [["dup-space", 64, [list(entries[1][2][0])], False, "w", 1, 1, 0]]
    elif spoil == "key twice":
        extra = [[entries[2][0], 64, [[1, SEG_SIZE - 64, 64]], False, "w", 1, 1, 0]]
    elif spoil == "no segment":
        extra = [["lost", 64, [[9, 0, 64]], False, "w", 1, 1, 0]]
    elif spoil == "unaligned":
        extra = [["odd", 64, [[1, SEG_SIZE - 100, 64]], False, "w", 1, 1, 0]]
    elif spoil == "odd size":
        extra = [["odd", 64.0, [[1, SEG_SIZE - 64, 64]], False, "w", 1, 1, 0]]
    kvs = _segments() + _kvs(entries, packed=True)
    if spoil == "bad packed":
        doc = msgpack.unpackb(kvs[-1]["value"])
        doc["off"] = doc["off"][:-1]
        kvs[-1] = dict(kvs[-1], value=msgpack.packb(doc, use_bin_type=True))
        ref_kvs = kvs[:-1]
    else:
        kvs.append({"key": LAY.record(999), "value": msgpack.packb(extra), "mod_revision": 5000})
        ref_kvs = kvs
    model, journal, counts = _recover(kvs)
    assert all(type(o) is Object for o in model.objects.values())      # one at a time: no lazy ones
    _same(model, _one_at_a_time(ref_kvs))
    if spoil in ("overlap", "no segment", "unaligned", "key twice"):
        assert 999 in journal._records          # the stale record is rewritten at the first flush


def test_reserve_many_equals_reserve():
    rng = random.Random(7)
    cap = 1 << 22
    spans, pos = [], 0
    while pos < cap - 4096:
        pos += rng.choice([0, 0, 64, 640])
        n = rng.choice([64, 128, 4096])
        if pos + n > cap:
            break
        spans.append((pos, n))
        pos += n
    rng.shuffle(spans)
    one = Allocator(cap)
    for off, n in spans:
        one.reserve(off, n)
    bulk = Allocator(cap)
    for _ in bulk.reserve_many([o for o, _ in spans], [n for _, n in spans], step=100):
        pass
    bulk.check()
    assert (bulk._by_offset, bulk._size, bulk._by_size, bulk._used, bulk.used) == \
        (one._by_offset, one._size, one._by_size, one._used, one.used)
    # then allocate and free as any allocator
    for off, _ in spans[:50]:
        assert bulk.release(off) == one.release(off)
    for size in [64, 100, 4096, 5000, 70000]:
        assert bulk.allocate(size) == one.allocate(size)
    bulk.check()
    assert (bulk._by_offset, bulk._by_size, bulk._used) == (one._by_offset, one._by_size, one._used)


@pytest.mark.parametrize("offs,lens", [([0, 64], [128, 64]), ([32], [64]), ([0], [0]), ([-64], [64]),
                                       ([1 << 20], [64]), ([0], [96])])
def test_reserve_many_refuses_bad_extents(offs, lens):
    a = Allocator(1 << 20)
    with pytest.raises(InvalidArgumentError):
        list(a.reserve_many(offs, lens))
    assert a.used == 0 and a.largest_free == 1 << 20           # unchanged
    a.check()


def test_reserve_many_needs_a_fresh_allocator():
    a = Allocator(1 << 20)
    a.allocate(64)
    with pytest.raises(InvalidArgumentError):
        list(a.reserve_many([128], [64]))


def test_packed_form_round_trip_and_fallback():
    rows = [("a", 10, [(1, 0, 64), (2, 64, 64)], True, "w1", 7, 2, 1234.5),
            ("b", 1 << 40, [(3, 1 << 35, 1 << 40)], False, "w2", 8, 1, 0)]
    assert isinstance(msgpack.unpackb(record_form.pack(rows)), list)      # too few objects to pay for columns
    doc = msgpack.unpackb(record_form.pack(rows, least=1))
    assert doc["v"] == record_form.VERSION and doc["writers"] == ["w1", "w2"]
    cols = record_form.from_packed([(5, doc)])
    assert [cols.entry(i) for i in range(2)] == [["a", 10, [[1, 0, 64], [2, 64, 64]], True, "w1", 7, 2, 1234.5],
                                                 ["b", 1 << 40, [[3, 1 << 35, 1 << 40]], False, "w2", 8, 1, 0]]
    assert cols.records == [(5, 2)]
    # a value the packed form does not hold: the entry form, which every reader reads
    odd = [("c", 10, [(1, 0, 64)], False, "w", -1, 1, 0)]
    assert msgpack.unpackb(record_form.pack(odd, least=1)) == [["c", 10, [[1, 0, 64]], False, "w", -1, 1, 0]]


def test_yields_while_restoring():
    """The fast path pauses between its steps: the election's keep-alive
    runs during a long recovery (durable.py's YIELD_S)."""
    entries = [[f"k{i}", 64, [[1, i * 64, 64]], False, "w", i, 1, 0] for i in range(300_000)]
    kvs = [{"key": LAY.seg(1), "value": msgpack.packb(["c", "h", "e", "s", 1 << 30, 1 << 25]), "mod_revision": 1}]
    kvs += _kvs(entries, packed=True, per=256)
    ticks = []

    async def main():
        model = StoreModel()
        journal = Journal(_NoEtcd(), LAY, model, fence_revision=1)

        async def beat():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)
        t = asyncio.ensure_future(beat())
        await asyncio.sleep(0)
        counts = await journal._rebuild(kvs, NOW)
        t.cancel()
        return counts
    t0 = time.monotonic()
    counts = asyncio.run(main())
    took = time.monotonic() - t0
    assert counts["objects"] == 300_000
    if took > 0.3:
        assert len(ticks) >= 3, (took, len(ticks))
