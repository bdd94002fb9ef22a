"""The global KVCache pool of seed 003 and [FAST'25] §3: every prefill
instance writes the blocks it computed into a pool spread over the
cluster's DRAM, with SSD below it, and any instance can fetch a prefix from
it instead of computing it again.

Two things live here:

- `PoolModel`, the pool the replay simulates (the ground truth, as `sim.py`
  is for the instances): DRAM and SSD tiers of a capacity in blocks, each
  an LRU (`index.BlockCache`: a chain's tail goes before its head). A block
  evicted from DRAM is demoted to SSD; one evicted from SSD is gone; a
  block read from SSD is promoted back to DRAM. The blocks are spread over
  `segments` nodes (by key), each reading at its own bandwidth, DRAM over
  its NIC and SSD at the drives' rate: a fetch waits behind the reads
  already booked on the segments that hold its blocks. A block read
  `hot_reads` times gets a replica on one more segment (up to
  `max_replicas`), and a read goes to the replica whose segment frees
  first: the seed's "hot blocks replicated", so that a system prompt every
  request reads does not queue on one node.
- `StorePoolIndex`, the live link: how long a prefix of a request a
  running `kvflow.store` holds, asked with one `batch_exists` round trip
  over the request's chained block keys. It takes the client duck-typed
  (the conductor imports nothing of the store: tests/test_layers.py).

The conductor sees either through the `PoolView` protocol: `match(keys)`,
the prefix held, and `split(keys)`, how many of those blocks sit in DRAM
and how many on SSD (for the fetch estimate; the live store does not say,
so it answers all DRAM).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .estimators import KV_BYTES_PER_TOKEN_70B, PAPER_NIC_BPS
from .index import BlockCache
from .trace import TRACE_BLOCK_TOKENS

__all__ = ["PAPER_SSD_BPS", "HeldPrefix", "PoolConfig", "PoolModel", "PoolStats", "PoolView", "StorePoolIndex"]

#: SSD read bandwidth per node: ours, four NVMe drives at about 5 GB/s
#: each (the paper gives none).
PAPER_SSD_BPS = 4 * 5e9

_GOLDEN = 0x9E3779B97F4A7C15


class PoolView(Protocol):
    """What the conductor asks of the pool."""

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the pool holds."""
        ...

    def split(self, keys: Sequence[int]) -> tuple[int, int]:
        """Of `keys` (all held), how many are in DRAM and how many on SSD."""
        ...


@dataclass(frozen=True)
class PoolConfig:
    """A pool of `dram_blocks` and `ssd_blocks` (None: unbounded) spread
    over `segments` nodes; per node a DRAM read goes at `dram_Bps` (its NIC:
    the link model's bandwidth by default) and an SSD read at `ssd_Bps`."""

    dram_blocks: int | None
    ssd_blocks: int | None = 0
    segments: int = 16
    block_bytes: int = TRACE_BLOCK_TOKENS * KV_BYTES_PER_TOKEN_70B
    dram_Bps: float = PAPER_NIC_BPS * 0.9
    ssd_Bps: float = PAPER_SSD_BPS
    hot_reads: int = 8           # reads of a block that earn it one more replica
    max_replicas: int = 4

    def __post_init__(self) -> None:
        for name in ("dram_blocks", "ssd_blocks"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {v}")
        if self.segments < 1 or self.block_bytes < 1 or self.max_replicas < 1 or self.hot_reads < 1:
            raise ValueError("segments, block_bytes, max_replicas and hot_reads must be >= 1")
        if not (self.dram_Bps > 0 and self.ssd_Bps > 0):
            raise ValueError("bandwidths must be positive")

    @classmethod
    def from_gb(cls, dram_gb: float, ssd_gb: float, *,
                block_bytes: int = TRACE_BLOCK_TOKENS * KV_BYTES_PER_TOKEN_70B, **kw: Any) -> PoolConfig:
        """A pool of `dram_gb` and `ssd_gb` gigabytes (10**9) over the whole
        cluster, in blocks of `block_bytes`."""
        return cls(int(dram_gb * 1e9 // block_bytes), int(ssd_gb * 1e9 // block_bytes),
                   block_bytes=block_bytes, **kw)

    def fetch_s(self, dram: int, ssd: int) -> float:
        """Seconds to read `dram` + `ssd` blocks spread over the segments,
        on an idle pool: the conductor's estimate (the segments read in
        parallel, at most `segments` ways)."""
        if dram + ssd <= 0:
            return 0.0
        ways_d = min(self.segments, dram) or 1
        ways_s = min(self.segments, ssd) or 1
        return max(dram * self.block_bytes / (self.dram_Bps * ways_d),
                   ssd * self.block_bytes / (self.ssd_Bps * ways_s))


@dataclass
class PoolStats:
    written_blocks: int = 0        # new blocks put after prefills
    read_blocks: int = 0           # blocks fetched by prefill instances
    read_dram_blocks: int = 0
    read_ssd_blocks: int = 0
    demoted: int = 0               # DRAM -> SSD
    dropped: int = 0               # evicted from SSD (or from DRAM with no SSD)
    replicas_made: int = 0


@dataclass
class _Segment:
    free_at: float = 0.0           # when its reads booked so far are done


class PoolModel:
    """The pool of the replay (see the module's docstring). Deterministic:
    placement is by key, ties go to the lowest segment."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.dram = BlockCache("pool.dram", config.dram_blocks)
        self.ssd = BlockCache("pool.ssd", config.ssd_blocks)
        self._segments = [_Segment() for _ in range(config.segments)]
        self._replicas: dict[int, int] = {}      # key -> replica count (1 if absent)
        self._reads: dict[int, int] = {}
        self.stats = PoolStats()

    # -- PoolView ---------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> int:
        dram, ssd = self.dram, self.ssd
        n = 0
        for k in keys:
            if k not in dram and k not in ssd:
                break
            n += 1
        return n

    def split(self, keys: Sequence[int]) -> tuple[int, int]:
        d = sum(1 for k in keys if k in self.dram)
        return d, len(keys) - d

    def __contains__(self, key: int) -> bool:
        return key in self.dram or key in self.ssd

    # -- writes and reads -------------------------------------------------------

    def put(self, keys: Sequence[int]) -> int:
        """Blocks a prefill computed (a prefix, in order) go into DRAM; those
        held already are only touched (the store's dedup: `batch_exists`
        before a put). Returns how many were new."""
        fresh = [k for k in keys if k not in self]
        # a block is in one tier: those on SSD stay there (touched), the
        # rest go to (or are touched in) DRAM
        self.ssd.touch([k for k in keys if k in self.ssd])
        self._into_dram([k for k in keys if k not in self.ssd])
        self.stats.written_blocks += len(fresh)
        return len(fresh)

    def fetch(self, now: float, keys: Sequence[int]) -> float:
        """Read `keys` (all held) for a prefill instance, starting at `now`:
        each block from the replica whose segment frees first, behind the
        reads booked there. Returns when the last block is read (the
        caller adds its own NIC's share). SSD blocks are promoted to DRAM;
        hot blocks get a replica."""
        cfg, segs = self.config, self._segments
        end = now
        for k in keys:
            on_ssd = k not in self.dram
            if on_ssd and k not in self.ssd:
                raise KeyError(f"block {k:#x} is not in the pool")
            reps = self._replicas.get(k, 1)
            home = self.home(k)
            seg = min((segs[(home + i) % len(segs)] for i in range(reps)), key=lambda s: s.free_at)
            start = max(now, seg.free_at)
            seg.free_at = start + cfg.block_bytes / (cfg.ssd_Bps if on_ssd else cfg.dram_Bps)
            end = max(end, seg.free_at)
            st = self.stats
            st.read_blocks += 1
            if on_ssd:
                st.read_ssd_blocks += 1
            else:
                st.read_dram_blocks += 1
            hits = self._reads[k] = self._reads.get(k, 0) + 1
            if hits % cfg.hot_reads == 0 and reps < min(cfg.max_replicas, len(segs)):
                # a copy from the segment read to the next one: its read
                # goes on the source's queue, after the block's own
                seg.free_at += cfg.block_bytes / (cfg.ssd_Bps if on_ssd else cfg.dram_Bps)
                self._replicas[k] = reps + 1
                st.replicas_made += 1
        promote = [k for k in keys if k not in self.dram]
        if promote:
            self.ssd.remove(promote)
            self._into_dram(keys)
        else:
            self.dram.touch(keys)
        return end

    def home(self, key: int) -> int:
        """The segment a block's first replica lives on (a hash of its key:
        chained keys are already hashes, the trace's ids are not)."""
        return (((key * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) >> 32) % self.config.segments

    def replicas(self, key: int) -> int:
        return self._replicas.get(key, 1) if key in self else 0

    def _into_dram(self, keys: Sequence[int]) -> None:
        demoted = self.dram.insert(keys)
        if not demoted:
            return
        st = self.stats
        if self.config.ssd_blocks == 0:
            self._drop(demoted)
            return
        st.demoted += len(demoted)
        # demoted in LRU order, coldest first: touch() would make the first
        # of them the hottest; insert them as a chain whose head is hottest
        self._drop(self.ssd.insert(demoted[::-1]))

    def _drop(self, keys: Sequence[int]) -> None:
        self.stats.dropped += len(keys)
        for k in keys:
            self._replicas.pop(k, None)
            self._reads.pop(k, None)


class StorePoolIndex:
    """The pool's answer for the live conductor: how many of a request's
    blocks, from the first, a running `kvflow.store` holds, from one
    `batch_exists` round trip over the request's chained block keys.

    `client`: anything with `async batch_exists(keys: list[str]) -> list`
    (a `kvflow.store.StoreClient`, or a Mooncake-compatible wrapper's async
    twin); `key_of`: the object key of a block key (the servers' own
    naming: default `"{namespace}{key:016x}"`). An answer that is not a
    plain True (an error object for that key) counts as absent."""

    def __init__(self, client: object, *, namespace: str = "kv/",
                 key_of: Callable[[int], str] | None = None) -> None:
        if not callable(getattr(client, "batch_exists", None)):
            raise TypeError(f"{client!r} has no batch_exists")
        self.client = client
        self.namespace = namespace
        self._key_of = key_of or (lambda k: f"{namespace}{k & 0xFFFFFFFFFFFFFFFF:016x}")
        self.round_trips = 0

    def object_keys(self, keys: Sequence[int]) -> list[str]:
        return [self._key_of(k) for k in keys]

    async def prefix_blocks(self, keys: Sequence[int]) -> int:
        """The length, in blocks, of the prefix of `keys` the store holds.
        Raises what the client's batch_exists raises (the master
        unreachable, a timeout)."""
        if not keys:
            return 0
        self.round_trips += 1
        found = await self.client.batch_exists(self.object_keys(keys))   # type: ignore[attr-defined]
        n = 0
        for ok in found:
            if ok is not True:
                break
            n += 1
        return n


@dataclass
class HeldPrefix:
    """A `PoolView` of one answer from the live store: the conductor routes
    one request against it (`Conductor.route_with_pool`). The live store
    does not say which tier a block is on: all count as DRAM."""

    keys: Sequence[int]
    blocks: int
    _set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self._set = frozenset(self.keys[:self.blocks])

    def match(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._set:
                break
            n += 1
        return n

    def split(self, keys: Sequence[int]) -> tuple[int, int]:
        return len(keys), 0
