"""A discrete-event simulation of a PD-disaggregated cluster driven by the
conductor, for replaying request traces.

The conductor routes with its estimates; this module is the ground truth it
is measured against:
- prefill instances run their queue in order, each request taking
  `PrefillModel.time(tokens, prefix)` with the prefix its instance's cache
  holds when it starts, after any prefix it fetches from another instance
  has landed;
- every instance has one NIC (`LinkModel`); prefix moves and the prefill ->
  decode KV streams share it, and a stream runs while its prefill computes
  (layer by layer), ending at most one layer's worth after it. Streams go
  first: a move takes the link only while no stream does (kvflow's
  priority classes: a stream is on a request's critical path, a replica
  is not), so a move under way pauses for the streams that start;
- decode instances run continuous batches: each step takes
  `DecodeModel.step_time(batch, context)`, a request joins when its KV has
  landed and its memory (prompt + output) fits the KV pool, and leaves when
  its last token is out;
- with a global KVCache pool (`ClusterConfig.pool`, `pool.PoolModel`),
  every prefill's blocks are put into it once computed (visible after
  their bytes crossed the prefill node's link), and a prefill instance
  fetches from it the blocks `route` names (`Decision.pool_blocks`): read
  from the pool's segments (DRAM or SSD) and received on its NIC in the
  move class, before its prefill starts;
- TTFT is arrival to the end of the prefill (the first token); TBT is the
  paper's: the mean of a request's longest 10% token intervals, the first
  interval counting the wait for the decode instance.

Everything is deterministic for a seed (only the `random` policy draws).
Decode steps are not simulated one by one: between two events every
sequence of a batch advances by the same number of tokens, so a decode
instance keeps a token clock and an epoch log of step times, and one event
per arrival or departure suffices.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .admission import CostAdmission
from .conductor import Conductor
from .estimators import (
    KV_BYTES_PER_TOKEN_70B, PAPER_DRAM_TOKENS, PAPER_LAYERS, DecodeModel, LinkModel, PrefillModel,
)
from .policies import PrefillPolicy
from .pool import PoolConfig, PoolModel, PoolStats
from .trace import TRACE_BLOCK_TOKENS, TraceRequest
from .types import Decision, InstanceSpec, Rejected, RejectionMode, Request, Role

__all__ = ["ClusterConfig", "RequestOutcome", "Simulation", "SimResult"]

_ARRIVE, _MOVED, _PREFILLED, _AT_DECODE, _DECODE_TICK, _POOLED, _POOL_PUT = range(7)


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 8
    decode: int = 8
    cache_blocks: int | None = PAPER_DRAM_TOKENS // TRACE_BLOCK_TOKENS   # per prefill instance
    block_tokens: int = TRACE_BLOCK_TOKENS
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_70B
    layers: int = PAPER_LAYERS
    prefill_model: PrefillModel = field(default_factory=PrefillModel)
    decode_model: DecodeModel = field(default_factory=DecodeModel)
    link: LinkModel = field(default_factory=LinkModel)
    pool: PoolConfig | None = None          # a global KVCache pool (None: none)

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")


@dataclass(slots=True)
class RequestOutcome:
    index: int
    arrival_s: float
    tokens: int
    output_tokens: int
    prefill: str = ""
    decode: str = ""
    rejected: str = ""            # the RejectReason value, "" if served
    prefill_start_s: float = math.nan
    prefill_s: float = 0.0
    ttft_s: float = math.nan
    tbt_s: float = math.nan       # mean of the longest 10% token intervals
    finish_s: float = math.nan
    blocks: int = 0
    reused_blocks: int = 0
    moved_blocks: int = 0
    pool_blocks: int = 0          # fetched from the global pool

    @property
    def completed(self) -> bool:
        return not self.rejected and not math.isnan(self.finish_s)


@dataclass
class SimResult:
    outcomes: list[RequestOutcome]
    span_s: float
    moved_bytes: int
    wasted_prefill_s: float
    prefill_busy_s: float
    #: the prefill time of the same prefills with an unlimited cache that all
    #: instances share, holding every block of every request prefilled
    #: before (by arrival): no router can use the cache better for the
    #: requests it admitted
    prefill_ideal_s: float = 0.0
    pool: PoolStats | None = None


class _PrefillServer:
    __slots__ = ("name", "queue", "busy", "running")

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[str] = deque()
        self.busy = False
        self.running = ""           # the request whose prefill runs (busy)


class _Nic:
    """A full-duplex NIC: what it sends and what it receives queue apart,
    each direction at the link's bandwidth, with two classes: KV streams
    to decode (a FIFO in time order) before prefix moves (a FIFO of their
    own, in the time the streams leave)."""
    __slots__ = ("tx_free_at", "rx_free_at", "mv_tx_free_at", "mv_rx_free_at", "moves_out")

    def __init__(self) -> None:
        self.tx_free_at = 0.0
        self.rx_free_at = 0.0
        self.mv_tx_free_at = 0.0
        self.mv_rx_free_at = 0.0
        self.moves_out: dict[str, list[float]] = {}   # moves it sources, not landed: rid -> [start, ready]


@dataclass(slots=True)
class _Seq:
    rid: str
    out: RequestOutcome
    v0: float            # the token clock when it joined
    v_end: float         # ... when its last token is out
    ctx0: int            # prompt tokens
    epoch0: int          # the epoch it joined in
    first_gap_s: float   # prefill end -> its first decode step began
    reserve: int         # KV pool tokens it holds (prompt + output)


class _DecodeServer:
    """A continuous batch with a token clock: `v` counts the decode steps
    every sequence has taken since the start; a sequence that joined at v0
    with k tokens to generate leaves at v0 + k."""

    def __init__(self, name: str, model: DecodeModel, capacity: int) -> None:
        self.name = name
        self.model = model
        self.capacity = capacity
        self.v = 0.0
        self.t = 0.0
        self.version = 0
        self.seqs: dict[str, _Seq] = {}
        self.ends: list[tuple[float, str]] = []
        self.waiting: deque[tuple[str, RequestOutcome, int]] = deque()
        self.used = 0
        self.ctx0_sum = 0
        self.v0_sum = 0.0
        self.epoch_v: list[float] = [0.0]
        self.epoch_tbt: list[float] = [0.0]

    def step_s(self) -> float:
        n = len(self.seqs)
        if n == 0:
            return 0.0
        ctx = self.ctx0_sum + n * self.v - self.v0_sum
        return self.model.step_time(n, int(ctx))

    def advance(self, t: float) -> None:
        if t <= self.t:
            return
        step = self.epoch_tbt[-1]
        if step > 0:
            self.v += (t - self.t) / step
        self.t = t

    def new_epoch(self) -> None:
        self.epoch_v.append(self.v)
        self.epoch_tbt.append(self.step_s())
        self.version += 1

    def next_end(self) -> float | None:
        while self.ends and self.ends[0][1] not in self.seqs:
            heapq.heappop(self.ends)
        if not self.ends:
            return None
        step = self.epoch_tbt[-1]
        return self.t + max(0.0, self.ends[0][0] - self.v) * step

    def join(self, rid: str, out: RequestOutcome, ready_s: float, reserve: int) -> None:
        k = out.output_tokens - 1
        seq = _Seq(rid, out, self.v, self.v + k, out.tokens, len(self.epoch_v), self.t - ready_s, reserve)
        self.seqs[rid] = seq
        heapq.heappush(self.ends, (seq.v_end, rid))
        self.used += reserve
        self.ctx0_sum += seq.ctx0
        self.v0_sum += seq.v0

    def leave(self, seq: _Seq) -> None:
        del self.seqs[seq.rid]
        self.used -= seq.reserve
        self.ctx0_sum -= seq.ctx0
        self.v0_sum -= seq.v0

    def tbt_of(self, seq: _Seq) -> float:
        """Mean of the longest 10% of the sequence's token intervals: the
        step times of the epochs it lived through, weighted by its steps in
        each, and its first interval (wait + first step)."""
        k = seq.out.output_tokens - 1
        parts: list[tuple[float, float]] = []
        ev, et = self.epoch_v, self.epoch_tbt
        j = seq.epoch0
        # The epoch it joined in starts at its v0 (it was opened by the join).
        first_step = et[j] if j < len(et) else 0.0
        parts.append((seq.first_gap_s + first_step, 1.0))
        remaining_lo = seq.v0 + 1.0
        hi = seq.v_end
        n = len(ev)
        while j < n and remaining_lo < hi:
            lo_e = ev[j]
            hi_e = ev[j + 1] if j + 1 < n else math.inf
            lo, up = max(lo_e, remaining_lo), min(hi_e, hi)
            if up > lo:
                parts.append((et[j], up - lo))
            j += 1
        take = max(1.0, math.ceil(0.1 * k))
        parts.sort(key=lambda p: -p[0])
        total, got = 0.0, 0.0
        for step, cnt in parts:
            c = min(cnt, take - got)
            total += step * c
            got += c
            if got >= take:
                break
        return total / got if got else 0.0


class Simulation:
    """One replay of `trace` through a `Conductor` with `policy`."""

    def __init__(self, trace: Sequence[TraceRequest], policy: PrefillPolicy, cluster: ClusterConfig,
                 *, speedup: float = 1.0, slo_ttft_s: float = 30.0, slo_tbt_s: float = 0.1,
                 rejection: RejectionMode = RejectionMode.NONE, admission: CostAdmission | None = None) -> None:
        if not speedup > 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        self.trace = trace
        self.cluster = cluster
        self.speedup = speedup
        c = cluster
        self.pool = PoolModel(c.pool) if c.pool is not None else None
        self.conductor = Conductor(policy=policy, rejection=rejection, slo_ttft_s=slo_ttft_s,
                                   slo_tbt_s=slo_tbt_s, prefill_model=c.prefill_model,
                                   decode_model=c.decode_model, kv_bytes_per_token=c.kv_bytes_per_token,
                                   link=c.link, pool=self.pool, pool_config=c.pool, admission=admission)
        self.prefill = {f"p{i}": _PrefillServer(f"p{i}") for i in range(c.prefill)}
        self.decode = {f"d{i}": _DecodeServer(f"d{i}", c.decode_model, c.decode_model.kv_capacity_tokens)
                       for i in range(c.decode)}
        self.nic = {name: _Nic() for name in [*self.prefill, *self.decode]}
        for name in self.prefill:
            self.conductor.register(InstanceSpec(name, Role.PREFILL, cache_blocks=c.cache_blocks))
        for name in self.decode:
            self.conductor.register(InstanceSpec(name, Role.DECODE, kv_capacity_tokens=c.decode_model.kv_capacity_tokens))
        self._events: list[tuple[float, int, int, str]] = []
        self._seq = 0
        self._outcomes: list[RequestOutcome] = []
        self._by_id: dict[str, RequestOutcome] = {}
        self._decisions: dict[str, Decision] = {}
        self._requests: dict[str, Request] = {}
        self._moving: set[str] = set()
        self._waiting_moves: dict[str, list[str]] = {}   # source -> fetches waiting for its compute
        self._landing: dict[str, int] = {}               # a fetch under way -> the blocks it carries
        self._wasted = 0.0
        self._busy = 0.0

    def _push(self, t: float, kind: int, key: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, key))

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        trace = self.trace
        t0 = trace[0].arrival_s if trace else 0.0
        for r in trace:
            out = RequestOutcome(r.index, (r.arrival_s - t0) / self.speedup, r.tokens, r.output_tokens)
            self._outcomes.append(out)
            self._by_id[str(r.index)] = out
        for r, out in zip(trace, self._outcomes):
            self._push(out.arrival_s, _ARRIVE, str(r.index))
        total, done = len(trace), 0
        events = self._events
        by_index = {str(r.index): r for r in trace}
        while events:
            t, _, kind, key = heapq.heappop(events)
            if kind == _ARRIVE:
                self._arrive(t, by_index[key])
                done += 1
                if progress is not None and (done % 256 == 0 or done == total):
                    progress(done, total)
            elif kind == _MOVED:
                self._moved(t, key)
            elif kind == _PREFILLED:
                self._prefilled(t, key)
            elif kind == _AT_DECODE:
                self._at_decode(t, key)
            elif kind == _POOLED:
                self._pooled(t, key)
            elif kind == _POOL_PUT:
                assert self.pool is not None
                self.pool.put(self._requests[key].keys)
            else:
                name, version = key.rsplit("#", 1)
                d = self.decode[name]
                if int(version) == d.version:
                    self._decode_tick(t, d)
        span = self._outcomes[-1].arrival_s if self._outcomes else 0.0
        return SimResult(self._outcomes, span, self.conductor.stats.moved_bytes, self._wasted, self._busy,
                         self._ideal_prefill_s(), self.pool.stats if self.pool is not None else None)

    def _ideal_prefill_s(self) -> float:
        """`SimResult.prefill_ideal_s`: each prefilled request (served or
        refused at decode) with the longest prefix of its blocks that the
        requests prefilled before it hold. Keys are chained, so a block
        seen is a prefix seen."""
        seen: set[int] = set()
        total = 0.0
        model, bt = self.cluster.prefill_model, self.cluster.block_tokens
        for r, out in zip(self.trace, self._outcomes):
            if math.isnan(out.prefill_start_s):
                continue            # refused before prefill: nothing computed
            n = 0
            for k in r.keys:
                if k not in seen:
                    break
                n += 1
            total += model.time(r.tokens, min(r.tokens, n * bt))
            seen.update(r.keys)
        return total

    # -- the stages -----------------------------------------------------------

    def _arrive(self, now: float, r: TraceRequest) -> None:
        rid = str(r.index)
        out = self._by_id[rid]
        # The conductor is not told the output length: a live router does not know it.
        req = Request(rid, r.tokens, r.keys, 0, self.cluster.block_tokens)
        self._requests[rid] = req
        dec = self.conductor.route(req, now)
        out.blocks = len(r.keys)
        if isinstance(dec, Rejected):
            out.rejected = dec.reason.value
            return
        self._decisions[rid] = dec
        out.prefill, out.decode = dec.prefill, dec.decode
        out.moved_blocks = len(dec.blocks_to_move)
        out.pool_blocks = len(dec.pool_blocks)
        if dec.pool_blocks:
            self._moving.add(rid)
            self._start_pool_fetch(now, rid)
        elif dec.prefix_source is not None:
            self._moving.add(rid)
            if self._has_moving(dec) == len(dec.blocks_to_move):
                self._start_move(now, rid)
            else:
                # blocks requests queued on the source are computing: the
                # fetch starts once they are there
                self._waiting_moves.setdefault(dec.prefix_source, []).append(rid)
        p = self.prefill[dec.prefill]
        p.queue.append(rid)
        self._try_start(p, now)

    def _has_moving(self, dec: Decision) -> int:
        """How many of the blocks `dec` moves, from the first, its source
        holds now."""
        return self.conductor.index.cache(dec.prefix_source).match(dec.blocks_to_move)

    def _start_move(self, now: float, rid: str, blocks: int | None = None) -> None:
        """The fetch of `rid`'s prefix (its first `blocks` blocks to move;
        None: all) starts now, on both NICs in time order."""
        dec, req, c = self._decisions[rid], self._requests[rid], self.cluster
        n = len(dec.blocks_to_move) if blocks is None else blocks
        moved_tokens = req.cached_tokens(dec.cached_blocks + n) - req.cached_tokens(dec.cached_blocks)
        src, dst = self.nic[dec.prefix_source], self.nic[dec.prefill]
        # after the streams booked on the source's link, and the moves on either
        start = max(now, src.tx_free_at, src.mv_tx_free_at, dst.mv_rx_free_at)
        ready = start + c.link.time(moved_tokens * c.kv_bytes_per_token)
        src.mv_tx_free_at = dst.mv_rx_free_at = ready
        src.moves_out[rid] = [start, ready]
        self._landing[rid] = n
        self._push(ready, _MOVED, rid)

    def _start_pool_fetch(self, now: float, rid: str) -> None:
        """The fetch of `rid`'s blocks from the pool starts now: read from
        the pool's segments as they free, received on the prefill node's
        NIC in the move class (behind the moves it receives)."""
        assert self.pool is not None
        dec, req, c = self._decisions[rid], self._requests[rid], self.cluster
        read = self.pool.fetch(now, dec.pool_blocks)
        lo = dec.cached_blocks
        tokens = req.cached_tokens(lo + len(dec.pool_blocks)) - req.cached_tokens(lo)
        dst = self.nic[dec.prefill]
        rx_end = max(now, dst.mv_rx_free_at) + tokens * c.kv_bytes_per_token / c.link.bandwidth_Bps
        landed = max(read, rx_end)
        dst.mv_rx_free_at = landed
        self._push(landed + c.link.latency_s, _POOLED, rid)

    def _pooled(self, now: float, rid: str) -> None:
        self.conductor.on_pool_fetch_done(rid, now)
        self._moving.discard(rid)
        self._try_start(self.prefill[self._decisions[rid].prefill], now)

    def _pause_moves(self, nic: _Nic, t0: float, t1: float) -> None:
        """A stream holds `nic`'s sending side over [t0, t1): the moves it
        sources pause meanwhile, each later one behind the one before."""
        carry = 0.0
        for rid, span in sorted(nic.moves_out.items(), key=lambda kv: kv[1][0]):
            start, ready = span[0] + carry, span[1] + carry
            overlap = max(0.0, min(t1, ready) - max(t0, start))
            if overlap <= 0.0 and carry == 0.0:
                continue
            span[0], span[1] = start, ready + overlap
            carry = span[1] - ready + carry
            self._push(span[1], _MOVED, rid)
        if carry:
            nic.mv_tx_free_at += carry

    def _start_waiting_moves(self, now: float, source: str) -> None:
        """After a prefill on `source`: the fetches from it whose blocks are
        all there now start; so do those whose missing blocks no request
        queued or running there will compute any more (with what is there,
        from the first: the prefill computes the rest)."""
        waiting = self._waiting_moves.get(source)
        if not waiting:
            return
        p = self.prefill[source]
        upcoming = [self._requests[r].keys for r in (*p.queue, *((p.running,) if p.busy else ()))]
        left = []
        for rid in waiting:
            dec = self._decisions[rid]
            have = self._has_moving(dec)
            if have < len(dec.blocks_to_move):
                missing = dec.blocks_to_move[have]
                if any(missing in keys for keys in upcoming):
                    left.append(rid)
                    continue
            self._start_move(now, rid, have)
        if left:
            self._waiting_moves[source] = left
        else:
            del self._waiting_moves[source]

    def _moved(self, now: float, rid: str) -> None:
        dec = self._decisions[rid]
        span = self.nic[dec.prefix_source].moves_out.get(rid)
        if span is None or now < span[1]:
            return                          # paused by a stream: a later event lands it
        del self.nic[dec.prefix_source].moves_out[rid]
        self.conductor.on_transfer_done(rid, now, self._landing.pop(rid))
        self._moving.discard(rid)
        self._try_start(self.prefill[dec.prefill], now)

    def _try_start(self, p: _PrefillServer, now: float) -> None:
        """Start the head of `p`'s queue if `p` is idle and the prefix the
        head fetches has landed (the queue is FIFO: the head holds it). The
        prefix it reuses is what `p`'s cache holds now, matched as a server
        matches its prefix cache when it schedules a request: blocks routed
        as cached were pinned, moved ones landed and were pinned, and blocks
        that requests ahead of it computed since may extend them."""
        if p.busy or not p.queue or p.queue[0] in self._moving:
            return
        rid = p.queue.popleft()
        req = self._requests[rid]
        out = self._by_id[rid]
        prefix = self.conductor.index.cache(p.name).match(req.keys)
        dur = self.cluster.prefill_model.time(req.tokens, req.cached_tokens(prefix))
        p.busy = True
        p.running = rid
        self._busy += dur
        out.reused_blocks = prefix
        out.prefill_start_s, out.prefill_s = now, dur
        out.ttft_s = now + dur - out.arrival_s
        self._push(now + dur, _PREFILLED, rid)
        self._stream_to_decode(now, rid)

    def _prefilled(self, now: float, rid: str) -> None:
        self.conductor.on_prefill_done(rid, now)
        if self.pool is not None:
            # its blocks go into the pool (the new ones' bytes over its
            # link, beside the stream: not queued on it), visible after
            c, req = self.cluster, self._requests[rid]
            fresh = sum(1 for k in req.keys if k not in self.pool)
            self._push(now + c.link.time(fresh * c.block_tokens * c.kv_bytes_per_token), _POOL_PUT, rid)
        p = self.prefill[self._decisions[rid].prefill]
        p.busy = False
        # the next prefill here first: its KV stream to decode is booked on
        # the link before a fetch of what this one computed
        self._try_start(p, now)
        self._start_waiting_moves(now, p.name)

    def _stream_to_decode(self, now: float, rid: str) -> None:
        """The KV streams to decode while the prefill computes, layer by
        layer: it ends one layer's worth after the prefill at the earliest,
        later when either NIC is busy. Taken on the NICs when the prefill
        starts, not when it was routed: a NIC is a queue in time order, and
        a stream booked for a prefill that starts in a minute must not hold
        back the transfers before it."""
        out = self._by_id[rid]
        c = self.cluster
        tx = out.tokens * c.kv_bytes_per_token / c.link.bandwidth_Bps
        src, dst = self.nic[out.prefill], self.nic[out.decode]
        tx_start = max(now, src.tx_free_at, dst.rx_free_at)
        src.tx_free_at = dst.rx_free_at = tx_start + tx
        if src.moves_out:
            self._pause_moves(src, tx_start, tx_start + tx)
        end = out.prefill_start_s + out.prefill_s
        landed = max(end + tx / c.layers, tx_start + tx) + c.link.latency_s
        self._push(landed, _AT_DECODE, rid)

    def _at_decode(self, now: float, rid: str) -> None:
        out = self._by_id[rid]
        rej = self.conductor.admit_decode(rid, now)
        if rej is not None:
            out.rejected = rej.reason.value
            self._wasted += out.prefill_s
            return
        if out.output_tokens <= 1:
            out.tbt_s = 0.0
            out.finish_s = now
            self.conductor.on_decode_done(rid, now, out.output_tokens)
            return
        d = self.decode[out.decode]
        d.advance(now)
        d.waiting.append((rid, out, out.tokens + out.output_tokens))
        if self._admit_waiting(d):
            d.new_epoch()
            self._schedule_tick(d)

    def _admit_waiting(self, d: _DecodeServer) -> bool:
        """Let waiting requests join while the KV pool holds them (in order);
        True if any joined (the caller opens a new epoch)."""
        joined = False
        while d.waiting:
            rid, out, reserve = d.waiting[0]
            if d.seqs and d.used + reserve > d.capacity:
                break   # FIFO: the head waits for memory, and so does everyone behind it
            d.waiting.popleft()
            prefill_end = out.arrival_s + out.ttft_s
            d.join(rid, out, prefill_end, reserve)
            joined = True
        return joined

    def _schedule_tick(self, d: _DecodeServer) -> None:
        t = d.next_end()
        if t is not None:
            self._push(t, _DECODE_TICK, f"{d.name}#{d.version}")

    def _decode_tick(self, now: float, d: _DecodeServer) -> None:
        d.advance(now)
        left = False
        # Sequences whose last token is out (within rounding of the clock).
        while d.ends and d.ends[0][0] <= d.v + 1e-6:
            _, rid = heapq.heappop(d.ends)
            seq = d.seqs.get(rid)
            if seq is None:
                continue
            d.leave(seq)
            seq.out.tbt_s = d.tbt_of(seq)
            seq.out.finish_s = now
            self.conductor.on_decode_done(rid, now, seq.out.output_tokens)
            left = True
        if left:
            self._admit_waiting(d)
            d.new_epoch()
        self._schedule_tick(d)
