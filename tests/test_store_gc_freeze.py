"""The standalone master's collector kept off its index (kvflow/store/gc_freeze.py):
a full collection's survivors are frozen, so the next walks only what came
since; a sweep collects what frozen objects left as cyclic garbage; a real
master process with a recovered index serves with it frozen."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from kvflow.store.gc_freeze import GcFreezer
from kvflow.store.model import StoreModel


@pytest.fixture
def freezer():
    f = GcFreezer(sweep_s=3600)
    f.install()
    try:
        yield f
    finally:
        f.uninstall()
        gc.collect()


def _index(n: int) -> StoreModel:
    m = StoreModel(seed=1)
    m.register_client("c0", "host", "127.0.0.1:1", now=0)
    m.mount("c0", "seg", 1 << 30, 1 << 30)
    for i in range(n):
        m.put_start("c0", f"k{i}", 256, 1, now=0)
        m.put_end("c0", f"k{i}")
    return m


def test_a_full_collections_survivors_are_frozen_and_not_walked_again(freezer):
    m = _index(20_000)
    gc.collect()                                    # a full collection: its survivors frozen
    assert freezer.freezes >= 1
    walked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    assert len(walked) < 20_000                     # the index is no longer walked
    for key in ("k0", "k10000", "k19999"):          # its records and their replicas are frozen
        obj = m.objects[key]
        assert id(obj) not in walked and id(obj.replicas) not in walked
    assert m.exists("k19999") and m.get_replicas("k5", now=0)   # and it is the same index (k5 leased now)
    record = weakref.ref(m.objects["k6"])
    m.remove("k6", now=0)                           # frozen records still go by reference counting
    assert not m.exists("k6") and record() is None


def test_a_sweep_collects_cyclic_garbage_that_was_frozen(freezer):
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a                         # a cycle, alive now
    gone = weakref.ref(a)
    gc.collect()                                    # frozen with the survivors
    del a, b                                        # garbage now, but frozen: no collection walks it
    gc.collect()
    assert gone() is not None
    freezer.sweep()
    assert gone() is None and freezer.sweeps == 1
    assert gc.get_freeze_count() > 0                # the survivors frozen again


def test_uninstall_gives_everything_back_to_the_collector():
    f = GcFreezer()
    f.install()
    gc.collect()
    assert gc.get_freeze_count() > 0
    f.uninstall()
    assert gc.get_freeze_count() == 0 and f._after not in gc.callbacks


async def test_the_sweep_runs_on_the_loop():
    f = GcFreezer(sweep_s=0.05)
    f.install()
    try:
        for _ in range(100):
            if f.sweeps:
                break
            await asyncio.sleep(0.05)
        assert f.sweeps >= 1 and f.last_sweep_s > 0
    finally:
        f.uninstall()


def test_master_stalls_tool_times_a_real_master_while_its_index_grows(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "stalls.json"
    r = subprocess.run([sys.executable, str(root / "tools" / "master_stalls.py"), "--objects", "5000",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["objects"] == 5000 and row["probes"] > 0 and row["load_s"] > 0
    assert 0 < row["p50_us"] <= row["p999_ms"] * 1000 <= row["max_ms"] * 1000
    assert str(row["probes"]) in r.stdout.replace(",", "") and "| 5,000 |" in r.stdout
