"""kvflow's own SGLang HiCache storage backend (kvflow.compat.sglang.hicache)
with SGLang's own pieces on CPU: its device and host KV pools
(MHATokenToKVPool/Host, MLATokenToKVPool/Host), its StorageBackendFactory
("dynamic" with module_path/class_name, interface_v1) and its
HiCacheController page functions (tests/_sglang_hicache.py).

- Two processes on a standalone kvflow master: one backs pages up (and
  keeps them in its segment), the other finds the prefix, reads the pages
  into other host slots and compares every byte; MHA and MLA, page_first
  and layer_first.
- Dedup: the second backup of the same pages writes nothing (counted).
- Prefix semantics: a missing page ends the prefix.
- In process: bad input gets typed errors and the backend keeps working."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvflow

HERE = Path(__file__).parent
ROOT = str(Path(kvflow.__file__).resolve().parents[1])

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")

KVFLOW = {"backend_name": "kvflow", "module_path": "kvflow.compat.sglang.hicache",
          "class_name": "KVFlowHiCacheStorage", "interface_v1": 1}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_", "KVFLOW_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


@pytest.fixture(scope="module")
def master():
    p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, text=True, env=_env(), stdin=subprocess.DEVNULL)
    line = p.stdout.readline()
    assert "ready" in line, line
    yield line.split()[-1]
    p.terminate()
    p.wait(10)


def _role(role: str, args: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "_sglang_hicache.py"), role, json.dumps(args)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize("mla,layout", [(False, "page_first"), (True, "page_first"), (True, "layer_first"),
                                        (False, "page_first_direct")])
def test_two_processes_every_byte(master, mla, layout):
    pages = 12
    base = {"mla": mla, "layout": layout, "tokens": 512, "page": 16, "layers": 3, "heads": 2, "dim": 32,
            "backend": "dynamic", "pages": pages, "seed": 11 + mla}
    setter = _role("set", {**base, "hold": True, "extra": {**KVFLOW, "master_server_addr": master,
                                                           "global_segment_size": 64 << 20}},
                   stdin=subprocess.PIPE)
    try:
        line = setter.stdout.readline()
        assert line.startswith("{"), line + setter.stderr.read()[-3000:]
        s = json.loads(line)
        # the getter mounts nothing: every page comes over tcp from the setter's segment
        getter = _role("get", {**base, "hashes": s["hashes"],
                               "extra": {**KVFLOW, "master_server_addr": master, "global_segment_size": 0}})
        out, err = getter.communicate(timeout=300)
        assert getter.returncode == 0, err[-4000:]
        g = _last_json(out)
    finally:
        setter.stdin.write("\n")
        setter.stdin.close()
        setter.wait(60)
    assert s["first"] is True and s["again"] is True, s
    # dedup: the second backup asked once whether the pages exist, and wrote none
    assert s["counters_again"] == {"exists_calls": 1, "pages_written": 0, "pages_skipped": pages,
                                   "pages_read": 0, "pages_failed": 0}, s
    assert s["counters_first"]["pages_written"] == pages, s
    assert g["hashes_match"] and g["hit_pages"] == pages and g["hit_tokens"] == pages * 16, g
    assert g["gap_prefix"] == 3 and g["missing_then_present"] == 0, g
    assert g["got"] == pages and g["bytes_equal"], g
    assert g["results"] == [True, True, False] and g["bytes_equal_after_partial"], g


# -- in process ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sg():
    sys.path.insert(0, str(HERE))
    import _sglang_hicache
    return _sglang_hicache


@pytest.fixture
def built(sg):
    a = {"mla": False, "tokens": 256, "page": 8, "layers": 2, "heads": 2, "dim": 16, "backend": "dynamic",
         "extra": {**KVFLOW, "global_segment_size": 16 << 20}}      # no master: one embedded in this process
    pool, backend = sg.build(a)
    yield sg, pool, backend
    backend.close()
    backend.close()         # idempotent


def test_loaded_through_sglangs_factory(built):
    sg, pool, backend = built
    from kvflow.compat.sglang.hicache import KVFlowHiCacheStorage
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    assert type(backend) is KVFlowHiCacheStorage and isinstance(backend, HiCacheStorage)
    assert backend.object_keys(["h"]) == ["h_0"]
    assert "MHA tp0" in repr(backend)


def test_bad_input_typed_errors_and_still_works(built):
    import torch
    from kvflow.errors import InvalidArgumentError
    sg, pool, backend = built
    slots = torch.arange(8, 24)
    with pytest.raises(InvalidArgumentError):
        backend.batch_set_v1(["a", "b", "c"], slots)            # 3 pages, 2 pages of slots
    with pytest.raises(InvalidArgumentError):
        backend.batch_set_v1([b"a", "b"], slots)                 # keys of the wrong type
    with pytest.raises(InvalidArgumentError):
        backend.batch_get_v1(["", "b"], slots)                  # empty key
    with pytest.raises(InvalidArgumentError):
        backend.batch_exists("ab")                              # not a list
    with pytest.raises(InvalidArgumentError):
        backend.batch_get_v1(["a", "b"], slots.view(2, 8))       # not 1-d
    with pytest.raises(InvalidArgumentError):
        backend.batch_set(["a"], None, None, None)              # only zero copy
    assert backend.batch_get_v1(["never-set"], slots[:8]) == [False]
    assert backend.batch_exists([]) == 0 and backend.batch_set_v1([], slots[:0]) == []
    # and it still works
    assert backend.batch_set_v1(["a", "b"], slots) == [True, True]
    assert backend.batch_exists(["a", "b", "c"]) == 2 and backend.exists("a") and not backend.exists("c")
    assert backend.batch_get_v1(["a", "b"], torch.arange(32, 48)) == [True, True]
    assert sg.page_bytes(pool, torch.arange(8, 24)) == sg.page_bytes(pool, torch.arange(32, 48))
    # the older interface, zero copy from the same registered pool
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(8, 16))
    assert backend.batch_set(["old"], None, [ptrs], [sizes]) is True and backend.exists("old")
    assert backend.get("old", list(ptrs), list(sizes))
    backend.clear()
    assert backend.batch_exists(["a"]) == 0


def test_misuse_before_register_and_bad_config(sg):
    import torch
    from kvflow.compat.sglang.hicache import KVFlowHiCacheStorage
    from kvflow.errors import InvalidArgumentError
    from kvflow.store import MasterUnavailableError
    cfg = lambda mla=False, **extra: sg.storage_config(mla, 0, 1, {**KVFLOW, **extra})   # noqa: E731
    b = KVFlowHiCacheStorage(cfg(global_segment_size=0), {})
    try:
        with pytest.raises(InvalidArgumentError, match="register_mem_pool_host"):
            b.batch_get_v1(["a"], torch.arange(8))
    finally:
        b.close()
    with pytest.raises(InvalidArgumentError):
        KVFlowHiCacheStorage(cfg(protocol="carrier-pigeon"), {})
    with pytest.raises(InvalidArgumentError):
        KVFlowHiCacheStorage(cfg(global_segment_size=-1), {})
    with pytest.raises(MasterUnavailableError):
        KVFlowHiCacheStorage(cfg(master_server_addr="127.0.0.1:1", timeout=1.0), {})
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    with pytest.raises(ValueError):         # SGLang's own check of the dynamic config
        StorageBackendFactory.create_backend("dynamic", sg.storage_config(False, 0, 1, {"backend_name": "x"}),
                                             None)


def _master_calls(backend, make) -> int:
    """Master calls that `make()`'s callable makes: the master counts every
    call it answers; heartbeats (one a second) only add, so the least of
    three tries is the call's own count."""
    counts = []
    for _ in range(3):
        fn = make()
        before = backend.pool_stats()["calls"]
        fn()
        counts.append(backend.pool_stats()["calls"] - before - 1)     # less the second stats call
    return min(counts)


def test_one_master_round_trip_per_batch(built):
    import uuid
    import torch
    sg, pool, backend = built
    slots = torch.arange(8, 8 + 12 * 8)
    fresh = lambda: [uuid.uuid4().hex for _ in range(12)]      # noqa: E731
    keys = fresh()
    assert _master_calls(backend, lambda: lambda: backend.batch_exists(keys)) == 1
    assert _master_calls(backend, lambda: lambda: backend.batch_exists(keys * 10)) == 1
    # a first backup: one exists, one put_start, one put_end
    assert _master_calls(backend, lambda: (lambda k: lambda: backend.batch_set_v1(k, slots))(fresh())) == 3
    # every page present: the exists call only, and nothing written
    backend.batch_set_v1(keys, slots)
    w = backend.counters.pages_written
    assert _master_calls(backend, lambda: lambda: backend.batch_set_v1(keys, slots)) == 1
    assert backend.counters.pages_written == w
    # a get: one round trip for every page's replicas, then the lease's
    # release as a one-way notice (no reply waited for)
    assert _master_calls(backend, lambda: lambda: backend.batch_get_v1(keys, torch.arange(128, 128 + 12 * 8))) == 2


def test_prefetch_and_backup_answer_while_the_engines_loop_is_held(sg, master):
    """On a tcp master, batch_exists, batch_set_v1 and batch_get_v1 run on
    the calling thread (StoreClient.batch_exists_blocking, direct.py): they
    finish, with every byte and the prefix right, while the backend's
    engine loop is held busy; a hop to the loop would wait for it."""
    import threading
    import time
    import uuid
    import torch
    a = {"mla": False, "tokens": 256, "page": 8, "layers": 2, "heads": 2, "dim": 16, "backend": "dynamic",
         "extra": {**KVFLOW, "global_segment_size": 16 << 20, "master_server_addr": master, "protocol": "tcp"}}
    pool, backend = sg.build(a)
    try:
        src, dst = torch.arange(8, 8 + 4 * 8), torch.arange(64, 64 + 4 * 8)
        sg.fill(pool, src, 7)
        keys = [uuid.uuid4().hex for _ in range(4)]
        assert backend.batch_set_v1(keys[:1], src[:8]) == [True]        # connections made, loop warm
        released = threading.Event()
        held = threading.Event()
        backend._thread.loop.call_soon_threadsafe(lambda: (held.set(), released.wait(20)))
        assert held.wait(10)
        try:
            t0 = time.monotonic()
            assert backend.batch_set_v1(keys, src) == [True] * 4
            assert backend.batch_exists(keys + [uuid.uuid4().hex]) == 4
            assert backend.batch_exists([keys[0], uuid.uuid4().hex, keys[1]]) == 1
            assert backend.batch_get_v1(keys, dst) == [True] * 4
            took = time.monotonic() - t0
            assert not released.is_set()
        finally:
            released.set()
        assert took < 10
        assert sg.page_bytes(pool, dst) == sg.page_bytes(pool, src)
        assert backend.counters.exists_calls == 4 and backend.counters.pages_read == 4
    finally:
        backend.close()
