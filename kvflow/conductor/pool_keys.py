"""How the servers name a prompt's KV pages in the global pool, so that the
router's lookups (`router_pool`) ask the store for the keys the servers put.

A page's name is a chain hash of the prompt's tokens up to the page's end,
computed by the server; the router has the same tokens, so it computes the
same names. Three schemes, as three writers name pages:

- `VllmMooncakeKeys`: vLLM's MooncakeStoreConnector (vLLM 0.32's own, on
  kvflow.compat.mooncake: tests/test_vllm_mooncake_store.py). A block's key
  is ``[CACHE_PREFIX@]MODEL@tp_rank:R@pcp0@dcp0@pp_rank:0@group:0@HASH``
  (its ``PoolKey``, the rank-local layout, the default), ``MODEL`` the last
  component of the server's model path, ``HASH`` vLLM's prefix-cache block
  hash in hex: sha256 of the pickled ``(parent hash, block tokens, None)``,
  the first block's parent sha256 of the pickled NONE_HASH seed
  (``"vllm-none-hash"``, or the servers' PYTHONHASHSEED when set). Exact for
  the default ``--prefix-caching-hash-algo sha256`` and text prompts (no
  LoRA, multimodal inputs or cache_salt: those add extra keys).
- `SGLangHiCacheKeys`: SGLang HiCache on kvflow.store
  (kvflow.compat.sglang.hicache). A page's key is ``KEY_PREFIX + HASH +
  "_" + TAIL``, ``HASH`` SGLang's ``get_hash_str`` chain: sha256 of the
  previous page's digest and the page's tokens as little-endian u32 (u64
  after a 0xff byte when one exceeds 32 bits), in hex; ``TAIL`` the TP
  rank (MHA) or ``mla``.
- `ConductorKeys`: kvflow's own naming, ``NAMESPACE`` and the conductor's
  block key in 16 hex digits (`StorePoolIndex`'s default): for writers
  that name pages by `block_keys`.

A page exists for each rank that wrote it; one rank's key stands for the
page (``tp_rank``): the servers of one deployment write every rank's page
together.
"""
from __future__ import annotations

import hashlib
import pickle
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .blocks import block_keys

__all__ = ["KeyScheme", "VllmMooncakeKeys", "SGLangHiCacheKeys", "ConductorKeys", "SCHEMES", "make_scheme",
           "VLLM_NONE_HASH_SEED"]

#: vLLM's DEFAULT_NONE_HASH_SEED (vllm/v1/core/kv_cache_utils.py), used when
#: the servers run without PYTHONHASHSEED
VLLM_NONE_HASH_SEED = "vllm-none-hash"


class KeyScheme(Protocol):
    name: str

    def object_keys(self, tokens: Sequence[int], block_tokens: int) -> list[str]:
        """The store keys of the full `block_tokens`-token pages of `tokens`,
        in order. ValueError for token ids a server would not take."""
        ...


def _pages(tokens: Sequence[int], block_tokens: int) -> list[Sequence[int]]:
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return [tokens[i:i + block_tokens] for i in range(0, len(tokens) - block_tokens + 1, block_tokens)]


class ChainMemo:
    """A page's digest and its hex by (its parent's digest, its tokens), the
    most recent `capacity` pages: the router computes keys for every
    request, and the requests that matter to it share prefixes (a
    conversation's turns, a system prompt), whose pages it then hashes
    once. A hit costs a dict lookup on a tuple of ints; what it replaces, a
    pickle and a sha256. The keys stay exact: the memo only returns what
    the same (parent, tokens) hashed to. One lock per prompt, not per page
    (the router's lookups may run on several threads)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[tuple, tuple[bytes, str]] = OrderedDict()
        self.lock = threading.Lock()

    def trim(self) -> None:
        """Drops the least recently used pages past `capacity` (under `lock`)."""
        pages = self.pages
        while len(pages) > self.capacity:
            pages.popitem(last=False)


def _vllm_sha256(obj: object) -> bytes:
    # vllm.utils.hashing.sha256: the pickle of the object, highest protocol
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@dataclass(frozen=True)
class VllmMooncakeKeys:
    """vLLM MooncakeStoreConnector's keys (see the module's docstring)."""

    model: str
    cache_prefix: str = ""
    tp_rank: int = 0
    hash_seed: str = VLLM_NONE_HASH_SEED
    name = "vllm"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("vLLM's keys name the model: give its path or name")
        # what vLLM's worker takes of the model path (model_config.model)
        object.__setattr__(self, "model", self.model.rstrip("/").split("/")[-1])

    @property
    def prefix(self) -> str:
        pre = f"{self.cache_prefix}@" if self.cache_prefix else ""
        return f"{pre}{self.model}@tp_rank:{self.tp_rank}@pcp0@dcp0@pp_rank:0@group:0@"

    def object_keys(self, tokens: Sequence[int], block_tokens: int) -> list[str]:
        prefix = self.prefix
        parent = _vllm_sha256(self.hash_seed)
        memo = _MEMOS.get((self.name, self.hash_seed))
        pages = memo.pages
        out = []
        with memo.lock:
            for page in _pages(tokens, block_tokens):
                # ints, as vLLM's token lists hold: a numpy integer pickles otherwise
                ids = tuple(map(int, page))
                hit = pages.get((parent, ids))
                if hit is None:
                    digest = _vllm_sha256((parent, ids, None))
                    hit = pages[(parent, ids)] = (digest, digest.hex())
                else:
                    pages.move_to_end((parent, ids))
                parent = hit[0]
                out.append(prefix + hit[1])
            memo.trim()
        return out


@dataclass(frozen=True)
class SGLangHiCacheKeys:
    """SGLang HiCache's page keys on kvflow.store (see the module's docstring)."""

    key_prefix: str = ""
    tail: str = "0"
    name = "sglang"

    def object_keys(self, tokens: Sequence[int], block_tokens: int) -> list[str]:
        prior = b""
        memo = _MEMOS.get((self.name, ""))
        pages = memo.pages
        out = []
        with memo.lock:
            for page in _pages(tokens, block_tokens):
                ids = tuple(page)
                hit = pages.get((prior, ids))
                if hit is None:
                    digest = hashlib.sha256(prior + _sglang_payload(page)).digest()
                    hit = pages[(prior, ids)] = (digest, digest.hex())
                else:
                    pages.move_to_end((prior, ids))
                prior = hit[0]
                out.append(f"{self.key_prefix}{hit[1]}_{self.tail}")
            memo.trim()
        return out


def _sglang_payload(page: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(page)}I", *page)
    except struct.error:
        # SGLang's wide pages (an id past 32 bits): a tag byte, then u64 ids
        try:
            payload = b"\xff" + struct.pack(f"<{len(page)}q", *page)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in 0..2**63-1 ({exc})") from None
        if any(t < 0 for t in page):
            raise ValueError("token ids must be >= 0")
        return payload


@dataclass(frozen=True)
class ConductorKeys:
    """The conductor's block keys under a namespace (`StorePoolIndex`'s default)."""

    namespace: str = "kv/"
    name = "kvflow"

    def object_keys(self, tokens: Sequence[int], block_tokens: int) -> list[str]:
        return [f"{self.namespace}{k:016x}" for k in block_keys(tokens, block_tokens)]


class _Memos(dict):
    """One ChainMemo per (scheme, seed): a digest depends on both."""

    def get(self, key: tuple) -> ChainMemo:       # type: ignore[override]
        memo = super().get(key)
        if memo is None:
            memo = self.setdefault(key, ChainMemo())
        return memo


_MEMOS = _Memos()

SCHEMES = ("vllm", "sglang", "kvflow")


def make_scheme(kind: str, *, model: str | None = None, key_prefix: str = "", rank: str = "0",
                hash_seed: str | None = None) -> KeyScheme:
    """A scheme by name (`SCHEMES`); `key_prefix` is vLLM's cache_prefix,
    SGLang's key_prefix or kvflow's namespace; `rank` the TP rank whose
    pages stand for the page (SGLang: ``mla`` for an MLA model). ValueError
    for an unknown name, vLLM's without a model or with a rank not a number."""
    if kind == "vllm":
        if not rank.isdigit():
            raise ValueError(f"vLLM's keys take a TP rank number, not {rank!r}")
        return VllmMooncakeKeys(model or "", key_prefix, int(rank), hash_seed or VLLM_NONE_HASH_SEED)
    if kind == "sglang":
        if not (rank.isdigit() or rank == "mla"):
            raise ValueError(f"SGLang's keys take a TP rank number or mla, not {rank!r}")
        return SGLangHiCacheKeys(key_prefix, rank)
    if kind == "kvflow":
        return ConductorKeys(key_prefix or "kv/")
    raise ValueError(f"key scheme {kind!r}: one of {', '.join(SCHEMES)}")
