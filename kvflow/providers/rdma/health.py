"""Device health for the rdma provider: each device's async events (port
error and active, fatal errors, QP errors) and its removal (a kernel
uevent when its uverbs node goes, and a periodic check behind it), taking a
device out of service and back, retiring a device that is gone, reopening
one that is listed again in its old slot, and closing peers that no device
reaches any more.

A mixin of RdmaProvider (kvflow.providers.rdma.provider): it works on the
provider's devices, channels and targets, which the provider's __init__
makes."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from kvflow.providers.base import PeerLink
from kvflow.providers.rdma.options import (DEVICE_CHECK, NETLINK_KOBJECT_UEVENT, _verbs,
                                           choose_ack_timeout, choose_worker_posts)

__all__ = ["DeviceHealth"]

log = logging.getLogger("kvflow")

QP_GONE = -2                   # RdmaChannel.qp_stats() "state" of a QP destroyed with its (removed) device


class DeviceHealth:
    """Device health (see the module doc); mixed into RdmaProvider."""

    def _watch_devices(self) -> None:
        """Watches each device's async events (port error/active, fatal
        errors) and its removal: a kernel uevent when a device node goes
        (Soft-RoCE's removal sends no verbs event at all, see
        _check_gone), with a periodic check behind it for where uevents do
        not reach (another user namespace)."""
        loop = self.ctx.loop
        for d in self.devices:
            self._watch(d)
        s = None
        try:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
            s.setblocking(False)
            s.bind((0, 1))                  # group 1: the kernel's uevents
            loop.add_reader(s.fileno(), self._on_uevent)
            self._uevents = s
        except OSError as e:
            if s is not None:
                s.close()
            log.info("kvflow: no kernel uevents (%s): device removal is noticed within %g s", e, DEVICE_CHECK)
        if not any(d.removal_known for d in self.devices):
            log.info("kvflow: rdma devices %s: their uverbs nodes are not visible here; removal is noticed "
                     "only through verbs events", ", ".join(d.name for d in self.devices))
        self._device_check = loop.create_task(self._check_loop())

    def _watch(self, d: Any) -> None:
        try:
            fd = d.async_fileno()
            self.ctx.loop.add_reader(fd, self._on_async, d.index)
            self._async_fds[d.index] = fd     # the fd it was watched by, for remove_reader
        except OSError as e:
            log.warning("kvflow: rdma device %s: its events cannot be watched: %s", d.name, e)

    def _unwatch(self, index: int) -> None:
        fd = self._async_fds.pop(index, None)
        if fd is not None:
            try:
                self.ctx.loop.remove_reader(fd)
            except (OSError, ValueError):
                pass

    def _on_uevent(self) -> None:
        assert self._uevents is not None
        seen = False
        while True:
            try:
                msg = self._uevents.recv(8192)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:                  # ENOBUFS: some were dropped; check anyway
                seen = True
                break
            seen = seen or b"infiniband" in msg
        if seen:
            self._check("a kernel uevent", True)

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(DEVICE_CHECK)
            self._check("the periodic check", False)

    def _check(self, via: str, listed: bool) -> None:
        """Retires the devices that went and reopens the ones that came
        back; `listed`: look at the device list even if no device is gone
        (a uevent: a new device is logged)."""
        try:
            self._check_gone(via)
            if listed or self.device_gone:
                self._check_back(via)
        except Exception:                    # never end the watch on one bad check
            log.exception("kvflow: rdma device check failed")

    def _check_gone(self, via: str) -> None:
        """Retires every device whose uverbs node is gone or now belongs to
        another device (Device.removed: compared with what was there at
        open; a node not visible at open is never taken for a removal).
        Removing a Soft-RoCE device (`rdma link delete`) first removes that
        node, then waits, with no event to the contexts, until every process
        has closed its context on the device: so kvflow closes it."""
        for d in self.devices:
            if d.index not in self.device_gone and d.removed():
                self._retire(d.index, f"the device was removed; seen through {via}")

    def _check_back(self, via: str) -> None:
        """Reopens each gone device that was removed and is listed again
        (added again under its name, or re-created by a driver reset): see
        _reopen. A device name never seen before is logged once: a running
        engine does not take up new devices."""
        names = _verbs.device_names()
        for name in names:
            if name not in self._names_seen:
                self._names_seen.add(name)
                log.warning("kvflow: rdma device %s appeared after this engine started: the engine does "
                            "not use it (a new engine does)", name)
        for index in sorted(self.device_gone):
            old = self.devices[index]
            if old.name not in names or old.removed():
                self._removed.add(index)
            if index in self._removed and old.name in names:
                self._reopen(index, via)

    def _reopen(self, index: int, via: str) -> None:
        """Opens gone device `index` again in its old slot, with the same
        options: the index is what the native tables, peers' rkey lists
        and their QPs' device pairs use. Every region and internal buffer is
        registered on it again, regions get their new keys, peers get them
        (with the device up again and the new probe keys: their repairs
        toward it succeed from then on), and this side's QPs that went with
        the device are rebuilt by repairs. A device not usable yet (port not
        active, no GID yet) is tried again soon."""
        name = self.devices[index].name
        regs = [*self._mrs.values(), *self._internal]
        d = None
        try:
            d = _verbs.Device(self.ctx.core, self.events, name, index, gid_index=self._gid_index,
                              ack_timeout=choose_ack_timeout(name, self._ack_timeout),
                              worker_posts=choose_worker_posts(name), spin_ns=self._spin_ns)
            for reg in regs:
                reg.handles[index], reg.lkeys[index], reg.rkeys[index] = d.register(reg.addr, reg.length,
                                                                                    reg.flags)
        except (OSError, ValueError) as e:
            if d is not None:
                for reg in regs:
                    d.deregister(reg.handles[index])
                    reg.handles[index] = reg.lkeys[index] = reg.rkeys[index] = 0
                d.close()
            self._retry_reopen(index, str(e))
            return
        self.devices[index] = d
        self.device_gone.discard(index)
        self._removed.discard(index)
        self.device_down.pop(index, None)
        self.device_down_at.pop(index, None)
        self._reopen_failed.pop(index, None)
        self._reopen_backoff.succeeded()
        self._watch(d)
        self.ctx.rekeyed({rid: (reg.lkeys, reg.rkeys) for rid, reg in self._mrs.items()})
        gone = [(peer, ch, i) for peer, ch, i in self._qps_on(index) if ch.qp_stats()[i]["state"] == QP_GONE]
        for peer, ch, i in gone:
            self._start_repair(peer, ch, i)
        self._extend_all()
        log.warning("kvflow: rdma device %s is back (seen through %s): reopened as %r, %d region(s) "
                    "registered again, rebuilding %d QP(s) of ours on it", name, via, d, len(self._mrs),
                    len(gone))

    def _retry_reopen(self, index: int, why: str) -> None:
        if self._reopen_failed.get(index) != why:
            log.info("kvflow: rdma device %s is listed again but not usable yet (%s); trying again",
                     self.devices[index].name, why)
            self._reopen_failed[index] = why
        self._reopen_backoff.failed()
        if self._reopen_timer is not None or self._reopen_backoff.delay >= DEVICE_CHECK:
            return                           # the periodic check tries from then on
        self._reopen_timer = self.ctx.loop.call_later(self._reopen_backoff.attempted(), self._reopen_again)

    def _reopen_again(self) -> None:
        self._reopen_timer = None
        self._check("a retry", False)

    def _on_async(self, index: int) -> None:
        d = self.devices[index]
        try:
            events = d.async_events()
        except OSError as e:                 # not EAGAIN: the fd is in an error state
            log.warning("kvflow: rdma device %s: its events cannot be read (%s); checking it", d.name, e)
            self._unwatch(index)
            self._check_gone("its event fd")
            return
        for kind, qpn, port in events:       # none: a spurious wake-up, keep watching
            what = _verbs.event_name(kind)
            if kind in (_verbs.EVENT_DEVICE_FATAL, _verbs.EVENT_CQ_ERR):
                # no completion will come from this device any more
                self._retire(index, what)
                return
            if kind == _verbs.EVENT_PORT_ERR and port == d.port:
                self._take_out(index, what)
            elif kind == _verbs.EVENT_PORT_ACTIVE and port == d.port:
                self._port_back(index)
            elif kind in (_verbs.EVENT_QP_FATAL, _verbs.EVENT_QP_REQ_ERR, _verbs.EVENT_QP_ACCESS_ERR):
                self.device_errors[index] += 1
                self._qp_failed(index, qpn, what)
            else:
                log.info("kvflow: rdma device %s: %s", d.name, what)

    def _qp_failed(self, index: int, qpn: int, what: str) -> None:
        """An async QP error: an initiator QP of ours is broken and repaired
        at once (its work may never complete in error to say so); a target
        QP is left to its initiator, which sees its own QP fail."""
        d = self.devices[index]
        for peer, ch, i in self._qps_on(index):
            st = ch.qp_stats()[i]
            if st["qpn"] == qpn:
                log.warning("kvflow: rdma device %s: QP %d (QP %d to %s): %s; reconnecting",
                            d.name, qpn, i, peer.address, what)
                if st["state"] in (1, 2):
                    ch.break_qp(i)
                self._start_repair(peer, ch, i)
                return
        log.warning("kvflow: rdma device %s: QP %d: %s", d.name, qpn, what)

    def _qps_on(self, index: int) -> list[tuple[PeerLink, Any, int]]:
        return [(peer, ch, i) for peer, ch in self._channels.values()
                for i, st in enumerate(ch.qp_stats()) if st["dev"] == index]

    def _take_out(self, index: int, why: str) -> None:
        """Device `index` is out of service now (a port error): its QPs
        break at once (their slices go to other devices' QPs instead of
        waiting for retries to time out) and their repairs wait for the port
        to come back, probing with back-off."""
        if index in self.device_down:
            return
        d = self.devices[index]
        self.device_down[index] = why
        self.device_down_at[index] = self.ctx.loop.time()
        self.device_errors[index] += 1
        log.warning("kvflow: rdma device %s out of service (%s): its traffic moves to the other devices",
                    d.name, why)
        for peer, ch, i in self._qps_on(index):
            if ch.qp_stats()[i]["state"] in (1, 2):
                ch.break_qp(i)
                self._start_repair(peer, ch, i)

    def _port_back(self, index: int) -> None:
        if index in self.device_gone or self.device_down.pop(index, None) is None:
            return
        log.info("kvflow: rdma device %s: port active again; probing its QPs", self.devices[index].name)
        self._wake(index)
        self._extend_all()

    def _extend_all(self) -> None:
        """A device is in service again: channels that connected without it
        get QPs on it (_extend)."""
        for peer, ch in list(self._channels.values()):
            self._extend_soon(peer, ch)

    def _wake(self, index: int) -> None:
        ev = self._device_back.pop(index, None)
        if ev is not None:
            ev.set()

    async def _wait_back(self, index: int, delay: float) -> None:
        """Sleeps `delay`, or less if the device's port comes back."""
        ev = self._device_back.setdefault(index, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), delay)
        except asyncio.TimeoutError:
            pass

    def _retire(self, index: int, why: str) -> None:
        """Device `index` is gone: its QPs (initiator and target side),
        MRs, CQ, PD and context are destroyed now, since the kernel's removal
        of the device waits for them; what its QPs carried moves to the
        other devices. A peer left with no QP on any other device is closed
        (see _orphaned). If it was removed, it is reopened when it is
        listed again (_check_back)."""
        if index in self.device_gone:
            return
        d = self.devices[index]
        self.device_gone.add(index)
        self.device_down[index] = why
        self.device_down_at.setdefault(index, self.ctx.loop.time())
        self.device_errors[index] += 1
        self._unwatch(index)
        moved = 0
        mine = [k for k in self._targets if k[0] == index]
        try:
            for _, ch in list(self._channels.values()):
                moved += ch.drop_device(d)
            for key in mine:
                self._targets[key][1].destroy()
            for reg in [*self._mrs.values(), *self._internal]:
                d.deregister(reg.handles[index])
                reg.handles[index] = reg.lkeys[index] = reg.rkeys[index] = 0
        finally:
            # whatever failed above, the device is closed (its removal waits
            # for that); close() destroys any QP of it still not handed over
            d.close()
            # the worker is joined: what it queued before it stopped (a
            # notification that arrived on a target QP of this device) is
            # delivered while the target QP's peer is still known
            self._on_events()
            for key in mine:
                self._targets.pop(key, None)
                for keys in self._session_qps.values():
                    if key in keys:
                        keys.remove(key)
            self._wake(index)                  # repairs of its QPs see it gone and end
        log.warning("kvflow: rdma device %s is gone (%s): closed it (%d QP(s) of ours on it); "
                    "the other devices carry its traffic", d.name, why, moved)
        self._orphaned()

    def _orphaned(self) -> None:
        """Closes each peer whose QPs were all on devices that are gone:
        nothing would ever carry its transfers (they would wait for a QP
        for ever). What was in flight fails with PeerLostError at once, and
        so does what is submitted later; a later connect() to that address
        pairs the devices still in service."""
        for token, (peer, ch) in list(self._channels.items()):
            stats = ch.qp_stats()
            if stats and all(s["state"] == QP_GONE for s in stats):
                log.warning("kvflow: no rdma device left toward %s (all its QPs were on removed devices); "
                            "closing the peer: connect again to use the devices in service", peer.address)
                ch.close()                     # fails queued and in-flight work now
                self.closed(ch)
                task = self.ctx.loop.create_task(peer.close())
                self._lost.add(task)
                task.add_done_callback(self._lost.discard)
