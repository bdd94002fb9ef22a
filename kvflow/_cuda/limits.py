"""What one GPU-initiated (IBGDA) RDMA write may carry: checked where the
kernel's launcher takes it (`kvflow/gpu/ibgda.py`) and where the rdma provider
posts it (`providers/rdma/ibgda.py`). Here, below both, because `_cuda/`
imports nothing of kvflow but `kvflow.errors` (tests/test_layers.py)."""
from __future__ import annotations

from kvflow.errors import InvalidArgumentError

__all__ = ["check_length"]


def check_length(length: object) -> int:
    """`length` if it is a write's length one work request can carry, else
    InvalidArgumentError."""
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length < 1 << 31:
        raise InvalidArgumentError(f"an IBGDA write is 1 byte to 2 GiB - 1, not {length!r}")
    return length
