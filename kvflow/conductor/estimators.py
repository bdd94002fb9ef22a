"""Time estimators the conductor routes by: prefill time from new and cached
tokens, decode step time (TBT) from batch size and context, and KV transfer
time from a link model or a kvflow peer's own `estimate()`.

Each is a small frozen object with one method, so a caller can swap in its
own (anything with the same method) and fit the defaults to its measurements
with `fit()`. The default constants describe a LLaMA-2-70B-class model on
one 8-GPU node, the model the Mooncake paper evaluates with (see
docs/conductor.md for where each number comes from).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "KV_BYTES_PER_TOKEN_70B", "PrefillModel", "DecodeModel", "LinkModel", "PeerTransferModel",
    "TransferModel",
]

#: 2 (K and V) x 80 layers x 8 KV heads x 128 dims x 2 bytes (fp16): the
#: 320 KB per token of LLaMA-2-70B's grouped-query attention.
KV_BYTES_PER_TOKEN_70B = 2 * 80 * 8 * 128 * 2


def _nonneg_lstsq(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a time model with a
    negative per-token cost would reward longer prompts): solve, then drop
    the most negative column and solve again, until none is negative."""
    free = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(rows[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef


# The Mooncake paper's cost model (FAST'25, Eq. 1 and Table 1): a prefill
# of n tokens costs l * (a * n**2 * d + b * n * d**2) FLOPs, on G FLOP/s.
PAPER_LAYERS, PAPER_DIM, PAPER_A, PAPER_B = 80, 8192, 4, 22
PAPER_GPU_FLOPS = 8 * 312e12          # one node of 8 A800s (bf16 dense)
PAPER_H2D_BPS = 128e9                 # DRAM -> HBM, per node
PAPER_NIC_BPS = 800e9 / 8             # four 200 Gb/s NICs per node
PAPER_DRAM_TOKENS = 3_000_000         # about 1 TB of DRAM KV cache per node
#: The model FLOP utilisation the defaults assume (the paper gives none).
DEFAULT_MFU = 0.5


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill `tokens` tokens of which the first `cached` are
    already in the KV cache (loaded from DRAM layer by layer, overlapping
    the compute):

        overhead_s + max(linear_s * (tokens - cached) + attention_s * (tokens**2 - cached**2),
                         load_s_per_token * cached)

    The linear term is every per-token matmul (projections, MLP); the
    quadratic one is attention of the new tokens over all keys, which sums
    to n**2 - p**2 for n tokens with p cached. Defaults: the paper's
    constants (l = 80, d = 8192, a = 4, b = 22, 8 x 312 TFLOPS, 128 GB/s
    host-to-device, 320 KB of KV per token) at `DEFAULT_MFU`."""

    linear_s: float = PAPER_LAYERS * PAPER_B * PAPER_DIM ** 2 / (PAPER_GPU_FLOPS * DEFAULT_MFU)
    attention_s: float = PAPER_LAYERS * PAPER_A * PAPER_DIM / (PAPER_GPU_FLOPS * DEFAULT_MFU)
    overhead_s: float = 0.02
    load_s_per_token: float = KV_BYTES_PER_TOKEN_70B / PAPER_H2D_BPS

    def compute_time(self, tokens: int, cached: int = 0) -> float:
        """The compute part alone (no overhead, no load)."""
        cached = self._clamp(tokens, cached)
        return self.linear_s * (tokens - cached) + self.attention_s * (tokens * tokens - cached * cached)

    def time(self, tokens: int, cached: int = 0) -> float:
        cached = self._clamp(tokens, cached)
        return self.overhead_s + max(self.compute_time(tokens, cached), self.load_s_per_token * cached)

    @staticmethod
    def _clamp(tokens: int, cached: int) -> int:
        # A fully cached prompt still runs its last token to produce the
        # first output token.
        if cached >= tokens:
            return tokens - 1 if tokens > 0 else 0
        return max(0, cached)

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]], load_s_per_token: float = 0.0) -> PrefillModel:
        """Fit overhead, linear and attention terms to measured (tokens,
        cached, seconds); the load term is given (0: loading is never the
        bound). ValueError if fewer than three samples."""
        data = [(float(n), float(min(p, n)), float(s)) for n, p, s in samples]
        if len(data) < 3:
            raise ValueError(f"need at least 3 (tokens, cached, seconds) samples, got {len(data)}")
        rows = np.array([[1.0, n - p, n * n - p * p] for n, p, _ in data])
        y = np.array([s for *_, s in data])
        c, a, b = _nonneg_lstsq(rows, y)
        return cls(linear_s=float(a), attention_s=float(b), overhead_s=float(c),
                   load_s_per_token=load_s_per_token)


@dataclass(frozen=True)
class DecodeModel:
    """Seconds per decode step (TBT) of a continuous batch:

        step_s + per_request_s * batch + per_context_token_s * context_tokens

    A decode step reads every weight once (step_s: 138 GB of fp16 weights
    over 8 x 2.0 TB/s of HBM at 60%, plus launch overhead), does a little
    work per sequence (per_request_s) and reads each sequence's whole KV
    cache (per_context_token_s: 320 KB per token at the same bandwidth).
    `kv_capacity_tokens` is what the KV pool holds: 8 x 80 GB minus the
    weights and activations, over 320 KB per token."""

    step_s: float = 138e9 / (8 * 2.0e12 * 0.6) + 0.004
    per_request_s: float = 1.5e-4
    per_context_token_s: float = KV_BYTES_PER_TOKEN_70B / (8 * 2.0e12 * 0.6)
    kv_capacity_tokens: int = int((8 * 80e9 - 140e9 - 60e9) / KV_BYTES_PER_TOKEN_70B)

    def step_time(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.step_s + self.per_request_s * batch + self.per_context_token_s * context_tokens

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]], kv_capacity_tokens: int | None = None) -> DecodeModel:
        """Fit to measured (batch, context_tokens, seconds per step);
        ValueError if fewer than three samples."""
        data = [(float(b), float(c), float(s)) for b, c, s in samples]
        if len(data) < 3:
            raise ValueError(f"need at least 3 (batch, context_tokens, seconds) samples, got {len(data)}")
        rows = np.array([[1.0, b, c] for b, c, _ in data])
        y = np.array([s for *_, s in data])
        s0, per_req, per_tok = _nonneg_lstsq(rows, y)
        cap = cls.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        return cls(step_s=float(s0), per_request_s=float(per_req), per_context_token_s=float(per_tok),
                   kv_capacity_tokens=int(cap))


class TransferModel(Protocol):
    """Seconds to move `nbytes` over an idle link."""

    def time(self, nbytes: int) -> float: ...


@dataclass(frozen=True)
class LinkModel:
    """A link of `bandwidth_Bps` bytes per second with `latency_s` per
    transfer. Default: the paper's 4 x 200 Gb/s RDMA NICs per node at 90%
    goodput."""

    bandwidth_Bps: float = PAPER_NIC_BPS * 0.9
    latency_s: float = 5e-4

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps must be a positive number, got {self.bandwidth_Bps}")

    def time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps if nbytes > 0 else 0.0


class PeerTransferModel:
    """Transfer time toward a live kvflow peer, from its provider's own
    estimate (`kvflow.Peer.estimate`), split into `entries` of
    `entry_bytes` the way a KV layout sends pages."""

    def __init__(self, estimate: Callable[..., float], entry_bytes: int = 64 * 1024) -> None:
        self._estimate = estimate
        self._entry = max(1, entry_bytes)

    def time(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return float(self._estimate(nbytes, max(1, -(-nbytes // self._entry))))
