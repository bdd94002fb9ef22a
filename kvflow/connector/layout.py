"""Page indices → transfer entries, and which ranks talk to which.

Pages move as whole items (a page of one layer's K, V, or MLA latent), so a
run of pages that is contiguous on both sides becomes ONE entry per buffer:
`base[b] + first_page * item_len[b]`, `count * item_len[b]` bytes. A request
whose pages were handed out in order on both sides costs one entry per
buffer, however long the prompt (SGLang's Mooncake connector groups the
same way).

When prefill and decode split an MHA model's KV heads over different TP
sizes, a decode rank takes a head range of every token from each prefill
rank that holds it. That is still one entry per run of pages per buffer, a
strided one (a piece per token, Peer.write's counts/strides), where SGLang
builds one descriptor per token in Python.
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


def rank_heads(rank: int, tp: int, total: int) -> tuple[int, int]:
    """(first head, head count) that TP rank `rank` holds of `total` KV heads.
    With more ranks than heads, each head is replicated on tp/total ranks."""
    if tp <= total:
        if total % tp:
            raise KVFlowError(f"{total} KV heads do not split over TP {tp}")
        per = total // tp
        return rank * per, per
    if tp % total:
        raise KVFlowError(f"TP {tp} is not a multiple of the {total} KV heads")
    return rank * total // tp, 1


def head_plan(decode_rank: int, decode_tp: int, prefill_tp: int, total: int) -> list[tuple[int, int, int]]:
    """For an MHA pool: [(prefill rank, first head, head count)] that feed
    `decode_rank`, one per prefill rank, each a contiguous head range. A
    head replicated on several prefill ranks is taken from one of them,
    chosen by the decode rank so that the load spreads."""
    d0, dn = rank_heads(decode_rank, decode_tp, total)
    plan: list[tuple[int, int, int]] = []
    for h in range(d0, d0 + dn):
        holders = [i for i in range(prefill_tp) if rank_heads(i, prefill_tp, total)[0] <= h
                   < sum(rank_heads(i, prefill_tp, total))]
        src = holders[decode_rank % len(holders)]
        if plan and plan[-1][0] == src and plan[-1][1] + plan[-1][2] == h:
            plan[-1] = (src, plan[-1][1], plan[-1][2] + 1)
        else:
            plan.append((src, h, 1))
    return plan


def source_ranks(decode_rank: int, decode_tp: int, prefill_tp: int, mla: bool,
                 total_heads: int = 1) -> list[tuple[int, int, int]]:
    """The prefill ranks a decode rank needs, as (rank, first head, head count).

    MLA keeps the whole latent on every rank: one source, spread
    round-robin (heads are not sliced: (rank, 0, 0)). MHA: head_plan."""
    if mla:
        return [(decode_rank % prefill_tp, 0, 0)]
    return head_plan(decode_rank, decode_tp, prefill_tp, total_heads)


def target_count(prefill_rank: int, prefill_tp: int, decode_tp: int, mla: bool, total_heads: int = 1) -> int:
    """How many decode ranks will ask a prefill rank for one request."""
    return sum(any(src == prefill_rank for src, _, _ in
                   source_ranks(d, decode_tp, prefill_tp, mla, total_heads)) for d in range(decode_tp))


def head_sliced_entries(src_ptrs: list[int], src_item_lens: list[int], dst_ptrs: list[int],
                        dst_item_lens: list[int], buffers: list[int],
                        runs: tuple[np.ndarray, np.ndarray, np.ndarray], page_size: int,
                        src_heads: tuple[int, int], dst_heads: tuple[int, int],
                        heads: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Strided entries moving KV heads [h0, h0+hn) of `runs` of NHD pages
    ([page_size, heads, head_dim]) from a rank holding src_heads to one
    holding dst_heads ((first, count) each): one entry per run per buffer,
    a piece per token (counts, local_strides, remote_strides as
    Peer.write takes them)."""
    src_first, dst_first, count = runs
    (s0, sn), (d0, dn), (h0, hn) = src_heads, dst_heads, heads
    n = count.size
    cols = [np.empty(n * len(buffers), dtype=np.uint64) for _ in range(6)]
    la, ra, ln, cnt, ls, rs = cols
    for j, b in enumerate(buffers):
        head_bytes, rem = divmod(src_item_lens[b], page_size * sn)
        if rem or dst_item_lens[b] != page_size * dn * head_bytes:
            raise KVFlowError(f"KV buffer {b}: pages of {src_item_lens[b]} and {dst_item_lens[b]} bytes do not "
                              f"hold {sn} and {dn} heads of one size ({page_size} tokens per page)")
        sl = slice(j * n, (j + 1) * n)
        la[sl] = np.uint64(src_ptrs[b] + (h0 - s0) * head_bytes) + src_first * np.uint64(src_item_lens[b])
        ra[sl] = np.uint64(dst_ptrs[b] + (h0 - d0) * head_bytes) + dst_first * np.uint64(dst_item_lens[b])
        ln[sl] = hn * head_bytes
        cnt[sl] = count * np.uint64(page_size)
        ls[sl] = sn * head_bytes
        rs[sl] = dn * head_bytes
    return la, ra, ln, cnt, ls, rs
