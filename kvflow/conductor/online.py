"""The conductor's time models fitted online to what the servers took.

A live router measures each prefill (tokens, of them cached, seconds) and
each decode (batch it joined, context tokens, seconds per output token) and
refits the models over a sliding window of recent samples, so that the
conductor's estimates follow the servers it routes to rather than the
defaults (a 70B model on GPUs). A prefill sample is only taken when the
router had nothing else in flight on any instance, as the seconds are then
the instance's compute and not its queue (which the conductor models
itself) nor a neighbour's compute on the same cores. Calibration samples
(`prior=True`, taken one at a time on an idle cluster) stay in every fit;
the others slide.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .estimators import DecodeModel, PrefillModel

__all__ = ["OnlineFit"]

MIN_SAMPLES = 4


@dataclass
class OnlineFit:
    """Sliding windows of samples and the models last fitted to them."""

    prefill: PrefillModel
    decode: DecodeModel
    window: int = 256
    refits: int = 0
    prefill_samples: deque = field(init=False)
    decode_samples: deque = field(init=False)
    prefill_prior: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.prefill_samples = deque(maxlen=self.window)
        self.decode_samples = deque(maxlen=self.window)

    def add_prefill(self, tokens: int, cached: int, seconds: float, prior: bool = False) -> PrefillModel:
        """One prefill measured alone; returns the model now in force."""
        if tokens > 0 and seconds > 0:
            sample = (int(tokens), int(min(cached, tokens)), float(seconds))
            (self.prefill_prior.append if prior else self.prefill_samples.append)(sample)
            samples = [*self.prefill_prior, *self.prefill_samples]
            # Three unknowns: refit once the samples span more than one size.
            sizes = {n - p for n, p, _ in samples}
            if len(samples) >= MIN_SAMPLES and len(sizes) >= 3:
                fitted = PrefillModel.fit(samples, self.prefill.load_s_per_token)
                if _finite(fitted.linear_s, fitted.attention_s, fitted.overhead_s):
                    self.prefill = fitted
                    self.refits += 1
        return self.prefill

    def add_decode(self, batch: int, context_tokens: int, seconds_per_token: float) -> DecodeModel:
        """One decode: the batch it joined, its context, seconds per output token."""
        if batch > 0 and seconds_per_token > 0:
            self.decode_samples.append((int(batch), int(context_tokens), float(seconds_per_token)))
            if len(self.decode_samples) >= MIN_SAMPLES:
                fitted = DecodeModel.fit(self.decode_samples, self.decode.kv_capacity_tokens)
                if _finite(fitted.step_s, fitted.per_request_s, fitted.per_context_token_s):
                    self.decode = fitted
                    self.refits += 1
        return self.decode

    def describe(self) -> dict:
        p, d = self.prefill, self.decode
        return {"prefill": {"overhead_s": p.overhead_s, "linear_s": p.linear_s, "attention_s": p.attention_s,
                            "samples": len(self.prefill_samples), "prior": len(self.prefill_prior)},
                "decode": {"step_s": d.step_s, "per_request_s": d.per_request_s,
                           "per_context_token_s": d.per_context_token_s, "samples": len(self.decode_samples)},
                "refits": self.refits}


def _finite(*xs: float) -> bool:
    return bool(np.all(np.isfinite(xs)))
