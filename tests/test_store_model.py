"""kvflow.store's pure parts: the segment allocator, placement and the
master's metadata model (two-phase visibility, leases, eviction, liveness).
No engine, no clock: time is passed in."""
from __future__ import annotations

import random

import pytest

from kvflow.errors import InvalidArgumentError, KVFlowError
from kvflow.store import Allocator, StoreModel, TaskNotFoundError, TaskStatus, TaskType
from kvflow.store.allocator import ALIGN
from kvflow.store.errors import (CODES, InvalidKeyError, NoSpaceError, ObjectBusyError, ObjectExistsError,
                                 ObjectLeasedError, ObjectNotFoundError, error_code, error_from_code)
from kvflow.store.model import State
from kvflow.store.placement import place

# -- allocator -----------------------------------------------------------------


def test_allocator_best_fit_and_alignment():
    a = Allocator(1 << 16)
    x = a.allocate(100)
    y = a.allocate(1000)
    z = a.allocate(100)
    assert (x, y, z) == (0, 128, 128 + 1024)
    assert all(o % ALIGN == 0 for o in (x, y, z))
    a.release(y)                          # a 1024-byte hole between x and z
    # best fit: a 900-byte request takes the hole, not the big tail
    assert a.allocate(900) == 128
    a.check()


def test_allocator_coalesces_both_neighbours():
    a = Allocator(64 * 10)
    offs = [a.allocate(64) for _ in range(10)]
    assert a.allocate(1) is None and a.free == 0
    for o in (offs[3], offs[5]):
        a.release(o)
    assert a.extents == 2
    a.release(offs[4])                    # joins [3] and [5] into one extent
    assert a.extents == 1 and a.largest_free == 3 * 64
    a.check()
    for o in offs[:3] + offs[6:]:
        a.release(o)
    assert a.extents == 1 and a.largest_free == a.capacity and a.used == 0
    a.check()


def test_allocator_fragmentation_then_recovery():
    a = Allocator(1 << 20)
    offs = [a.allocate(4096) for _ in range(256)]
    assert a.allocate(1) is None
    for o in offs[::2]:                   # every other block: half free, all fragmented
        a.release(o)
    assert a.free == 1 << 19 and a.largest_free == 4096
    assert a.allocate(8192) is None       # fragmented: no 8 KiB extent
    for o in offs[1::2]:
        a.release(o)
    assert a.allocate(1 << 20) == 0       # coalesced back to one extent
    a.check()


def test_allocator_no_leak_after_many_random_cycles():
    rng = random.Random(7)
    a = Allocator(1 << 22)
    live: dict[int, int] = {}
    for step in range(20000):
        if live and (rng.random() < 0.45 or a.free < 1 << 16):
            off = rng.choice(list(live))
            assert a.release(off) == live.pop(off)
        else:
            n = rng.choice((1, 63, 64, 65, 4096, 100_000, 1 << 18))
            off = a.allocate(n)
            if off is not None:
                live[off] = (n + ALIGN - 1) // ALIGN * ALIGN
        if step % 997 == 0:
            a.check()
            assert a.used == sum(live.values())
    for off in list(live):
        a.release(off)
    a.check()
    assert a.used == 0 and a.extents == 1 and a.largest_free == a.capacity


def test_allocator_bad_input():
    a = Allocator(4096)
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(InvalidArgumentError):
            a.allocate(bad)
    off = a.allocate(10)
    a.release(off)
    with pytest.raises(InvalidArgumentError):
        a.release(off)                    # double free
    with pytest.raises(InvalidArgumentError):
        Allocator(10)
    a.check()


# -- placement -----------------------------------------------------------------


class _Seg:
    def __init__(self, id, client, cap, used=0):
        self.id, self.client, self.cap, self.used = id, client, cap, used

    def fits(self, size):
        return self.cap - self.used >= size

    def fill_after(self, size):
        return (self.used + size) / self.cap


def test_placement_spreads_over_clients_then_segments():
    segs = [_Seg(1, "a", 100), _Seg(2, "a", 100), _Seg(3, "b", 100)]
    for seed in range(20):
        got = place(segs, 10, 2, rng=random.Random(seed))
        assert {s.client for s in got} == {"a", "b"}
        got = place(segs, 10, 3, rng=random.Random(seed))
        assert {s.id for s in got} == {1, 2, 3}
    # more replicas than segments: as many as there are
    assert len(place(segs, 10, 5)) == 3
    # nothing fits: none
    assert place(segs, 1000, 1) == []


def test_placement_preferred_segment_first():
    segs = [_Seg(1, "a", 100), _Seg(2, "b", 100), _Seg(3, "c", 100)]
    for seed in range(10):
        got = place(segs, 10, 2, preferred=3, rng=random.Random(seed))
        assert got[0].id == 3 and got[1].client != "c"
    # a preferred segment that is full is passed over
    segs[2].used = 95
    assert place(segs, 10, 1, preferred=3, rng=random.Random(1))[0].id != 3


def test_placement_new_empty_segment_does_not_draw_every_write():
    # nine segments 80% full and one just joined, empty: the empty one gets
    # more than its share (free space counts) but far from every write
    segs = [_Seg(i, f"c{i}", 1000, used=800) for i in range(9)] + [_Seg(9, "new", 1000)]
    rng = random.Random(3)
    hits = sum(place(segs, 1, 1, rng=rng)[0].id == 9 for _ in range(2000))
    assert 2000 / 10 < hits < 2000 / 2


# -- the model -----------------------------------------------------------------


def _model(segments=2, size=1 << 20, **kw):
    m = StoreModel(seed=1, **kw)
    for i in range(segments):
        m.register_client(f"c{i}", "host", f"127.0.0.1:{1000 + i}", now=0)
        m.mount(f"c{i}", "seg", 0x10000000 * (i + 1), size)
    return m


def test_two_phase_put_is_invisible_until_put_end():
    m = _model()
    reps = m.put_start("c0", "k", 1000, 2, now=0)
    assert len(reps) == 2 and len({m.segments[r.segment].client for r in reps}) == 2
    assert not m.exists("k") and m.exist_many(["k"]) == [False]
    with pytest.raises(ObjectNotFoundError):
        m.get_replicas("k", now=0)
    with pytest.raises(ObjectNotFoundError):
        m.size("k")
    with pytest.raises(ObjectBusyError):
        m.put_start("c1", "k", 1000, 1, now=0)
    with pytest.raises(ObjectNotFoundError):
        m.put_end("c1", "k")               # only the writer commits
    assert m.put_end("c0", "k") == 2
    assert m.exists("k") and m.size("k") == 1000
    assert m.exist_many(["k", "other"]) == [True, False]
    assert m.objects["k"].state is State.COMPLETE
    # immutable: a second put of the key is a no-op success
    assert m.put_start("c1", "k", 1000, 1, now=0) is None
    with pytest.raises(ObjectExistsError):
        m.put_start("c1", "k", 999, 1, now=0)     # same key, another size


def test_revoke_and_failed_replicas_free_space():
    m = _model()
    m.put_start("c0", "k", 5000, 2, now=0)
    assert m.used == 2 * 5056
    m.put_revoke("c0", "k")
    assert m.used == 0 and "k" not in m.objects and not m.exists("k")
    reps = m.put_start("c0", "k", 5000, 2, now=0)
    assert m.put_end("c0", "k", [reps[0].segment]) == 1   # one replica's write failed
    assert m.used == 5056 and len(m.objects["k"].replicas) == 1
    reps = m.put_start("c0", "j", 64, 2, now=0)
    assert m.put_end("c0", "j", [r.segment for r in reps]) == 0   # every write failed
    assert "j" not in m.objects and m.used == 5056


def test_writer_death_revokes_its_puts_and_holder_death_drops_replicas():
    m = _model(segments=3)
    m.put_start("c0", "pending", 100, 1, now=0)
    used = m.used
    m.client_lost("c0")                     # the writer died before put_end
    assert "pending" not in m.objects and m.used < used
    for s in m.segments.values():
        assert s.alloc.used == 0
    m.put_start("c1", "two", 100, 2, now=0)
    m.put_end("c1", "two")
    a, b = (m.segments[r.segment].client for r in m.objects["two"].replicas)
    m.client_lost(a)                        # one holder gone: the other replica lives
    assert m.exists("two") and len(m.objects["two"].replicas) == 1
    assert m.segments[m.objects["two"].replicas[0].segment].client == b
    m.client_lost(b)                        # no holder left: the object is gone
    assert not m.exists("two") and not m.objects
    for s in m.segments.values():
        s.alloc.check()
        assert s.alloc.used == 0


def test_lease_blocks_remove_and_eviction_until_it_expires():
    m = _model(segments=1, size=64 * 100, lease_ttl=5.0)
    m.put_start("c0", "k", 64, 1, now=0)
    m.put_end("c0", "k")
    m.get_replicas("k", now=10)
    with pytest.raises(ObjectLeasedError):
        m.remove("k", now=14)
    assert m.remove_all(now=14) == 0
    m.remove("k", now=15.01)
    assert not m.exists("k") and m.used == 0


def test_forced_removal_of_a_leased_object_frees_its_space_when_the_lease_ends():
    m = _model(segments=1, size=64 * 4, lease_ttl=5.0)
    reps = m.put_start("c0", "k", 64, 1, now=0)
    m.put_end("c0", "k")
    m.get_replicas("k", now=10)             # a reader holds [10, 15)
    m.remove("k", now=11, force=True)
    assert not m.exists("k") and m.used == 64          # gone, space still held
    # a new put before the lease ends never gets the reader's bytes
    for i in range(3):
        got = m.put_start("c0", f"n{i}", 64, 1, now=12)
        assert got[0].offset != reps[0].offset
    with pytest.raises(NoSpaceError):
        m.put_start("c0", "full", 64, 1, now=12)
    assert m.put_start("c0", "k", 64, 1, now=15.5)[0].offset == reps[0].offset   # freed at 15
    for s in m.segments.values():
        s.alloc.check()


def test_released_leases():
    m = _model(segments=1, size=64 * 4, lease_ttl=5.0)
    m.put_start("c0", "k", 64, 1, now=0)
    m.put_end("c0", "k")
    one, two = m.new_lease(now=1), m.new_lease(now=1)
    m.get_replicas("k", now=1, lease=one)
    m.get_replicas("k", now=1, lease=two)
    m.release_lease(one, now=2)
    with pytest.raises(ObjectLeasedError):      # the other reader still holds it
        m.remove("k", now=2)
    m.remove("k", now=2, force=True)            # gone; space held for reader two
    assert not m.exists("k") and m.used == 64
    m.release_lease(two, now=3)                 # the last reader is done: freed at once
    assert m.used == 0
    m.release_lease(two, now=3)                 # twice, or unknown ids: nothing happens
    m.release_lease(12345, now=3)
    for s in m.segments.values():
        s.alloc.check()
    # leases nobody releases run out by time, and their ids are swept
    m.put_start("c0", "j", 64, 1, now=4)
    m.put_end("c0", "j")
    m.get_replicas("j", now=4)
    with pytest.raises(ObjectLeasedError):
        m.remove("j", now=8.9)
    m.expire_leases(now=9.1)
    assert not m._leases
    m.remove("j", now=9.1)


def test_eviction_is_lru_and_skips_leased_and_pinned():
    # 100 slots of 64 bytes; watermarks 0.9 / 0.5
    m = _model(segments=1, size=64 * 100, high_watermark=0.9, low_watermark=0.5)
    for i in range(90):
        m.put_start("c0", f"k{i}", 64, 1, now=0, pin=(i == 1))
        m.put_end("c0", f"k{i}")
    m.get_replicas("k0", now=1)            # k0: leased (and now most recent)
    m.get_replicas("k5", now=1)            # k5: recently used (lease expires at 6)
    m.put_start("c0", "new", 64, 1, now=100)   # above 0.9: evict down to 0.5
    m.put_end("c0", "new")
    assert m.used <= 0.5 * m.capacity + 64
    assert m.exists("k1")                  # pinned
    assert m.exists("k5") and m.exists("new")
    gone = [i for i in range(90) if not m.exists(f"k{i}")]
    # least recently used first: the first ones put (k2, k3, ...), never the
    # pinned k1, nor k5, used since
    assert gone == [i for i in range(2, 2 + len(gone) + 1) if i != 5] and len(gone) >= 40
    # leased objects survive eviction, even when nothing else is left
    m2 = _model(segments=1, size=64 * 10, high_watermark=0.9, low_watermark=0.5)
    for i in range(10):
        m2.put_start("c0", f"k{i}", 64, 1, now=0)
        m2.put_end("c0", f"k{i}")
        m2.get_replicas(f"k{i}", now=0)
    with pytest.raises(NoSpaceError):
        m2.put_start("c0", "x", 64, 1, now=1)
    assert m2.put_start("c0", "x", 64, 1, now=6) is not None   # leases expired: evicts


def test_soft_pins_go_last_and_run_out():
    """A soft-pinned object is evicted only when nothing unpinned is left,
    and only until its time runs out; a hard pin never; bad soft pins are
    typed errors."""
    m = _model(segments=1, size=64 * 10, high_watermark=0.9, low_watermark=0.5, soft_pin_ttl=100.0)
    for i in range(9):
        pin = ["soft", None] if i < 3 else ["soft", 5.0] if i == 3 else (i == 4)
        m.put_start("c0", f"k{i}", 64, 1, now=0, pin=pin)
        m.put_end("c0", f"k{i}")
    m.put_start("c0", "a", 64, 1, now=1)            # 10 of 10 slots: evict down to 5
    m.put_end("c0", "a")
    # the unpinned k5..k8 went first, then the least recent soft pin (k0)
    assert [m.exists(f"k{i}") for i in range(9)] == [False, True, True, True, True, False, False, False, False]
    assert m.soft_evictions == 1 and m.exists("a")
    for i in range(5):
        m.put_start("c0", f"b{i}", 64, 1, now=10)    # k3's soft pin ran out at 5: plain LRU now
        m.put_end("c0", f"b{i}")
    # the fifth put evicts 5: k3 (its pin over), a, b0, b1, b2; never k1, k2 (soft), k4 (hard)
    assert [m.exists(k) for k in ("k1", "k2", "k3", "k4", "a", "b0", "b1", "b2", "b3", "b4")] == \
        [True, True, False, True, False, False, False, False, True, True]
    assert m.soft_evictions == 1
    for bad in (["soft", 0], ["soft", -1.0], ["soft", "x"], ["hard", 1.0], {"soft": 1}, 2):
        with pytest.raises(InvalidArgumentError):
            m.put_start("c0", "bad", 64, 1, now=10, pin=bad)
    assert not m.exists("bad")


def test_a_chained_prefixs_tail_is_evicted_before_its_head():
    """The keys of one batch are a prompt's pages, head first: after the
    batch the head is the most recently used, so eviction takes the tail
    first and what stays is always a prefix."""
    from kvflow.store.master import Master

    master = Master(lease_ttl=5.0, high_watermark=0.9, low_watermark=0.5, clock=lambda: 0.0)
    model = master.model
    model.register_client("c0", "h", "e", 0)
    model.mount("c0", "seg", 1 << 20, 64 * 20)
    chain = [f"p{i}" for i in range(12)]
    master._batch_put_start("c0", 0.0, [[k, 64, 1, None, False] for k in chain])
    master._batch_put_end("c0", 0.0, [[k, []] for k in chain])
    master._batch_get_replicas("c0", 0.0, chain[:8])        # a hit on the first 8 pages
    model.expire_leases(100.0)
    model.put_start("c0", "other", 64 * 7, 1, now=100.0)       # evicts down to half
    kept = [model.exists(k) for k in chain]
    assert kept == sorted(kept, reverse=True) and not all(kept) and kept[0], kept   # a prefix stays


def test_lost_replicas_are_made_again_and_nothing_leaks():
    """An object short of the replicas its put asked for is handed to a
    holder of its other replica with a new allocation on a client holding
    none; the copy joins only at repair_end; a copy whose object was removed
    and put again, whose copier was lost, or that failed, gives its space
    back."""
    m = StoreModel(seed=1)
    for c in ("c0", "c1", "c2"):
        m.register_client(c, "h", f"e-{c}", 0)
        m.mount(c, f"s-{c}", 1 << 20 if c == "c0" else 2 << 20 if c == "c1" else 3 << 20, 64 * 100)
    for i in range(6):
        m.put_start("c0", f"k{i}", 64, 2, now=0, preferred=1)     # segment 1 (c0) and one other
        m.put_end("c0", f"k{i}")
    lost = [f"k{i}" for i in range(6) if any(m.segments[r.segment].client == "c1"
                                                for r in m.objects[f"k{i}"].replicas)]
    assert lost
    m.client_lost("c1")
    assert m.repairable("c0") == len(lost) and m.repairable("c2") == 0
    jobs, lease = m.repair_start("c0", 1.0, 64)
    assert sorted(j[0] for j in jobs) == sorted(lost)
    assert all(m.segments[new.segment].client == "c2" for _, _, _, new in jobs)
    assert m.repairable("c0") == 0                              # handed out once
    key0, key1 = jobs[0][0], jobs[-1][0]
    # the first job's object is removed and put again meanwhile: its copy never joins the new one
    m.remove(key0, now=1.0, force=True)
    m.put_start("c0", key0, 64, 1, now=1.0)
    m.put_end("c0", key0)
    assert m.repair_end("c0", key0, True) == 0 and len(m.objects[key0].replicas) == 1
    if key1 != key0:
        assert m.repair_end("c0", key1, False) == 0              # a failed copy: tried again later
        assert m.repairable("c0") == 1
    for key, _, _, _ in jobs[1:-1]:
        assert m.repair_end("c0", key, True) == 1
    m.release_lease(lease, 1.0)
    jobs2, lease2 = m.repair_start("c0", 2.0, 64)
    assert [j[0] for j in jobs2] == ([key1] if key1 != key0 else [])
    m.client_lost("c0")                                          # the copier is lost mid-copy
    assert not m._repairs and m.used == sum(s.alloc.used for s in m.segments.values())
    with pytest.raises(ObjectNotFoundError):
        m.repair_end("c0", key1, True)


def test_namespace_bytes_follow_every_way_an_object_goes():
    """A namespace's bytes count each object once from put_start, and come
    back whether the put is revoked, ends with no replica, the object is
    removed or evicted, or its only holder is lost."""
    m = _model(segments=2, size=64 * 100)
    m.set_quota("t", 64 * 10)
    k = lambda i: f"t\x1fk{i}"             # noqa: E731
    for i in range(4):
        m.put_start("c0", k(i), 64, 1, now=0, preferred=1)
    assert m.ns_bytes["t"] == 4 * 64
    m.put_revoke("c0", k(0))
    assert m.put_end("c0", k(1), failed_segments=[1]) == 0      # its one replica failed
    m.put_end("c0", k(2))
    m.put_end("c0", k(3))
    assert m.ns_bytes["t"] == 2 * 64
    m.remove(k(2), now=0)
    assert m.ns_bytes["t"] == 64
    m.client_lost("c0")                                          # k3's only replica was on c0
    assert "t" not in m.ns_bytes and not m.objects
    for bad in (("", 10), ("a\x1fb", 10), ("t", 0), ("t", 1.5), (3, 10)):
        with pytest.raises(InvalidArgumentError):
            m.set_quota(*bad)


def test_full_pool_puts_evict_and_succeed():
    m = _model(segments=2, size=64 * 1000)
    for i in range(10000):
        size = 64 * (1 + i % 7)
        m.put_start(f"c{i % 2}", f"k{i}", size, 1, now=i)
        m.put_end(f"c{i % 2}", f"k{i}")
    assert m.evictions > 0 and m.used <= m.capacity
    assert m.used == sum(s.alloc.used for s in m.segments.values())
    assert m.exists("k9999")
    m.client_lost("c0")
    assert m.used == sum(s.alloc.used for s in m.segments.values())
    assert m.capacity == sum(s.alloc.capacity for s in m.segments.values())


def test_oversize_object_and_bad_input():
    m = _model(segments=1, size=4096)
    m.put_start("c0", "small", 64, 1, now=0)
    m.put_end("c0", "small")
    with pytest.raises(NoSpaceError):
        m.put_start("c0", "big", 8192, 1, now=0)
    assert m.exists("small") and m.evictions == 0      # nothing evicted for a put that cannot fit
    m.remove("small", now=0)
    for key in ("", 3, None, b"k", "x" * 5000):
        with pytest.raises(InvalidKeyError):
            m.put_start("c0", key, 10, 1, now=0)
    for size in (0, -1, 1.0, True):
        with pytest.raises(InvalidArgumentError):
            m.put_start("c0", "k", size, 1, now=0)
    with pytest.raises(KVFlowError):
        m.put_start("nobody", "k", 10, 1, now=0)
    assert m.used == 0 and not m.objects


def test_liveness_grace():
    m = _model(segments=2)
    m.seen("c0", 100.0)
    assert m.expire_clients(now=100.0, grace=60) == ["c1"]     # c1 last seen at 0
    assert list(m.clients) == ["c0"] and len(m.segments) == 1


def test_error_codes_round_trip():
    for code, cls in CODES.items():
        e = error_from_code(code, "msg", "k")
        assert type(e) is cls and error_code(e) == code


# -- durability: what the master records, and recovery --------------------------


def test_allocator_reserve_rebuilds_what_allocate_gave():
    a = Allocator(64 * 100)
    offs = [a.allocate(64 * n) for n in (3, 5, 2, 7)]
    b = Allocator(64 * 100)
    for o in reversed(offs):                    # any order
        b.reserve(o, a.allocated_length(o))
    b.check()
    assert (b.used, b.extents, b.largest_free) == (a.used, a.extents, a.largest_free)
    with pytest.raises(InvalidArgumentError):
        b.reserve(offs[1], 64)                  # taken: two records claim the same bytes
    with pytest.raises(InvalidArgumentError):
        b.reserve(64 * 99, 128)                 # past the end
    with pytest.raises(InvalidArgumentError):
        b.reserve(3, 64)                        # not aligned
    b.check()


def test_model_records_durable_changes_only():
    m = StoreModel(seed=1)
    m.track()
    m.register_client("c1", "h", "e1", 0)
    sid = m.mount("c1", "s", 4096, 1 << 20)
    assert (m.dirty_objects, m.dirty_segments) == (set(), {sid})
    m.dirty_segments.clear()
    m.put_start("c1", "k", 1000, 1, 0, token=1)
    m.put_start("c1", "gone", 1000, 1, 0, token=1)
    m.put_revoke("c1", "gone")
    assert m.dirty_objects == set()             # puts in progress are never recorded
    m.put_end("c1", "k")
    assert m.dirty_objects == {"k"}
    m.dirty_objects.clear()
    m.get_replicas("k", 1)                       # reads and leases: nothing
    assert m.dirty_objects == set()
    m.remove("k", 10)
    assert m.dirty_objects == {"k"} and "k" not in m.objects


def test_put_start_and_put_end_are_idempotent_for_a_retried_request():
    m = StoreModel(seed=1)
    m.register_client("c1", "h", "e1", 0)
    m.register_client("c2", "h", "e2", 0)
    m.mount("c1", "s", 4096, 1 << 20)
    first = m.put_start("c1", "k", 1000, 1, 0, token=7)
    assert m.put_start("c1", "k", 1000, 1, 0, token=7) is first     # same request id: same replicas
    assert m.used == first[0].length                                 # allocated once
    with pytest.raises(ObjectBusyError):
        m.put_start("c1", "k", 1000, 1, 0, token=8)                  # another call of the same client
    with pytest.raises(ObjectBusyError):
        m.put_start("c2", "k", 1000, 1, 0, token=7)                  # another client
    assert m.put_end("c1", "k") == 1
    assert m.put_end("c1", "k") == 1                                 # the commit, retried
    with pytest.raises(ObjectNotFoundError):
        m.put_end("c2", "k")


def test_restore_rebuilds_the_index_and_waits_for_owners():
    m = StoreModel(seed=1)
    m.register_client("c1", "h", "e1", 0)
    s1 = m.mount("c1", "seg", 4096, 1 << 20)
    for i in range(5):
        m.put_start("c1", f"k{i}", 1000 + i, 1, 0)
        m.put_end("c1", f"k{i}")
    m.put_start("c1", "half", 5000, 1, 0)        # in progress: not recorded, not restored
    records = {k: (o.size, [[r.segment, r.offset, r.length] for r in o.replicas])
               for k, o in m.objects.items() if o.state is State.COMPLETE}

    r = StoreModel(seed=1)
    r.track()
    r.restore_segment(s1, "c1", "h", "e1", "seg", 4096, 1 << 20, now=100)
    for k, (size, reps) in records.items():
        assert r.restore_object(k, size, reps, writer="c1")
    assert not r.restore_object("orphan", 10, [[99, 0, 64]])   # its segment is gone
    assert "orphan" in r.dirty_objects                          # deleted at the first flush
    assert sorted(r.objects) == sorted(records) and r.used == sum(rr[0][2] for _, rr in records.values())
    assert r.get_replicas("k3", 100).size == 1003                # readable before the owner is back
    r.register_client("c2", "h", "e2", 100)
    s2 = r.mount("c2", "seg", 1 << 30, 1 << 20)
    # an attached segment first; the detached one only for what it cannot hold
    assert [x.segment for x in r.put_start("c2", "new", 10, 1, 100)] == [s2]
    assert sorted(x.segment for x in r.put_start("c2", "two", 10, 2, 100)) == sorted([s1, s2])
    assert r.clients["c1"].recovered
    r.register_client("c1", "h", "e1", 101)                      # the owner, back
    assert r.mount("c1", "seg", 4096, 1 << 20) == s1              # same segment, same objects
    assert not r.clients["c1"].recovered and r.segments[s1].attached
    assert r.mount("c1", "other", 8192, 1 << 20) > 99            # ids are never reused
    # an owner that does not come back is lost after the grace, with its objects
    r2 = StoreModel(seed=1)
    r2.restore_segment(s1, "c1", "h", "e1", "seg", 4096, 1 << 20, now=100)
    r2.restore_object("k0", *records["k0"])
    assert r2.expire_clients(now=100 + 61, grace=60) == ["c1"] and not r2.objects


# -- copy and move tasks (tasks.py) ---------------------------------------------


def _task_pool() -> StoreModel:
    m = StoreModel(seed=3)
    for i, c in enumerate(("c0", "c1", "c2")):
        m.register_client(c, "h", f"e-{c}", 0)
        m.mount(c, f"s-{c}", (i + 1) << 20, 64 * 100)
    return m


def _accounted(m: StoreModel) -> None:
    for s in m.segments.values():
        s.alloc.check()
    assert m.used == sum(s.alloc.used for s in m.segments.values())


def test_copy_and_move_tasks_run_through_the_holders_copies_and_account_their_space():
    """A copy task is handed to the holder of the source replica one target
    at a time (a target holding a replica already is skipped); each copy
    joins at its end. A move's source replica leaves at the end, its space
    back once the copy's lease is released."""
    m = _task_pool()
    m.put_start("c1", "k", 64, 1, now=0, preferred="s-c0")            # segments by name
    m.put_end("c1", "k")
    assert [m.segments[r.segment].name for r in m.objects["k"].replicas] == ["s-c0"]
    tid = m.create_copy_task("k", ["s-c1", "s-c2", "s-c0"])
    assert m.query_task(tid).status is TaskStatus.PENDING and m.query_task(list(tid)).client == "c0"
    assert m.repairable("c0") == 1 and m.repairable("c1") == 0
    for target in ("s-c1", "s-c2"):
        jobs, lease = m.repair_start("c0", 1.0, 64)
        assert [(j[0], m.segments[j[3].segment].name) for j in jobs] == [("k", target)]
        assert m.query_task(tid).status is TaskStatus.PROCESSING
        assert m.repair_end("c0", "k", True) == 1
        m.release_lease(lease, 1.0)
    task = m.query_task(tid)
    assert task.status is TaskStatus.SUCCESS and task.message == "" and task.type is TaskType.REPLICA_COPY
    assert sorted(m.segments[r.segment].name for r in m.objects["k"].replicas) == ["s-c0", "s-c1", "s-c2"]
    assert m.repairable("c0") == 0 and m.repaired == 0               # a task is not a repair
    _accounted(m)
    assert m.used == 3 * 64

    m.put_start("c1", "mv", 64, 1, now=1, preferred="s-c2")
    m.put_end("c1", "mv")
    tid = m.create_move_task("mv", "s-c2", "s-c1")
    jobs, lease = m.repair_start("c2", 2.0, 64)
    assert m.repair_end("c2", "mv", True) == 1
    assert [m.segments[r.segment].name for r in m.objects["mv"].replicas] == ["s-c1"]
    assert m.query_task(tid).status is TaskStatus.SUCCESS
    assert m.used == 5 * 64                  # the source's space waits for the copy's lease
    m.release_lease(lease, 2.0)
    _accounted(m)
    assert m.used == 4 * 64 and "mv" not in m.segments[3].keys


def test_copy_and_move_tasks_refuse_bad_input_and_fail_with_a_reason():
    m = _task_pool()
    m.put_start("c1", "k", 64, 1, now=0, preferred="s-c0")
    m.put_end("c1", "k")
    for call, err in [(lambda: m.create_copy_task("nope", ["s-c1"]), ObjectNotFoundError),
                      (lambda: m.create_move_task("nope", "s-c0", "s-c1"), ObjectNotFoundError),
                      (lambda: m.create_copy_task("", ["s-c1"]), InvalidKeyError),
                      (lambda: m.create_copy_task("k", []), InvalidArgumentError),
                      (lambda: m.create_copy_task("k", ["s-c1", "unknown"]), InvalidArgumentError),
                      (lambda: m.create_move_task("k", "s-c0", "s-c0"), InvalidArgumentError),
                      (lambda: m.create_move_task("k", "unknown", "s-c1"), InvalidArgumentError),
                      (lambda: m.create_move_task("k", "s-c1", "s-c2"), InvalidArgumentError),   # holds none
                      (lambda: m.create_move_task("k", "s-c0", "unknown"), InvalidArgumentError),
                      (lambda: m.query_task((1, 2)), TaskNotFoundError),
                      (lambda: m.query_task("x"), TaskNotFoundError)]:
        with pytest.raises(err):
            call()
    assert not m.tasks and not m._task_queue

    # a failed copy frees its allocation; the task says why
    tid = m.create_copy_task("k", ["s-c1"])
    jobs, lease = m.repair_start("c0", 1.0, 64)
    assert m.repair_end("c0", "k", False) == 0
    m.release_lease(lease, 1.0)
    assert m.query_task(tid).status is TaskStatus.FAILED and "failed" in m.query_task(tid).message
    # the object goes before the copy is handed out
    tid = m.create_copy_task("k", ["s-c2"])
    m.remove("k", now=2.0)
    assert m.repair_start("c0", 2.0, 64)[0] == []
    assert m.query_task(tid).status is TaskStatus.FAILED
    # no room on the target: FAILED, nothing evicted
    m.put_start("c1", "big", 64 * 60, 1, now=3, preferred="s-c0")
    m.put_end("c1", "big")
    m.put_start("c0", "fill", 64 * 60, 1, now=3, preferred="s-c1")
    m.put_end("c0", "fill")
    tid = m.create_copy_task("big", ["s-c1"])
    assert m.repair_start("c0", 3.0, 64)[0] == [] and "no room" in m.query_task(tid).message
    assert m.exists("fill")
    # the copier is lost: its tasks fail, its copy in progress ends
    pending = m.create_move_task("big", "s-c0", "s-c2")
    assert m.repairable("c0") == 1
    m.client_lost("c0")
    assert m.query_task(pending).status is TaskStatus.FAILED and not m._repairs and not m._task_queue
    _accounted(m)


def test_restore_keeps_what_a_put_asked_for():
    # the want count (short of it: made again), pins, a soft pin's end; an
    # object recorded SSD-only gets them back when a tier adopts it again
    m = StoreModel(seed=1)
    m.track()
    for c, base in (("c1", 4096), ("c2", 1 << 30)):
        m.restore_segment(base, c, "h", f"e-{c}", "seg", base, 1 << 20, now=100)
    assert m.restore_object("two", 1000, [[4096, 0, 4096]], want=2, pinned=True, soft_until=0)
    assert m.restore_object("soft", 1000, [[4096, 4096, 4096]], soft_until=130.0)
    assert m.restore_object("old", 1000, [[4096, 8192, 4096], [1 << 30, 0, 4096]])   # a 6-field record
    two, soft, old = m.objects["two"], m.objects["soft"], m.objects["old"]
    assert (two.want, two.pinned, soft.want, soft.soft_until, old.want) == (2, True, 1, 130.0, 2)
    m.register_client("c1", "h", "e-c1", 101)
    m.mount("c1", "seg", 4096, 1 << 20)
    m.register_client("c2", "h", "e-c2", 101)
    m.mount("c2", "seg", 1 << 30, 1 << 20)
    assert m.repairable("c1") == 1                        # "two" lacks a replica
    jobs, lease = m.repair_start("c1", 101, 8)
    assert [j[0] for j in jobs] == ["two"] and m.repair_end("c1", "two", True) == 1
    assert len(two.replicas) == 2 and "two" in m.dirty_objects
    # recorded with no DRAM replica (SSD-only): adopted with what it asked for
    assert not m.restore_object("ssd", 5000, [], pinned=True, want=3, writer="c9", token=4)
    assert not m.restore_object("late", 5000, [], soft_until=500.0)
    m.ssd_attach("c1", "/tmp/x", "evict")
    assert m.ssd_add("c1", "ssd", 5000, adopt=True)
    got = m.objects["ssd"]
    assert (got.pinned, got.want, got.writer, got.token, got.replicas) == (True, 3, "c9", 4, [])
    # not adopted within two graces: forgotten (its holder is back without it, or lost)
    assert m.expire_clients(now=101, grace=60) == []
    m.seen("c1", 300)
    m.seen("c2", 300)
    assert m.expire_clients(now=300, grace=60) == [] and not m._adoptable
    assert m.ssd_add("c1", "late", 5000, adopt=True) and m.objects["late"].soft_until == 0.0
