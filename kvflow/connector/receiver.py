"""KVReceiver: the decode side of one request.

Lifecycle (SGLang's): Bootstrapping while the prefill ranks are looked up
in the bootstrap server and connected; WaitingForInput until
`send_metadata()` gives the decode pages and aux slot; Transferring once
the metadata reached every prefill rank that feeds this rank; Success when
each of them notified "done" (through the data path, after its bytes
landed: nothing polls the prefill side); Failed on an abort from either
side, a lost peer, or no data within the manager's transfer_timeout.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.connector import layout, messages
from kvflow.connector.request import Request
from kvflow.connector.types import KVPoll
from kvflow.errors import KVFlowError

if TYPE_CHECKING:
    from kvflow.connector.manager import KVManager


class KVReceiver(Request):
    """The decode side of request `bootstrap_room` (SGLang's KVReceiver).

    Methods are called from the server's thread and never block."""

    def __init__(self, mgr: "KVManager", bootstrap_addr: str, bootstrap_room: int,
                 prefill_dp_rank: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._sources: dict[str, int] = {}         # prefill address → its tp rank
        self._done_from: set[str] = set()
        self._acks: set[str] = set()
        self._meta_sent = False
        self._aborted_here = False
        self._metadata: asyncio.Future[tuple[np.ndarray, int]] | None = None
        self._finished: asyncio.Future[None] | None = None
        self._started = False
        if prefill_dp_rank is not None:
            self.init(prefill_dp_rank)

    # ------------------------------------------------------------ server's thread
    def init(self, prefill_dp_rank: int = 0) -> None:
        """Looks up the prefill ranks of dp group `prefill_dp_rank` and
        connects to them (in the background; poll() says when it is done)."""
        if self._started:
            return
        self._started = True
        self.mgr.call_soon(self._attach, int(prefill_dp_rank))

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: Any = None, decode_prefix_len: int | None = None) -> None:
        """Tells the prefill side where this request's pages (decode page
        indices, in prompt order) and aux record (aux slot) go."""
        if state_indices is not None:
            raise KVFlowError("state_indices (Mamba/SWA state) are not supported by kvflow's connector")
        if decode_prefix_len:
            raise KVFlowError("decode_prefix_len (decode-side prefix reuse) is not supported yet")
        pages = np.array(kv_indices, dtype=np.int64).ravel()
        if pages.size and (pages.min() < 0 or pages.max() >= 1 << 31):
            raise KVFlowError("decode page indices must be in 0..2^31-1")
        if not self._started:
            self.init(0)
        self.mgr.call_soon(self._on_metadata, pages, -1 if aux_index is None else int(aux_index))

    def abort(self) -> None:
        """Fails the request here and tells the prefill side, which stops
        writing and acknowledges (see `release_safe`)."""
        self.mgr.call_soon(self._local_abort)

    def clear(self) -> None:
        """Forgets the request (call once it is Success or Failed)."""
        self.mgr.call_soon(self._detach)

    @property
    def release_safe(self) -> bool:
        """True when no prefill rank can still write into this request's
        pages: it succeeded, or every source acknowledged the failure or is
        gone, or the metadata never left."""
        if self.state is KVPoll.Success or not self._meta_sent:
            return self.state in (KVPoll.Success, KVPoll.Failed)
        return self.state is KVPoll.Failed and all(
            a in self._acks or not self._source_alive(a) for a in self._sources)

    def is_abort_release_safe(self) -> bool:   # SGLang's name
        return self.release_safe

    # ------------------------------------------------------------ engine loop
    def _attach(self, dp_rank: int) -> None:
        old = self.mgr.receivers.get(self.room)
        if old is not None and old is not self:
            old._fail("replaced by a new receiver for the same room", tell_peers=False)
        self.mgr.receivers[self.room] = self
        loop = asyncio.get_running_loop()
        self._metadata = loop.create_future()
        self._finished = loop.create_future()
        self._spawn(self._run(dp_rank))

    def _detach(self) -> None:
        if self.mgr.receivers.get(self.room) is self:
            del self.mgr.receivers[self.room]
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")

    def _on_metadata(self, pages: np.ndarray, aux: int) -> None:
        if self._metadata is not None and not self._metadata.done():
            self._metadata.set_result((pages, aux))

    def _local_abort(self) -> None:
        self._aborted_here = True
        self._fail("aborted by decode")

    def _source_alive(self, address: str) -> bool:
        return self.mgr.engine.peer(address) is not None

    def _peer_addresses(self) -> list[str]:
        return list(self._sources)

    async def _run(self, dp_rank: int) -> None:
        mgr = self.mgr
        a = mgr.kv_args
        group = await mgr.prefill_group(self.bootstrap_addr, dp_rank)
        ranks = group["ranks"]
        if any(r["mla"] != mgr.is_mla for r in ranks.values()):
            raise KVFlowError("prefill and decode disagree on the pool kind (MLA vs MHA)")
        prefill_tp = group["tp_size"]
        heads: dict[str, list[int]] = {}
        for rank, h0, hn in layout.source_ranks(a.engine_rank, a.tp_size, prefill_tp, mgr.is_mla,
                                                a.total_kv_head_num):
            self._sources[ranks[rank]["address"]] = rank
            heads[ranks[rank]["address"]] = [h0, hn]
        own = [0, 0] if mgr.is_mla else list(layout.rank_heads(a.engine_rank, a.tp_size, a.total_kv_head_num))
        try:
            peers = {addr: await mgr.peer(addr) for addr in self._sources}
        except KVFlowError:
            # The group may have restarted since it was cached: look it up afresh next time.
            mgr.forget_group(self.bootstrap_addr, dp_rank)
            raise
        self._set_state(KVPoll.WaitingForInput)
        assert self._metadata is not None and self._finished is not None
        pages, aux = await self._metadata
        for addr, peer in peers.items():
            expected = layout.target_count(self._sources[addr], prefill_tp, a.tp_size, mgr.is_mla,
                                           a.total_kv_head_num)
            meta = messages.encode(
                "meta", self.room, addr=mgr.address, rank=a.engine_rank, expected=expected,
                pages=messages.pack_pages(pages), aux=aux, kv_ptrs=list(a.kv_data_ptrs),
                kv_item_lens=list(a.kv_item_lens), aux_ptrs=list(a.aux_data_ptrs),
                aux_item_lens=list(a.aux_item_lens), heads=heads[addr], dst_heads=own,
                total_heads=a.total_kv_head_num)
            self._meta_sent = True
            await peer.notify(meta)
        self._set_state(KVPoll.Transferring)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(self._finished), mgr.transfer_timeout)
        except asyncio.TimeoutError:
            self._fail(f"no data from prefill within {mgr.transfer_timeout:g} s")
            return
        self.metric.transfer_latency_s = time.monotonic() - started
        for addr in self._sources:
            stats = mgr.peer_stats[addr]
            stats.requests += 1
            stats.latency_s += self.metric.transfer_latency_s
        self._set_state(KVPoll.Success)

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        src = next((addr for addr, rank in self._sources.items() if rank == msg["rank"]), None)
        if src is None:
            return          # not from a rank that feeds this request (a stale room)
        if kind == "done":
            if self.state in (KVPoll.Success, KVPoll.Failed):
                return
            self._done_from.add(src)
            self.metric.transfer_total_bytes = (self.metric.transfer_total_bytes or 0) + msg["bytes"]
            self.mgr.peer_stats[src].bytes += msg["bytes"]
            exposed = time.time() - msg["at"]
            self.metric.exposed_s = max(self.metric.exposed_s or 0.0, exposed)
            if len(self._done_from) == len(self._sources) and self._finished is not None \
                    and not self._finished.done():
                self._finished.set_result(None)
        elif kind == "fail":
            self._acks.add(src)       # a prefill rank reports failure only after its writes drained
            self._fail(f"prefill rank {msg['rank']} failed: {msg['reason']}", peer=src, tell_peers=False)
        elif kind == "ack":
            self._acks.add(src)

    def _after_fail(self, reason: str, tell_peers: bool) -> None:
        if self._metadata is not None and not self._metadata.done():
            self._metadata.cancel()
        if tell_peers and self._meta_sent:
            asyncio.get_running_loop().create_task(self._tell_abort(reason))

    async def _tell_abort(self, reason: str) -> None:
        msg = messages.encode("abort", self.room, addr=self.mgr.address, reason=reason)
        for addr in self._sources:
            peer = self.mgr.engine.peer(addr)
            if peer is None:
                continue
            try:
                await peer.notify(msg)
            except KVFlowError:
                pass
