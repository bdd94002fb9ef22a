"""One SGLang rank's HiCache storage, driven by SGLang's own classes on CPU:
the installed SGLang's MHATokenToKVPool / MLATokenToKVPool (device pools
built on "cpu") and MHATokenToKVPoolHost / MLATokenToKVPoolHost over them,
the backend built by SGLang's StorageBackendFactory ("dynamic", the extra
config naming kvflow's class, or "mooncake" for SGLang's Mooncake backend),
and pages moved by HiCacheController's own zero-copy page functions
(_page_set_zero_copy, _page_get_zero_copy, _storage_hit_query: SGLang's
code, called on a controller object that holds only what they read).

Run by tests/test_sglang_hicache.py and tools/hicache_bench.py:

    python tests/_sglang_hicache.py ROLE JSON_ARGS

ROLE set: fills `pages` pages of the host pool with a pattern seeded by
`seed`, backs them up, backs them up again (dedup), prints a JSON line.
ROLE get: checks the prefix (and a gap), reads the pages into other host
slots, compares every byte with the pattern, prints a JSON line.
ROLE bench: set then get rounds of `batch` pages, prints pages per second.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid

import torch

from sglang.srt.managers.cache_controller import HiCacheController, get_storage_hash_str
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

KVFLOW = {"backend_name": "kvflow", "module_path": "kvflow.compat.sglang.hicache",
          "class_name": "KVFlowHiCacheStorage", "interface_v1": 1}


def host_pool(mla: bool, layout: str, tokens: int, page: int, layers: int, heads: int, dim: int):
    """SGLang's device pool on CPU and its host pool (2x the device's tokens).
    Built inside SGLang's host_memory_budget_scope with a 4 GiB budget: the
    pools here take a few MiB, and SGLang's own check (free memory less a
    10 GB reserve) fails on a shared CI host whatever the pool's size."""
    with host_memory_budget_scope(4 << 30):
        return _host_pool(mla, layout, tokens, page, layers, heads, dim)


def _host_pool(mla: bool, layout: str, tokens: int, page: int, layers: int, heads: int, dim: int):
    if mla:
        dev = MLATokenToKVPool(size=tokens, page_size=page, dtype=torch.bfloat16, kv_lora_rank=dim,
                               qk_rope_head_dim=dim // 8, layer_num=layers, device="cpu", enable_memory_saver=False)
        return MLATokenToKVPoolHost(dev._mla_buffer_info(), 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)
    dev = MHATokenToKVPool(size=tokens, page_size=page, dtype=torch.bfloat16, head_num=heads, head_dim=dim,
                           layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    return MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers)


def storage_config(mla: bool, tp_rank: int, tp_size: int, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=None, extra_config=dict(extra))


class Controller:
    """The attributes HiCacheController's page functions read, with SGLang's
    own functions bound to it (the full controller needs a GPU device pool,
    process groups and a scheduler)."""

    def __init__(self, backend, pool) -> None:
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = pool.page_size

    page_set = HiCacheController._page_set_zero_copy
    page_get = HiCacheController._page_get_zero_copy
    hit_query = HiCacheController._storage_hit_query


class Op:
    """What _storage_hit_query and _page_get_zero_copy read of a prefetch operation."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids, self.last_hash, self.prefix_keys = tokens, None, None
        self.request_id = "r0"
        self.all_hash_values: list = []

    def is_terminated(self) -> bool:
        return False


def build(a: dict):
    pool = host_pool(a["mla"], a.get("layout", "page_first"), a["tokens"], a["page"], a["layers"], a["heads"],
                     a["dim"])
    backend = StorageBackendFactory.create_backend(a["backend"], storage_config(a["mla"], a.get("tp_rank", 0),
                                                                               a.get("tp_size", 1), a["extra"]),
                                                   pool)
    backend.register_mem_pool_host(pool)
    return pool, backend


def page_bytes(pool, slots: torch.Tensor) -> list[bytes]:
    """Each page's bytes, read through the host pool's own buffer list."""
    ptrs, sizes = pool.get_page_buffer_meta(slots)
    base, buf = pool.kv_buffer.data_ptr(), pool.kv_buffer.view(-1).view(torch.uint8)
    per = len(ptrs) // (len(slots) // pool.page_size)
    out = []
    for i in range(0, len(ptrs), per):
        out.append(b"".join(buf[p - base:p - base + s].numpy().tobytes() for p, s in zip(ptrs[i:i + per],
                                                                                        sizes[i:i + per])))
    return out


def fill(pool, slots: torch.Tensor, seed: int) -> None:
    """A pattern in the pages' bytes only (so a read that lands elsewhere shows)."""
    g = torch.Generator().manual_seed(seed)
    ptrs, sizes = pool.get_page_buffer_meta(slots)
    base, buf = pool.kv_buffer.data_ptr(), pool.kv_buffer.view(-1).view(torch.uint8)
    for p, s in zip(ptrs, sizes):
        buf[p - base:p - base + s] = torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g)


def tokens_for(a: dict) -> list[int]:
    g = torch.Generator().manual_seed(a["seed"])
    return torch.randint(0, 32000, (a["pages"] * a["page"],), generator=g).tolist()


def role_set(a: dict) -> dict:
    pool, backend = build(a)
    c = Controller(backend, pool)
    n, page = a["pages"], a["page"]
    hashes = get_storage_hash_str(tokens_for(a), None, page_size=page)     # what the prefetch side computes
    slots = torch.arange(page, page + n * page)
    fill(pool, slots, a["seed"])
    out = {"hashes": hashes, "first": c.page_set(hashes, slots)}
    before = dict(backend.counters.as_dict()) if hasattr(backend, "counters") else {}
    out["again"] = c.page_set(hashes, slots)
    if hasattr(backend, "counters"):
        after = backend.counters.as_dict()
        out["counters_first"] = before
        out["counters_again"] = {k: after[k] - before[k] for k in after}
    if a.get("hold"):
        print(json.dumps(out), flush=True)
        sys.stdin.readline()            # the segment holds the pages until the getter is done
        backend.close()
        return {}
    return out


def role_get(a: dict) -> dict:
    pool, backend = build(a)
    c = Controller(backend, pool)
    n, page = a["pages"], a["page"]
    op = Op(tokens_for(a))
    hit_hashes, hit_tokens = c.hit_query(op)
    out: dict = {"hit_pages": len(hit_hashes), "hit_tokens": hit_tokens}
    hashes = op.all_hash_values
    out["hashes_match"] = hashes == a["hashes"]
    gap = hashes[:3] + [uuid.uuid4().hex] + hashes[3:]
    out["gap_prefix"] = backend.batch_exists(gap)
    out["missing_then_present"] = backend.batch_exists([uuid.uuid4().hex] + hashes)
    # the pattern, rebuilt in the set side's slots, is what every page must hold
    src = torch.arange(page, page + n * page)
    fill(pool, src, a["seed"])
    want = page_bytes(pool, src)
    dst = torch.arange((n + 2) * page, (2 * n + 2) * page)
    ptrs, sizes = pool.get_page_buffer_meta(dst)
    base, buf = pool.kv_buffer.data_ptr(), pool.kv_buffer.view(-1).view(torch.uint8)
    for p, s in zip(ptrs, sizes):
        buf[p - base:p - base + s] = 0
    out["got"] = c.page_get(op, hashes, dst)
    out["bytes_equal"] = page_bytes(pool, dst) == want
    out["results"] = backend.batch_get_v1(hashes[:2] + [uuid.uuid4().hex], dst[:3 * page])
    out["bytes_equal_after_partial"] = page_bytes(pool, dst[:2 * page]) == want[:2]
    return out


def role_bench(a: dict) -> dict:
    """Pages set and got per second: `rounds` rounds, each sets `batch` new
    pages (SGLang's backup: exists + put of the missing) then gets them
    (SGLang's prefetch: batch_exists + batch_get_v1), timed separately."""
    pool, backend = build(a)
    page, batch = a["page"], a["batch"]
    src = torch.arange(page, page + batch * page)
    dst = torch.arange((batch + 2) * page, (2 * batch + 2) * page)
    fill(pool, src, 1)
    want = page_bytes(pool, src)
    # warm-up: one round (connections, first-touch of the segments)
    keys = [uuid.uuid4().hex for _ in range(batch)]
    assert all(backend.batch_set_v1(keys, src))
    assert all(backend.batch_get_v1(keys, dst))
    sets, gets = [], []
    for _ in range(a["rounds"]):
        keys = [uuid.uuid4().hex for _ in range(batch)]
        t = time.perf_counter()
        ok = backend.batch_set_v1(keys, src)
        sets.append(time.perf_counter() - t)
        assert all(ok), ok
        t = time.perf_counter()
        hit = backend.batch_exists(keys)
        ok = backend.batch_get_v1(keys[:hit], dst)
        gets.append(time.perf_counter() - t)
        assert hit == batch and all(ok), (hit, ok)
        assert page_bytes(pool, dst) == want
        if a.get("remove"):
            backend.clear()
    sets.sort()
    gets.sort()
    bpp = len(want[0])
    return {"page_bytes": bpp, "batch": batch, "rounds": a["rounds"],
            "set_pages_per_s": batch / sets[len(sets) // 2], "get_pages_per_s": batch / gets[len(gets) // 2],
            "set_s": sets, "get_s": gets}


def main() -> int:
    role, a = sys.argv[1], json.loads(sys.argv[2])
    out = {"set": role_set, "get": role_get, "bench": role_bench}[role](a)
    if out:
        print(json.dumps(out), flush=True)
    os._exit(0)         # SGLang's and Mooncake's threads do not all end by themselves


if __name__ == "__main__":
    sys.exit(main())
