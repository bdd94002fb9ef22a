"""Prefix blocks: a prompt cut into fixed-size token blocks, each named by a
chained hash, so that two prompts share block k's key exactly when they share
every token up to the end of block k.

The chain (each key hashes the previous key with the block's tokens) is what
lets a cache index match prefixes with one dict lookup per block and no tree:
equal keys at position k imply equal prefixes, as in vLLM's and SGLang's
block hashing. Only full blocks get keys: a partial last block would name a
prefix that the next turn of the conversation extends, so nothing could reuse
it. The open Mooncake traces already carry such keys (`hash_ids`, one per
512-token block, the last one partial); `Request.from_trace` takes them as
they are.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["block_keys", "chain_keys", "DEFAULT_BLOCK_TOKENS"]

DEFAULT_BLOCK_TOKENS = 512

_SEED = b"kvflow.conductor.v1"


def block_keys(tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[int]:
    """Chained 64-bit keys of the full `block_tokens`-token blocks of `tokens`.

    Raises ValueError for a block size below 1 or a token id outside
    0..2**32-1 (what a tokenizer gives)."""
    return chain_keys(None, tokens, block_tokens)


def chain_keys(parent: int | None, tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[int]:
    """The keys of the full blocks of `tokens` that follow the block keyed
    `parent` (None: the prompt's start), so that chaining the keys of a
    prompt's blocks piece by piece gives `block_keys` of the whole: how a
    server's "these blocks, after that one" events are keyed."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    keys: list[int] = []
    prev = _SEED if parent is None else int(parent).to_bytes(8, "little")
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start:start + block_tokens]
        try:
            payload = struct.pack(f"<{block_tokens}I", *block)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in 0..2**32-1 ({exc})") from None
        digest = hashlib.blake2b(prev + payload, digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little"))
        prev = digest
    return keys
