"""KVCache-centric scheduling (Mooncake's conductor) and a trace replay to
measure it against the routers in use.

Live use: register instances, then `route()` each request and report what
happened with the `on_*` methods:

    from kvflow.conductor import Conductor, InstanceSpec, Request, Role
    c = Conductor()
    c.register(InstanceSpec("p0", Role.PREFILL, cache_blocks=4096))
    c.register(InstanceSpec("d0", Role.DECODE))
    d = c.route(Request.from_tokens("r1", tokens, block_tokens=16), now=time.monotonic())

Replay: `python -m kvflow.conductor.replay --trace FILE --policy kvcache ...`;
capacity search: `python -m kvflow.conductor.capacity --trace FILE`.

This package uses kvflow's public API only (a kvflow peer's `estimate()`
through `PeerTransferModel`); it never imports engine internals.
"""
from __future__ import annotations

from .blocks import DEFAULT_BLOCK_TOKENS, block_keys
from .conductor import Conductor, ConductorStats
from .estimators import DecodeModel, LinkModel, PeerTransferModel, PrefillModel, TransferModel
from .index import BlockCache, PrefixIndex
from .policies import POLICIES, Candidate, PrefillChoice, PrefillPolicy, RoutingView, make_policy
from .types import Decision, InstanceSpec, Rejected, RejectionMode, RejectReason, Request, Role

__all__ = [
    "Conductor", "ConductorStats", "Decision", "Rejected", "RejectReason", "RejectionMode", "Request",
    "InstanceSpec", "Role", "PrefixIndex", "BlockCache", "block_keys", "DEFAULT_BLOCK_TOKENS",
    "PrefillModel", "DecodeModel", "LinkModel", "PeerTransferModel", "TransferModel",
    "PrefillPolicy", "PrefillChoice", "RoutingView", "Candidate", "POLICIES", "make_policy",
]
