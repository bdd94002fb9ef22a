"""KVManager: one per inference-server rank. Owns a kvflow Engine (on its
own loop thread, so that a synchronous scheduler can drive it), registers
the rank's KV pool and aux buffers, publishes a prefill rank in the
bootstrap server, and routes connector messages to the request objects.

Threading: KVSender/KVReceiver methods are called from the server's thread
(SGLang's scheduler loop, or a compute thread); they hand work to the engine
loop with call_soon and never block on the network. Every piece of request
state below is touched only on the engine loop; the server's thread reads
`poll()`, a single attribute.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kvflow.connector import messages
from kvflow.connector.bootstrap import BootstrapClient
from kvflow.connector.types import DisaggregationMode, KVArgs
from kvflow.engine.thread import EngineThread
from kvflow.errors import KVFlowError, PeerUnreachableError, ProtocolError
from kvflow.memory import Access

# KVManager(priority_bytes=): a request's class from its KV bytes when the
# server gives none: HIGH up to 64 MiB, LOW from 1 GiB.
PRIORITY_BYTES = (64 << 20, 1 << 30)

if TYPE_CHECKING:
    from kvflow.connector.receiver import KVReceiver
    from kvflow.connector.sender import KVSender
    from kvflow.engine.peer import Peer

log = logging.getLogger("kvflow.connector")


class PeerStats:
    """Per-peer totals (bytes moved, requests, failures, latency sum)."""
    __slots__ = ("bytes", "requests", "failures", "latency_s")

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0
        self.failures = 0
        self.latency_s = 0.0

    def as_dict(self) -> dict[str, Any]:
        mean = self.latency_s / self.requests if self.requests else None
        return {"bytes": self.bytes, "requests": self.requests, "failures": self.failures,
                "latency_s": self.latency_s, "mean_latency_s": mean}


class KVManager:
    """The connector for one rank (SGLang's KVManager shape).

    args: the rank's pool layout (KVArgs); disaggregation_mode: PREFILL or
    DECODE; server_args: unused, accepted for SGLang's signature;
    is_mla_backend: the pool holds one MLA latent buffer per layer.
    bootstrap_addr: prefill ranks register there at construction;
    listen/protocols/secret and **engine_options go to the Engine;
    bootstrap_timeout: how long a request may wait for its peer to show up;
    transfer_timeout: how long a decode request may wait for its data once
    its metadata is sent (then it fails and tells the prefill side);
    priority_bytes: (high_max, low_min): a prefill request without a
    priority from the server (KVSender.init(priority=)) gets one from its
    KV size: HIGH up to high_max bytes, LOW from low_min, NORMAL between
    (shortest first; the engine's aging bound keeps LOW from starving).
    """

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: Any = None, is_mla_backend: bool = False, *,
                 bootstrap_addr: str | None = None, listen: str = "127.0.0.1:0",
                 protocols: Any = None, secret: bytes | str | None = None,
                 bootstrap_timeout: float = 30.0, transfer_timeout: float = 60.0,
                 priority_bytes: tuple[int, int] = PRIORITY_BYTES, **engine_options: Any) -> None:
        self.kv_args = args
        self.mode = DisaggregationMode(disaggregation_mode)
        self.is_mla = bool(is_mla_backend)
        args.validate(self.is_mla)
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_timeout = bootstrap_timeout
        self.transfer_timeout = transfer_timeout
        high_max, low_min = priority_bytes
        if not 0 <= high_max <= low_min:
            raise KVFlowError(f"priority_bytes must be (high_max, low_min) with 0 <= high_max <= low_min, "
                              f"not {priority_bytes!r}")
        self.priority_bytes = (int(high_max), int(low_min))
        self._thread = EngineThread(thread_name=f"kvflow-{self.mode.value}-{args.engine_rank}", listen=listen,
                                    protocols=protocols, secret=secret, **engine_options)
        self.engine = self._thread.start()
        self.address = self.engine.address
        self.closed = False
        # Engine-loop-only state.
        self.senders: dict[int, "KVSender"] = {}
        self.receivers: dict[int, "KVReceiver"] = {}
        self.metas: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)   # prefill: room → addr → meta
        self.early_aborts: dict[int, str] = {}       # prefill: aborts for rooms without a sender yet
        self.peer_stats: dict[str, PeerStats] = defaultdict(PeerStats)
        self._watched: set[str] = set()
        self._groups: dict[tuple[str, int], dict[str, Any]] = {}
        self._client = BootstrapClient()
        try:
            self._regions = self._thread.call_sync(self._register_pool)
            self._dispatcher = self._thread.submit(self._dispatch())
            if self.mode is DisaggregationMode.PREFILL and bootstrap_addr:
                self.register_to_bootstrap()
        except BaseException:
            self._thread.call(self._client.close())
            self._thread.close()
            raise

    # ------------------------------------------------------------ setup
    def _register_pool(self) -> list[Any]:
        a = self.kv_args
        access = Access.READ | Access.WRITE
        return [self.engine.register((ptr, ln), access=access)
                for ptr, ln in zip(a.kv_data_ptrs + a.aux_data_ptrs, a.kv_data_lens + a.aux_data_lens)]

    def rank_record(self) -> dict[str, Any]:
        a = self.kv_args
        return {"dp_rank": a.dp_rank, "tp_rank": a.engine_rank, "tp_size": a.tp_size,
                "address": self.address, "mla": self.is_mla,
                "incarnation": self.engine.descriptor().incarnation}

    def register_to_bootstrap(self) -> None:
        """Publishes this prefill rank in the bootstrap server (blocking)."""
        if not self.bootstrap_addr:
            raise KVFlowError("register_to_bootstrap: no bootstrap_addr was given")
        self._thread.call(self._register(self.bootstrap_addr))

    async def _register(self, bootstrap_addr: str) -> None:
        # A rank may come up before its bootstrap server: keep trying for
        # bootstrap_timeout before giving up.
        deadline = time.monotonic() + self.bootstrap_timeout
        delay = 0.05
        while True:
            try:
                return await self._client.register(bootstrap_addr, self.rank_record())
            except PeerUnreachableError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def prefill_group(self, bootstrap_addr: str, dp_rank: int) -> dict[str, Any]:
        """The prefill dp group's ranks, polling the bootstrap server until
        every rank is there or bootstrap_timeout passes."""
        key = (bootstrap_addr, dp_rank)
        cached = self._groups.get(key)
        if cached is not None:
            return cached
        deadline = time.monotonic() + self.bootstrap_timeout
        delay = 0.01
        while True:
            group = await self._client.lookup(bootstrap_addr, dp_rank)
            if group is not None:
                self._groups[key] = group
                return group
            if time.monotonic() > deadline:
                raise KVFlowError(f"prefill dp group {dp_rank} did not register at {bootstrap_addr} "
                                  f"within {self.bootstrap_timeout:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def forget_group(self, bootstrap_addr: str, dp_rank: int) -> None:
        self._groups.pop((bootstrap_addr, dp_rank), None)

    async def peer(self, address: str) -> "Peer":
        """The connected peer at `address`; watched for loss once."""
        peer = await self.engine.connect(address, timeout=min(10.0, self.bootstrap_timeout))
        if address not in self._watched:
            self._watched.add(address)
            peer.on_lost(self._on_peer_lost)
        return peer

    def _on_peer_lost(self, peer: "Peer") -> None:
        self._watched.discard(peer.address)
        for obj in list(self.senders.values()) + list(self.receivers.values()):
            obj._peer_lost(peer.address)

    # ------------------------------------------------------------ messages
    async def _dispatch(self) -> None:
        async for sender_addr, data in self.engine.notifications():
            try:
                msg = messages.decode(data)
            except ProtocolError as e:
                log.warning("kvflow.connector: dropping a malformed message from %s: %s", sender_addr, e)
                continue
            if msg is None:
                continue
            try:
                self._route(msg)
            except Exception:  # one bad message must not stop the dispatcher
                log.exception("kvflow.connector: handling %s from %s failed", msg.get("t"), sender_addr)

    def _route(self, msg: dict[str, Any]) -> None:
        kind, room = msg["t"], msg["room"]
        if self.mode is DisaggregationMode.PREFILL:
            if kind == "meta":
                self.early_aborts.pop(room, None)     # metadata after an abort: a retry
                self.metas[room][msg["addr"]] = msg
                sender = self.senders.get(room)
                if sender is not None:
                    sender._on_meta()
            elif kind == "abort":
                sender = self.senders.get(room)
                if sender is not None:
                    sender._on_remote_abort(msg["addr"], msg["reason"])
                else:
                    # Nothing was written for this room: say so at once.
                    self.early_aborts[room] = msg["reason"]
                    self.metas.pop(room, None)
                    self._prune_early_aborts()
                    asyncio.get_running_loop().create_task(self._ack(msg["addr"], room))
        else:
            receiver = self.receivers.get(room)
            if receiver is not None and kind in ("done", "fail", "ack"):
                receiver._on_message(msg)

    def _prune_early_aborts(self, keep: int = 4096) -> None:
        # Aborts of requests this rank never saw (the prefill request was
        # dropped upstream) would pile up: keep the newest `keep` (dicts
        # iterate in insertion order).
        while len(self.early_aborts) > keep:
            del self.early_aborts[next(iter(self.early_aborts))]

    async def _ack(self, address: str, room: int) -> None:
        try:
            peer = await self.peer(address)
            await peer.notify(messages.encode("ack", room, rank=self.kv_args.engine_rank))
        except KVFlowError as e:
            log.info("kvflow.connector: cannot acknowledge the abort of room %d to %s: %s", room, address, e)

    # ------------------------------------------------------------ thread hand-off
    def call_soon(self, fn: Any, *args: Any) -> None:
        self._thread.call_soon(fn, *args)

    # ------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """Totals per peer address (bytes, requests, failures, mean latency)."""
        async def snap() -> dict[str, Any]:
            return {addr: s.as_dict() for addr, s in self.peer_stats.items()}
        return self._thread.call(snap())

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Leaves the bootstrap server, fails live requests, closes the engine."""
        if self.closed:
            return
        self.closed = True

        async def shutdown() -> None:
            for obj in list(self.senders.values()) + list(self.receivers.values()):
                obj._fail("the KV manager closed")
            if self.mode is DisaggregationMode.PREFILL and self.bootstrap_addr:
                try:
                    await self._client.unregister(self.bootstrap_addr, self.rank_record())
                except KVFlowError as e:
                    log.info("kvflow.connector: leaving the bootstrap server: %s", e)
            await self._client.close()
        try:
            self._thread.call(shutdown(), timeout=15)
        finally:
            self._thread.close()

    def __enter__(self) -> "KVManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<KVManager {self.mode.value} rank {self.kv_args.engine_rank}/{self.kv_args.tp_size} "
                f"{self.address}{' closed' if self.closed else ''}>")
