"""The conductor's vocabulary: instances, requests, and what `route` answers."""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from .blocks import DEFAULT_BLOCK_TOKENS, block_keys

__all__ = [
    "Role", "RejectionMode", "RejectReason", "InstanceSpec", "Request", "Decision", "Rejected",
]


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class RejectionMode(enum.Enum):
    """When the conductor turns requests away under overload (Mooncake's
    three variants, and none).

    NONE: never; a request waits for decode memory instead.
    BASELINE: at the decode instance, when the prefilled request would push
      its TBT past the SLO (the prefill is then wasted); and before prefill
      when the estimated TTFT misses its SLO.
    EARLY: BASELINE, and before prefill when the chosen decode instance is
      already too loaded now.
    PREDICTIVE: BASELINE, and before prefill when the decode instance is
      predicted to be too loaded at the time the prefill will end (requests
      decoding now that will still be there, and requests prefilling now
      that will have arrived)."""

    NONE = "none"
    BASELINE = "baseline"
    EARLY = "early"
    PREDICTIVE = "predictive"


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"                       # estimated TTFT above the SLO
    DECODE_LOAD = "decode_load"                 # decode TBT would break the SLO now
    PREDICTED_DECODE_LOAD = "predicted_decode_load"
    DECODE_FULL = "decode_full"                 # at the decode instance (BASELINE)
    PREFILL_COST = "prefill_cost"               # among the dearest prefills under load (admission.py)
    NO_INSTANCE = "no_instance"                 # no prefill or no decode instance registered


@dataclass(frozen=True)
class InstanceSpec:
    """One serving instance the conductor routes to.

    `cache_blocks`: a prefill instance's prefix cache capacity, in blocks
    (None: unbounded); `kv_capacity_tokens`: a decode instance's KV pool
    (None: the decode model's default). `address` is free-form (a URL, a
    kvflow engine address) and only carried for the caller."""

    name: str
    role: Role
    cache_blocks: int | None = None
    kv_capacity_tokens: int | None = None
    address: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an instance needs a name")
        if not isinstance(self.role, Role):
            raise TypeError(f"role must be a Role, got {self.role!r}")
        for f in ("cache_blocks", "kv_capacity_tokens"):
            v = getattr(self, f)
            if v is not None and v < 0:
                raise ValueError(f"{f} must be >= 0 or None, got {v}")


@dataclass(frozen=True)
class Request:
    """A prompt of `tokens` tokens whose prefix blocks are `keys` (chained,
    `blocks.block_keys`), expecting about `output_tokens` output tokens
    (0: unknown; the simulator uses the trace's lengths as the truth)."""

    id: str
    tokens: int
    keys: tuple[int, ...]
    output_tokens: int = 0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"request {self.id!r}: a prompt needs at least one token")
        if self.block_tokens < 1:
            raise ValueError(f"request {self.id!r}: block_tokens must be >= 1")
        if len(self.keys) > -(-self.tokens // self.block_tokens):
            raise ValueError(f"request {self.id!r}: {len(self.keys)} block keys for {self.tokens} tokens"
                             f" of {self.block_tokens} per block")
        if self.output_tokens < 0:
            raise ValueError(f"request {self.id!r}: output_tokens must be >= 0")

    @classmethod
    def from_tokens(cls, id: str, tokens: Sequence[int], output_tokens: int = 0,
                    block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Request:
        return cls(id, len(tokens), tuple(block_keys(tokens, block_tokens)), output_tokens, block_tokens)

    def cached_tokens(self, blocks: int) -> int:
        """Tokens covered by the first `blocks` blocks."""
        return min(blocks * self.block_tokens, self.tokens)


@dataclass(frozen=True)
class Decision:
    """Where a request goes. The prefill instance first fetches
    `blocks_to_move` (the request's blocks `cached_blocks` ..
    `cached_blocks + len(blocks_to_move)`) from `prefix_source`, which
    leaves a replica there, then computes the rest; its KV then goes to
    `decode`. Estimates are the conductor's, in seconds from `route`.
    `est_source_wait_s`: how long until the source holds every block to
    move (0: it holds them now; more: requests queued there are computing
    some of them, and the fetch starts once they are done).
    `pool_blocks`: blocks the prefill instance fetches from the global
    KVCache pool instead (the request's blocks `cached_blocks` ..
    `cached_blocks + len(pool_blocks)`; never with a move), landing in
    about `est_pool_s`."""

    request_id: str
    prefill: str
    decode: str
    prefix_source: str | None
    blocks_to_move: tuple[int, ...]
    cached_blocks: int
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    est_source_wait_s: float = 0.0
    pool_blocks: tuple[int, ...] = ()
    est_pool_s: float = 0.0

    @property
    def prefix_blocks(self) -> int:
        """Blocks the prefill will not compute: cached there, moved in, or
        fetched from the pool."""
        return self.cached_blocks + len(self.blocks_to_move) + len(self.pool_blocks)


@dataclass(frozen=True)
class Rejected:
    """A request turned away; `http_status` is what a router answers
    (429 Too Many Requests, or 503 when there is nothing to route to)."""

    request_id: str
    reason: RejectReason
    detail: str = ""
    decode: str | None = field(default=None)

    @property
    def http_status(self) -> int:
        return 503 if self.reason is RejectReason.NO_INSTANCE else 429
