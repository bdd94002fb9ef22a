"""QP repair for the rdma provider: probing a QP before it carries
anything (a read of the peer's cookie), bringing a broken QP back (a new QP
in its place on both ends, probed, then in service; back-off between
tries), adding QPs for device pairs a channel lacks once a device is back,
and closing a peer whose QPs all stayed down.

A mixin of RdmaProvider (kvflow.providers.rdma.provider)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvflow.errors import ProtocolError, ProviderUnavailableError
from kvflow.providers.base import PeerLink
from kvflow.providers.rdma.options import DEAD_AFTER, PROBE_TIMEOUT, QP_DEPTH, REPAIR_MAX, REPAIR_MIN, _verbs
from kvflow.schedule.health import Backoff

__all__ = ["QpRepair"]

log = logging.getLogger("kvflow")

QP_UP = 1                      # RdmaChannel.qp_stats() "state": 1 up, 2 probing, 0 broken, -1 closed,
QP_GONE = -2                   # -2 destroyed with its (removed) device


class QpRepair:
    """QP probing and repair (see the module doc); mixed into RdmaProvider."""

    async def _probe_all(self, peer: PeerLink, ch: Any, indexes: list[int], required: bool = True) -> None:
        """Probes the QPs `indexes` (added not in service) and puts each one
        that answers in service; one that does not is broken and repaired
        like a QP that failed later (a device pair that does not reach
        costs its share, not the connect). `required`: raises the first
        probe's error when none answers."""
        results = await asyncio.gather(*(self._probe_qp(peer, ch, i) for i in indexes),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r                        # cancelled
        failed = [(i, r) for i, r in zip(indexes, results) if isinstance(r, Exception)]
        if required and failed and len(failed) == len(indexes):
            raise failed[0][1]
        if not ch.alive:
            return                             # closed while probing: nothing to put in service
        for i, r in zip(indexes, results):
            if not isinstance(r, Exception):
                ch.qp_up(i)
        for i, e in failed:
            log.warning("kvflow: rdma QP %d to %s on %s: %s; in service without it, repairing it",
                        i, peer.address, ch.qp_device(i).name, e)
            ch.break_qp(i)
            # runs once this connect returned (the peer is in service then)
            self._start_repair(peer, ch, i)

    def _extend_soon(self, peer: PeerLink, ch: Any) -> None:
        """Runs _extend for this channel (once more if one is running)."""
        if ch.token in self._extending:
            self._extend_again.add(ch.token)
            return
        self._extending.add(ch.token)
        task = self.ctx.loop.create_task(self._extend(peer, ch))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _extend(self, peer: PeerLink, ch: Any) -> None:
        """Adds QPs for the device pairs the channel lacks: a device (here
        or at the peer) was gone or out of service when it connected and
        is in service again. Pairs it already has (even broken, or gone
        with their device) are left to their repairs."""
        try:
            while ch.alive and peer.alive and peer.descriptor.rdma is not None:
                self._extend_again.discard(ch.token)
                try:
                    pairs = self._wanted_pairs(peer, peer.descriptor.rdma["devices"])
                except ProviderUnavailableError:
                    return
                have = {(st["dev"], st["rdev"]) for st in ch.qp_stats()}
                missing = [p for p in pairs if p not in have]
                if missing:
                    qps = []
                    try:
                        qps = self._new_qps(missing)
                        added = await self._join(peer, ch, qps)
                    except Exception as e:     # verbs, protocol, a lost peer: the channel stays as it is
                        log.warning("kvflow: rdma channel to %s: could not add QPs for device pair(s) %s: %s",
                                    peer.address, missing, e)
                        return
                    finally:
                        for _, qp, _ in qps:
                            qp.destroy()       # those not handed to the channel
                    log.info("kvflow: rdma channel to %s: %d QP(s) added for device pair(s) %s (back in service)",
                             peer.address, len(added), missing)
                    await self._probe_all(peer, ch, added, required=False)
                if ch.token not in self._extend_again:
                    return
        finally:
            self._extending.discard(ch.token)
            self._extend_again.discard(ch.token)

    async def _probe_qp(self, peer: PeerLink, ch: Any, i: int) -> None:
        """Reads the peer's cookie over QP `i` (a posted READ that must come
        back with the right bytes). Raises ProviderUnavailableError."""
        raddr, rkeys, cookie = peer.descriptor.rdma["probe"]
        dev = ch.qp_device(i)
        rdev = ch.qp_stats()[i]["rdev"]
        async with self._probe_slots:
            # a landing slot of its own (probes of other peers and QPs run at once)
            index = self._probe_free.pop()
            try:
                slot = index * 64
                landing = int(self._probe_landing.__array_interface__["data"][0]) + slot
                self._probe_landing[slot:slot + 64] = 0
                status, bid = ch.post_one(i, _verbs.OP_PROBE, landing, self.landing_keys[0][dev.index],
                                          raddr, rkeys[rdev], len(cookie))
                if status:
                    raise ProviderUnavailableError(f"{peer.address}: rdma probe could not be posted",
                                                   peer=peer.address)
                try:
                    await self.ctx.batches.track(bid, peer.address, 1, len(cookie), PROBE_TIMEOUT)
                except Exception as e:
                    raise ProviderUnavailableError(
                        f"{peer.address}: rdma device {dev.name} does not reach the peer's device "
                        f"({e}); check GIDs/routes with ibv_devinfo -v and `rdma link`",
                        peer=peer.address) from None
                if self._probe_landing[slot:slot + len(cookie)].tobytes() != cookie:
                    raise ProviderUnavailableError(f"{peer.address}: rdma probe read back the wrong bytes "
                                                   f"over {dev.name}", peer=peer.address)
            finally:
                self._probe_free.append(index)

    def _start_repair(self, peer: PeerLink, ch: Any, index: int) -> None:
        if (ch.token, index) in self._repairing:
            return
        task = self.ctx.loop.create_task(self._repair(peer, ch, index))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _repair(self, peer: PeerLink, ch: Any, index: int) -> None:
        """Brings broken QP `index` back: a new QP in its place (the old pair
        is replaced on both ends), probed with a read of the peer's cookie,
        and only then in service. A failed attempt backs off (REPAIR_MIN
        doubling to REPAIR_MAX) and probes again: meanwhile that device
        pair carries nothing (slices go to the QPs that are up). When no QP
        of the peer has been up for DEAD_AFTER seconds (or keepalive, if
        longer), the peer is closed and what waited fails with PeerLostError."""
        key = (ch.token, index)
        if key in self._repairing or not ch.alive:
            return                     # its own probe failed: the running repair sees it
        self._repairing.add(key)
        dev = ch.qp_device(index)
        self.device_errors[dev.index] += 1
        self.count_qp(ch, index, 0)
        backoff = Backoff(REPAIR_MIN, REPAIR_MAX, self.ctx.loop.time)
        backoff.failed()
        try:
            while ch.alive and peer.alive:
                if dev.index in self.device_gone:
                    return
                if dev.index in self.device_down:
                    # no use trying before the back-off (or the port's return)
                    await self._wait_back(dev.index, backoff.delay)
                    if dev.index in self.device_gone:
                        return
                self.count_qp(ch, index, 2)
                why = await self._reconnect(peer, ch, index)
                if why is None:
                    self.count_qp(ch, index, 1)
                    if self.device_down.pop(dev.index, None) is not None:
                        log.info("kvflow: rdma device %s answers again: back in service", dev.name)
                    self._all_down.pop(ch.token, None)
                    log.info("kvflow: rdma QP %d to %s on %s is back", index, peer.address, dev.name)
                    return
                loop = self.ctx.loop
                if not any(q["state"] == QP_UP for q in ch.qp_stats()):
                    since = self._all_down.setdefault(ch.token, loop.time())
                    if loop.time() - since > max(DEAD_AFTER, self.ctx.keepalive):
                        log.warning("kvflow: no rdma QP to %s works (last: %s); closing the peer",
                                    peer.address, why)
                        await peer.close()
                        return
                wait = backoff.attempted()
                log.warning("kvflow: rdma QP %d to %s on %s is still down (%s); next try in %.1f s",
                            index, peer.address, dev.name, why, wait)
                if dev.index not in self.device_down:
                    await self._wait_back(dev.index, wait)
        finally:
            self._repairing.discard(key)

    async def _reconnect(self, peer: PeerLink, ch: Any, index: int) -> str | None:
        """One repair attempt of QP `index`: None when it is in service
        again, else why not."""
        st = ch.qp_stats()[index]
        dev = self.devices[st["dev"]]        # for a QP that went with its device: the one reopened
        rdev = st["rdev"]
        qp = None
        try:
            qp = dev.create_qp(QP_DEPTH)
            old = self._remote_qpns[ch.token][index]
            reply = await peer.request({"t": "rdma_connect", "qps": [self._qp_wire(dev, qp, rdev)],
                                         "replace": [[rdev, old]]})
            (qpn, psn, gid, lid, mtu), = _accepted(reply, 1, peer.address)
            # the target replaced its QP: the next attempt replaces this one
            self._remote_qpns[ch.token][index] = qpn
            if not dev.open:
                return "the device is gone"    # closing it destroyed `qp`
            qp.connect(qpn, psn, gid, lid, mtu)
            if not ch.replace_qp(index, qp, False):
                return "the channel was closed"
        except Exception as e:      # verbs, protocol, a lost peer: try again later
            return f"{type(e).__name__}: {e}"
        finally:
            if qp is not None:
                qp.destroy()
        try:
            await self._probe_qp(peer, ch, index)
        except ProviderUnavailableError as e:
            ch.break_qp(index)         # a probe that timed out leaves it half in service
            return str(e)
        return None if ch.qp_up(index) else "the channel was closed"

    def remote_changed(self, peer: PeerLink, channel: Any) -> None:
        """The peer pushed its rdma devices again (one of its devices came
        back, with new probe keys): repairs toward it that wait out a
        back-off try now, and a channel that connected while that device
        was gone gets QPs on it."""
        for p, ch in list(self._channels.values()):
            if p is peer:
                for st in ch.qp_stats():
                    if st["state"] not in (QP_UP, QP_GONE) and st["dev"] not in self.device_down:
                        self._wake(st["dev"])
                self._extend_soon(peer, ch)     # a device of the peer's it connected without


def _accepted(reply: dict[str, Any], n: int, peer: str) -> list[tuple[int, int, bytes, int, int]]:
    if reply.get("t") == "rdma_error":
        raise ProviderUnavailableError(f"{peer} could not set up rdma: {reply.get('message')}", peer=peer)
    qps = reply.get("qps")
    if reply.get("t") != "rdma_accept" or not isinstance(qps, list) or len(qps) != n:
        raise ProtocolError(f"{peer}: malformed rdma_accept", peer=peer)
    out = []
    for item in qps:
        try:
            qpn, psn, gid, lid, mtu = item
            if not (isinstance(qpn, int) and isinstance(psn, int) and isinstance(gid, bytes) and len(gid) == 16
                    and isinstance(lid, int) and isinstance(mtu, int)):
                raise TypeError
        except (TypeError, ValueError):
            raise ProtocolError(f"{peer}: malformed rdma_accept entry", peer=peer) from None
        out.append((qpn, psn, gid, lid, mtu))
    return out
