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
from dataclasses import dataclass, field

from .estimators import KV_BYTES_PER_TOKEN_70B, DecodeModel, LinkModel, PrefillModel, TransferModel
from .index import PrefixIndex
from .policies import Candidate, KVCacheCentric, PrefillPolicy, RoutingView
from .types import Decision, InstanceSpec, Rejected, RejectionMode, RejectReason, Request, Role

__all__ = ["Conductor", "ConductorStats"]


@dataclass
class _Prefill:
    spec: InstanceSpec
    free_at: float = 0.0               # when everything routed here is expected done
    egress_free_at: float = 0.0        # when its link is done with the moves it sources
    queue: dict[str, float] = field(default_factory=dict)   # request -> expected end
    queued_tokens: int = 0
    queued_new_tokens: int = 0


@dataclass
class _Decode:
    spec: InstanceSpec
    capacity: int
    running: dict[str, tuple[int, float]] = field(default_factory=dict)   # request -> (context, start)
    reserved: dict[str, tuple[int, float]] = field(default_factory=dict)  # request -> (context, expected ready)
    running_ctx: int = 0
    reserved_ctx: int = 0


@dataclass
class _Flight:
    """A routed request until its decode ends."""
    request: Request
    decision: Decision
    prefill_end: float
    new_tokens: int
    moving: bool


@dataclass
class ConductorStats:
    routed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    blocks: int = 0                 # prompt blocks of routed requests
    reused_blocks: int = 0          # of which cached locally or moved in
    moved_blocks: int = 0
    moved_bytes: int = 0


class Conductor:
    """KVCache-centric scheduling over registered instances.

    `policy`: prefill selection (default `KVCacheCentric()`);
    `rejection`: `RejectionMode`; `slo_ttft_s`/`slo_tbt_s`: the SLOs it
    admits against; `kv_bytes_per_token`: KV size, for transfer estimates;
    `link`: the transfer model between two prefill instances (or `links`,
    a function of (source, destination) giving one, e.g. a
    `PeerTransferModel` over a kvflow peer's `estimate`)."""

    def __init__(self, *, policy: PrefillPolicy | None = None,
                 rejection: RejectionMode = RejectionMode.NONE,
                 slo_ttft_s: float = 30.0, slo_tbt_s: float = 0.1,
                 prefill_model: PrefillModel | None = None, decode_model: DecodeModel | None = None,
                 kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_70B,
                 link: TransferModel | None = None,
                 links: Callable[[str, str], TransferModel] | None = None,
                 expected_output_tokens: int = 256) -> None:
        if not isinstance(rejection, RejectionMode):
            raise TypeError(f"rejection must be a RejectionMode, got {rejection!r}")
        if slo_ttft_s <= 0 or slo_tbt_s <= 0:
            raise ValueError("SLOs must be positive")
        self.policy = policy if policy is not None else KVCacheCentric()
        self.rejection = rejection
        self.slo_ttft_s = slo_ttft_s
        self.slo_tbt_s = slo_tbt_s
        self.prefill_model = prefill_model or PrefillModel()
        self.decode_model = decode_model or DecodeModel()
        self.kv_bytes_per_token = kv_bytes_per_token
        self._link = link or LinkModel()
        self._links = links
        self.index = PrefixIndex()
        self._prefill: dict[str, _Prefill] = {}
        self._decode: dict[str, _Decode] = {}
        self._flights: dict[str, _Flight] = {}
        self._out_mean = float(expected_output_tokens)
        self._decode_s_mean: float | None = None   # t_d of the predictive variant
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

    def route(self, request: Request, now: float) -> Decision | Rejected:
        """Choose prefill and decode instances for `request` arriving at
        `now` (seconds, any clock the `on_*` calls share), or reject it.
        ValueError if a request with this id is in flight."""
        if request.id in self._flights:
            raise ValueError(f"request {request.id!r} is already routed")
        if not self._prefill or not self._decode:
            return self._reject(request, RejectReason.NO_INSTANCE, "no prefill or no decode instance")
        keys = request.keys
        matches = self.index.matches(keys, self._prefill)
        best_src, best = None, 0
        for name, m in matches.items():
            if m > best:
                best_src, best = name, m
        cands = [Candidate(name, matches[name], max(0.0, p.free_at - now), len(p.queue),
                           p.queued_tokens, p.queued_new_tokens, len(self.index.cache(name)))
                 for name, p in self._prefill.items()]
        view = RoutingView(request, cands, best_src, best, self.prefill_model,
                           lambda s, d, n: self._transfer_s(request, s, d, matches[d], n, now))
        choice = self.policy.choose(view)
        p = self._prefill[choice.instance]
        cached = matches[choice.instance]
        move = choice.move_blocks
        if choice.prefix_source is None or move <= 0:
            source, move = None, 0
        else:
            source = choice.prefix_source
            move = min(move, matches[source] - cached)
            if move <= 0:
                source, move = None, 0
        queue_s = max(0.0, p.free_at - now)
        transfer_s = self._transfer_s(request, source, p.spec.name, cached, move, now) if source else 0.0
        prefix_tokens = request.cached_tokens(cached + move)
        prefill_s = self.prefill_model.time(request.tokens, prefix_tokens)
        start = now + max(queue_s, transfer_s)
        ttft = start + prefill_s - now

        ctx = request.tokens + self._expected_output(request) // 2
        d, tbt = self._pick_decode(ctx)
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
                batch, pctx = self._predicted_load(d, now + ttft)
                pred = self.decode_model.step_time(batch + 1, pctx + ctx)
                if pred > self.slo_tbt_s or pctx + ctx > d.capacity:
                    return self._reject(request, RejectReason.PREDICTED_DECODE_LOAD,
                                        f"decode {d.spec.name} TBT {pred * 1e3:.0f} ms predicted", d.spec.name)

        # Commit: the queue, the pins, the link, the decode reservation.
        decision = Decision(request.id, p.spec.name, d.spec.name, source,
                            tuple(keys[cached:cached + move]), cached, queue_s, transfer_s, prefill_s,
                            ttft, tbt)
        end = start + prefill_s
        p.queue[request.id] = end
        p.free_at = max(p.free_at, end)
        new_tokens = request.tokens - prefix_tokens
        p.queued_tokens += request.tokens
        p.queued_new_tokens += new_tokens
        self.index.pin(p.spec.name, keys[:cached])
        if source is not None:
            self.index.pin(source, decision.blocks_to_move)
            src = self._prefill[source]
            src.egress_free_at = max(src.egress_free_at, now) + self._raw_transfer_s(
                source, p.spec.name, self._moved_bytes(request, cached, move))
        d.reserved[request.id] = (ctx, end)
        d.reserved_ctx += ctx
        self._flights[request.id] = _Flight(request, decision, end, new_tokens, source is not None)
        st = self.stats
        st.routed += 1
        st.blocks += len(keys)
        st.reused_blocks += cached + move
        st.moved_blocks += move
        st.moved_bytes += self._moved_bytes(request, cached, move)
        return decision

    # -- what the servers report --------------------------------------------

    def on_transfer_done(self, request_id: str, now: float) -> list[int]:
        """The prefix `route` told the prefill instance to fetch has landed
        there: it is now a replica (counted in the index, pinned until the
        prefill ends). Returns blocks its cache evicted to make room."""
        f = self._flights[request_id]
        if not f.moving:
            return []
        f.moving = False
        dec = f.decision
        assert dec.prefix_source is not None
        evicted = self.index.insert(dec.prefill, dec.blocks_to_move)
        self.index.pin(dec.prefill, dec.blocks_to_move)
        if dec.prefix_source in self._prefill:
            evicted_src = self.index.unpin(dec.prefix_source, dec.blocks_to_move)
            del evicted_src   # the source's own evictions are its business
        return evicted

    def on_prefill_done(self, request_id: str, now: float) -> list[int]:
        """The prefill of `request_id` ended at `now`: its blocks are cached
        on the prefill instance (returns what that evicted) and its KV is on
        its way to the decode instance."""
        f = self._flights[request_id]
        if f.moving:   # a transfer that was not reported: count it as landed
            self.on_transfer_done(request_id, now)
        dec = f.decision
        p = self._prefill.get(dec.prefill)
        if p is None:
            return []
        expected = p.queue.pop(request_id, now)
        p.queued_tokens -= f.request.tokens
        p.queued_new_tokens -= f.new_tokens
        if p.queue:
            p.free_at += now - expected       # later (or earlier) than estimated: the rest shifts
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
        f = self._flights[request_id]
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
        f = self._flights.pop(request_id)
        d = self._decode.get(f.decision.decode)
        if d is not None and request_id in d.running:
            ctx, start = d.running.pop(request_id)
            d.running_ctx -= ctx
            dur = now - start
            # t_d, the uniform decode time of the predictive variant: a slow
            # moving average of what decodes really take.
            self._decode_s_mean = dur if self._decode_s_mean is None else 0.95 * self._decode_s_mean + 0.05 * dur
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
            p.queue.pop(request_id)
            p.queued_tokens -= f.request.tokens
            p.queued_new_tokens -= f.new_tokens
            self.index.unpin(dec.prefill, f.request.keys[:dec.cached_blocks])
            if not f.moving and dec.blocks_to_move:
                self.index.unpin(dec.prefill, dec.blocks_to_move)
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

    def _predicted_load(self, d: _Decode, t: float) -> tuple[int, int]:
        """Requests decoding on `d` at time `t`: those decoding now that will
        not have finished (each decode taking t_d), and those on their way
        that will have arrived (Mooncake's system-level prediction, per
        instance)."""
        td = self._decode_s_mean
        if td is None:
            td = self._out_mean * self.slo_tbt_s / 2
        batch, ctx = 0, 0
        for c, start in d.running.values():
            if start + td > t:
                batch += 1
                ctx += c
        for c, ready in d.reserved.values():
            if ready <= t < ready + td:
                batch += 1
                ctx += c
        return batch, ctx

    def _moved_bytes(self, request: Request, cached: int, move: int) -> int:
        tokens = request.cached_tokens(cached + move) - request.cached_tokens(cached)
        return tokens * self.kv_bytes_per_token

    def _raw_transfer_s(self, src: str, dst: str, nbytes: int) -> float:
        link = self._links(src, dst) if self._links is not None else self._link
        return link.time(nbytes)

    def _transfer_s(self, request: Request, src: str | None, dst: str, cached: int, move: int,
                    now: float) -> float:
        if src is None or move <= 0:
            return 0.0
        busy = max(0.0, self._prefill[src].egress_free_at - now)
        return busy + self._raw_transfer_s(src, dst, self._moved_bytes(request, cached, move))

    def _reject(self, request: Request, reason: RejectReason, detail: str, decode: str | None = None) -> Rejected:
        self.stats.rejected[reason.value] = self.stats.rejected.get(reason.value, 0) + 1
        return Rejected(request.id, reason, detail, decode)

    def _drop(self, request_id: str, reason: RejectReason, detail: str) -> Rejected:
        f = self._flights[request_id]
        self.forget(request_id)
        return self._reject(f.request, reason, detail, f.decision.decode)
