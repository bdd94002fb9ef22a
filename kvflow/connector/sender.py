"""KVSender: the prefill side of one request.

Lifecycle (SGLang's): Bootstrapping until every decode rank that serves the
request has sent its metadata (page indices, aux slot, pool layout), then
WaitingForInput; `send()` moves chunks of pages (every layer), `send_layer()`
one layer as soon as it is computed, so the transfer of layer i overlaps the
computation of layer i+1; the last chunk (or `finish()` in layer-wise use)
writes the aux record, waits for every write, then notifies the decode side
through the data path: Transferring → Success. Writes are posted as soon as
they are handed over; nothing waits for a previous chunk.
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
from kvflow import Priority

if TYPE_CHECKING:
    from kvflow.connector.manager import KVManager
    from kvflow.engine.peer import Peer
    from kvflow.engine.transfer import Transfer

_FINISH = object()


class KVSender(Request):
    """The prefill side of request `bootstrap_room` (SGLang's KVSender).

    Methods are called from the server's thread and never block; the
    transfer runs on the manager's engine loop."""

    def __init__(self, mgr: "KVManager", bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Any = None, pp_rank: int = 0) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self._sent_pages = 0                 # pages handed over by send() (all layers)
        self._finish_requested = False
        self._layers = layout.num_layers(len(mgr.kv_args.kv_data_ptrs), mgr.is_mla)
        self._ops: asyncio.Queue[Any] | None = None
        self._targets: dict[str, dict[str, Any]] = {}
        self._transfers: list["Transfer"] = []
        self._meta_ready: asyncio.Future[None] | None = None
        self.batch_seconds: list[float] = []     # post → completion of each batch (one per layer when streaming)
        self.priority = Priority.NORMAL          # set by init()
        mgr.call_soon(self._attach)

    # ------------------------------------------------------------ server's thread
    def init(self, num_kv_indices: int, aux_index: int | None = None, priority: Any = None) -> None:
        """The request has `num_kv_indices` pages; its aux record is in aux
        slot `aux_index`. priority: the server's class for the request (a
        kvflow.Priority, e.g. from SGLang's request priority); None: from
        its KV size (KVManager(priority_bytes=): shortest first)."""
        if num_kv_indices < 0:
            raise KVFlowError(f"room {self.room}: num_kv_indices must be >= 0")
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        if priority is None:
            nbytes = self.num_kv_indices * sum(int(n) for n in self.mgr.kv_args.kv_item_lens)
            high_max, low_min = self.mgr.priority_bytes
            priority = Priority.HIGH if nbytes <= high_max else Priority.LOW if nbytes >= low_min \
                else Priority.NORMAL
        try:
            self.priority = Priority(priority)
        except ValueError:
            raise KVFlowError(f"room {self.room}: priority must be a kvflow.Priority, not {priority!r}") from None

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        """Sends every layer of the next chunk of pages (prefill page
        indices, in prompt order). The chunk that completes num_kv_indices
        also sends the aux record and finishes the request."""
        if state_indices is not None:
            raise KVFlowError("state_indices (Mamba/SWA state) are not supported by kvflow's connector")
        pages = self._pages(kv_indices)
        if self.num_kv_indices is None:
            raise KVFlowError(f"room {self.room}: send() before init()")
        self._sent_pages += pages.size
        if self._sent_pages > self.num_kv_indices:
            raise KVFlowError(f"room {self.room}: {self._sent_pages} pages sent, more than the "
                              f"{self.num_kv_indices} given to init()")
        last = self._sent_pages == self.num_kv_indices and not self._finish_requested
        self.mgr.call_soon(self._enqueue, (pages, None))
        if last:
            self.finish()

    def send_layer(self, layer: int, kv_indices: Any, after: Any = None) -> None:
        """Sends one layer of these pages now (layer-wise streaming); call
        finish() once the last layer and the aux record are ready. `after`:
        a CUDA event (or stream) the layer's KV is written by: its writes
        start once it has completed (Peer.write's after=), so a layer is
        sent as soon as its kernel is done, never before."""
        if not 0 <= layer < self._layers:
            raise KVFlowError(f"room {self.room}: layer {layer} outside 0..{self._layers - 1}")
        self.mgr.call_soon(self._enqueue, (self._pages(kv_indices), (layer, after)))

    def finish(self) -> None:
        """Sends the aux record and, once every write has landed, tells the
        decode side the request is complete."""
        if self._finish_requested:
            return
        self._finish_requested = True
        self.mgr.call_soon(self._enqueue, (_FINISH, time.time()))

    def abort(self) -> None:
        """Fails the request here and on the decode side."""
        self.mgr.call_soon(self._fail, "aborted by prefill")

    def clear(self) -> None:
        """Forgets the request (call once it is Success or Failed)."""
        self.mgr.call_soon(self._detach)

    @staticmethod
    def _pages(kv_indices: Any) -> np.ndarray:
        pages = np.array(kv_indices, dtype=np.int64).ravel()
        if pages.size and pages.min() < 0:
            raise KVFlowError("page indices must be non-negative")
        return pages

    # ------------------------------------------------------------ engine loop
    def _attach(self) -> None:
        mgr = self.mgr
        old = mgr.senders.get(self.room)
        if old is not None and old is not self:
            old._fail("replaced by a new sender for the same room", tell_peers=False)
        mgr.senders[self.room] = self
        self._ops = asyncio.Queue()
        self._meta_ready = asyncio.get_running_loop().create_future()
        reason = mgr.early_aborts.pop(self.room, None)
        if reason is not None:
            self._fail(f"aborted by decode before prefill started: {reason}", tell_peers=False)
            return
        self._spawn(self._run())
        self._on_meta()

    def _detach(self) -> None:
        if self.mgr.senders.get(self.room) is self:
            del self.mgr.senders[self.room]
            if self.state in (KVPoll.Success, KVPoll.Failed):
                self.mgr.metas.pop(self.room, None)
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")

    def _enqueue(self, op: Any) -> None:
        if self._ops is not None and self.state not in (KVPoll.Success, KVPoll.Failed):
            self._ops.put_nowait(op)

    def _on_meta(self) -> None:
        metas = self.mgr.metas.get(self.room, {})
        if not metas or self._meta_ready is None or self._meta_ready.done():
            return
        expected = max(m["expected"] for m in metas.values())
        if len(metas) >= expected:
            self._targets = dict(metas)
            self._meta_ready.set_result(None)

    def _on_remote_abort(self, address: str, reason: str) -> None:
        self._fail(f"aborted by decode {address}: {reason}", peer=address)

    def _peer_addresses(self) -> list[str]:
        return list(self._targets)

    async def _run(self) -> None:
        mgr = self.mgr
        assert self._meta_ready is not None and self._ops is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._meta_ready), mgr.bootstrap_timeout)
        except asyncio.TimeoutError:
            self._fail(f"no decode metadata within {mgr.bootstrap_timeout:g} s")
            return
        peers = {addr: await mgr.peer(addr) for addr in self._targets}
        self._set_state(KVPoll.WaitingForInput)
        offsets = np.zeros(self._layers, dtype=np.int64)     # pages sent so far, per layer
        started = 0.0
        while True:
            op, arg = await self._ops.get()
            if op is _FINISH:
                break
            if not started:
                started = time.monotonic()
                self._set_state(KVPoll.Transferring)
            layer, after = (None, None) if arg is None else arg
            layers = range(self._layers) if layer is None else (layer,)
            self._post(peers, op, layers, offsets, after)
        self._post_aux(peers)
        await asyncio.gather(*self._transfers)
        self.metric.transfer_latency_s = time.monotonic() - (started or time.monotonic())
        self.metric.batches = len(self._transfers)
        done = messages.encode("done", self.room, rank=mgr.kv_args.engine_rank,
                               bytes=int(self.metric.transfer_total_bytes or 0), at=float(arg))
        for addr, peer in peers.items():
            await peer.notify(done)
            stats = mgr.peer_stats[addr]
            stats.requests += 1
            stats.latency_s += self.metric.transfer_latency_s
        self._set_state(KVPoll.Success)

    def _post(self, peers: dict[str, "Peer"], pages: np.ndarray, layers: Any, offsets: np.ndarray,
              after: Any = None) -> None:
        a = self.mgr.kv_args
        n = pages.size
        if not n:
            return
        for addr, meta in self._targets.items():
            dst_all = messages.unpack_pages(meta["pages"])
            by_offset: dict[int, list[int]] = {}
            for layer in layers:
                by_offset.setdefault(int(offsets[layer]), []).extend(
                    layout.layer_buffers(layer, len(a.kv_data_ptrs), self.mgr.is_mla))
            sliced = self._head_slice(meta)
            for off, buffers in by_offset.items():
                if off + n > dst_all.size:
                    raise KVFlowError(f"room {self.room}: decode {addr} gave {dst_all.size} pages, "
                                      f"prefill sends {off + n}")
                runs = layout.page_runs(pages, dst_all[off:off + n])
                if sliced is None:
                    self._write(peers[addr], *layout.kv_entries(a.kv_data_ptrs, a.kv_item_lens, meta["kv_ptrs"],
                                                                meta["kv_item_lens"], buffers, runs), after=after)
                else:
                    la, ra, ln, *strides = layout.head_sliced_entries(
                        a.kv_data_ptrs, a.kv_item_lens, meta["kv_ptrs"], meta["kv_item_lens"], buffers, runs,
                        a.page_size, *sliced)
                    self._write(peers[addr], la, ra, ln, strides, after=after)
        for layer in layers:
            offsets[layer] += n

    def _head_slice(self, meta: dict[str, Any]) -> tuple[tuple[int, int], ...] | None:
        """(own heads, decode heads, heads sent) when only some KV heads of
        each token go to this decode rank; None when pages move whole."""
        a = self.mgr.kv_args
        if self.mgr.is_mla:
            return None
        if meta["total_heads"] != a.total_kv_head_num:
            raise KVFlowError(f"room {self.room}: decode has {meta['total_heads']} KV heads in all, "
                              f"prefill {a.total_kv_head_num}")
        own = layout.rank_heads(a.engine_rank, a.tp_size, a.total_kv_head_num)
        dst, heads = tuple(meta["dst_heads"]), tuple(meta["heads"])
        if not (own[0] <= heads[0] and heads[0] + heads[1] <= own[0] + own[1]):
            raise KVFlowError(f"room {self.room}: decode asks for heads {heads} but this rank holds {own}")
        if own == dst == heads:
            return None
        return own, dst, heads

    def _post_aux(self, peers: dict[str, "Peer"]) -> None:
        a = self.mgr.kv_args
        if self.aux_index is None or not a.aux_data_ptrs:
            return
        for addr, meta in self._targets.items():
            if len(meta["aux_ptrs"]) != len(a.aux_data_ptrs):
                raise KVFlowError(f"room {self.room}: decode {addr} has {len(meta['aux_ptrs'])} aux "
                                  f"buffers, prefill {len(a.aux_data_ptrs)}")
            la = [p + self.aux_index * item for p, item in zip(a.aux_data_ptrs, a.aux_item_lens)]
            ra = [p + meta["aux"] * item for p, item in zip(meta["aux_ptrs"], meta["aux_item_lens"])]
            ln = [min(x, y) for x, y in zip(a.aux_item_lens, meta["aux_item_lens"])]
            self._write(peers[addr], la, ra, ln)

    def _write(self, peer: "Peer", la: Any, ra: Any, ln: Any, strides: Any = None, after: Any = None) -> None:
        if strides is None:
            t = peer.write_nowait(la, ra, ln, priority=self.priority, after=after)
        else:
            t = peer.write_nowait(la, ra, ln, counts=strides[0], local_strides=strides[1],
                                  remote_strides=strides[2], priority=self.priority, after=after)
        self._transfers.append(t)
        self.metric.entries += len(ln)
        posted = time.perf_counter()
        t.add_done_callback(lambda _, posted=posted: self.batch_seconds.append(time.perf_counter() - posted))
        self.metric.transfer_total_bytes = (self.metric.transfer_total_bytes or 0) + t.nbytes
        self.mgr.peer_stats[peer.address].bytes += t.nbytes

    def _after_fail(self, reason: str, tell_peers: bool) -> None:
        transfers, self._transfers = self._transfers, []
        for t in transfers:
            t.cancel()
        targets = list(self._targets)
        if self._meta_ready is not None and not self._meta_ready.done():
            self._meta_ready.cancel()
        asyncio.get_running_loop().create_task(self._tell_failed(transfers, targets, reason, tell_peers))

    async def _tell_failed(self, transfers: list["Transfer"], targets: list[str], reason: str,
                           tell_peers: bool) -> None:
        # Pages on the decode side may be reused once we say so: first let
        # every write we posted finish or be dropped (bounded by the drain grace).
        await asyncio.gather(*transfers, return_exceptions=True)
        if not targets:
            targets = list(self.mgr.metas.get(self.room, {}))
        for addr in targets:
            try:
                peer = await self.mgr.peer(addr)
                if tell_peers:
                    await peer.notify(messages.encode("fail", self.room, rank=self.mgr.kv_args.engine_rank,
                                                      reason=reason))
                await peer.notify(messages.encode("ack", self.room, rank=self.mgr.kv_args.engine_rank))
            except KVFlowError:
                pass
