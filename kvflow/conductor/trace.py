"""The open Mooncake request traces: one JSON object per line with
`timestamp` (ms from the start), `input_length`, `output_length` and
`hash_ids` (one id per 512-token block; equal ids, equal prefixes)."""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

__all__ = ["TraceRequest", "load_trace", "TRACE_BLOCK_TOKENS"]

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    tokens: int
    output_tokens: int
    keys: tuple[int, ...]


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """Read a trace file (plain or .gz), in arrival order. ValueError naming
    the line for a malformed record (missing field, negative length, ids
    that do not fit the length)."""
    out: list[TraceRequest] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                rec = json.loads(line)
                ts, n, o, ids = rec["timestamp"], rec["input_length"], rec["output_length"], rec["hash_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record ({exc})") from None
            if not (isinstance(n, int) and n >= 1 and isinstance(o, int) and o >= 0
                    and isinstance(ts, (int, float)) and ts >= 0 and isinstance(ids, list)):
                raise ValueError(f"{path}:{lineno}: bad timestamp, input_length or output_length")
            if len(ids) > -(-n // TRACE_BLOCK_TOKENS):
                raise ValueError(f"{path}:{lineno}: {len(ids)} hash_ids for {n} tokens")
            out.append(TraceRequest(len(out), ts / 1000.0, n, o, tuple(int(i) for i in ids)))
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out
