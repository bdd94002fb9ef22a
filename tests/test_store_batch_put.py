"""The master's put_start of a whole batch in the common case
(batch_puts.py: one attached segment, room below the high watermark):
the same answers as put_start per key, each allocation of the batch's
one run released alone."""
from __future__ import annotations


def test_put_start_of_a_batch_on_one_segment_as_put_start_per_key():
    from kvflow.store.master import Master
    m = Master(seed=1)
    s = m.session("t")
    m.dispatch(s, "register", ["c", "h", "e", 10.0, True])
    sid = m.dispatch(s, "mount", ["seg", 1 << 30, 1 << 20])
    assert m.dispatch(s, "batch_put_start", [[["old", 100, 1, None, False]], 1])["items"][0][0] == 0
    m.dispatch(s, "batch_put_end", [[["old", []]]])
    m.model.set_quota("t", 1000)
    items = [["a", 100, 1, None, False], ["old", 100, 1, None, False], ["b", 65, 1, sid, False],
             ["old", 7, 1, None, False], ["t\x1fq", 10, 1, None, False], ["p", 10, 1, None, True],
             ["", 10, 1, None, False], ["c", 0, 1, None, False], ["d", 1 << 20, 1, None, False]]
    assert m.model.put_start_one_segment("c", items, 0.0, 2) is None       # past the high watermark: evictions
    fast = m.model.put_start_one_segment("c", items[:-1], 0.0, 2)
    assert [r is not None for r in fast] == [True, False, True, False, False, False, False, False]
    for o in ("a", "b"):
        m.model.put_revoke("c", o)
    assert m.dispatch(s, "batch_put_start", [items[:4], 3])["items"][3][1] == "busy"     # a key twice
    m.model.put_revoke("c", "a")
    m.model.put_revoke("c", "b")
    out = m.dispatch(s, "batch_put_start", [items[:3] + items[4:-1], 3])["items"]
    assert [it[0] for it in out] == [0, 0, 0, 0, 0, 1, 1]     # the per-key path's answers where not common
    assert out[1] == [0, None] and out[0][1] == [[sid, (1 << 30) + m.model.objects["a"].replicas[0].offset]]
    offs = sorted(m.model.objects[k].replicas[0].offset for k in ("a", "b", "t\x1fq", "p"))
    assert len(set(offs)) == 4 and all(o % 64 == 0 for o in offs)
    assert m.model.objects["a"].state.name == "ALLOCATED" and m.model.objects["p"].pinned
    m.dispatch(s, "batch_put_end", [[[k, []] for k in ("a", "b", "t\x1fq", "p")]])
    assert m.dispatch(s, "batch_remove", [["a", "b", "t\x1fq", "p", "old"], True]) == [[0, None]] * 5
    seg = m.model.segments[sid]
    seg.alloc.check()
    assert m.model.used == 0 and seg.alloc.extents == 1


def test_allocate_run_lays_a_batch_end_to_end_each_released_alone():
    from kvflow.store.allocator import Allocator
    a = Allocator(1 << 20)
    first = a.allocate(1000)
    offs = a.allocate_run([64, 65, 1, 4096])
    assert offs == [1024, 1088, 1216, 1280] and a.used == 1024 + 64 + 128 + 64 + 4096
    for o in (offs[1], first, offs[3], offs[0], offs[2]):
        a.release(o)
        a.check()
    assert a.used == 0 and a.extents == 1
    assert Allocator(4096).allocate_run([4000, 100]) is None
