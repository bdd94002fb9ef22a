"""The router's page-key memo (conductor/pool_keys.ChainMemo): keys
remembered are the keys computed afresh, for prompts sharing prefixes and
prompts that diverge, with a memo trimmed to its capacity; the parity of
the computed keys with vLLM's and SGLang's own hashes is in
tests/test_router_pool.py."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvflow.conductor import pool_keys
from kvflow.conductor.pool_keys import ChainMemo, SGLangHiCacheKeys, VllmMooncakeKeys


@pytest.fixture
def fresh_memos(monkeypatch):
    memos = pool_keys._Memos()
    monkeypatch.setattr(pool_keys, "_MEMOS", memos)
    return memos


def _afresh(scheme, tokens, block):
    saved = pool_keys._MEMOS
    pool_keys._MEMOS = pool_keys._Memos()
    try:
        return scheme.object_keys(tokens, block)
    finally:
        pool_keys._MEMOS = saved


@pytest.mark.parametrize("scheme", [VllmMooncakeKeys("org/model"), SGLangHiCacheKeys("p-", "mla")])
def test_remembered_keys_are_the_keys_computed_afresh(fresh_memos, scheme):
    rng = random.Random(7)
    system = [rng.randrange(50000) for _ in range(256)]
    prompts = [system + [rng.randrange(50000) for _ in range(rng.randrange(0, 300))] for _ in range(12)]
    prompts.append(system[:100] + [1] * 200)            # diverges inside a page
    prompts.append(list(np.array(system, dtype=np.int64)))   # numpy ids: the same pages
    for block in (16, 64):
        for toks in prompts:
            assert scheme.object_keys(toks, block) == _afresh(scheme, toks, block)
    memo = fresh_memos.get((scheme.name, getattr(scheme, "hash_seed", "")))
    # the shared system prompt's pages were hashed once per page size
    assert len(memo.pages) < sum(len(p) // 16 + len(p) // 64 for p in prompts)


def test_a_memo_past_its_capacity_drops_its_oldest_pages_and_stays_exact(fresh_memos):
    scheme = SGLangHiCacheKeys()
    memo = fresh_memos.get((scheme.name, ""))
    memo.capacity = 8
    toks = list(range(1000, 1000 + 16 * 20))
    keys = scheme.object_keys(toks, 16)
    assert len(memo.pages) == 8
    assert scheme.object_keys(toks, 16) == keys == _afresh(scheme, toks, 16)
    assert len(memo.pages) == 8


def test_a_bad_token_is_still_refused_with_a_memo(fresh_memos):
    with pytest.raises(ValueError):
        SGLangHiCacheKeys().object_keys([-1] * 16, 16)
    assert isinstance(fresh_memos.get(("sglang", "")), ChainMemo)
