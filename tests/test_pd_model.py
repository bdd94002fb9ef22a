"""The model half of the PD example (examples/pd/model.py): the paged KV pool must
reproduce a cache-free forward, and a decode pool filled by page copies alone must
continue a request exactly where the prefill pool would have."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="examples/pd needs PyTorch (pip install torch)")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # examples/ is not an installed package
    sys.path.insert(0, REPO_ROOT)

from examples.pd.model import (
    AUX_FIRST_TOKEN,
    AUX_PROMPT_LEN,
    KVPool,
    Model,
    ModelConfig,
    OutOfPagesError,
    OutOfSlotsError,
    encode,
)

# Two cores on the test machines, shared with the rest of the suite: more threads
# only add OpenMP barrier waits.
torch.set_num_threads(1)

PAGE_SIZE = 16
NEW_TOKENS = 12   # enough to cross a page boundary while decoding


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelConfig(), seed=1234)


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, ModelConfig().vocab_size, size=length).tolist()


def shuffled_pages(pool: KVPool, num_tokens: int, seed: int) -> np.ndarray:
    pages = pool.alloc(pool.pages_for(num_tokens))
    return np.random.default_rng(seed).permutation(pages).astype(np.int32)


def copy_pages(src: KVPool, src_pages: np.ndarray, dst: KVPool, dst_pages: np.ndarray) -> None:
    """What the transfer engine does: page i of every registered buffer of ``src`` to page
    i of the same buffer of ``dst``, as bytes at ``page * page_bytes``."""
    assert src.page_bytes == dst.page_bytes
    for s, d in zip(src.buffers(), dst.buffers()):
        s_bytes = s.numpy().view(np.uint8).reshape(src.num_pages, src.page_bytes)
        d_bytes = d.numpy().view(np.uint8).reshape(dst.num_pages, dst.page_bytes)
        d_bytes[dst_pages] = s_bytes[src_pages]


@pytest.mark.parametrize("length", [1, 5, PAGE_SIZE - 1, PAGE_SIZE + 1, 3 * PAGE_SIZE + 7, 150])
def test_paged_generate_matches_reference(model: Model, length: int) -> None:
    prompt = prompt_of(length, seed=length)
    pool = KVPool(model.config, num_pages=64, page_size=PAGE_SIZE)
    pool.alloc(3)  # so that the request's pages do not start at 0
    pages = shuffled_pages(pool, length + NEW_TOKENS, seed=length)
    got = model.generate(prompt, NEW_TOKENS, pool, pages)
    assert got == model.reference_generate(prompt, NEW_TOKENS)
    assert len(got) == NEW_TOKENS


def test_generation_depends_on_context(model: Model) -> None:
    # Guards the other tests against a degenerate model that ignores its cache.
    outputs = {tuple(model.reference_generate(prompt_of(40, seed), 6)) for seed in range(4)}
    assert len(outputs) == 4
    assert any(len(set(out)) > 2 for out in outputs)
    assert model.reference_generate(encode("hello, world"), 3) == Model(ModelConfig(), seed=1234).reference_generate(
        encode("hello, world"), 3)


def test_on_layer_called_per_layer_with_that_layer_in_the_pool(model: Model) -> None:
    prompt = prompt_of(70, seed=7)
    pool = KVPool(model.config, num_pages=32, page_size=PAGE_SIZE)
    pages = shuffled_pages(pool, len(prompt), seed=7)
    slots = pool.token_slots(pages, 0, len(prompt))
    seen: list[int] = []
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_layer(layer: int) -> None:
        seen.append(layer)
        k_rows, v_rows = pool.rows(pool.k[layer])[slots], pool.rows(pool.v[layer])[slots]
        assert k_rows.abs().sum(dim=1).min() > 0 and v_rows.abs().sum(dim=1).min() > 0  # every token written
        snapshots[layer] = (k_rows.clone(), v_rows.clone())
        for later in range(layer + 1, model.config.num_layers):  # the next layers are not computed yet
            assert not pool.k[later].any() and not pool.v[later].any()

    first = model.prefill(prompt, pool, pages, on_layer=on_layer)
    assert seen == list(range(model.config.num_layers))
    assert first == model.reference_generate(prompt, 1)[0]
    for layer, (k_rows, v_rows) in snapshots.items():  # what the hook saw is the layer's final K/V
        assert torch.equal(pool.rows(pool.k[layer])[slots], k_rows)
        assert torch.equal(pool.rows(pool.v[layer])[slots], v_rows)


def test_decode_in_another_pool_from_copied_pages(model: Model) -> None:
    prompt = prompt_of(3 * PAGE_SIZE + 9, seed=3)
    expected = model.generate(prompt, NEW_TOKENS, KVPool(model.config, 16, PAGE_SIZE),
                              np.arange(16, dtype=np.int32))

    # Prefill process: prompt pages only, scattered.
    prefill_pool = KVPool(model.config, num_pages=40, page_size=PAGE_SIZE, max_slots=4)
    prefill_pool.alloc(5)
    src_pages = shuffled_pages(prefill_pool, len(prompt), seed=1)
    src_slot = prefill_pool.alloc_slot()
    first = model.prefill(prompt, prefill_pool, src_pages)
    prefill_pool.set_aux(src_slot, first_token=first, prompt_len=len(prompt))

    # Decode process: a different pool, other page indices, room for the new tokens too.
    decode_pool = KVPool(model.config, num_pages=25, page_size=PAGE_SIZE, max_slots=8)
    decode_pool.alloc(2)
    dst_slot = [decode_pool.alloc_slot() for _ in range(3)][-1]
    dst_pages = shuffled_pages(decode_pool, len(prompt) + NEW_TOKENS, seed=2)
    n_prompt_pages = len(src_pages)
    assert not np.array_equal(dst_pages[:n_prompt_pages], src_pages)

    copy_pages(prefill_pool, src_pages, decode_pool, dst_pages[:n_prompt_pages])
    decode_pool.aux[dst_slot] = prefill_pool.aux[src_slot]

    aux = decode_pool.get_aux(dst_slot)
    assert (aux.first_token, aux.prompt_len) == (first, len(prompt))
    assert decode_pool.aux[dst_slot, AUX_FIRST_TOKEN] == first
    assert decode_pool.aux[dst_slot, AUX_PROMPT_LEN] == len(prompt)
    got = [aux.first_token, *model.decode(aux.first_token, aux.prompt_len, NEW_TOKENS - 1, decode_pool, dst_pages)]
    assert got == expected

    # The decode side really reads the copied pages: without the last layer's V the
    # continuation differs.
    blank = KVPool(model.config, num_pages=25, page_size=PAGE_SIZE)
    copy_pages(prefill_pool, src_pages, blank, dst_pages[:n_prompt_pages])
    blank.v[-1].zero_()
    assert model.decode(first, len(prompt), NEW_TOKENS - 1, blank, dst_pages) != expected[1:]


def test_pool_layout(model: Model) -> None:
    c = model.config
    pool = KVPool(c, num_pages=10, page_size=PAGE_SIZE, max_slots=3)
    bufs = pool.buffers()
    assert len(bufs) == 2 * c.num_layers
    assert all(b is k for b, k in zip(bufs, pool.k)) and all(b is v for b, v in zip(bufs[c.num_layers:], pool.v))
    for b in bufs:
        assert b.shape == (10, PAGE_SIZE, c.num_kv_heads, c.head_dim) and b.is_contiguous()
        assert b.dtype == torch.float32
        assert b.stride(0) * b.element_size() == pool.page_bytes
    assert pool.page_bytes == PAGE_SIZE * c.num_kv_heads * c.head_dim * 4
    assert pool.aux.shape == (3, 8) and pool.aux.dtype == torch.int64
    assert len({b.data_ptr() for b in bufs}) == len(bufs)
    assert "KVPool" in repr(pool) and "Model" in repr(model)


def test_out_of_pages_and_slots(model: Model) -> None:
    pool = KVPool(model.config, num_pages=4, page_size=PAGE_SIZE, max_slots=1)
    a = pool.alloc(3)
    assert a.dtype == np.int32 and sorted(a.tolist()) == [0, 1, 2]
    with pytest.raises(OutOfPagesError, match="need 2 pages, only 1 of 4"):
        pool.alloc(2)
    assert pool.num_free == 1  # a failed alloc takes nothing
    pool.free(a[:2])
    assert sorted(pool.alloc(3).tolist()) == [0, 1, 3]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([2, 2])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="need 2 pages"):
        model.prefill(prompt_of(PAGE_SIZE + 1, 0), pool, [0])
    with pytest.raises(ValueError, match="out of range"):
        model.decode_step(1, 0, pool, [4])
    pool.alloc_slot()
    with pytest.raises(OutOfSlotsError):
        pool.alloc_slot()
