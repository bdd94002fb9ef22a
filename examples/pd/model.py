"""A small decoder-only transformer with a paged KV pool: the model half of the PD example.

The point of this file is the KV pool, laid out the way an inference server keeps
it, because kvflow copies pages of it from a prefill process into a decode process:

* per layer one K tensor and one V tensor, each ``[num_pages, page_size,
  num_kv_heads, head_dim]`` (NHD), contiguous and allocated once, so one page of
  one layer is one contiguous run of ``page_bytes`` bytes at
  ``data_ptr() + page * page_bytes``: a transfer names a page by its index;
* token ``t`` of a request lives in page ``pages[t // page_size]``, slot
  ``t % page_size``; the pages of a request need not be consecutive nor ordered;
* K is stored after the rotary embedding, so a page is position-bound and can be
  copied as bytes into any page of another pool with the same shape;
* an ``aux`` tensor ``[max_slots, 8]`` int64 carries, per request slot, what decode
  needs besides K/V: the first generated token and the prompt length.

The model (Llama-style: RMSNorm, rotary embeddings, grouped-query attention, SiLU
gated MLP) has random weights from a fixed seed: it generates nonsense, but
deterministic nonsense that depends on every cached K/V, which is what a test of a
KV transfer needs. CPU, float32; torch is imported here, never by ``import kvflow``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "AUX_COLUMNS", "AUX_FIRST_TOKEN", "AUX_PROMPT_LEN", "AuxRecord", "KVPool", "Model", "ModelConfig",
    "OutOfPagesError", "OutOfSlotsError", "encode",
]

# Columns of KVPool.aux (one int64 row per request slot; the rest are spare).
AUX_FIRST_TOKEN = 0
AUX_PROMPT_LEN = 1
AUX_COLUMNS = 8


class OutOfPagesError(RuntimeError):
    """KVPool.alloc was asked for more pages than are free."""


class OutOfSlotsError(RuntimeError):
    """KVPool.alloc_slot found every aux slot taken."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model, and so of the KV pool.

    The defaults are sized for 2 CPU cores: prefill of a 4,096-token prompt costs
    about 90 ms per layer there (float32, two threads, mostly causal attention:
    its cost grows with num_heads * head_dim * tokens**2). hidden_size=256,
    num_heads=8, num_kv_heads=4, intermediate_size=768 doubles the KV bytes per
    token and costs about 250 ms per layer.
    """
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4            # query heads
    num_kv_heads: int = 2         # grouped-query attention: num_heads // num_kv_heads queries share a K/V head
    head_dim: int = 32
    intermediate_size: int = 384  # SiLU-gated MLP width
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for the rotary embedding, got {self.head_dim}")


class AuxRecord(NamedTuple):
    first_token: int
    prompt_len: int


def encode(text: str, vocab_size: int = 512) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes modulo ``vocab_size`` (no real tokenizer needed)."""
    return [b % vocab_size for b in text.encode("utf-8")]


def _as_page_tensor(pages: np.ndarray | Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.as_tensor(np.asarray(pages, dtype=np.int64).reshape(-1), device=device)


class KVPool:
    """Paged K/V storage for every layer, a page allocator and per-request aux rows.

    ``k[layer]`` and ``v[layer]`` are ``[num_pages, page_size, num_kv_heads,
    head_dim]`` float32 tensors; ``buffers()`` lists them for registration with a
    transfer engine and ``aux`` is one more (small) tensor to register.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, *, max_slots: int = 16,
                 device: torch.device | str = "cpu") -> None:
        if num_pages <= 0 or page_size <= 0 or max_slots <= 0:
            raise ValueError(f"num_pages, page_size and max_slots must be positive, "
                             f"got {num_pages}, {page_size}, {max_slots}")
        self.config = config
        self.device = torch.device(device)
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        # Zeroed, not torch.empty: a page that was never written reads as zeros,
        # so a transfer that missed a page shows up as different tokens rather
        # than as whatever the allocator left there.
        # K/V on `device` (a GPU's KV pool, as a real server's); aux rows in host memory
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=torch.float32, device=self.device)
                                      for _ in range(config.num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=torch.float32, device=self.device)
                                      for _ in range(config.num_layers)]
        self.aux = torch.zeros((max_slots, AUX_COLUMNS), dtype=torch.int64)
        # Free lists as stacks, reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._page_used = np.zeros(num_pages, dtype=bool)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._slot_used = np.zeros(max_slots, dtype=bool)

    # -- layout ----------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (the same for V)."""
        return self.page_size * self.config.num_kv_heads * self.config.head_dim * self.k[0].element_size()

    @property
    def aux_row_bytes(self) -> int:
        return AUX_COLUMNS * self.aux.element_size()

    @property
    def max_slots(self) -> int:
        return self.aux.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of all K/V buffers (aux not included)."""
        return 2 * self.config.num_layers * self.num_pages * self.page_bytes

    def buffers(self) -> list[torch.Tensor]:
        """The 2*L K/V tensors in registration order: ``[K0 .. K(L-1), V0 .. V(L-1)]``."""
        return [*self.k, *self.v]

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    # -- page allocator ----------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_pages)

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages; returns their indices (int32, not necessarily consecutive).

        Raises OutOfPagesError when fewer than ``n`` are free (nothing is taken then),
        ValueError when ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free_pages):
            raise OutOfPagesError(f"need {n} pages, only {len(self._free_pages)} of {self.num_pages} are free")
        taken = [self._free_pages.pop() for _ in range(n)]
        self._page_used[taken] = True
        return np.array(taken, dtype=np.int32)

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Give pages back. Raises ValueError for an index out of range or a page that is not allocated
        (nothing is freed then)."""
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.num_pages:
            raise ValueError(f"page index out of range [0, {self.num_pages}): {idx.tolist()}")
        if len(np.unique(idx)) != idx.size or not self._page_used[idx].all():
            raise ValueError(f"freeing pages that are not allocated (or twice): {idx.tolist()}")
        self._page_used[idx] = False
        self._free_pages.extend(int(p) for p in idx[::-1])

    # -- aux slots ---------------------------------------------------------------

    def alloc_slot(self) -> int:
        """Take a free aux row (its contents zeroed). Raises OutOfSlotsError when none is free."""
        if not self._free_slots:
            raise OutOfSlotsError(f"all {self.max_slots} aux slots are in use")
        slot = self._free_slots.pop()
        self._slot_used[slot] = True
        self.aux[slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        """Give an aux row back. Raises ValueError if it is out of range or not allocated."""
        if not 0 <= slot < self.max_slots or not self._slot_used[slot]:
            raise ValueError(f"aux slot {slot} is not allocated")
        self._slot_used[slot] = False
        self._free_slots.append(slot)

    def set_aux(self, slot: int, *, first_token: int, prompt_len: int) -> None:
        """Record what decode needs besides K/V in aux row ``slot``."""
        self.aux[slot, AUX_FIRST_TOKEN] = first_token
        self.aux[slot, AUX_PROMPT_LEN] = prompt_len

    def get_aux(self, slot: int) -> AuxRecord:
        """Read aux row ``slot`` back (on the decode side: after it was transferred)."""
        row = self.aux[slot].tolist()
        return AuxRecord(first_token=row[AUX_FIRST_TOKEN], prompt_len=row[AUX_PROMPT_LEN])

    # -- token slots ---------------------------------------------------------------

    def page_table(self, pages: np.ndarray | Sequence[int], num_tokens: int) -> torch.Tensor:
        """The first ``pages_for(num_tokens)`` of ``pages`` as an int64 tensor.

        Raises ValueError if ``pages`` cannot hold ``num_tokens`` positions or name a page
        outside the pool.
        """
        page_t = _as_page_tensor(pages, self.device)
        need = self.pages_for(num_tokens)
        if need > page_t.numel():
            raise ValueError(f"{num_tokens} positions need {need} pages of {self.page_size}, got {page_t.numel()}")
        page_t = page_t[:need]
        if need and (int(page_t.min()) < 0 or int(page_t.max()) >= self.num_pages):
            raise ValueError(f"page index out of range [0, {self.num_pages}): {page_t.tolist()}")
        return page_t

    def token_slots(self, pages: np.ndarray | Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Row indices, in a layer's K/V viewed as ``[num_pages * page_size, H * D]``, of
        positions ``[start, stop)`` of a request that owns ``pages``. Raises as page_table."""
        page_t = self.page_table(pages, stop)
        pos = torch.arange(start, stop, dtype=torch.int64, device=self.device)
        return page_t[pos // self.page_size] * self.page_size + pos % self.page_size

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``k[layer]`` or ``v[layer]`` viewed as ``[num_pages * page_size, H * D]``: one row per
        token slot, the row index being what token_slots returns."""
        return tensor.view(self.num_pages * self.page_size, -1)

    def __repr__(self) -> str:
        c = self.config
        return (f"<KVPool {c.num_layers} layers x {self.num_pages} pages x {self.page_size} tokens "
                f"(page {self.page_bytes} B, {self.nbytes / 2**20:.1f} MiB K+V), "
                f"{self.num_free} free, {self.max_slots} aux slots>")


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor   # [hidden]
    wqkv: torch.Tensor        # [(Hq + 2 Hkv) * D, hidden], q, k, v projections fused into one matmul
    wo: torch.Tensor          # [hidden, Hq * D]
    mlp_norm: torch.Tensor    # [hidden]
    w_gate_up: torch.Tensor   # [2 * intermediate, hidden], gate and up fused
    w_down: torch.Tensor      # [hidden, intermediate]


class Model:
    """The transformer; every method runs under ``torch.inference_mode`` and is deterministic."""

    def __init__(self, config: ModelConfig | None = None, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.config = c = config or ModelConfig()
        self.seed = seed
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)

        def init(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            # std 1/sqrt(fan_in) keeps activations O(1) through the layers, so that an
            # untrained model's logits still depend sharply on the context (with the
            # usual std 0.02 they flatten out and greedy decoding repeats one token).
            std = 1.0 / math.sqrt(fan_in if fan_in is not None else shape[-1])
            return torch.randn(shape, generator=gen, dtype=torch.float32) * std

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = init(c.vocab_size, c.hidden_size, fan_in=1)
        self.layers = [
            _LayerWeights(
                attn_norm=torch.ones(c.hidden_size),
                wqkv=init(q_dim + 2 * kv_dim, c.hidden_size),
                wo=init(c.hidden_size, q_dim),
                mlp_norm=torch.ones(c.hidden_size),
                w_gate_up=init(2 * c.intermediate_size, c.hidden_size),
                w_down=init(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = torch.ones(c.hidden_size)
        self.lm_head = init(c.vocab_size, c.hidden_size)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        if self.device.type != "cpu":       # the same weights (drawn on the CPU), on the device
            move = lambda t: t.to(self.device)      # noqa: E731
            self.embed, self.final_norm, self.lm_head, self.inv_freq = map(
                move, (self.embed, self.final_norm, self.lm_head, self.inv_freq))
            self.layers = [_LayerWeights(*(move(getattr(w, f)) for f in _LayerWeights.__dataclass_fields__))
                           for w in self.layers]

    def __repr__(self) -> str:
        c = self.config
        return (f"<Model {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}q/{c.num_kv_heads}kv heads "
                f"x {c.head_dim}, vocab {c.vocab_size}, seed {self.seed}>")

    # -- building blocks ---------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)       # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                     # [T, 1, D]
        return emb.cos(), emb.sin()

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _qkv(self, w: _LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] for hidden states h [T, hidden]; q and k rotated."""
        c = self.config
        x = F.rms_norm(h, (c.hidden_size,), w.attn_norm, c.rms_eps)
        T, hq, hkv = h.shape[0], c.num_heads, c.num_kv_heads
        qkv = F.linear(x, w.wqkv).view(T, hq + 2 * hkv, c.head_dim)
        # q and k rotated together: one pass over both instead of two.
        qk = self._apply_rope(qkv[:, :hq + hkv], cos, sin)
        return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over k, v [S, Hkv, D] (causal, or under a boolean
        [T, S] mask of the keys each query sees); returns [T, Hq * D]."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, enable_gqa=True)                  # [1, Hq, T, D]
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _finish_layer(self, w: _LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = h + F.linear(attn, w.wo)
        x = F.rms_norm(h, (c.hidden_size,), w.mlp_norm, c.rms_eps)
        gate, up = F.linear(x, w.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w.w_down)

    def _next_token(self, h_last: torch.Tensor) -> int:
        c = self.config
        x = F.rms_norm(h_last, (c.hidden_size,), self.final_norm, c.rms_eps)
        return int(torch.argmax(F.linear(x, self.lm_head)))

    def _check_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        if len(tokens) == 0:
            raise ValueError("empty prompt")
        t = torch.as_tensor(list(tokens), dtype=torch.int64, device=self.device)
        if int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return t

    def _check_pool(self, pool: KVPool) -> None:
        if pool.config != self.config:
            raise ValueError("the KV pool was made for a different ModelConfig")
        if pool.device != self.device:
            raise ValueError(f"the KV pool is on {pool.device}, the model on {self.device}")

    # -- paged inference -----------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], pool: KVPool, pages: np.ndarray | Sequence[int],
                on_layer: Callable[[int], None] | None = None, *, cached: int = 0) -> int:
        """Run the prompt in one forward pass, writing its K/V into ``pool``; returns the first
        generated token (greedy).

        Token ``t``'s K/V go to page ``pages[t // page_size]``, slot ``t % page_size``, in
        every layer. With ``cached`` > 0 the K/V of positions ``[0, cached)`` are already in
        those pages (a prefix cache hit, or pages copied from another server): only positions
        ``[cached, len(tokens))`` are computed, attending over the cached keys read back from
        the pool. ``on_layer(i)`` is called as soon as layer ``i``'s K/V are in the pool,
        before the rest of layer ``i`` (attention, MLP) and before layer ``i + 1``: the hook
        through which sending layer ``i`` overlaps the computation that follows. Exceptions
        from ``on_layer`` propagate (the pool then holds the layers written so far).

        Raises ValueError for an empty prompt, token ids outside the vocabulary, pages that
        cannot hold the prompt or lie outside the pool, a pool of another config, or
        ``cached`` outside ``[0, len(tokens))`` (the last token is always computed: it gives
        the first output token).
        """
        t = self._check_tokens(tokens)
        self._check_pool(pool)
        n = t.numel()
        if not 0 <= cached < n:
            raise ValueError(f"cached must be in [0, {n}) for a {n}-token prompt, got {cached}")
        slots = pool.token_slots(pages, cached, n)
        cos, sin = self._rope(torch.arange(cached, n, device=self.device))
        h = self.embed[t[cached:]]
        c = self.config
        if cached:
            page_t = pool.page_table(pages, n)
            # query i (position cached + i) sees keys 0 .. cached + i
            mask = torch.arange(n, device=self.device)[None, :] <= torch.arange(cached, n, device=self.device)[:, None]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, h, cos, sin)
            # Write this layer's K/V first, announce them, then finish the layer: K/V are
            # final once projected and rotated, so the sender can start on layer i while
            # its attention and MLP still run, not only during layer i + 1.
            pool.rows(pool.k[i]).index_copy_(0, slots, k.reshape(k.shape[0], -1))
            pool.rows(pool.v[i]).index_copy_(0, slots, v.reshape(v.shape[0], -1))
            if on_layer is not None:
                on_layer(i)
            if cached:
                k_all = pool.k[i].index_select(0, page_t).view(-1, c.num_kv_heads, c.head_dim)[:n]
                v_all = pool.v[i].index_select(0, page_t).view(-1, c.num_kv_heads, c.head_dim)[:n]
                attn = self._attend(q, k_all, v_all, causal=False, mask=mask)
            else:
                attn = self._attend(q, k, v, causal=True)
            h = self._finish_layer(w, h, attn)
        return self._next_token(h[-1])

    @torch.inference_mode()
    def decode_step(self, token: int, position: int, pool: KVPool, pages: np.ndarray | Sequence[int]) -> int:
        """One decoding step: ``token`` at ``position`` attends to positions ``[0, position]``,
        whose K/V it reads from ``pool`` only (positions ``< position`` must already be there,
        from prefill or from a transfer); its own K/V are written at ``position``. Returns the
        greedy next token.

        Raises ValueError for a bad token or position, or pages that cannot hold ``position + 1``
        positions.
        """
        if position < 0:
            raise ValueError(f"negative position {position}")
        t = self._check_tokens([token])
        self._check_pool(pool)
        page_t = pool.page_table(pages, position + 1)
        own = int(page_t[position // pool.page_size]) * pool.page_size + position % pool.page_size
        cos, sin = self._rope(torch.tensor([position], device=self.device))
        h = self.embed[t]
        c = self.config
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, h, cos, sin)
            # Store our own K/V first and then gather positions [0, position] back by
            # page table (whole pages, then trim), so that everything attention sees
            # went through the pool.
            pool.rows(pool.k[i])[own] = k.reshape(-1)
            pool.rows(pool.v[i])[own] = v.reshape(-1)
            k_all = pool.k[i].index_select(0, page_t).view(-1, c.num_kv_heads, c.head_dim)[:position + 1]
            v_all = pool.v[i].index_select(0, page_t).view(-1, c.num_kv_heads, c.head_dim)[:position + 1]
            h = self._finish_layer(w, h, self._attend(q, k_all, v_all, causal=False))
        return self._next_token(h[-1])

    def decode(self, first_token: int, prompt_len: int, num_tokens: int, pool: KVPool,
               pages: np.ndarray | Sequence[int]) -> list[int]:
        """Continue a request whose prompt K/V are in ``pool``: feed ``first_token`` at position
        ``prompt_len`` and so on, returning the ``num_tokens`` tokens generated after it.
        Raises as decode_step."""
        out: list[int] = []
        token = first_token
        for step in range(num_tokens):
            token = self.decode_step(token, prompt_len + step, pool, pages)
            out.append(token)
        return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, pool: KVPool,
                 pages: np.ndarray | Sequence[int]) -> list[int]:
        """Prefill then decode in one pool (the single-process reference for PD); returns
        ``max_new_tokens`` tokens, the first from prefill. ``pages`` must hold
        ``len(prompt) + max_new_tokens - 1`` positions. Raises as prefill and decode_step."""
        if max_new_tokens <= 0:
            return []
        first = self.prefill(prompt, pool, pages)
        return [first, *self.decode(first, len(prompt), max_new_tokens - 1, pool, pages)]

    # -- non-paged reference ---------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int]) -> int:
        """Greedy next token after ``tokens``, computed from scratch (no cache at all)."""
        t = self._check_tokens(tokens)
        cos, sin = self._rope(torch.arange(t.numel(), device=self.device))
        h = self.embed[t]
        for w in self.layers:
            q, k, v = self._qkv(w, h, cos, sin)
            h = self._finish_layer(w, h, self._attend(q, k, v, causal=True))
        return self._next_token(h[-1])

    def reference_generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy generation recomputing the whole sequence at every step: what the paged
        path must reproduce."""
        seq = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(self.forward(seq))
            seq.append(out[-1])
        return out
