"""examples/pd/prefix_cache.py: the prefill servers' prefix cache of KV
pages. Page ownership is what matters: every page back in the pool exactly
once, pinned pages never evicted, a chain's tail evicted before its head."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch", reason="the PD example needs PyTorch (pip install torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.pd.model import KVPool, ModelConfig, OutOfPagesError  # noqa: E402
from examples.pd.prefix_cache import PrefixCache  # noqa: E402


def pool(pages: int) -> KVPool:
    return KVPool(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                              intermediate_size=32), pages, 4)


def test_inserted_pages_stay_pinned_in_a_full_cache():
    p = pool(8)
    c = PrefixCache(p, max_pages=2)
    a = c.alloc(2)
    c.insert([1, 2], a)                  # pinned until released
    b = c.alloc(2)
    assert c.insert([3, 4], b) == []     # over max_pages: nothing unpinned to evict
    assert c.match([3, 4]) == b and c.match([1, 2]) == a
    c.release([1, 2, 3, 4])              # now it shrinks to 2: a chain's tail first
    assert len(c) == 2 and sorted(c.take_evicted()) in ([2, 4], [1, 2], [3, 4])
    assert p.num_free == 8 - 2


def test_duplicates_stay_the_callers_and_every_page_is_freed_once():
    p = pool(8)
    c = PrefixCache(p, max_pages=8)
    first = c.alloc(3)
    c.insert([1, 2, 3], first)
    c.release([1, 2, 3])
    again = c.alloc(2)
    kept = c.insert([1, 2], again)        # blocks 1, 2 are cached already
    assert kept == again                  # still ours: free them when nothing reads them
    p.free(kept)
    c.release([1, 2])
    assert p.num_free == 8 - 3 and c.match([1, 2, 3]) == first


def test_acquire_pins_the_matched_prefix_and_alloc_evicts_around_it():
    p = pool(4)
    c = PrefixCache(p, max_pages=4)
    pages = c.alloc(4)
    c.insert([1, 2, 3, 4], pages)
    c.release([1, 2, 3, 4])
    held = c.acquire([1, 2, 9])           # 1, 2 pinned; 9 is not cached
    assert held == pages[:2]
    got = c.alloc(2)                      # evicts the unpinned tail 4, 3
    assert sorted(got) == sorted(pages[2:]) and c.match([1, 2, 3]) == pages[:2]
    with pytest.raises(OutOfPagesError):
        c.alloc(1)                        # the rest is pinned
    c.release([1, 2])
    assert c.alloc(1)                     # and now it can go
