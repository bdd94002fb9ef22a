"""The conductor: routes each request to a prefill and a decode instance,
decides which cached prefix moves where, and turns requests away under
overload; it learns what happened from the `on_*` calls.

It keeps only estimates: per prefill instance the requests routed there and
when it is expected to be free, per decode instance the requests decoding or
on their way, and the prefix index of every prefill instance's cache. A
live router calls `route()` when a request arrives and the `on_*` methods
as its servers report; the trace simulator (`sim.py`) calls exactly the
same methods, so what is replayed is what runs live.

Not thread-safe: one router task (or the simulator's loop) owns it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import bisect
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .admission import CostAdmission
from .estimators import KV_BYTES_PER_TOKEN_70B, DecodeModel, LinkModel, PrefillModel, TransferModel
from .index import PrefixIndex, add_counts, drop_counts
from .policies import Candidate, KVCacheCentric, PrefillPolicy, RoutingView
from .pool import HeldPrefix, PoolConfig, PoolView, StorePoolIndex
from .types import Decision, InstanceSpec, Rejected, RejectionMode, RejectReason, Request, Role

__all__ = ["Conductor", "ConductorStats"]


@dataclass
class _Prefill:
    spec: InstanceSpec
    free_at: float = 0.0               # when everything routed here is expected done
    egress_free_at: float = 0.0        # when its link is done with the moves it sources
    stream_free_at: float = 0.0        # ... with the KV streams to decode routed so far
    queue: dict[str, list[float]] = field(default_factory=dict)  # request -> [expected end, duration], FIFO
    queued_tokens: int = 0
    queued_new_tokens: int = 0
    pending: dict[int, int] = field(default_factory=dict)   # blocks its queued requests will cache
    pool_free_at: float = 0.0          # when its link is done with the pool fetches routed to it


@dataclass
class _Decode:
    spec: InstanceSpec
    capacity: int
    running: dict[str, tuple[int, float]] = field(default_factory=dict)   # request -> (context, start)
    reserved: dict[str, tuple[int, float]] = field(default_factory=dict)  # request -> (context, expected ready)
    running_ctx: int = 0
    reserved_ctx: int = 0
    rx_free_at: float = 0.0            # when its link is done with the KV streams routed to it
    #: the streams routed to it, (start, end) by start, none overlapping: a
    #: stream routed now may start before one routed earlier (a shorter
    #: queue), in the gap before it, as the link serves them in time order
    rx_booked: list[tuple[float, float]] = field(default_factory=list)

    def rx_slot(self, t: float, dur: float, now: float) -> float:
        """The earliest start at or after `t` of a stream of `dur` seconds
        that overlaps none booked (forgetting those over by `now`)."""
        b = self.rx_booked
        done = 0
        while done < len(b) and b[done][1] <= now:
            done += 1
        if done:
            del b[:done]
        for start, end in b:
            if end <= t:
                continue
            if start >= t + dur:
                break
            t = end
        return t


@dataclass
class _Flight:
    """A routed request until its decode ends."""
    request: Request
    decision: Decision
    prefill_end: float
    new_tokens: int
    moving: bool
    pooling: bool = False               # its pool fetch has not landed


@dataclass
class ConductorStats:
    routed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    blocks: int = 0                 # prompt blocks of routed requests
    reused_blocks: int = 0          # of which cached locally, moved in or fetched from the pool
    moved_blocks: int = 0
    moved_bytes: int = 0
    pool_blocks: int = 0            # fetched from the global pool
    pool_bytes: int = 0


class Conductor:
    """KVCache-centric scheduling over registered instances.

    `policy`: prefill selection (default `KVCacheCentric()`);
    `rejection`: `RejectionMode`; `slo_ttft_s`/`slo_tbt_s`: the SLOs it
    admits against; `kv_bytes_per_token`: KV size, for transfer estimates;
    `link`: the transfer model between two prefill instances (or `links`,
    a function of (source, destination) giving one, e.g. a
    `PeerTransferModel` over a kvflow peer's `estimate`);
    `pool`: the global KVCache pool as a source of prefixes (a `PoolView`:
    the replay's `PoolModel`; live, `route_with_pool` asks a
    `StorePoolIndex`), with `pool_config` for its read bandwidths;
    `admission`: a `CostAdmission` that also refuses the dearest prefills
    under load (`admission.py`), besides the gate of `rejection`."""

    def __init__(self, *, policy: PrefillPolicy | None = None,
                 rejection: RejectionMode = RejectionMode.NONE,
                 slo_ttft_s: float = 30.0, slo_tbt_s: float = 0.1,
                 prefill_model: PrefillModel | None = None, decode_model: DecodeModel | None = None,
                 kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_70B,
                 link: TransferModel | None = None,
                 links: Callable[[str, str], TransferModel] | None = None,
                 expected_output_tokens: int = 256, predict_margin: float = 1.0,
                 pool: PoolView | None = None, pool_config: PoolConfig | None = None,
                 admission: CostAdmission | None = None) -> None:
        if not isinstance(rejection, RejectionMode):
            raise TypeError(f"rejection must be a RejectionMode, got {rejection!r}")
        if slo_ttft_s <= 0 or slo_tbt_s <= 0:
            raise ValueError("SLOs must be positive")
        self.policy = policy if policy is not None else KVCacheCentric()
        self.predict_margin = predict_margin
        self.rejection = rejection
        self.slo_ttft_s = slo_ttft_s
        self.slo_tbt_s = slo_tbt_s
        self.prefill_model = prefill_model or PrefillModel()
        self.decode_model = decode_model or DecodeModel()
        self.kv_bytes_per_token = kv_bytes_per_token
        self._link = link or LinkModel()
        self._links = links
        self.index = PrefixIndex()
        self.pool = pool
        self.pool_config = pool_config or PoolConfig(dram_blocks=None)
        self.admission = admission
        self._prefill: dict[str, _Prefill] = {}
        self._decode: dict[str, _Decode] = {}
        self._flights: dict[str, _Flight] = {}
        self._out_mean = float(expected_output_tokens)
        self._decode_s_mean: float | None = None   # t_d of the predictive variant
        self._durations: deque[float] = deque(maxlen=2048)
        self._durations_sorted: np.ndarray | None = None
        self._ends_since_sort = 0
        self.stats = ConductorStats()

    # -- instances -----------------------------------------------------------

    def register(self, spec: InstanceSpec) -> None:
        """Add an instance; ValueError if its name is taken."""
        if spec.name in self._prefill or spec.name in self._decode:
            raise ValueError(f"instance {spec.name!r} is already registered")
        if spec.role is Role.PREFILL:
            self.index.add(spec.name, spec.cache_blocks)
            self._prefill[spec.name] = _Prefill(spec)
        else:
            cap = spec.kv_capacity_tokens if spec.kv_capacity_tokens is not None \
                else self.decode_model.kv_capacity_tokens
            self._decode[spec.name] = _Decode(spec, cap)

    def unregister(self, name: str) -> None:
        """Remove an instance (it left or failed). Requests in flight on it
        are forgotten; the caller retries them. KeyError if unknown."""
        for rid in [r for r, f in self._flights.items()
                    if name in (f.decision.prefill, f.decision.decode, f.decision.prefix_source)]:
            self.forget(rid)
        if name in self._prefill:
            del self._prefill[name]
            self.index.drop(name)
        else:
            del self._decode[name]

    def instances(self, role: Role | None = None) -> list[InstanceSpec]:
        out = [p.spec for p in self._prefill.values()] + [d.spec for d in self._decode.values()]
        return [s for s in out if role is None or s.role is role]

    # -- routing -------------------------------------------------------------

    async def route_with_pool(self, request: Request, now: float, pool: StorePoolIndex) -> Decision | Rejected:
        """`route`, with the global pool's prefix of the request asked of a
        live store first (one `batch_exists` round trip through `pool`).
        Raises what the store's client raises."""
        held = await pool.prefix_blocks(request.keys)
        return self.route(request, now, pool=HeldPrefix(request.keys, held))

    def route(self, request: Request, now: float, *, pool: PoolView | None = None) -> Decision | Rejected:
        """Choose prefill and decode instances for `request` arriving at
        `now` (seconds, any clock the `on_*` calls share), or reject it.
        `pool`: what the global pool holds (default: the conductor's own
        `pool`, if any). ValueError if a request with this id is in
        flight."""
        if request.id in self._flights:
            raise ValueError(f"request {request.id!r} is already routed")
        if not self._prefill or not self._decode:
            return self._reject(request, RejectReason.NO_INSTANCE, "no prefill or no decode instance")
        keys = request.keys
        matches = self.index.matches(keys, self._prefill)
        pool = pool if pool is not None else self.pool
        pool_held = pool.match(keys) if pool is not None else 0
        best_src, best = None, 0
        for name, m in matches.items():
            if m > best:
                best_src, best = name, m
        # Decode first: its choice does not depend on the prefill's, and the
        # stream to it is part of a prefill instance's cost.
        ctx = request.tokens + self._expected_output(request) // 2
        d, tbt = self._pick_decode(ctx)
        kv_bytes = request.tokens * self.kv_bytes_per_token
        cands = [Candidate(name, matches[name], max(0.0, p.free_at - now), len(p.queue),
                           p.queued_tokens, p.queued_new_tokens, len(self.index.cache(name)),
                           self._ready_blocks(p, keys, matches[name]),
                           d.rx_slot(max(now + max(0.0, p.free_at - now), p.stream_free_at),
                                     self._raw_transfer_s(name, d.spec.name, kv_bytes), now) - now)
                 for name, p in self._prefill.items()]
        ready = {c.name: c.ready_blocks for c in cands}
        # The instance that will hold the longest prefix once the requests
        # queued there have computed it, if that is longer than any cached
        # one: a fetch from it can start when they are done.
        pend_src, pend, pend_wait = None, best, 0.0
        for c in cands:
            if c.ready_blocks > pend:
                pend_src, pend = c.name, c.ready_blocks
        if pend_src is not None:
            pend_wait = self._computed_in(self._prefill[pend_src], keys, pend, now)
            if pend_wait is None:
                pend_src, pend, pend_wait = None, best, 0.0

        def fetch_wait(src: str | None, upto: int) -> float:
            """How long a fetch of the request's blocks up to `upto` from
            `src` waits for them to be computed there (0: cached there now)."""
            return pend_wait if src is not None and src == pend_src and upto > matches[src] else 0.0

        view = RoutingView(request, cands, best_src, best, self.prefill_model,
                           lambda src, dst, n: self._transfer_s(request, src, dst, matches[dst], n, now,
                                                                fetch_wait(src, matches[dst] + n)),
                           lambda src: self._raw_transfer_s(src, d.spec.name, kv_bytes),
                           self.slo_ttft_s, self.slo_tbt_s, pend_src, pend if pend_src else 0,
                           pool_held, (lambda dst, lo, hi: self._pool_s(request, pool, dst, lo, hi, now))
                           if pool is not None else None)
        choice = self.policy.choose(view)
        p = self._prefill[choice.instance]
        cached = matches[choice.instance]
        # Blocks that requests queued ahead on the instance will have cached
        # when this one starts count as cached, unless a move replaces them.
        if choice.prefix_source is None or choice.move_blocks <= 0:
            cached = ready[choice.instance]
        move = choice.move_blocks
        if choice.prefix_source is None or move <= 0:
            source, move = None, 0
        else:
            source = choice.prefix_source
            # cached there, or (the pending source) computed there by then
            have = pend if source == pend_src else matches[source]
            move = min(move, have - cached)
            if move <= 0:
                source, move = None, 0
        # The global pool: what the policy asked for (None: the engine's
        # default, whatever it holds beyond the instance's own prefix).
        upto = pool_held if choice.pool_upto is None else min(choice.pool_upto, pool_held)
        pool_lo = cached
        pool_hi = upto if source is None and upto > cached else cached
        wait = fetch_wait(source, cached + move)
        queue_s = max(0.0, p.free_at - now)
        transfer_s = self._transfer_s(request, source, p.spec.name, cached, move, now, wait) if source else 0.0
        pool_s = self._pool_s(request, pool, p.spec.name, pool_lo, pool_hi, now) if pool_hi > pool_lo else 0.0
        transfer_s = max(transfer_s, pool_s)
        prefix_tokens = request.cached_tokens(cached + move + pool_hi - pool_lo)
        prefill_s = self.prefill_model.time(request.tokens, prefix_tokens)
        start = now + max(queue_s, transfer_s)
        ttft = start + prefill_s - now

        if self.admission is not None:
            # before the gate, so that the costs of the requests the gate
            # refuses count in the admission's quantile too
            behind = sum(max(0.0, q.free_at - now) for q in self._prefill.values()) / len(self._prefill)
            why = self.admission.refuse(prefill_s, behind, self.slo_ttft_s)
            if why is not None:
                return self._reject(request, RejectReason.PREFILL_COST, why, d.spec.name)
        if self.rejection is not RejectionMode.NONE:
            if ttft > self.slo_ttft_s:
                return self._reject(request, RejectReason.TTFT_SLO,
                                    f"estimated TTFT {ttft:.2f} s > {self.slo_ttft_s} s", d.spec.name)
            if self.rejection is RejectionMode.EARLY:
                now_tbt = self.decode_model.step_time(len(d.running) + 1, d.running_ctx + ctx)
                if now_tbt > self.slo_tbt_s or d.running_ctx + ctx > d.capacity:
                    return self._reject(request, RejectReason.DECODE_LOAD,
                                        f"decode {d.spec.name} TBT {now_tbt * 1e3:.0f} ms now", d.spec.name)
            elif self.rejection is RejectionMode.PREDICTIVE:
                pred, pctx = self._predicted_peak(d, now + ttft, ctx, now)
                if pred > self.slo_tbt_s or pctx > d.capacity:
                    return self._reject(request, RejectReason.PREDICTED_DECODE_LOAD,
                                        f"decode {d.spec.name} TBT {pred * 1e3:.0f} ms predicted", d.spec.name)

        # Commit: the queue, the pins, the link, the decode reservation.
        decision = Decision(request.id, p.spec.name, d.spec.name, source,
                            tuple(keys[cached:cached + move]), cached, queue_s, transfer_s, prefill_s,
                            ttft, tbt, wait, tuple(keys[pool_lo:pool_hi]), pool_s)
        end = start + prefill_s
        p.queue[request.id] = [end, prefill_s]
        p.free_at = max(p.free_at, end)
        new_tokens = request.tokens - prefix_tokens
        p.queued_tokens += request.tokens
        p.queued_new_tokens += new_tokens
        self.index.pin(p.spec.name, keys[:cached])
        add_counts(p.pending, keys)
        if source is not None:
            # pinned on the source, those it has not computed yet as well
            # (they stay once computed, until the fetch is done)
            self.index.pin(source, decision.blocks_to_move)
            src = self._prefill[source]
            # a fetch that waits for the source's compute is booked from
            # when it can start (the link is one queue in time: anything
            # booked later is taken to wait behind it)
            src.egress_free_at = max(src.egress_free_at, now + wait) + self._raw_transfer_s(
                source, p.spec.name, self._moved_bytes(request, cached, move))
        pool_bytes = self._moved_bytes(request, pool_lo, pool_hi - pool_lo)
        if pool_hi > pool_lo:
            # the fetch is one queue on the instance's link, in time
            p.pool_free_at = max(p.pool_free_at, now) + self._link.time(pool_bytes)
        # The KV streams to decode from the prefill's start, layer by layer,
        # behind the streams routed there before it.
        tx = self._raw_transfer_s(p.spec.name, d.spec.name, kv_bytes)
        s0 = d.rx_slot(max(p.stream_free_at, start), tx, now)
        bisect.insort(d.rx_booked, (s0, s0 + tx))
        p.stream_free_at = s0 + tx
        d.rx_free_at = max(d.rx_free_at, s0 + tx)
        d.reserved[request.id] = (ctx, end)
        d.reserved_ctx += ctx
        self._flights[request.id] = _Flight(request, decision, end, new_tokens, source is not None,
                                            pool_hi > pool_lo)
        st = self.stats
        st.routed += 1
        st.blocks += len(keys)
        st.reused_blocks += cached + move + pool_hi - pool_lo
        st.moved_blocks += move
        st.moved_bytes += self._moved_bytes(request, cached, move)
        st.pool_blocks += pool_hi - pool_lo
        st.pool_bytes += pool_bytes
        return decision

    # -- what the servers report --------------------------------------------

    def on_transfer_done(self, request_id: str, now: float, landed: int | None = None) -> list[int]:
        """The prefix `route` told the prefill instance to fetch has landed
        there: it is now a replica (counted in the index, pinned until the
        prefill ends). `landed`: how many of the blocks to move arrived, from
        the first (None: all; fewer when the source no longer had, or did
        not have yet, the rest: the prefill computes them). Returns blocks
        its cache evicted to make room. A request no longer known
        (forgotten) is ignored, as by every on_*."""
        f = self._flights.get(request_id)
        if f is None or not f.moving:
            return []
        f.moving = False
        dec = f.decision
        assert dec.prefix_source is not None
        if dec.prefill not in self._prefill:
            return []
        n = len(dec.blocks_to_move) if landed is None else max(0, min(int(landed), len(dec.blocks_to_move)))
        # Pinned before they are inserted: a cache full of pinned blocks
        # would otherwise evict the replica as it lands. All of them, as
        # on_prefill_done and forget release the whole prefix.
        self.index.pin(dec.prefill, dec.blocks_to_move)
        evicted = self.index.insert(dec.prefill, dec.blocks_to_move[:n])
        if dec.prefix_source in self._prefill:
            # What the source evicts now that the blocks are free again shows
            # in the index; its server reports its own evictions (on_evict).
            self.index.unpin(dec.prefix_source, dec.blocks_to_move)
        return evicted

    def on_pool_fetch_done(self, request_id: str, now: float) -> list[int]:
        """The blocks `route` told the prefill instance to fetch from the
        global pool have landed there: cached (pinned until the prefill
        ends). Returns blocks its cache evicted to make room."""
        f = self._flights.get(request_id)
        if f is None or not f.pooling:
            return []
        f.pooling = False
        dec = f.decision
        if dec.prefill not in self._prefill:
            return []
        self.index.pin(dec.prefill, dec.pool_blocks)
        return self.index.insert(dec.prefill, dec.pool_blocks)

    def on_prefill_done(self, request_id: str, now: float) -> list[int]:
        """The prefill of `request_id` ended at `now`: its blocks are cached
        on the prefill instance (returns what that evicted) and its KV is on
        its way to the decode instance."""
        f = self._flights.get(request_id)
        if f is None:
            return []
        if f.moving:   # a transfer that was not reported: count it as landed
            self.on_transfer_done(request_id, now)
        if f.pooling:
            self.on_pool_fetch_done(request_id, now)
        dec = f.decision
        p = self._prefill.get(dec.prefill)
        if p is None or request_id not in p.queue:
            return []
        expected, _ = p.queue.pop(request_id)
        p.queued_tokens -= f.request.tokens
        p.queued_new_tokens -= f.new_tokens
        self._unpend(p, f.request.keys)
        if p.queue:
            # Later (or earlier) than estimated: everything queued behind it
            # shifts, once (their own ends move with it, so the next
            # completion is measured against the shifted estimate).
            delta = now - expected
            for entry in p.queue.values():
                entry[0] += delta
            p.free_at += delta
        else:
            p.free_at = now
        keys = f.request.keys
        prefix = dec.prefix_blocks
        evicted = self.index.insert(dec.prefill, keys)
        evicted += self.index.unpin(dec.prefill, keys[:prefix])
        return evicted

    def admit_decode(self, request_id: str, now: float) -> Rejected | None:
        """The request's KV has reached its decode instance at `now`; under
        a rejection mode other than NONE the decode side checks its load
        again (Mooncake's local double check), and a request it refuses is
        rejected, its prefill wasted. None when it starts decoding."""
        f = self._flights.get(request_id)
        if f is None:       # forgotten (failed, or its instance left)
            return None
        d = self._decode.get(f.decision.decode)
        if d is None:
            return self._drop(request_id, RejectReason.NO_INSTANCE, "its decode instance left")
        ctx, _ = d.reserved.pop(request_id)
        d.reserved_ctx -= ctx
        if self.rejection is not RejectionMode.NONE:
            tbt = self.decode_model.step_time(len(d.running) + 1, d.running_ctx + ctx)
            if tbt > self.slo_tbt_s or d.running_ctx + ctx > d.capacity:
                return self._drop(request_id, RejectReason.DECODE_FULL,
                                  f"decode {d.spec.name} TBT {tbt * 1e3:.0f} ms at arrival")
        d.running[request_id] = (ctx, now)
        d.running_ctx += ctx
        return None

    def on_decode_done(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """The request finished decoding (`output_tokens` generated, if
        known: it tunes the expected output length)."""
        f = self._flights.pop(request_id, None)
        if f is None:       # forgotten (failed, or its instance left)
            return
        d = self._decode.get(f.decision.decode)
        if d is not None and request_id in d.running:
            ctx, start = d.running.pop(request_id)
            d.running_ctx -= ctx
            dur = now - start
            # t_d, the uniform decode time of the predictive variant: a slow
            # moving average of what decodes really take.
            self._decode_s_mean = dur if self._decode_s_mean is None else 0.95 * self._decode_s_mean + 0.05 * dur
            self._durations.append(dur)
            self._ends_since_sort += 1
        if output_tokens:
            self._out_mean = 0.95 * self._out_mean + 0.05 * output_tokens

    def on_evict(self, instance: str, keys: Sequence[int]) -> None:
        """A prefill instance dropped `keys` from its cache on its own."""
        self.index.remove(instance, keys)

    def forget(self, request_id: str) -> None:
        """Drop a routed request (it failed or was cancelled): its pins,
        queue slot and decode reservation are released. No-op if unknown."""
        f = self._flights.pop(request_id, None)
        if f is None:
            return
        dec = f.decision
        p = self._prefill.get(dec.prefill)
        if p is not None and request_id in p.queue:
            # Its estimated prefill leaves the queue: those behind it move up.
            behind, dur = False, p.queue[request_id][1]
            for rid, entry in p.queue.items():
                if behind:
                    entry[0] -= dur
                behind = behind or rid == request_id
            p.queue.pop(request_id)
            p.free_at = max(p.queue.values(), key=lambda e: e[0])[0] if p.queue else p.free_at - dur
            p.queued_tokens -= f.request.tokens
            p.queued_new_tokens -= f.new_tokens
            self._unpend(p, f.request.keys)
            self.index.unpin(dec.prefill, f.request.keys[:dec.cached_blocks])
            if not f.moving and dec.blocks_to_move:
                self.index.unpin(dec.prefill, dec.blocks_to_move)
            if not f.pooling and dec.pool_blocks:
                self.index.unpin(dec.prefill, dec.pool_blocks)
        if f.moving and dec.prefix_source in self._prefill:
            self.index.unpin(dec.prefix_source, dec.blocks_to_move)
        d = self._decode.get(dec.decode)
        if d is not None:
            if request_id in d.reserved:
                ctx, _ = d.reserved.pop(request_id)
                d.reserved_ctx -= ctx
            if request_id in d.running:
                ctx, _ = d.running.pop(request_id)
                d.running_ctx -= ctx

    # -- estimates -----------------------------------------------------------

    def decode_load(self, name: str) -> tuple[int, int]:
        """(requests decoding, their estimated context tokens) on a decode instance."""
        d = self._decode[name]
        return len(d.running), d.running_ctx

    def _expected_output(self, request: Request) -> int:
        return request.output_tokens or int(self._out_mean)

    def _pick_decode(self, ctx: int) -> tuple[_Decode, float]:
        """Load-balancing decode selection: the lowest estimated TBT with
        this request added (decoding and on their way), among the instances
        whose KV pool holds it; the emptiest pool when none does."""
        best, best_t = None, float("inf")
        model = self.decode_model
        for d in self._decode.values():
            used = d.running_ctx + d.reserved_ctx + ctx
            if used > d.capacity:
                continue
            t = model.step_time(len(d.running) + len(d.reserved) + 1, used)
            if t < best_t:
                best, best_t = d, t
        if best is None:
            best = min(self._decode.values(), key=lambda d: d.running_ctx + d.reserved_ctx)
            best_t = model.step_time(len(best.running) + len(best.reserved) + 1,
                                     best.running_ctx + best.reserved_ctx + ctx)
        return best, best_t

    def _ready_blocks(self, p: _Prefill, keys: Sequence[int], cached: int) -> int:
        """The request's prefix that `p` will hold when a request routed
        there now starts: its cached blocks, extended by blocks requests
        queued ahead of it are computing (they finish first: the queue is
        FIFO, and their blocks get pinned by this request's route)."""
        pending = p.pending
        if not pending:
            return cached
        cache = self.index.cache(p.spec.name)
        n = cached
        for k in keys[cached:]:
            if k in pending or k in cache:
                n += 1
            else:
                break
        return n

    @staticmethod
    def _unpend(p: _Prefill, keys: Sequence[int]) -> None:
        drop_counts(p.pending, keys)

    def _decode_time_s(self) -> float:
        """t_d, the uniform decode time of the predictive variant."""
        if self._decode_s_mean is not None:
            return self._decode_s_mean
        return self._out_mean * self.slo_tbt_s / 2

    def _survival(self) -> np.ndarray | None:
        """Observed decode durations, sorted (refreshed every 64 ends), for
        S(x), the fraction of decodes that last longer than x."""
        if len(self._durations) < 32:
            return None
        if self._durations_sorted is None or self._ends_since_sort >= 64:
            self._durations_sorted = np.sort(np.fromiter(self._durations, float))
            self._ends_since_sort = 0
        return self._durations_sorted

    def _predicted_peak(self, d: _Decode, ready: float, ctx: int, now: float) -> tuple[float, float]:
        """The worst TBT and KV use expected on `d` while this request would
        decode there, over [ready, ready + t_d), with it added.

        A system-level prediction, as Mooncake's: no request's output length
        is known, but the distribution of decode times is. A request that
        has decoded for a seconds is still there at time tau with
        probability S(a + tau - now) / S(a); one on its way that lands at r,
        with S(tau - r). Length-biased: the requests still running are the
        long ones, which a uniform t_d (the paper's first cut) undercounts.
        Before 32 decodes have ended, a uniform t_d stands in for S.

        Checking the whole window, not only its first instant, is what keeps
        one admission from breaking an earlier one: a request admitted
        before this one but landing after it is inside this window, so this
        one is refused rather than the earlier one crowded out at decode."""
        td = self._decode_time_s()
        sorted_d = self._survival()
        run_ctx = np.fromiter((c for c, _ in d.running.values()), float, len(d.running))
        run_age = np.fromiter((now - s for _, s in d.running.values()), float, len(d.running))
        res_ctx = np.fromiter((c for c, _ in d.reserved.values()), float, len(d.reserved))
        res_at = np.fromiter((r for _, r in d.reserved.values()), float, len(d.reserved))

        if sorted_d is None:
            def surv(x: np.ndarray) -> np.ndarray:
                return (x < td).astype(float)
        else:
            total = float(len(sorted_d))

            def surv(x: np.ndarray) -> np.ndarray:
                return 1.0 - np.searchsorted(sorted_d, x, side="right") / total
        # A request already decoding for longer than any decode seen (or
        # than t_d, before any was seen) says the distribution is wrong
        # about it: it is taken to stay. The others are still there at tau
        # with probability S(age + tau - now) / S(age).
        horizon = float(sorted_d[-1]) if sorted_d is not None else td
        old = run_age >= horizon
        s_age = np.where(old, 1.0, surv(run_age))
        s_age = np.where(s_age > 0, s_age, 1.0)
        model = self.decode_model
        worst_t, worst_ctx = 0.0, 0.0
        for frac in (0.0, 0.25, 0.5, 0.75):
            tau = ready + frac * td
            w_run = np.where(old, 1.0, np.minimum(1.0, surv(run_age + (tau - now)) / s_age))
            w_res = np.where(res_at <= tau, surv(np.maximum(0.0, tau - res_at)), 0.0)
            # Each request is there or not (Bernoulli): the count's spread
            # is sum w(1 - w); `predict_margin` standard deviations over the
            # mean, so that an admission near the limit is not a coin toss.
            v_run, v_res = w_run * (1.0 - w_run), w_res * (1.0 - w_res)
            z = self.predict_margin
            n = 1.0 + float(w_run.sum()) + float(w_res.sum()) + z * math.sqrt(float(v_run.sum() + v_res.sum()))
            c = ctx + float(w_run @ run_ctx) + float(w_res @ res_ctx) \
                + z * math.sqrt(float(v_run @ (run_ctx * run_ctx) + v_res @ (res_ctx * res_ctx)))
            worst_t = max(worst_t, model.step_time(max(1, round(n)), int(c)))
            worst_ctx = max(worst_ctx, c)
        return worst_t, worst_ctx

    def _moved_bytes(self, request: Request, cached: int, move: int) -> int:
        tokens = request.cached_tokens(cached + move) - request.cached_tokens(cached)
        return tokens * self.kv_bytes_per_token

    def _raw_transfer_s(self, src: str, dst: str, nbytes: int) -> float:
        link = self._links(src, dst) if self._links is not None else self._link
        return link.time(nbytes)

    def _transfer_s(self, request: Request, src: str | None, dst: str, cached: int, move: int,
                    now: float, wait: float = 0.0) -> float:
        """Seconds until `move` blocks after `cached` land on `dst` from
        `src`: behind what its link is busy with, and not before `wait`
        (when the source has computed them)."""
        if src is None or move <= 0:
            return 0.0
        # behind the moves it sources (the streams to decode go first and
        # pause it briefly; not counted)
        busy = max(0.0, self._prefill[src].egress_free_at - now, wait)
        return busy + self._raw_transfer_s(src, dst, self._moved_bytes(request, cached, move))

    def _pool_s(self, request: Request, pool: PoolView, dst: str, lo: int, hi: int, now: float) -> float:
        """Seconds until the request's blocks lo..hi, read from the global
        pool (DRAM and SSD at their bandwidths, spread over its segments),
        land on `dst`: behind the pool fetches booked toward it, and no
        faster than its link."""
        if hi <= lo:
            return 0.0
        dram, ssd = pool.split(request.keys[lo:hi])
        nbytes = self._moved_bytes(request, lo, hi - lo)
        busy = max(0.0, self._prefill[dst].pool_free_at - now)
        return busy + max(self.pool_config.fetch_s(dram, ssd), self._link.time(nbytes))

    def _computed_in(self, p: _Prefill, keys: Sequence[int], blocks: int, now: float) -> float | None:
        """Seconds until `p` holds keys[:blocks], of which the cached part
        is there now and the rest is computed by requests queued there: the
        expected end of the first of them (in queue order) whose prompt
        holds block blocks-1 (keys are chained: a prompt holding that block
        holds it at that place, and every block before it). None if none
        does."""
        last = keys[blocks - 1]
        if last in self.index.cache(p.spec.name):
            return 0.0
        for rid, (end, _) in p.queue.items():
            f = self._flights.get(rid)
            if f is not None and len(f.request.keys) >= blocks and f.request.keys[blocks - 1] == last:
                return max(0.0, end - now)
        return None

    def _reject(self, request: Request, reason: RejectReason, detail: str, decode: str | None = None) -> Rejected:
        self.stats.rejected[reason.value] = self.stats.rejected.get(reason.value, 0) + 1
        return Rejected(request.id, reason, detail, decode)

    def _drop(self, request_id: str, reason: RejectReason, detail: str) -> Rejected:
        f = self._flights[request_id]
        self.forget(request_id)
        return self._reject(f.request, reason, detail, f.decision.decode)
