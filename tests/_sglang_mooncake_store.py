"""SGLang HiCache's Mooncake backend (sglang.srt.mem_cache.storage.
mooncake_store, the installed SGLang's file, unchanged) on whatever
`mooncake.store` is importable: kvflow's with the shim first on
PYTHONPATH, else the real wheel. Run by tests/test_compat_mooncake_store.py
with MOONCAKE_MASTER etc. in the environment.

1. SGLang's own test of that backend (test_mooncake_store.py, shipped in
   the same SGLang package): set/get/exists of one page, batch_set_v1 /
   batch_exists / batch_get_v1 for MHA and MLA at four TP layouts.
2. Byte checks on the same class: MHA pages (a K key and a V key per page:
   batch_put_from / batch_get_into) and MLA pages of two buffers each
   (batch_put_from_multi_buffers / batch_get_into_multi_buffers: one object
   per page made of both), every byte of what batch_get_v1 brought back
   compared with what batch_set_v1 stored, the stored objects read back
   with the store's plain get(), a page set twice (exists: skipped), and
   batch_exists stopping at the first missing page.
3. With --standalone: the byte checks of 2 on a store in SGLang's
   standalone_storage mode (setup_dummy to a mooncake_client at
   MOONCAKE_CLIENT, the host pool from MooncakeHostTensorAllocator).
Prints one JSON line: what ran and what each check saw."""
from __future__ import annotations

import json
import sys
import uuid

import torch

from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as upstream
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeHostTensorAllocator, MooncakeStore


def sglang_own_tests() -> list[str]:
    ran = []
    upstream.test_single_operation()
    ran.append("test_single_operation")
    for mla, rank, size in ((False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)):
        upstream.test_batch_operation(upstream.make_hicache_storage_config(is_mla_model=mla, tp_rank=rank,
                                                                           tp_size=size))
        ran.append(f"test_batch_operation(mla={mla}, tp_rank={rank}, tp_size={size})")
    return ran


class Counting:
    """The store object with a count of the calls SGLang makes on it (a
    proxy: the real wheel's class takes no new attributes)."""

    def __init__(self, store: object) -> None:
        self._store, self.calls = store, {}

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args: object, **kw: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kw)
        return call


def byte_checks(mla: bool, pages: int = 9, page_elems: int = 512, standalone: bool = False) -> dict:
    entries = 2     # MHA: K and V, one key each; MLA: two buffers packed into one object
    pool, buf = upstream.create_mock_host_kv_cache(4 << 20, entries_per_page=entries, page_elements=page_elems)
    if standalone:
        # the host pool in shared memory a standalone real client maps
        # (SGLang's MooncakeHostTensorAllocator), as MooncakeStore requires then
        pool.allocator = MooncakeHostTensorAllocator()
        pool.kv_buffer = buf = pool.allocator.allocate((buf.numel(),), buf.dtype)
    store = MooncakeStore(upstream.make_hicache_storage_config(is_mla_model=mla, tp_rank=0, tp_size=1),
                          mem_pool=pool if standalone else None)
    torch.manual_seed(7)
    buf.copy_(torch.randn(buf.numel()))
    store.register_mem_pool_host(pool)
    store.store = counting = Counting(store.store)
    keys = [f"page-{uuid.uuid4().hex}" for _ in range(pages)]
    src, dst = torch.arange(pages), torch.arange(pages, 2 * pages)
    span = lambda idx: buf[idx * entries * page_elems:(idx + 1) * entries * page_elems]  # noqa: E731
    out: dict = {"mla": mla}
    out["set"] = store.batch_set_v1(keys, src)
    out["set_again"] = store.batch_set_v1(keys, src)          # every key exists: nothing written
    out["exists"] = store.batch_exists(keys)
    out["exists_gap"] = store.batch_exists(keys[:3] + ["never-set"] + keys[3:])
    buf[pages * entries * page_elems:2 * pages * entries * page_elems] = 0
    out["get"] = store.batch_get_v1(keys, dst)
    out["bytes_equal"] = all(torch.equal(span(int(s)).view(torch.uint8), span(int(d)).view(torch.uint8))
                             for s, d in zip(src, dst))
    # what the store holds for page 0, read back with the plain bytes API
    if mla:
        raw = store.store.get(f"{keys[0]}_{store.mla_suffix}_k")
        want = span(0).numpy().tobytes()
    else:
        raw = store.store.get(f"{keys[0]}_{store.mha_suffix}_k") + store.store.get(f"{keys[0]}_{store.mha_suffix}_v")
        want = span(0).numpy().tobytes()
    out["raw_bytes_equal"] = raw == want
    out["missing_get"] = store.batch_get_v1(["never-set"], torch.arange(2 * pages, 2 * pages + 1))
    out["calls"] = counting.calls
    return out


def main() -> int:
    report = {"store_module": sys.modules["mooncake.store"].__file__ if "mooncake.store" in sys.modules else None}
    if "--standalone" in sys.argv[1:]:
        # MOONCAKE_STANDALONE_STORAGE=true and MOONCAKE_CLIENT in the
        # environment: the store is a dummy client of a mooncake_client
        # (SGLang's own tests build stores without a host pool: not run)
        report["sglang_own_tests"] = []
        report["checks"] = [byte_checks(False, standalone=True), byte_checks(True, standalone=True)]
        report["store_module"] = sys.modules["mooncake.store"].__file__
        report["dummy"] = True
        print(json.dumps(report), flush=True)
        return 0
    report["sglang_own_tests"] = sglang_own_tests()
    report["store_module"] = sys.modules["mooncake.store"].__file__
    report["checks"] = [byte_checks(False), byte_checks(True)]
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
