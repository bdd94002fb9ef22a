"""Connector messages between prefill and decode managers.

They travel as kvflow notifications (msgpack), so they share the ordering
guarantee of the data path: a "done" sent after the writes completed reaches
the decode side after the bytes have landed, with no extra round trip.

  decode → prefill   meta   room, decode engine address, decode rank, the
                            number of decode ranks this prefill rank serves
                            for the room, decode page indices, aux index,
                            decode pool layout (ptrs, item lengths), the KV
                            heads wanted from this rank and those the decode
                            rank holds ([first, count]; MLA: [0, 0])
                     abort  room, reason
  prefill → decode   done   room, prefill rank, bytes, prefill wall clock at finish ("at")
                     fail   room, prefill rank, reason
                     ack    room, prefill rank (an abort has drained)
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from kvflow.errors import ProtocolError

MAGIC = "kvflow.pd/1"
MAX_PAGES = 1 << 24


def encode(kind: str, room: int, **fields: Any) -> bytes:
    return msgpack.packb({"m": MAGIC, "t": kind, "room": room, **fields}, use_bin_type=True)


def decode(data: bytes) -> dict[str, Any] | None:
    """A connector message, None for a notification that is not one
    (the engine's notifications are shared with other users), or
    ProtocolError for a connector message that is malformed."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(msg, dict) or msg.get("m") != MAGIC:
        return None
    kind = msg.get("t")
    room = msg.get("room")
    if kind not in _CHECKS or not isinstance(room, int) or isinstance(room, bool):
        raise ProtocolError(f"connector message with bad kind/room: {kind!r}/{room!r}")
    for key, typ in _CHECKS[kind].items():
        v = msg.get(key)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ProtocolError(f"connector {kind} message: field {key!r} must be {typ.__name__}")
    if kind == "meta":
        for key in ("kv_ptrs", "kv_item_lens", "aux_ptrs", "aux_item_lens", "heads", "dst_heads"):
            if not all(isinstance(x, int) and x >= 0 for x in msg[key]):
                raise ProtocolError(f"connector meta message: {key} must be non-negative integers")
        if len(msg["kv_ptrs"]) != len(msg["kv_item_lens"]) or \
                len(msg["aux_ptrs"]) != len(msg["aux_item_lens"]):
            raise ProtocolError("connector meta message: pointer and item-length lists differ")
        if len(msg["heads"]) != 2 or len(msg["dst_heads"]) != 2:
            raise ProtocolError("connector meta message: heads and dst_heads are [first, count]")
        if len(msg["pages"]) % 4 or len(msg["pages"]) // 4 > MAX_PAGES:
            raise ProtocolError("connector meta message: bad page list")
    return msg


def pack_pages(pages: np.ndarray) -> bytes:
    return np.ascontiguousarray(pages, dtype="<i4").tobytes()


def unpack_pages(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


_CHECKS: dict[str, dict[str, type]] = {
    "meta": {"addr": str, "rank": int, "expected": int, "pages": bytes, "aux": int,
             "kv_ptrs": list, "kv_item_lens": list, "aux_ptrs": list, "aux_item_lens": list,
             "heads": list, "dst_heads": list, "total_heads": int},
    "abort": {"addr": str, "reason": str},
    "done": {"rank": int, "bytes": int, "at": float},
    "fail": {"rank": int, "reason": str},
    "ack": {"rank": int},
}
