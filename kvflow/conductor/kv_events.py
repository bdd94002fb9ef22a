"""What a vLLM instance caches, from its own KV cache events.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT"}'`` publishes, after each
engine step, the blocks its prefix cache stored and removed: ZMQ multipart
messages ``[topic, sequence (8 bytes, big-endian), msgpack(batch)]``, a
batch being ``[ts, [event, ...], dp_rank?]`` and an event a map tagged by
``"type"``:

- ``BlockStored``: ``block_hashes`` (vLLM's own, bytes or int), the
  ``parent_block_hash`` they follow (None: the prompt's start), the
  ``token_ids`` of those blocks, ``block_size``;
- ``BlockRemoved``: ``block_hashes``;
- ``AllBlocksCleared``.

vLLM's hashes cannot be computed outside the instance (they are seeded per
process), so `KVEventLog` keys each stored block the conductor's way
(`chain_keys` from the parent's key and the block's tokens) and remembers
vLLM's hash for it: a router that keys a prompt with `block_keys` then finds
exactly the blocks the instance holds. A block whose parent it never heard
of (events published before it subscribed, or lost: the sequence numbers
show gaps) cannot be keyed and is counted in `unkeyed`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .blocks import chain_keys

__all__ = ["KVEventLog", "KVEventFeed", "EventCounts"]

log = logging.getLogger("kvflow.conductor.kv_events")


@dataclass
class EventCounts:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unkeyed: int = 0        # stored blocks whose parent was never heard of
    gaps: int = 0           # batches missed, by their sequence numbers
    malformed: int = 0      # messages or events that were not what vLLM sends


class KVEventLog:
    """One instance's stored blocks, by vLLM hash, as conductor keys.

    `apply(payload)` takes one published batch and returns (stored keys,
    removed keys, cleared): what the instance's cache gained and lost."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._keys: dict[Any, int] = {}
        self._seq: int | None = None
        self.counts = EventCounts()

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        return list(self._keys.values())

    def sequence(self, seq: int) -> None:
        """Note a batch's sequence number (counts the batches missed)."""
        if self._seq is not None and seq > self._seq + 1:
            self.counts.gaps += seq - self._seq - 1
        self._seq = seq

    def apply(self, payload: bytes) -> tuple[list[int], list[int], bool]:
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = batch[1]
            if not isinstance(events, list):
                raise TypeError("events is not a list")
        except Exception as exc:    # noqa: BLE001 - anything undecodable is counted, not raised
            self.counts.malformed += 1
            log.warning("undecodable KV event batch (%s)", exc)
            return [], [], False
        self.counts.batches += 1
        stored: list[int] = []
        removed: list[int] = []
        cleared = False
        for ev in events:
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "BlockStored":
                stored += self._stored(ev)
            elif kind == "BlockRemoved":
                removed += self._removed(ev.get("block_hashes") or ())
            elif kind == "AllBlocksCleared":
                self._keys.clear()
                stored, removed, cleared = [], [], True
                self.counts.cleared += 1
            else:
                self.counts.malformed += 1
        return stored, removed, cleared

    def _stored(self, ev: dict) -> list[int]:
        hashes = ev.get("block_hashes") or []
        tokens = ev.get("token_ids") or []
        size = ev.get("block_size") or self.block_tokens
        parent = ev.get("parent_block_hash")
        if size != self.block_tokens or len(tokens) != len(hashes) * size:
            # another block size than the router keys prompts with: these
            # blocks can never match a prompt's keys
            self.counts.malformed += 1
            return []
        parent_key = None
        if parent is not None:
            parent_key = self._keys.get(_hashable(parent))
            if parent_key is None:
                self.counts.unkeyed += len(hashes)
                return []
        keys = chain_keys(parent_key, tokens, size)
        for h, k in zip(hashes, keys):
            self._keys[_hashable(h)] = k
        self.counts.stored += len(keys)
        return keys

    def _removed(self, hashes: Sequence[Any]) -> list[int]:
        out = []
        for h in hashes:
            k = self._keys.pop(_hashable(h), None)
            if k is not None:
                out.append(k)
        self.counts.removed += len(out)
        return out


def _hashable(h: Any) -> Any:
    return tuple(h) if isinstance(h, list) else h


class KVEventFeed:
    """Subscribes to one instance's ZMQ publisher and hands each batch's
    change to `on_change(stored, removed, cleared)`, on the running loop."""

    def __init__(self, endpoint: str, block_tokens: int,
                 on_change: Callable[[list[int], list[int], bool], None], topic: str = "") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.log = KVEventLog(block_tokens)
        self._on_change = on_change
        self._task: asyncio.Task | None = None
        self._sock = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._sock.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _run(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) != 3:
                self.log.counts.malformed += 1
                continue
            _, seq, payload = parts
            self.log.sequence(int.from_bytes(seq, "big"))
            stored, removed, cleared = self.log.apply(payload)
            if stored or removed or cleared:
                self._on_change(stored, removed, cleared)
