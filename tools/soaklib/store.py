"""The store soak (tools/soak.py --mode store): kvflow.store, the KVCache
pool, under a randomised mixed load with faults, every byte checked.

A standalone master (over etcd with --store-etcd), `holders` member
processes that mount segments, a writer process and this process's own
client (no segment) put, get, check and remove objects whose bytes follow
from their keys (store_procs.content_of), while:

  kill      a holder is SIGKILLed and started again (its objects go, the
            ones with a second replica elsewhere stay readable)
  stop      a holder is SIGSTOPped for 2-4 s (less than the master's client
            grace) and SIGCONTed: the pinned objects put on it just before
            must all still be there, byte for byte
  writer    the writer is SIGKILLed mid-put: each key of that put is then
            either complete and right or absent, never partial
  pool      the segments are small: puts evict (the master's LRU)

At the end every key is read once more, the segment space is balanced
against the objects that exist (each replica's aligned size), everything is
removed and the master must be back to zero: no allocation leaked.

Invariants (problems()): no wrong byte, no error that is not a
kvflow.KVFlowError, no object lost that no kill or eviction explains, no
removed or failed key that reads back, no object of a stopped holder
dropped, no hang, no leaked space, the master exits cleanly."""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np

from kvflow.errors import KVFlowError
from kvflow.store import (MasterUnavailableError, ObjectNotFoundError, StoreClient, StoreTimeoutError)
from kvflow.store.allocator import ALIGN
from soaklib import base
from soaklib.base import Hang
from soaklib.store_procs import (POOL_BYTES, Etcd, MasterProc, Member, content_of, content_pool, key_for)

T = TypeVar("T")

MIN_OBJ, MAX_OBJ = 4 << 10, 1 << 20
MAX_BATCH = 8
SEGMENT = 16 << 20             # per holder: a few seconds of puts fill the pool
CLIENT_GRACE = 10.0            # the master's; a stop lasts at most 4 s
HEARTBEAT = 0.5
LEASE_TTL = 2.0
TIMEOUT = 10.0                 # each client call's
HANG_S = 45.0                  # no await of the soak may take longer
SETTLE_S = LEASE_TTL + 8.0     # for leases, quarantined replicas and removals to clear
WRITER_KILL_P = 0.3
# (operation, weight) of the in-process workers
OPERATIONS = (("put", 22), ("get", 40), ("exists", 15), ("remove", 15), ("put_rn2", 8))

LIVE, UNCERTAIN, REMOVED, ABSENT, LOST = "live", "uncertain", "removed", "absent", "lost"
REMOVING = "removing"       # a remove in flight: another task's get may or may not find it


async def bounded(aw: Awaitable[T], what: str) -> T:
    """soak's bounded() with this soak's limit: Hang past HANG_S."""
    return await base.bounded(aw, what, HANG_S)


@dataclass
class Obj:
    key: str
    state: str
    t_put: float
    evictions_at_put: int
    pinned: bool = False
    t_gone: float | None = None     # when the soak learnt it was removed, lost or never put

    def gone(self, state: str) -> None:
        self.state, self.t_gone = state, time.monotonic()

    def gone_before(self, t: float) -> bool:
        """Whether a call started at `t` must not find it (one started
        earlier may: a force remove does not wait for a get's lease)."""
        return self.state in (REMOVED, ABSENT, LOST) and self.t_gone is not None and self.t_gone < t


@dataclass
class StoreTally:
    ops: Counter = field(default_factory=Counter)            # operation -> calls
    errors: Counter = field(default_factory=Counter)         # "op ErrorType" -> keys that met it
    untyped: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    objects_put: int = 0
    bytes_put: int = 0
    bytes_verified: int = 0
    wrong_bytes: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    lost: Counter = field(default_factory=Counter)           # why -> objects
    unexplained: list[str] = field(default_factory=list)
    resurrected: list[str] = field(default_factory=list)     # removed or failed keys that read back
    uncertain: Counter = field(default_factory=Counter)      # a killed writer's keys: present / absent
    stop_checked: int = 0
    dropped_by_stop: list[str] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)


@dataclass
class StoreSoakResult:
    seconds: float
    seed: int
    holders: int
    etcd: bool
    wall_s: float = 0.0
    tally: StoreTally = field(default_factory=StoreTally)
    evictions: int = 0
    accounting: dict[str, Any] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    master_exit: int | None = None

    def problems(self) -> list[str]:
        t = self.tally
        out = []
        if t.wrong_bytes:
            out.append(f"{t.wrong_bytes} wrong bytes in {len(t.wrong)} gets")
        if t.untyped:
            out.append(f"{len(t.untyped)} errors that are not KVFlowErrors")
        if t.hangs:
            out.append(f"{len(t.hangs)} hangs")
        if t.unexplained:
            out.append(f"{len(t.unexplained)} objects lost that no kill or eviction explains")
        if t.resurrected:
            out.append(f"{len(t.resurrected)} removed or failed keys read back")
        if t.dropped_by_stop:
            out.append(f"{len(t.dropped_by_stop)} objects of a stopped holder dropped")
        if t.lost["evicted"] > self.evictions:
            out.append(f"{t.lost['evicted']} objects put down to eviction, the master evicted {self.evictions}")
        if self.master_exit not in (0, -15):
            out.append(f"the master exited with {self.master_exit}")
        return out + self.leaks + self.tool_errors


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StoreSoak:
    def __init__(self, seconds: float, seed: int, *, holders: int = 3, etcd: bool = False,
                 say: Callable[[str], None] = print) -> None:
        self.seconds, self.seed, self.say = seconds, seed, say
        self.rng = random.Random(seed)
        self.res = StoreSoakResult(seconds, seed, holders, etcd)
        self.t = self.res.tally
        self.pool = content_pool(seed)
        self.objs: dict[str, Obj] = {}
        self.serial = 0
        self.kills: list[float] = []          # when holders were SIGKILLed
        self.evictions = 0                    # the master's count, sampled
        self.etcd = Etcd() if etcd else None
        self.master: MasterProc | None = None
        self.holders: list[Member] = []
        self.writer: Member | None = None
        self.c: StoreClient | None = None
        self.base = 0
        self.stop = asyncio.Event()

    # ---------------------------------------------------------------- keys
    def new_keys(self, prefix: str, n: int) -> list[str]:
        keys = []
        for _ in range(n):
            size = int(math.exp(self.rng.uniform(math.log(MIN_OBJ), math.log(MAX_OBJ))))
            self.serial += 1
            keys.append(key_for(prefix, self.serial, self.rng.randrange(POOL_BYTES - size), size))
        return keys

    def pick(self, states: tuple[str, ...], n: int, recent: bool = False) -> list[str]:
        """Up to `n` keys in `states`; with `recent`, mostly of the last
        puts (the pool evicts fast: older keys are mostly gone)."""
        keys = [k for k, o in self.objs.items() if o.state in states]
        if recent and self.rng.random() < 0.75:
            keys = keys[-6 * MAX_BATCH:]
        return self.rng.sample(keys, min(n, len(keys)))

    def put_outcomes(self, op: str, keys: list[str], results: list[Any], t0: float, ev: int,
                     pinned: bool = False) -> None:
        for k, r in zip(keys, results):
            if isinstance(r, int) and not isinstance(r, bool) and r >= 1:
                self.objs[k] = Obj(k, LIVE, t0, ev, pinned)
                self.t.objects_put += 1
                self.t.bytes_put += content_of(k)[1] * r
            elif isinstance(r, (KVFlowError, str)):
                name = r if isinstance(r, str) else type(r).__name__
                self.t.errors[f"{op} {name}"] += 1
                # a put cut short by a timeout or the master's link may have committed
                maybe = name in (StoreTimeoutError.__name__, MasterUnavailableError.__name__)
                self.objs[k] = o = Obj(k, UNCERTAIN, t0, ev)
                if not maybe:
                    o.gone(ABSENT)
            else:
                self.untyped(op, f"{k}: {r!r}")

    def untyped(self, op: str, what: str) -> None:
        self.t.untyped.append(f"{op}: {what}"[:300])

    async def lost(self, o: Obj) -> None:
        """`o` (live) is gone: a kill after its put, or an eviction, explains it."""
        o.gone(LOST)
        ev = (await self.c.stats())["evictions"]
        if any(t > o.t_put for t in self.kills):
            self.t.lost["holder killed"] += 1
        elif ev > o.evictions_at_put and not o.pinned:
            self.t.lost["evicted"] += 1
        else:
            self.t.lost["unexplained"] += 1
            self.t.unexplained.append(o.key)

    def check_bytes(self, key: str, got: bytes) -> None:
        off, size = content_of(key)
        want = self.pool[off:off + size]
        have = np.frombuffer(got, dtype=np.uint8)
        n = min(len(have), size)
        wrong = int(np.count_nonzero(have[:n] != want[:n])) + abs(len(have) - size)
        self.t.bytes_verified += n
        if wrong:
            self.t.wrong_bytes += wrong
            if len(self.t.wrong) < 20:
                self.t.wrong.append({"key": key, "size": size, "got": len(have), "wrong": wrong,
                                     "state": self.objs[key].state})

    # ----------------------------------------------------------- operations
    async def op_put(self, rn: int, *, prefix: str = "p", n: int | None = None,
                     segment: int | None = None, pin: bool = False) -> list[str]:
        keys = self.new_keys(prefix, n or self.rng.randint(1, MAX_BATCH))
        where = [content_of(k) for k in keys]
        t0, ev = time.monotonic(), self.evictions
        try:
            res = await self.c.batch_put_from(keys, [self.base + o for o, _ in where], [s for _, s in where],
                                              replica_num=rn, preferred_segment=segment, pin=pin)
        except KVFlowError as e:
            res = [e] * len(keys)
        self.put_outcomes("put", keys, res, t0, ev, pinned=pin)
        return keys

    async def op_get(self, keys: list[str], op: str = "get") -> dict[str, Any]:
        if not keys:
            return {}
        t0 = time.monotonic()
        try:
            res = await self.c.batch_get(keys)
        except KVFlowError as e:
            res = [e] * len(keys)
        for k, r in zip(keys, res):
            o = self.objs[k]
            if isinstance(r, (bytes, bytearray)):
                self.check_bytes(k, r)
                if o.gone_before(t0):
                    self.t.resurrected.append(f"{k} ({o.state}) read back")
            elif isinstance(r, KVFlowError):
                self.t.errors[f"{op} {type(r).__name__}"] += 1
                # not found: gone; a replica unavailable or a timeout: perhaps a stopped holder
                if isinstance(r, ObjectNotFoundError) and o.state == LIVE:
                    await self.lost(o)
            else:
                self.untyped(op, f"{k}: {r!r}")
        return dict(zip(keys, res))

    async def op_exists(self) -> None:
        keys = self.pick((LIVE, REMOVED, ABSENT, UNCERTAIN), 16)
        if not keys:
            return
        t0 = time.monotonic()
        try:
            res = await self.c.batch_exists(keys)
        except KVFlowError as e:
            self.t.errors[f"exists {type(e).__name__}"] += len(keys)
            return
        for k, r in zip(keys, res):
            o = self.objs[k]
            if isinstance(r, KVFlowError):
                self.t.errors[f"exists {type(r).__name__}"] += 1
            elif r is True and o.gone_before(t0):
                self.t.resurrected.append(f"{k} ({o.state}) exists")
            elif r is False and o.state == LIVE:
                await self.lost(o)
            elif not isinstance(r, bool):
                self.untyped("exists", f"{k}: {r!r}")

    async def op_remove(self) -> None:
        keys = self.pick((LIVE,), self.rng.randint(1, 4))
        if not keys:
            return
        for k in keys:
            self.objs[k].state = REMOVING
        try:
            res = await self.c.batch_remove(keys)
        except KVFlowError as e:
            res = [e] * len(keys)
        for k, r in zip(keys, res):
            o = self.objs[k]
            if r is None or (isinstance(r, int) and not isinstance(r, bool)):
                o.gone(REMOVED)
            elif isinstance(r, KVFlowError):
                self.t.errors[f"remove {type(r).__name__}"] += 1
                o.state = LIVE
                if isinstance(r, ObjectNotFoundError):
                    await self.lost(o)
            else:
                o.state = LIVE
                self.untyped("remove", f"{k}: {r!r}")

    async def worker(self, wid: int) -> None:
        rng = random.Random(self.seed * 1000 + wid)
        ops, weights = zip(*OPERATIONS)
        while not self.stop.is_set():
            op = rng.choices(ops, weights)[0]
            self.t.ops[op] += 1
            try:
                if op in ("put", "put_rn2"):
                    await bounded(self.op_put(2 if op == "put_rn2" else rng.choice((1, 2))), op)
                elif op == "get":
                    await bounded(self.op_get(self.pick((LIVE, UNCERTAIN, REMOVED, ABSENT),
                                                        rng.randint(1, MAX_BATCH), recent=True)), op)
                elif op == "exists":
                    await bounded(self.op_exists(), op)
                else:
                    await bounded(self.op_remove(), op)
            except Hang as e:
                self.t.hangs.append(str(e))
            except KVFlowError as e:                # stats() while explaining a loss
                self.t.errors[f"{op} {type(e).__name__}"] += 1
            except Exception as e:  # noqa: BLE001 -- an untyped error is what the soak reports
                self.untyped(op, f"{type(e).__name__}: {e}")
            await asyncio.sleep(0)

    async def writer_loop(self) -> None:
        """Puts through the writer process; now and then SIGKILLs it mid-put
        and starts another."""
        rng = random.Random(self.seed * 1000 + 99)
        while not self.stop.is_set():
            w = self.writer
            keys = self.new_keys("w", rng.randint(1, MAX_BATCH))
            rn = rng.choice((1, 2))
            t0, ev = time.monotonic(), self.evictions
            self.t.ops["writer put"] += 1
            w.send({"keys": keys, "rn": rn})
            if rng.random() < WRITER_KILL_P:
                await asyncio.sleep(rng.uniform(0.002, 0.12))     # before, during or after its put
                w.kill()
                await w.reap()
                self.t.faults["writer killed mid-put"] += 1
                for k in keys:
                    self.objs[k] = Obj(k, UNCERTAIN, t0, ev)
                await w.stop()
                await bounded(w.start(), "a writer's restart")
                continue
            try:
                ans = await bounded(w.answer(HANG_S), "a writer's put")
            except Hang as e:
                self.t.hangs.append(str(e))
                return
            self.put_outcomes("writer put", keys, ans["results"], t0, ev)

    # --------------------------------------------------------------- faults
    async def chaos(self) -> None:
        rng = random.Random(self.seed * 1000 + 7)
        cycle: list[str] = []
        await asyncio.sleep(rng.uniform(1.5, 3))
        while not self.stop.is_set():
            if not cycle:
                cycle = ["kill", "stop"]
                rng.shuffle(cycle)
            kind = cycle.pop()
            h = rng.choice(self.holders)
            if kind == "kill":
                self.kills.append(time.monotonic())
                h.kill()
                await h.reap()
                self.t.faults["holder killed"] += 1
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                await h.stop()
                await bounded(h.start(), "a holder's restart")
            else:
                await self.stop_check(h, rng)
            try:
                await asyncio.wait_for(self.stop.wait(), rng.uniform(2, 4))
            except asyncio.TimeoutError:
                pass

    async def stop_check(self, h: Member, rng: random.Random) -> None:
        """Pinned objects on `h`, `h` stopped for less than the grace: after
        SIGCONT every one of them is still there, byte for byte."""
        keys = await bounded(self.op_put(1, prefix="s", n=4, segment=h.segment, pin=True), "a pinned put")
        keys = [k for k in keys if self.objs[k].state == LIVE]
        h.signal(19)                                        # SIGSTOP
        self.t.faults["holder stopped"] += 1
        await asyncio.sleep(rng.uniform(2, 4))
        h.signal(18)                                        # SIGCONT
        for attempt in range(3):
            got = await bounded(self.op_get(keys, "stopped get"), "reading a stopped holder's objects")
            if all(isinstance(v, bytes) or isinstance(v, ObjectNotFoundError) for v in got.values()):
                break
            await asyncio.sleep(1)
        for k, v in got.items():
            self.t.stop_checked += 1
            if not isinstance(v, bytes):
                self.t.dropped_by_stop.append(f"{k}: {type(v).__name__}")
        try:
            res = await self.c.batch_remove(keys, force=True)
        except KVFlowError as e:
            res = [e] * len(keys)
        for k, r in zip(keys, res):
            if isinstance(r, KVFlowError):
                self.t.errors[f"remove {type(r).__name__}"] += 1
            else:
                self.objs[k].gone(REMOVED)

    async def sampler(self) -> None:
        t0, n = time.monotonic(), 0
        while not self.stop.is_set():
            try:
                st = await self.c.stats()
                self.evictions = st["evictions"]
                if n % 20 == 0:
                    self.say(f"store soak: t={time.monotonic() - t0:.0f} s ops={sum(self.t.ops.values())} "
                             f"objects={st['objects']} used={st['used'] >> 20}/{st['capacity'] >> 20} MiB "
                             f"evictions={st['evictions']} wrong={self.t.wrong_bytes} "
                             f"lost={dict(self.t.lost)} faults={dict(self.t.faults)}")
            except KVFlowError as e:
                self.t.errors[f"stats {type(e).__name__}"] += 1
            n += 1
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ end
    async def final_pass(self) -> None:
        """Every key once more; a killed writer's keys are now known present or absent."""
        keys = [k for k, o in self.objs.items() if o.state in (LIVE, UNCERTAIN, REMOVED, ABSENT)]
        for i in range(0, len(keys), 16):
            chunk = keys[i:i + 16]
            uncertain = [k for k in chunk if self.objs[k].state == UNCERTAIN]
            got = await bounded(self.op_get(chunk, "final get"), "the final pass")
            for k in uncertain:
                self.t.uncertain["present" if isinstance(got[k], bytes) else "absent"] += 1

    async def settle(self) -> dict[str, Any]:
        """The master's detailed view once no lease, put or quarantined replica is left."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            v = await self.c.stats(detail=True)
            if (not v["leases"] and not v["puts_in_progress"] and not v["quarantined_bytes"]) \
                    or time.monotonic() > deadline:
                return v
            await asyncio.sleep(0.2)

    async def balance(self) -> None:
        """Segment space against the objects that exist, then everything
        removed: the master must be back to zero."""
        v = await self.settle()
        a = self.res.accounting
        a["used"], a["capacity"], a["segments"] = v["used"], v["capacity"], len(v["segments"])
        a["segments_used"] = sum(s["used"] for s in v["segments"])
        keys = list(self.objs)
        exists = []
        for i in range(0, len(keys), 256):
            exists += await self.c.batch_exists(keys[i:i + 256])
        live = [k for k, e in zip(keys, exists) if e is True]
        replicas = 0
        for k in live:
            n = len(await self.c.get_replicas(k))
            replicas += n
            a["objects_bytes"] = a.get("objects_bytes", 0) + _aligned(content_of(k)[1]) * n
        a["objects"], a["replicas"] = len(live), replicas
        a["master_objects"] = sum(v["objects"].values())
        if a["segments_used"] != a["used"]:
            self.res.leaks.append(f"segments hold {a['segments_used']} B, the master counts {a['used']} B")
        if a.get("objects_bytes", 0) != a["used"]:
            self.res.leaks.append(f"segment space used {a['used']} B, the objects that exist account for "
                                  f"{a.get('objects_bytes', 0)} B")
        if a["master_objects"] != len(live):
            self.res.leaks.append(f"the master holds {a['master_objects']} objects, {len(live)} of them known")
        for what in ("leases", "puts_in_progress", "quarantined_bytes"):
            if v[what]:
                self.res.leaks.append(f"{what} {v[what]} after {SETTLE_S:g} s")
        a["removed_at_end"] = await self.c.remove_all(force=True)
        v = await self.settle()
        a["used_after_remove_all"] = v["used"]
        a["objects_after_remove_all"] = sum(v["objects"].values())
        if v["used"] or any(s["used"] for s in v["segments"]) or sum(v["objects"].values()):
            self.res.leaks.append(f"after remove_all: used {v['used']} B, objects {v['objects']}, segments "
                                  f"{[(s['id'], s['used']) for s in v['segments'] if s['used']]}")
        self.res.evictions = sum(v["evictions"].values())

    # ------------------------------------------------------------------ run
    async def run(self) -> StoreSoakResult:
        t_start = time.monotonic()
        args = ["--client-grace", str(CLIENT_GRACE), "--heartbeat-interval", str(HEARTBEAT),
                "--lease-ttl", str(LEASE_TTL)]
        tasks: list[asyncio.Task] = []
        try:
            if self.etcd is not None:
                self.etcd.start()
                args += ["--etcd", self.etcd.address, "--cluster", "soak"]
            self.master = MasterProc(*args)
            await self.master.start()
            addr = self.master.address
            self.holders = [Member(f"holder{i}", "holder", addr, SEGMENT, self.seed, TIMEOUT)
                            for i in range(self.res.holders)]
            self.writer = Member("writer", "writer", addr, 0, self.seed, TIMEOUT)
            await asyncio.gather(*(m.start() for m in (*self.holders, self.writer)))
            self.c = StoreClient(addr, segment_size=0, local_buffer_size=16 << 20, protocols=("tcp",),
                                 timeout=TIMEOUT)
            await self.c.start()
            self.base = self.c.register_buffer(self.pool).addr
            loop = asyncio.get_running_loop()
            tasks = [loop.create_task(self.worker(i)) for i in range(2)]
            tasks += [loop.create_task(self.writer_loop()), loop.create_task(self.chaos()),
                      loop.create_task(self.sampler())]
            done, _ = await asyncio.wait(tasks, timeout=self.seconds, return_when=asyncio.FIRST_EXCEPTION)
            self.stop.set()
            for t in done:
                if t.exception() is not None:
                    self.res.tool_errors.append(f"{type(t.exception()).__name__}: {t.exception()}")
            rest = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG_S + 30)
            for r in rest:
                if isinstance(r, BaseException) and f"{type(r).__name__}: {r}" not in self.res.tool_errors:
                    self.res.tool_errors.append(f"{type(r).__name__}: {r}")
            for h in self.holders:
                h.signal(18)                                # SIGCONT, whatever the chaos was doing
            await self.final_pass()
            await self.balance()
        except Exception as e:  # noqa: BLE001 -- reported as the tool's own failure, with what it had
            self.res.tool_errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.c is not None:
                await self.c.close()
            await asyncio.gather(*(m.stop() for m in (*self.holders, *([self.writer] if self.writer else []))),
                                 return_exceptions=True)
            if self.master is not None:
                self.res.master_exit = await self.master.stop()
            if self.etcd is not None:
                self.etcd.stop()
        self.res.wall_s = time.monotonic() - t_start
        return self.res


async def store_soak(seconds: float, seed: int = 1, *, holders: int = 3, etcd: bool = False,
                     log: Callable[[str], None] = print) -> StoreSoakResult:
    return await StoreSoak(seconds, seed, holders=holders, etcd=etcd, say=log).run()


def table(res: StoreSoakResult) -> str:
    t = res.tally
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    rows = [f"store soak: {res.seconds:g} s (wall {res.wall_s:.1f} s), seed {res.seed}, {res.holders} holders"
            f"{' over etcd' if res.etcd else ''}",
            "| what | count |", "|---|---|",
            f"| operations | {sum(t.ops.values())} ({', '.join(f'{k} {v}' for k, v in sorted(t.ops.items()))}) |",
            f"| objects put | {t.objects_put} ({mib(t.bytes_put)} MiB with replicas) |",
            f"| bytes verified | {mib(t.bytes_verified)} MiB |",
            f"| wrong bytes | {t.wrong_bytes} |",
            f"| typed errors | {sum(t.errors.values())} |",
            f"| untyped errors | {len(t.untyped)} |",
            f"| hangs | {len(t.hangs)} |",
            f"| objects lost | {sum(t.lost.values())} ({', '.join(f'{k} {v}' for k, v in t.lost.items()) or '-'}) |",
            f"| evictions (master) | {res.evictions} |",
            f"| faults | {', '.join(f'{k} {v}' for k, v in t.faults.items()) or '-'} |",
            f"| killed writer's keys | {', '.join(f'{k} {v}' for k, v in t.uncertain.items()) or '-'} |",
            f"| stopped holder's pinned objects checked / dropped | {t.stop_checked} / {len(t.dropped_by_stop)} |",
            f"| removed or failed keys read back | {len(t.resurrected)} |"]
    a = res.accounting
    if a:
        rows.append(f"| space at the end | used {a.get('used')} B = objects {a.get('objects_bytes', 0)} B "
                    f"({a.get('objects')} objects, {a.get('replicas')} replicas); after remove_all "
                    f"{a.get('used_after_remove_all')} B, {a.get('objects_after_remove_all')} objects |")
    rows.append("")
    rows.append("typed errors: " + (", ".join(f"{k} {v}" for k, v in sorted(t.errors.items())) or "none"))
    for p in res.problems():
        rows.append(f"PROBLEM: {p}")
    for w in t.wrong[:5]:
        rows.append(f"- wrong: {w}")
    for u in (t.untyped + t.unexplained + t.resurrected + t.dropped_by_stop + t.hangs)[:10]:
        rows.append(f"- {u}")
    rows.append("OK" if not res.problems() else "FAILED")
    return "\n".join(rows)
