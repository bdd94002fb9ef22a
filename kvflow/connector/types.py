"""The connector's value types, shaped like SGLang's disaggregation
interfaces (sglang/srt/disaggregation/base/conn.py): KVArgs, KVPoll,
DisaggregationMode, KVTransferMetric, and the connector's error."""
from __future__ import annotations

import dataclasses
import enum

from kvflow.errors import KVFlowError


class KVPoll(enum.IntEnum):
    """Request state, with SGLang's values (Failed=0 ... Success=4)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(KVFlowError):
    """A request's transfer failed: aborted by either side, timed out, or
    its peer was lost. `room` is the bootstrap room; `reason` says why."""

    def __init__(self, room: int, reason: str, *, peer: str | None = None) -> None:
        super().__init__(f"KV transfer of room {room} failed: {reason}", peer=peer)
        self.room = room
        self.reason = reason


@dataclasses.dataclass
class KVArgs:
    """One rank's KV pool layout, as SGLang's KVArgs describes it.

    kv_data_ptrs / kv_data_lens / kv_item_lens: one entry per KV buffer.
    MHA: [K of layer 0..L-1, V of layer 0..L-1]; MLA: one buffer per layer.
    kv_item_lens is the byte size of one page in that buffer, so page p of
    buffer b lives at kv_data_ptrs[b] + p * kv_item_lens[b].
    aux_*: the same for the aux buffers (one item per request slot).
    kv_head_num: KV heads held by this rank; total_kv_head_num: the model's.
    """
    engine_rank: int = 0
    kv_data_ptrs: list[int] = dataclasses.field(default_factory=list)
    kv_data_lens: list[int] = dataclasses.field(default_factory=list)
    kv_item_lens: list[int] = dataclasses.field(default_factory=list)
    aux_data_ptrs: list[int] = dataclasses.field(default_factory=list)
    aux_data_lens: list[int] = dataclasses.field(default_factory=list)
    aux_item_lens: list[int] = dataclasses.field(default_factory=list)
    page_size: int = 1
    kv_head_num: int = 1
    total_kv_head_num: int = 1
    tp_size: int = 1
    dp_rank: int = 0
    ib_device: str = ""
    gpu_id: int = 0
    kv_layout: str = "nhd"

    def validate(self, mla: bool) -> None:
        n = len(self.kv_data_ptrs)
        if not n or len(self.kv_data_lens) != n or len(self.kv_item_lens) != n:
            raise KVFlowError("KVArgs: kv_data_ptrs, kv_data_lens and kv_item_lens must be "
                              "non-empty and of equal length")
        if not mla and n % 2:
            raise KVFlowError(f"KVArgs: an MHA pool has K and V buffers per layer; got {n} buffers")
        if len(self.aux_data_lens) != len(self.aux_data_ptrs) or \
                len(self.aux_item_lens) != len(self.aux_data_ptrs):
            raise KVFlowError("KVArgs: aux_data_ptrs, aux_data_lens and aux_item_lens differ in length")
        if any(i <= 0 for i in self.kv_item_lens) or any(i <= 0 for i in self.aux_item_lens):
            raise KVFlowError("KVArgs: item lengths must be positive")
        if not 0 <= self.engine_rank < self.tp_size:
            raise KVFlowError(f"KVArgs: engine_rank {self.engine_rank} is outside tp_size {self.tp_size}")
        if self.page_size < 1 or self.kv_head_num < 1 or self.total_kv_head_num < 1:
            raise KVFlowError("KVArgs: page_size and head counts must be positive")
        if not mla:
            from kvflow.connector.layout import rank_heads
            held = rank_heads(self.engine_rank, self.tp_size, self.total_kv_head_num)[1]
            if held != self.kv_head_num:
                raise KVFlowError(f"KVArgs: TP rank {self.engine_rank}/{self.tp_size} holds {held} of "
                                  f"{self.total_kv_head_num} KV heads, kv_head_num says {self.kv_head_num}")

    @property
    def num_pages(self) -> int:
        return min(ln // item for ln, item in zip(self.kv_data_lens, self.kv_item_lens))


@dataclasses.dataclass
class KVTransferMetric:
    """What one request's transfer cost (SGLang's KVTransferMetric, plus
    kvflow's finer fields). Times in seconds; None where not measured."""
    transfer_latency_s: float | None = None
    transfer_total_bytes: int | None = None
    batches: int = 0       # kvflow batches posted (prefill side)
    entries: int = 0       # (address, length) entries in them: one per run of pages per buffer
    exposed_s: float | None = None   # decode side: prefill's finish() → decode knows all landed
