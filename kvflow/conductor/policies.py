"""Prefill selection policies: Mooncake's KVCache-centric one and the rules
of the routers in use today, on one interface so the simulator and a live
router can run any of them.

A policy sees a `RoutingView` (the request, one `Candidate` per prefill
instance with its cached prefix and load, the best prefix holder, and the
conductor's estimators) and answers a `PrefillChoice`: an instance, and for
the KVCache-centric policy the prefix it should fetch first. Decode
selection and admission are the conductor's, the same for every policy, so
a comparison between policies measures prefill routing alone.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .estimators import PrefillModel
from .index import PrefixIndex
from .types import Request

__all__ = [
    "Candidate", "RoutingView", "PrefillChoice", "PrefillPolicy", "POLICIES", "make_policy",
    "KVCacheCentric", "RandomPolicy", "RoundRobin", "LeastLoaded", "PrefixGreedy",
    "SGLangCacheAware", "DynamoKV", "VllmTTFT", "LlmD",
]


@dataclass(slots=True)
class Candidate:
    """One prefill instance as the router sees it when a request arrives."""

    name: str
    cached_blocks: int        # the request's prefix cached there, in blocks
    queue_s: float            # estimated wait before a request routed now starts
    queued_requests: int      # routed there and not finished
    queued_tokens: int        # their prompt tokens
    queued_new_tokens: int    # their tokens still to compute (prompt minus prefix)
    cache_blocks_used: int    # blocks in its prefix cache
    ready_blocks: int         # cached_blocks, extended by blocks the requests queued ahead
                              # will have computed when a request routed now starts
    stream_free_s: float = 0.0  # estimated wait before a KV stream from it to the request's
                                # decode instance can start: behind the streams and moves booked on
                                # its link and the streams booked on the decode instance's


@dataclass(slots=True)
class RoutingView:
    request: Request
    candidates: list[Candidate]
    best_source: str | None   # the instance with the longest cached prefix
    best_blocks: int
    prefill_model: PrefillModel
    #: seconds to move n blocks of this request from one instance to another,
    #: counting what the source's link is already busy with
    transfer_s: Callable[[str, str, int], float]
    #: seconds for this request's whole KV to stream from an instance to
    #: its decode instance (None: not estimated)
    stream_s: Callable[[str], float] | None = None
    slo_ttft_s: float = math.inf
    slo_tbt_s: float = math.inf
    #: the instance that will hold a longer prefix than any holds now once
    #: the requests queued there have computed it, and that length (blocks);
    #: transfer_s from it counts the wait for them
    pending_source: str | None = None
    pending_blocks: int = 0
    #: the request's prefix the global KVCache pool holds (blocks), and the
    #: seconds until the pool's blocks from one index to another land on an
    #: instance (counting the fetches already booked toward it)
    pool_blocks: int = 0
    pool_s: Callable[[str, int, int], float] | None = None


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """`pool_upto`: fetch the request's blocks from the global pool up to
    this many (a prefix length), 0 for none; None leaves it to the prefill
    engine, which fetches whatever the pool holds beyond its own prefix
    (SGLang HiCache's prefetch from its storage tier): what every router
    that does not know of the pool gets."""

    instance: str
    prefix_source: str | None = None
    move_blocks: int = 0
    pool_upto: int | None = None


class PrefillPolicy(Protocol):
    name: str

    def choose(self, view: RoutingView) -> PrefillChoice: ...


def _argmin(cands: list[Candidate], key: Callable[[Candidate], float]) -> Candidate:
    """The candidate with the smallest key, the first one on ties (the
    registration order), so a replay is deterministic."""
    best = cands[0]
    best_k = key(best)
    for c in cands[1:]:
        k = key(c)
        if k < best_k:
            best, best_k = c, k
    return best


class KVCacheCentric:
    """Mooncake's Algorithm 1 (FAST'25): the instance with the smallest
    estimated TTFT = queue + prefix transfer + prefill of the rest.

    For each instance with `prefix` cached blocks, when the best holder has
    `best > kvcache_balancing_threshold * prefix` blocks, fetching the
    `best - prefix` missing blocks from it is considered as well as
    computing them; the cheaper of the two counts (the paper's condition
    takes the fetch unconditionally there; taking the minimum never
    estimates worse). The fetch starts when the request is routed, while it
    waits in the instance's queue, so the TTFT of that option is
    max(queue, transfer) + prefill, not their sum; the simulator and a live
    router both start it then. A fetch leaves a replica on the instance:
    hot-spot replication.

    The conductor knows what it has routed: blocks that requests queued on
    an instance are computing count as that instance's prefix
    (`Candidate.ready_blocks`), since they are cached by the time a request
    routed behind them starts. KV-event routers (Dynamo) only see blocks
    once computed, so a conversation's next turn arriving while the last
    one still queues finds nothing. Those blocks can also be fetched by
    another instance (`RoutingView.pending_source`): the fetch starts once
    the request computing them there is done, so a next turn arriving
    while its instance's queue is long goes where the queue ends first and
    still skips its prefix.

    Beyond the paper: an option that misses an SLO by the conductor's own
    estimates comes after every option that meets both, whatever their
    TTFTs (then the smallest TTFT, as in the paper). Its TTFT past the TTFT
    SLO is one miss; the other is its KV landing at decode more than the
    TBT SLO after its prefill, because the stream waits behind the KV of
    earlier requests on the instance's link or the decode instance's (the
    prompt's whole KV streams, cached or not: a mostly cached prompt is
    computed in a fraction of the time its stream takes). Without a
    stream estimate in the view it is the paper's rule."""

    name = "kvcache"

    def __init__(self, kvcache_balancing_threshold: float = 1.0) -> None:
        if not kvcache_balancing_threshold >= 1.0:
            raise ValueError(f"kvcache_balancing_threshold must be >= 1, got {kvcache_balancing_threshold}")
        self.threshold = kvcache_balancing_threshold

    def choose(self, view: RoutingView) -> PrefillChoice:
        req = view.request
        model = view.prefill_model
        best_src, best = view.best_source, view.best_blocks
        full = model.time(req.tokens, req.cached_tokens(best)) if best_src is not None else 0.0
        pool, pool_s = view.pool_blocks, view.pool_s
        pooled = model.time(req.tokens, req.cached_tokens(pool)) if pool_s is not None and pool else 0.0
        choice, key = None, (True, float("inf"))
        for c in view.candidates:
            prefill = model.time(req.tokens, req.cached_tokens(c.ready_blocks))
            t = c.queue_s + prefill
            pick = PrefillChoice(c.name, pool_upto=0)
            if pool_s is not None and pool > c.ready_blocks:
                # the global pool holds more than this instance will: fetch
                # the rest from it (over the pool's segments and this
                # instance's NIC) while the request queues
                t_pool = max(c.queue_s, pool_s(c.name, c.ready_blocks, pool)) + pooled
                if t_pool < t:
                    t, prefill, pick = t_pool, pooled, PrefillChoice(c.name, pool_upto=pool)
            if best_src is not None and best > c.ready_blocks and best > self.threshold * c.ready_blocks:
                move = best - c.cached_blocks
                t_move = max(c.queue_s, view.transfer_s(best_src, c.name, move)) + full
                if t_move < t:
                    t, prefill, pick = t_move, full, PrefillChoice(c.name, best_src, move, 0)
            pend_src, pend = view.pending_source, view.pending_blocks
            if pend_src is not None and pend_src != c.name and pend > c.ready_blocks and \
                    pend > self.threshold * c.ready_blocks:
                # a fetch of what requests queued there are computing, once
                # they are done: a conversation's next turn, say, arriving
                # while the last one still queues where it would queue longer
                move = pend - c.cached_blocks
                done = model.time(req.tokens, req.cached_tokens(pend))
                t_pend = max(c.queue_s, view.transfer_s(pend_src, c.name, move)) + done
                if t_pend < t:
                    t, prefill, pick = t_pend, done, PrefillChoice(c.name, pend_src, move, 0)
            k = (t > view.slo_ttft_s or self._late(view, c, t - prefill, t), t)
            if k < key:
                choice, key = pick, k
        assert choice is not None
        return choice

    @staticmethod
    def _late(view: RoutingView, c: Candidate, start: float, end: float) -> bool:
        """Whether the request's KV, streamed from c to decode from `start`
        (behind the streams already booked on c's link and on the decode
        instance's), would land more than the TBT SLO after its prefill
        ends at `end`: its first token interval would miss, however light
        the decode."""
        if view.stream_s is None:
            return False
        return max(start, c.stream_free_s) + view.stream_s(c.name) - end > view.slo_tbt_s


class RandomPolicy:
    """Any instance, uniformly (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, view: RoutingView) -> PrefillChoice:
        return PrefillChoice(self._rng.choice(view.candidates).name)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, view: RoutingView) -> PrefillChoice:
        c = view.candidates[self._next % len(view.candidates)]
        self._next += 1
        return PrefillChoice(c.name)


class LeastLoaded:
    """The instance with the fewest prompt tokens routed and not finished
    (the paper's load-balancing baseline: "the lightest load")."""

    name = "least_loaded"

    def choose(self, view: RoutingView) -> PrefillChoice:
        return PrefillChoice(_argmin(view.candidates, lambda c: c.queued_tokens).name)


class PrefixGreedy:
    """The longest cached prefix, the least loaded on ties."""

    name = "prefix_greedy"

    def choose(self, view: RoutingView) -> PrefillChoice:
        return PrefillChoice(_argmin(view.candidates, lambda c: (-c.cached_blocks, c.queued_tokens)).name)


class SGLangCacheAware:
    """SGLang router's cache-aware policy with its defaults: when the load
    is imbalanced (max - min > balance_abs_threshold and max >
    balance_rel_threshold x min, load = requests in flight), the least
    loaded worker; otherwise the worker whose tree has the longest prefix
    match, if it covers more than cache_threshold of the prompt, else the
    worker with the smallest tree. As in SGLang, the tree is the router's
    own record of what it routed to each worker (by blocks here, by
    characters there), bounded by max_tree_size (2**26 characters, about
    4 per token), not the workers' real caches."""

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_blocks: int = 2 ** 26 // (4 * 512)) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self._trees = PrefixIndex()

    def choose(self, view: RoutingView) -> PrefillChoice:
        cands = view.candidates
        req = view.request
        trees = self._trees
        for c in cands:
            if c.name not in trees:
                trees.add(c.name, self.max_tree_blocks)
        loads = [c.queued_requests for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            pick = _argmin(cands, lambda c: c.queued_requests).name
        else:
            best, best_len = trees.best(req.keys, [c.name for c in cands])
            if best is not None and req.cached_tokens(best_len) / req.tokens > self.cache_threshold:
                pick = best
            else:
                pick = min((c.name for c in cands), key=lambda n: len(trees.cache(n)))
        trees.insert(pick, req.keys)
        return PrefillChoice(pick)


class DynamoKV:
    """Dynamo's KV router with its defaults: the lowest
    overlap_score_weight x prefill_blocks + decode_blocks, where
    prefill_blocks are the tokens the worker would have to prefill with
    this request (its queued new tokens and this request's uncached ones)
    and decode_blocks the KV blocks of its active requests (temperature 0:
    the minimum, the first on ties)."""

    name = "dynamo_kv"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.weight = overlap_score_weight

    def choose(self, view: RoutingView) -> PrefillChoice:
        req = view.request
        b = req.block_tokens
        w = self.weight

        def cost(c: Candidate) -> float:
            new = req.tokens - req.cached_tokens(c.cached_blocks)
            return w * (c.queued_new_tokens + new) / b + c.queued_tokens / b
        return PrefillChoice(_argmin(view.candidates, cost).name)


class VllmTTFT:
    """vLLM router's TTFT estimate, 0.6 x queue + 0.4 x compute, both in
    tokens to compute (the router knows no cost model): queue = the
    worker's queued new tokens, compute = this request's uncached tokens."""

    name = "vllm_ttft"

    def __init__(self, queue_weight: float = 0.6, compute_weight: float = 0.4) -> None:
        self.queue_weight, self.compute_weight = queue_weight, compute_weight

    def choose(self, view: RoutingView) -> PrefillChoice:
        req = view.request

        def ttft(c: Candidate) -> float:
            new = req.tokens - req.cached_tokens(c.cached_blocks)
            return self.queue_weight * c.queued_new_tokens + self.compute_weight * new
        return PrefillChoice(_argmin(view.candidates, ttft).name)


class LlmD:
    """llm-d's default scorers: 2 x prefix score (fraction of the prompt's
    blocks cached) + 1 x queue score (1 for the shortest queue, 0 for the
    longest, requests in flight), the highest total."""

    name = "llm_d"

    def __init__(self, prefix_weight: float = 2.0, queue_weight: float = 1.0) -> None:
        self.prefix_weight, self.queue_weight = prefix_weight, queue_weight

    def choose(self, view: RoutingView) -> PrefillChoice:
        cands = view.candidates
        nblocks = max(1, len(view.request.keys))
        qs = [c.queued_requests for c in cands]
        lo, hi = min(qs), max(qs)
        span = hi - lo

        def score(c: Candidate) -> float:
            q = 1.0 if span == 0 else (hi - c.queued_requests) / span
            return -(self.prefix_weight * c.cached_blocks / nblocks + self.queue_weight * q)
        return PrefillChoice(_argmin(cands, score).name)


POLICIES: dict[str, Callable[..., PrefillPolicy]] = {
    "kvcache": KVCacheCentric,
    "random": RandomPolicy,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix_greedy": PrefixGreedy,
    "sglang_cache_aware": SGLangCacheAware,
    "dynamo_kv": DynamoKV,
    "vllm_ttft": VllmTTFT,
    "llm_d": LlmD,
}


def make_policy(name: str, seed: int = 0, **options: float) -> PrefillPolicy:
    """The policy called `name` with its defaults (and `options`); ValueError
    naming the known ones for any other name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    if factory is RandomPolicy:
        return RandomPolicy(seed)
    return factory(**options)
