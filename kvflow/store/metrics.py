"""The pool's numbers, kept where they happen: a client counts its own
calls (`StoreClient.metrics()`), the master what it holds and decides
(`Master.metrics()`, and over the wire `stats` with detail, which
`kvflow-info --store` prints). Prometheus export as kvflow's engine
metrics have it (kvflow/metrics.py; prometheus-client is optional):

    kvflow.store.metrics.register_prometheus(client)    # or a Master
    python -m kvflow.store master --metrics-port 9401   # a standalone master

Client (labels: op, and where said; with `name=`, a `store` label too):

| name | kind | what |
|---|---|---|
| kvflow_store_calls_total | counter | batch calls (op: put, get, exists, remove) |
| kvflow_store_call_failures_total | counter | calls that raised as a whole (master unreachable, bad arguments) |
| kvflow_store_hits_total | counter | keys found (op: get, exists) |
| kvflow_store_misses_total | counter | keys not in the pool (op: get, exists, remove) |
| kvflow_store_errors_total | counter | keys that met another typed error (op) |
| kvflow_store_puts_total | counter | keys put, by result: stored (new), existed (immutable: a no-op) |
| kvflow_store_bytes_total | counter | bytes written (put: object x replicas) and read (get), label tier |
| kvflow_store_lease_waits_total | counter | removes refused because a reader holds a lease (op remove), reads that outlasted their lease (op get) |
| kvflow_store_replica_fallbacks_total | counter | reads that went on to another replica |
| kvflow_store_master_round_trips_total | counter | calls to the master that waited for a reply (label method) |
| kvflow_store_master_round_trip_failures_total | counter | of those, no reply or an error reply (method) |
| kvflow_store_master_round_trip_seconds | histogram | request to reply (method; buckets: powers of two of us) |
| kvflow_store_local_buffer_used_bytes | gauge | the local buffer held by put()/get() in progress |

Master (labels said per row):

| name | kind | what |
|---|---|---|
| kvflow_store_master_clients | gauge | registered clients |
| kvflow_store_master_objects | gauge | complete objects (tier) |
| kvflow_store_master_puts_in_progress | gauge | objects allocated, not committed |
| kvflow_store_master_leases | gauge | read leases not yet released or run out |
| kvflow_store_master_quarantined_bytes | gauge | space of forced removals waiting for their readers |
| kvflow_store_segment_capacity_bytes, kvflow_store_segment_used_bytes | gauge | per segment (segment, client, tier) |
| kvflow_store_segment_fenced_bytes | gauge | per segment: free space a new leader holds back until the failover fence lifts (fence.py) |
| kvflow_store_segment_replicas | gauge | replicas held per segment (segment, client, tier) |
| kvflow_store_tier_capacity_bytes, kvflow_store_tier_used_bytes | gauge | per tier |
| kvflow_store_evictions_total, kvflow_store_evicted_bytes_total | counter | objects evicted and their bytes (tier) |
| kvflow_store_master_lease_waits_total | counter | reason: remove (refused), evict (a leased object skipped), quarantine (a forced removal's space held for its readers) |
| kvflow_store_master_lookups_total | counter | keys looked up (op: get, exists; result: hit, miss) |
| kvflow_store_master_calls_total | counter | calls served (method) |

Tiers: every segment is `dram` today (a segment with a `tier` attribute
of its own reports that instead); a client counts bytes per tier as the
reads and writes name it. Nothing here is sampled or kept twice: the
counters are plain ints the callers bump, read whole at each scrape.
"""
from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from .errors import LeaseExpiredError, ObjectLeasedError, ObjectNotFoundError

__all__ = ["ClientCounters", "Histogram", "StoreCollector", "counted", "master_view", "register_prometheus"]

DRAM = "dram"
_BUCKETS = 25           # bucket i: under 2^(i+1) us; the last one unbounded (2^24 us is 16.8 s)


class Histogram:
    """Round-trip latencies in power-of-two buckets of microseconds, the
    layout of kvflow's engine latencies (docs/metrics.md): percentiles are
    upper bounds within a factor of two, the mean is exact."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0.0

    def add(self, seconds: float) -> None:
        i = int(seconds * 1e6).bit_length() - 1
        self.counts[min(max(i, 0), _BUCKETS - 1)] += 1
        self.total += seconds

    def snapshot(self) -> dict[str, Any]:
        counts = list(self.counts)
        n = sum(counts)
        bounds = [float(2 << i) for i in range(_BUCKETS - 1)] + [float("inf")]

        def pct(q: float) -> float | None:
            if not n:
                return None
            seen = 0
            for bound, c in zip(bounds, counts):
                seen += c
                if seen >= q * n:
                    return bound
            return bounds[-1]

        return {"count": n, "mean_us": self.total / n * 1e6 if n else None, "p50_us": pct(0.5),
                "p99_us": pct(0.99), "buckets": list(zip(bounds, counts)), "sum_seconds": self.total}


class ClientCounters:
    """What one StoreClient did. Bumped on the client's loop (and by
    batch_exists_blocking on its caller's thread: two threads bumping one
    counter at once may lose an increment, never make a wrong value); read
    whole by metrics() from any thread (a scrape copies each dict first)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.call_failures: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.puts: Counter[str] = Counter()          # stored, existed
        self.bytes: dict[str, Counter[str]] = {"put": Counter(), "get": Counter()}     # op -> tier -> bytes
        self.lease_waits: Counter[str] = Counter()
        self.round_trips: dict[str, Histogram] = {}
        self.round_trip_failures: Counter[str] = Counter()

    def round_trip(self, method: str, seconds: float, ok: bool) -> None:
        h = self.round_trips.get(method)
        if h is None:
            h = self.round_trips[method] = Histogram()
        h.add(seconds)
        if not ok:
            self.round_trip_failures[method] += 1

    def master_round_trips(self, *, skip: tuple[str, ...] = ("heartbeat",)) -> int:
        """Round trips so far, every method but `skip` (a bench's per-call count)."""
        return sum(sum(h.counts) for m, h in list(self.round_trips.items()) if m not in skip)

    def exists_done(self, hits: int, misses: int) -> None:
        """done("exists") of a batch whose every item was found or not
        (batch_exists_blocking has counted them already)."""
        self.calls["exists"] += 1
        self.hits["exists"] += hits
        self.misses["exists"] += misses

    def done(self, op: str, args: tuple, kw: dict, results: list) -> None:
        """A batch call's per-key results (values or the errors they met)."""
        self.calls[op] += 1
        if op == "put":
            self._puts(args[1] if len(args) > 1 else kw.get("parts", ()), results)
            return
        if op == "exists":
            # the servers' hot query (a prefix check before every put and
            # get): counted in C, three passes, no Python loop per key
            hits, misses = results.count(True), results.count(False)
            self.hits[op] += hits
            self.misses[op] += misses
            if hits + misses != len(results):
                self.errors[op] += len(results) - hits - misses
            return
        if op == "get":
            # every key found (the common case): sums in C, no loop per key
            # (an error in the list raises TypeError: int + exception, len(exception))
            for total in (sum, lambda rs: sum(map(len, rs))):
                try:
                    nbytes = total(results)
                except TypeError:
                    continue
                self.hits[op] += len(results)
                self.bytes["get"][DRAM] += nbytes
                return
        hits = misses = errors = 0
        nbytes = 0
        for r in results:
            if isinstance(r, BaseException):
                if isinstance(r, ObjectNotFoundError):
                    misses += 1
                    continue
                errors += 1
                if isinstance(r, (ObjectLeasedError, LeaseExpiredError)):
                    self.lease_waits[op] += 1
            elif op == "get":
                hits += 1
                nbytes += len(r) if isinstance(r, bytes) else int(r)
        self.hits[op] += hits
        self.misses[op] += misses
        self.errors[op] += errors
        if nbytes:
            self.bytes["get"][DRAM] += nbytes

    def _puts(self, parts: Any, results: list) -> None:
        try:
            # one-part objects and no error (the common case): no Python loop
            # but the sizes' (unpacking raises ValueError for several parts,
            # TypeError multiplying an error)
            sizes = [n for ((_, n),) in parts]
            nbytes = sum(map(operator.mul, results, sizes))
        except (TypeError, ValueError):
            pass
        else:
            existed = results.count(0)
            self.puts["stored"] += len(results) - existed
            self.puts["existed"] += existed
            self.bytes["put"][DRAM] += nbytes
            return
        stored = existed = errors = nbytes = 0
        for ps, r in zip(parts, results):
            if isinstance(r, BaseException):
                errors += 1
                if isinstance(r, ObjectLeasedError):
                    self.lease_waits["put"] += 1
            elif r:
                stored += 1
                nbytes += r * sum(int(s) for _, s in ps)
            else:
                existed += 1
        self.puts["stored"] += stored
        self.puts["existed"] += existed
        self.errors["put"] += errors
        self.bytes["put"][DRAM] += nbytes

    def snapshot(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "call_failures": dict(self.call_failures), "hits": dict(self.hits),
                "misses": dict(self.misses), "errors": dict(self.errors), "puts": dict(self.puts),
                "bytes": {op: dict(t) for op, t in list(self.bytes.items())},
                "lease_waits": dict(self.lease_waits),
                "round_trips": {m: h.snapshot() for m, h in list(self.round_trips.items())},
                "round_trip_failures": dict(self.round_trip_failures)}


def counted(op: str) -> Callable:
    """Counts a StoreClient batch funnel's results in `self.counters` (a
    put retried inside the funnel, `_again`, is counted by its caller)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def call(self: Any, *args: Any, **kw: Any) -> Any:
            try:
                results = await fn(self, *args, **kw)
            except BaseException:
                self.counters.call_failures[op] += 1
                raise
            if not kw.get("_again"):
                self.counters.done(op, args, kw, results)
            return results
        return call
    return wrap


def master_view(master: Any) -> dict[str, Any]:
    """The master's state and counters as plain data (msgpack-able: what
    `stats` with detail answers). Reads the model in one go on the
    master's loop; from another thread (a scrape) each table is copied
    first."""
    m = master.model
    now = master.clock()
    segments, tiers = [], {}
    for seg in list(m.segments.values()):
        tier = getattr(seg, "tier", DRAM)
        c = m.clients.get(seg.client)
        row = {"id": seg.id, "client": seg.client, "host": c.host if c else "", "engine": c.engine if c else "",
               "name": seg.name, "tier": tier, "capacity": seg.alloc.capacity, "used": seg.alloc.used,
               "fenced": seg.alloc.fenced, "replicas": len(seg.keys), "attached": seg.attached}
        segments.append(row)
        t = tiers.setdefault(tier, {"capacity": 0, "used": 0, "segments": 0})
        t["capacity"] += row["capacity"]
        t["used"] += row["used"]
        t["segments"] += 1
    clients = [{"id": c.id, "host": c.host, "engine": c.engine, "segments": sorted(c.segments),
                "writing": len(c.writing), "silent_s": round(now - c.last_seen, 3), "recovered": c.recovered}
               for c in list(m.clients.values())]
    complete = len(m._lru)          # the LRU order holds exactly the COMPLETE objects (model.py)
    counters = master.counters
    return {"kind": "master", "address": master.address, "clients": clients, "segments": segments,
            "tiers": tiers, "capacity": m.capacity, "used": m.used,
            "objects": {DRAM: complete}, "puts_in_progress": len(m.objects) - complete,
            "leases": len(m._leases), "lease_ttl": m.lease_ttl,
            # leases renewed for gets still reading (read_leases.py), puts revoked uncommitted (put_timeouts.py)
            "lease_renewals": m.lease_renewals, "puts_timed_out": m.puts_timed_out,
            "quarantined_bytes": sum(r.length for _, reps in list(m._quarantine) for r in reps),
            "evictions": {DRAM: m.evictions}, "evicted_bytes": {DRAM: m.evicted_bytes},
            "lease_waits": dict(m.lease_waits), "calls": master.calls,
            "calls_by_method": dict(counters.calls),
            "lookups": {op: {"hit": h, "miss": n} for op, (h, n) in list(counters.lookups.items())},
            "watermarks": [m.high_watermark, m.low_watermark]}


class MasterCounters:
    """What the master served: calls per method, lookups that found their
    key or not (get_replicas, exists). Bumped on the master's loop."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lookups: dict[str, list[int]] = {"get": [0, 0], "exists": [0, 0]}     # op -> [hit, miss]

    def looked_up(self, op: str, hits: int, misses: int) -> None:
        t = self.lookups[op]
        t[0] += hits
        t[1] += misses


# -- Prometheus ----------------------------------------------------------------------------------------------
class StoreCollector:
    """A prometheus_client collector for one StoreClient or Master (its
    metrics() at each scrape). Several in one process: one each, with a
    distinct `name` (the `store` label)."""

    def __init__(self, source: Any, name: str | None = None) -> None:
        self.source = source
        self.name = name

    def collect(self) -> Iterator[Any]:
        m = self.source.metrics()
        yield from (_master_families if m["kind"] == "master" else _client_families)(m, self.name)


def _families(name: str | None) -> tuple[list[str], list[str], Callable[..., Any]]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    extra, tag = (["store"], [name]) if name else ([], [])

    def family(kind: str, metric: str, help_: str, labels: tuple[str, ...] = ()) -> Any:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(metric, help_, labels=extra + list(labels))
    return extra, tag, family


def _client_families(m: dict[str, Any], name: str | None) -> Iterator[Any]:
    from prometheus_client.core import HistogramMetricFamily

    extra, tag, family = _families(name)
    per_op = (("kvflow_store_calls", "batch calls", "calls"),
              ("kvflow_store_call_failures", "calls that raised as a whole", "call_failures"),
              ("kvflow_store_hits", "keys found", "hits"),
              ("kvflow_store_misses", "keys not in the pool", "misses"),
              ("kvflow_store_errors", "keys that met another typed error", "errors"),
              ("kvflow_store_lease_waits", "keys that met a read lease", "lease_waits"))
    for metric, what, key in per_op:
        f = family("counter", metric, what, ("op",))
        for op, n in sorted(m[key].items()):
            f.add_metric(tag + [op], n)
        yield f
    f = family("counter", "kvflow_store_puts", "keys put, by result", ("result",))
    for result in ("stored", "existed"):
        f.add_metric(tag + [result], m["puts"].get(result, 0))
    yield f
    f = family("counter", "kvflow_store_bytes", "bytes written (object x replicas) and read", ("op", "tier"))
    for op, tiers in sorted(m["bytes"].items()):
        for tier in sorted(set(tiers) | {DRAM}):
            f.add_metric(tag + [op, tier], tiers.get(tier, 0))
    yield f
    f = family("counter", "kvflow_store_replica_fallbacks", "reads that went on to another replica")
    f.add_metric(tag, m["replica_fallbacks"])
    yield f
    rts = family("counter", "kvflow_store_master_round_trips", "calls to the master that waited for a reply",
                 ("method",))
    fails = family("counter", "kvflow_store_master_round_trip_failures", "no reply or an error reply",
                   ("method",))
    lat = HistogramMetricFamily("kvflow_store_master_round_trip_seconds", "request to reply",
                                labels=extra + ["method"])
    for method, h in sorted(m["round_trips"].items()):
        rts.add_metric(tag + [method], h["count"])
        fails.add_metric(tag + [method], m["round_trip_failures"].get(method, 0))
        cumulative, buckets = 0, []
        for bound, n in h["buckets"]:
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e6), cumulative))
        lat.add_metric(tag + [method], buckets, sum_value=h["sum_seconds"])
    yield from (rts, fails, lat)
    f = family("gauge", "kvflow_store_local_buffer_used_bytes", "local buffer held by calls in progress")
    f.add_metric(tag, m["local_buffer_in_use"])
    yield f


def _master_families(m: dict[str, Any], name: str | None) -> Iterator[Any]:
    _, tag, family = _families(name)
    for metric, what, value in (("kvflow_store_master_clients", "registered clients", len(m["clients"])),
                                ("kvflow_store_master_puts_in_progress", "objects allocated, not committed",
                                 m["puts_in_progress"]),
                                ("kvflow_store_master_leases", "live read leases", m["leases"]),
                                ("kvflow_store_master_quarantined_bytes", "forced removals' space held",
                                 m["quarantined_bytes"])):
        f = family("gauge", metric, what)
        f.add_metric(tag, value)
        yield f
    seg_labels = ("segment", "client", "tier")
    cap = family("gauge", "kvflow_store_segment_capacity_bytes", "segment size", seg_labels)
    used = family("gauge", "kvflow_store_segment_used_bytes", "segment bytes allocated", seg_labels)
    fenced = family("gauge", "kvflow_store_segment_fenced_bytes",
                    "free bytes a new leader holds back from late writes (fence.py)", seg_labels)
    reps = family("gauge", "kvflow_store_segment_replicas", "replicas held", seg_labels)
    for s in m["segments"]:
        labels = tag + [str(s["id"]), s["client"], s["tier"]]
        cap.add_metric(labels, s["capacity"])
        used.add_metric(labels, s["used"])
        fenced.add_metric(labels, s["fenced"])
        reps.add_metric(labels, s["replicas"])
    yield from (cap, used, fenced, reps)
    tiers = sorted(set(m["tiers"]) | {DRAM})
    for metric, key, what in (("kvflow_store_tier_capacity_bytes", "capacity", "tier size"),
                              ("kvflow_store_tier_used_bytes", "used", "tier bytes allocated")):
        f = family("gauge", metric, what, ("tier",))
        for t in tiers:
            f.add_metric(tag + [t], m["tiers"].get(t, {}).get(key, 0))
        yield f
    for kind, metric, key, what in (("gauge", "kvflow_store_master_objects", "objects", "complete objects"),
                                    ("counter", "kvflow_store_evictions", "evictions", "objects evicted"),
                                    ("counter", "kvflow_store_evicted_bytes", "evicted_bytes", "bytes evicted")):
        f = family(kind, metric, what, ("tier",))
        for t in tiers:
            f.add_metric(tag + [t], m[key].get(t, 0))
        yield f
    f = family("counter", "kvflow_store_master_lease_waits", "what a read lease held back", ("reason",))
    for reason, n in sorted(m["lease_waits"].items()):
        f.add_metric(tag + [reason], n)
    yield f
    f = family("counter", "kvflow_store_master_lookups", "keys looked up", ("op", "result"))
    for op, t in sorted(m["lookups"].items()):
        for result in ("hit", "miss"):
            f.add_metric(tag + [op, result], t[result])
    yield f
    f = family("counter", "kvflow_store_master_calls", "calls served", ("method",))
    for method, n in sorted(m["calls_by_method"].items()):
        f.add_metric(tag + [method], n)
    yield f


def register_prometheus(source: Any, registry: Any = None, name: str | None = None) -> StoreCollector:
    """Registers a StoreCollector for `source` (a StoreClient or a Master)
    with `registry` (default: prometheus_client's) and returns it.
    ImportError without prometheus-client."""
    from prometheus_client import REGISTRY

    collector = StoreCollector(source, name)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
