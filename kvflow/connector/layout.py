"""Page indices → transfer entries, and which ranks talk to which.

Pages move as whole items (a page of one layer's K, V, or MLA latent), so a
run of pages that is contiguous on both sides becomes ONE entry per buffer:
`base[b] + first_page * item_len[b]`, `count * item_len[b]` bytes. A request
whose pages were handed out in order on both sides costs one entry per
buffer, however long the prompt (SGLang's Mooncake connector groups the
same way; per-token entries are never produced here).
"""
from __future__ import annotations

import numpy as np

from kvflow.errors import KVFlowError


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits paired page lists into runs contiguous on both sides.

    Returns (src_first, dst_first, count), uint64 arrays, one element per run."""
    src = np.asarray(src_pages, dtype=np.int64).ravel()
    dst = np.asarray(dst_pages, dtype=np.int64).ravel()
    if src.shape != dst.shape:
        raise KVFlowError(f"page lists differ in length: {src.size} prefill pages, {dst.size} decode pages")
    if src.size == 0:
        empty = np.empty(0, dtype=np.uint64)
        return empty, empty, empty
    if src.min() < 0 or dst.min() < 0:
        raise KVFlowError("page indices must be non-negative")
    # A run breaks wherever either side does not step by exactly one page.
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return (src[starts].astype(np.uint64), dst[starts].astype(np.uint64),
            (ends - starts).astype(np.uint64))


def kv_entries(src_ptrs: list[int], src_item_lens: list[int], dst_ptrs: list[int],
               dst_item_lens: list[int], buffers: list[int],
               runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries (local addrs, remote addrs, lengths) moving `runs` of pages
    in each buffer index of `buffers` (whole pages: item lengths must match)."""
    src_first, dst_first, count = runs
    n = count.size
    la = np.empty(n * len(buffers), dtype=np.uint64)
    ra = np.empty_like(la)
    ln = np.empty_like(la)
    for j, b in enumerate(buffers):
        item = src_item_lens[b]
        if dst_item_lens[b] != item:
            raise KVFlowError(f"KV buffer {b}: page is {item} bytes on prefill but {dst_item_lens[b]} "
                              "on decode (same TP size needs the same page layout)")
        sl = slice(j * n, (j + 1) * n)
        la[sl] = np.uint64(src_ptrs[b]) + src_first * np.uint64(item)
        ra[sl] = np.uint64(dst_ptrs[b]) + dst_first * np.uint64(item)
        ln[sl] = count * np.uint64(item)
    return la, ra, ln


def layer_buffers(layer: int, num_buffers: int, mla: bool) -> list[int]:
    """Buffer indices holding `layer`: K and V for MHA, the latent for MLA."""
    if mla:
        return [layer]
    half = num_buffers // 2
    return [layer, half + layer]


def num_layers(num_buffers: int, mla: bool) -> int:
    return num_buffers if mla else num_buffers // 2


def source_ranks(decode_rank: int, decode_tp: int, prefill_tp: int, mla: bool) -> list[int]:
    """The prefill ranks whose data a decode rank needs.

    MLA keeps the whole latent on every rank: one source, spread round-robin.
    MHA splits heads over TP; with equal TP sizes rank i feeds rank i.
    Different MHA TP sizes need head slicing, which is not built (see
    check_tp)."""
    if mla:
        return [decode_rank % prefill_tp]
    check_tp(decode_tp, prefill_tp, mla)
    return [decode_rank]


def target_count(prefill_rank: int, prefill_tp: int, decode_tp: int, mla: bool) -> int:
    """How many decode ranks will ask a prefill rank for one request."""
    if mla:
        return len([d for d in range(decode_tp) if d % prefill_tp == prefill_rank])
    check_tp(decode_tp, prefill_tp, mla)
    return 1


def check_tp(decode_tp: int, prefill_tp: int, mla: bool) -> None:
    if not mla and decode_tp != prefill_tp:
        raise KVFlowError(
            f"prefill TP {prefill_tp} != decode TP {decode_tp} for an MHA pool needs head slicing, "
            "which this connector does not build yet (MLA pools work with any TP sizes)")
