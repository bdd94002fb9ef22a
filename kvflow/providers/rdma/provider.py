"""The rdma provider's Python side: the devices an engine opens, memory
registration on every one of them, connecting queue pairs through the
control connection (both ends), notifications over the data path, and the
provider contract (kvflow.providers.base). Its other parts: options.py
(options and per-device choices), repair.py (probing and repairing QPs),
health.py (device events, removal and return).

Hot-path work is native (kvflow/_native/rdma_*.c); everything here runs once
per connection, registration or failure.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.config import env_int, env_list
from kvflow.control.descriptor import Descriptor
from kvflow.errors import InvalidArgumentError, PeerLostError, ProtocolError, ProviderUnavailableError
from kvflow.memory import Access
from kvflow.providers.base import Caps, PeerLink, Provider, ProviderContext, RegionKeys
from kvflow.providers.rdma.health import DeviceHealth
from kvflow.providers.rdma.ibgda import IBGDA_DEPTH, IbgdaEndpoint
from kvflow.providers.rdma.options import (  # noqa: F401 (re-exported: the provider's public names)
    DEAD_AFTER,
    DEVICE_CHECK,
    LARGE_REGION,
    MAX_TARGET_QPS,
    NOTIFY_SLOTS,
    PROBE_TIMEOUT,
    QP_DEPTH,
    QP_STATES,
    REOPEN_RETRY,
    RdmaOptions,
    _verbs,
    available,
    check_ack_timeout,
    choose_ack_timeout,
    choose_worker_posts,
    device_names,
    is_software,
)
from kvflow.providers.rdma.repair import QpRepair, _accepted
from kvflow.schedule.health import Backoff
from kvflow.status import WC_STATUS
from kvflow.tasks import cancel_and_wait
from kvflow.topology import NicKind, Topology, match_rails

__all__ = ["RdmaOptions", "RdmaProvider", "available", "device_names"]

log = logging.getLogger("kvflow")

# A QP's queue in RdmaChannel.qp_stats(), under the names tcp connections use
QUEUE_FIELDS = ("queued_slices", "queued_bytes", "inflight_slices", "inflight_bytes")


def _ordered(names: list[str], topology: Topology | None, location: str) -> list[str]:
    """The devices (of `names`) that serve memory at `location`: the
    topology's preferred ones, else its fallback ones, else all of them."""
    if topology is None:
        return names
    try:
        preferred, fallback = topology.preferred(location, NicKind.RDMA)
    except InvalidArgumentError:
        return names
    return [n for n in preferred if n in names] or [n for n in fallback if n in names] or names


@dataclass
class Registration:
    """One range registered on every device (0s where a device is gone):
    what it takes to register it again on a device that comes back. The
    key lists are updated in place."""
    addr: int
    length: int
    flags: int
    handles: list[int]
    lkeys: list[int]
    rkeys: list[int]


def _pairs(local: list[str], mine: list[str], remote: list[str], theirs: list[str]) -> list[tuple[int, int]]:
    """Device pairs (local index, remote index): each end's devices for its
    memory, in its published order, paired rail i to rail i (the shorter
    list round-robin: kvflow.topology.match_rails)."""
    return [(local.index(a), remote.index(b)) for a, b in match_rails(mine, theirs)]


class RdmaProvider(QpRepair, DeviceHealth, Provider):
    """The rdma provider of one engine: RC queue pairs per (local device,
    peer device), RDMA WRITE/READ for data, SEND for notifications (after
    the data on the same QP), probes before a QP is in service, repairs
    with back-off when one breaks, devices taken out and reopened."""

    name = "rdma"
    caps = Caps(remote=True, same_host=True, data_notify=True, lifeline=True)
    control = {"rdma_connect": "rdma_error"}
    replies = frozenset({"rdma_accept", "rdma_error"})
    pushed = True               # devices in service and probe keys change when a device comes back
    # one 100 Gb/s port and a NIC's round trip, for estimate() where sysfs gives no rate
    LATENCY_S = 5e-6
    BYTES_PER_S = 12.5e9

    def __init__(self, ctx: ProviderContext, options: RdmaOptions) -> None:
        devices, gid_index, ack_timeout = options.devices, options.gid_index, options.ack_timeout
        if gid_index is None:
            gid_index = env_int("KVFLOW_GID_INDEX")
        qps_per_pair, slice_size = options.qps_per_pair, options.slice_size
        if _verbs is None:
            raise ProviderUnavailableError("kvflow was built without libibverbs (install libibverbs-dev "
                                           "and reinstall kvflow)")
        spin = env_int("KVFLOW_RDMA_SPIN_NS")
        self._spin_ns = _verbs.SPIN_NS if spin is None else spin
        names = devices
        if names is None:
            names = env_list("KVFLOW_RDMA_DEVICES") or _verbs.device_names()
        if not names:
            raise ProviderUnavailableError("no RDMA device on this host")
        self.ctx = ctx
        self._remote_qpns: dict[int, list[int]] = {}      # channel token -> the peer's QP numbers
        self._ibgda_on = options.ibgda
        self._ibgda: dict[int, list[IbgdaEndpoint]] = {}  # channel token -> its IBGDA endpoints
        self._gid_index = gid_index              # the options a returning device is reopened with
        self._ack_timeout = ack_timeout
        # before anything is opened: a bad override is the caller's error
        timeouts = {name: choose_ack_timeout(name, ack_timeout) for name in names[:8]}
        worker_posts = {name: choose_worker_posts(name) for name in names[:8]}
        self.events = _verbs.Events()
        self.devices: list[Any] = []
        problems = []
        for name in names[:8]:
            try:
                self.devices.append(_verbs.Device(ctx.core, self.events, name, len(self.devices),
                                                  gid_index=gid_index, ack_timeout=timeouts[name],
                                                  worker_posts=worker_posts[name], spin_ns=self._spin_ns))
            except (OSError, ValueError) as e:
                problems.append(str(e))
        if not self.devices:
            self.events.close()
            raise ProviderUnavailableError("no usable RDMA device: " + "; ".join(problems))
        for p in problems:
            log.warning("kvflow: rdma device skipped: %s", p)
        self.qps_per_pair = qps_per_pair
        self.slice_size = slice_size
        self._mrs: dict[int, Registration] = {}          # region id -> its MRs
        self._targets: dict[tuple[int, int], tuple[str, Any]] = {}   # (dev, qpn) -> (peer, Qp)
        self._session_qps: dict[Any, list[tuple[int, int]]] = {}
        self._channels: dict[int, tuple[PeerLink, Any]] = {}          # token -> (peer, channel)
        self._next_token = 1
        self._repairs: set[asyncio.Task[None]] = set()
        self._lost: set[asyncio.Task[None]] = set()                 # peers being closed (no device left)
        self._repairing: set[tuple[int, int]] = set()                 # (token, QP index)
        self._extending: set[int] = set()                             # channel tokens being extended
        self._extend_again: set[int] = set()
        self._all_down: dict[int, float] = {}                         # token -> since when no QP is up
        # token -> QP index -> [breaks, repairs (back in service), repair attempts]
        self._qp_counts: dict[int, dict[int, list[int]]] = {}
        self.device_errors = [0] * len(self.devices)                  # QP breaks and device events per device
        # Devices out of service: index -> why (a port error, or gone). A
        # down device's QPs carry nothing; their repairs back off and probe,
        # and a PORT_ACTIVE event wakes them at once. A gone device (removed,
        # or a fatal error) is closed for good.
        self.device_down: dict[int, str] = {}
        self.device_gone: set[int] = set()
        self.device_down_at: dict[int, float] = {}                    # loop time it went out of service
        # A gone device seen removed (its node gone, or its name unlisted)
        # is reopened when its name is listed again; one retired for a
        # fatal error and never removed stays closed.
        self._removed: set[int] = set()
        self._reopen_failed: dict[int, str] = {}                      # index -> why (logged once)
        self._reopen_timer: asyncio.TimerHandle | None = None
        # retries of a device listed again but not usable yet: REOPEN_RETRY
        # doubling until the periodic check (DEVICE_CHECK) takes over
        self._reopen_backoff = Backoff(REOPEN_RETRY, DEVICE_CHECK, ctx.loop.time)
        self._names_seen = set(_verbs.device_names())                  # a new one is logged once
        self._device_back: dict[int, asyncio.Event] = {}
        self._uevents: socket.socket | None = None
        self._async_fds: dict[int, int] = {}                           # device index -> watched async fd
        self._device_check: asyncio.Task[None] | None = None
        # The reachability probe: peers read this cookie back over each QP.
        self._probe = np.frombuffer(os.urandom(64), dtype=np.uint8).copy()
        self._probe_landing = np.zeros(MAX_TARGET_QPS * 64, dtype=np.uint8)
        self._probe_free = list(range(MAX_TARGET_QPS))
        self._probe_slots = asyncio.Semaphore(MAX_TARGET_QPS)
        self._notify_buf = np.zeros(NOTIFY_SLOTS * _verbs.RECV_BYTES, dtype=np.uint8)
        self._notify_free = list(range(NOTIFY_SLOTS))
        self._notify_sem = asyncio.Semaphore(NOTIFY_SLOTS)
        self._internal: list[Registration] = []
        self.probe_keys = self._register_internal(self._probe, Access.READ)
        self.landing_keys = self._register_internal(self._probe_landing, Access.READ | Access.WRITE)
        self.notify_keys = self._register_internal(self._notify_buf, Access.READ)
        ctx.loop.add_reader(self.events.fileno(), self._on_events)
        self._watch_devices()
        log.info("kvflow: rdma devices %s", ", ".join(repr(d) for d in self.devices))

    # ------------------------------------------------------------ memory
    @staticmethod
    def _flags(access: Access, writable: bool) -> int:
        flags = 0
        if writable:
            flags |= _verbs.ACCESS_LOCAL_WRITE
        if access & Access.WRITE:
            flags |= _verbs.ACCESS_REMOTE_WRITE
        if access & Access.READ:
            flags |= _verbs.ACCESS_REMOTE_READ
        return flags

    def _reg_all(self, addr: int, length: int, flags: int) -> Registration:
        reg = Registration(addr, length, flags, [], [], [])
        try:
            for d in self.devices:
                # nothing on a gone device (its QPs are gone too): done if it comes back
                h, lkey, rkey = (0, 0, 0) if d.index in self.device_gone else d.register(addr, length, flags)
                reg.handles.append(h)
                reg.lkeys.append(lkey)
                reg.rkeys.append(rkey)
        except OSError as e:
            self._release(reg)
            raise InvalidArgumentError(f"rdma cannot register {length} bytes at {addr:#x}: {e}") from None
        return reg

    def _release(self, reg: Registration) -> None:
        for d, h in zip(self.devices, reg.handles):
            d.deregister(h)

    def _register_internal(self, arr: np.ndarray, access: Access) -> tuple[list[int], list[int]]:
        addr = int(arr.__array_interface__["data"][0])
        reg = self._reg_all(addr, arr.nbytes, self._flags(access, True))
        self._internal.append(reg)
        return reg.lkeys, reg.rkeys

    def register(self, rid: int, addr: int, length: int, access: Access, writable: bool) -> RegionKeys:
        """Registers a region on every device."""
        t0 = time.perf_counter()
        reg = self._reg_all(addr, length, self._flags(access, writable))
        took = time.perf_counter() - t0
        self._mrs[rid] = reg
        if length >= LARGE_REGION:
            log.info("kvflow: rdma registration of %d MiB on %d device(s) took %.3f s (%.2f GB/s)",
                     length >> 20, len(self.devices), took, length / max(took, 1e-9) / 1e9)
        return RegionKeys(tuple(reg.lkeys), tuple(reg.rkeys), took)

    def deregister(self, rid: int) -> None:
        reg = self._mrs.pop(rid, None)
        if reg is not None:
            self._release(reg)

    def regions_on(self, index: int) -> list[tuple[int, int, int, int]]:
        """(addr, length, lkey, rkey) of every region registered on device
        `index`, sorted by address."""
        return sorted((r.addr, r.length, r.lkeys[index], r.rkeys[index])
                      for r in self._mrs.values() if r.handles[index])

    def describe(self) -> dict[str, Any]:
        return {}

    def part(self) -> dict[str, Any]:
        return self._part()

    def reaches(self, address: str, remote: Descriptor) -> str | None:
        return None if remote.rdma is not None else "the peer has no rdma devices"

    def estimate(self, nbytes: int, entries: int) -> float:
        """A round trip plus the bytes at the devices' summed link speed
        (the topology's, in Mb/s; BYTES_PER_S per device where unknown)."""
        topology = self.ctx.topology
        speed = {n.name: n.speed for n in topology.nics} if topology is not None else {}
        rate = sum((speed.get(d.name) or self.BYTES_PER_S * 8e-6) * 1e6 / 8
                   for d in self.devices if d.index not in self.device_gone)
        return self.LATENCY_S + nbytes / (rate or self.BYTES_PER_S)

    def _part(self) -> dict[str, Any]:
        # "up": in service. A device whose port is down counts as up only
        # when no device is in service (peers then pair it and repair
        # until the port is back, as this side's connect does)
        serving = [d.index for d in self.devices if d.index not in self.device_down]
        return {"devices": [{**d.info(), "up": d.index not in self.device_gone
                             and (d.index in serving or not serving)} for d in self.devices],
                "probe": [int(self._probe.__array_interface__["data"][0]), self.probe_keys[1],
                          self._probe.tobytes()[:16]]}

    def device_rows(self) -> list[dict[str, Any]]:
        """Per device, in index order: index, name, state ("up"; "down": a
        port error, its QPs wait for it; "gone": removed or fatally failed,
        closed), why it is out of service and since when (loop time), the
        errors counted on it (QP breaks, device events), the rkey of the
        probe region on it, and whether its worker posts batches itself."""
        return [{"index": d.index, "name": d.name,
                 "state": "gone" if d.index in self.device_gone else "down" if d.index in self.device_down else "up",
                 "why": self.device_down.get(d.index), "down_since": self.device_down_at.get(d.index),
                 "errors": self.device_errors[d.index], "probe_rkey": self.probe_keys[1][d.index],
                 "worker_posts": bool(d.worker_posts), "software": d.software}
                for d in self.devices]

    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    # ------------------------------------------------------------ initiator
    def _qp_wire(self, dev: Any, qp: Any, rdev: int) -> list[Any]:
        return [rdev, qp.qpn, qp.psn, dev.gid, dev.lid, dev.mtu]

    async def connect(self, peer: PeerLink, remote: Descriptor, token: bytes) -> Any:
        """Connects QPs to the peer's devices (a pair of devices per rail,
        qps_per_pair QPs each), probes each QP with a read of the peer's
        cookie, and returns the channel. Raises ProviderUnavailableError
        when the devices do not reach each other."""
        assert remote.rdma is not None
        pairs = self._wanted_pairs(peer, remote.rdma["devices"])
        token = self._next_token
        self._next_token += 1
        ch = _verbs.RdmaChannel(self.ctx.core, peer.table, peer.address, self.slice_size, token)
        qps: list[tuple[Any, Any, int]] = []
        ibgda: list[tuple[Any, Any, int]] = []
        try:
            qps = self._new_qps(pairs)
            if self._ibgda_on:
                ibgda = self._new_qps(pairs, ibgda=True)
            self._remote_qpns[token] = []
            added = await self._join(peer, ch, qps, ibgda)
            self._channels[token] = (peer, ch)
            await self._probe_all(peer, ch, added)
        except BaseException:
            ch.close()
            self._channels.pop(token, None)
            self._remote_qpns.pop(token, None)
            self._ibgda.pop(token, None)
            for dev, qp, rdev in qps + ibgda:
                qp.destroy()                   # those not handed to the channel (destroy is idempotent)
            raise
        return ch

    def ibgda_endpoints(self, channel: Any) -> list[IbgdaEndpoint]:
        """The channel's IBGDA endpoints (Engine(rdma_ibgda=True)), one per
        device pair; [] without."""
        return list(self._ibgda.get(getattr(channel, "token", -1), []))

    def _wanted_pairs(self, peer: PeerLink, rdevs: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """The device pairs (local index, remote index) a channel to `peer`
        should have now. Gone devices (here or there) are left out, and so
        are devices out of service (port down) while another is in service.
        Raises ProviderUnavailableError when either side has none."""
        local = [d.name for d in self.devices]
        rnames = [d["name"] for d in rdevs]
        desc = peer.descriptor
        live = [d.name for d in self.devices if d.index not in self.device_gone]
        serving = [d.name for d in self.devices if d.index not in self.device_down]
        live = serving or live
        rlive = [d["name"] for d in rdevs if d.get("up", True)]
        if not live or not rlive:
            side = "this side" if not live else "the peer's side"
            raise ProviderUnavailableError(f"{peer.address}: no rdma device in service on {side}",
                                           peer=peer.address)
        return _pairs(local, _ordered(live, self.ctx.topology, self.ctx.location),
                      rnames, _ordered(rlive, desc.topology, desc.location or "cpu"))

    def _new_qps(self, pairs: list[tuple[int, int]], ibgda: bool = False) -> list[tuple[Any, Any, int]]:
        """qps_per_pair new QPs per device pair (ibgda: one IBGDA endpoint
        per pair instead): (device, QP, remote index)."""
        qps: list[tuple[Any, Any, int]] = []
        try:
            for ldev, rdev in pairs:
                dev = self.devices[ldev]
                if ibgda:
                    qps.append((dev, dev.create_ibgda(IBGDA_DEPTH), rdev))
                    continue
                for _ in range(self.qps_per_pair):
                    if not dev.reserve(QP_DEPTH):
                        raise ProviderUnavailableError(f"{dev.name}: completion queue full (too many QPs)")
                    qps.append((dev, dev.create_qp(QP_DEPTH), rdev))
        except BaseException:
            for _, qp, _ in qps:
                qp.destroy()
            raise
        return qps

    async def _join(self, peer: PeerLink, ch: Any, qps: list[tuple[Any, Any, int]],
                    ibgda: list[tuple[Any, Any, int]] | None = None) -> list[int]:
        """Has the peer make the other ends of `qps` (and of the IBGDA
        endpoints `ibgda`), connects them and hands `qps` to the channel,
        not in service before their probe (_probe_all). Returns their
        indexes in the channel."""
        msg: dict[str, Any] = {"t": "rdma_connect", "qps": [self._qp_wire(d, q, r) for d, q, r in qps]}
        if ibgda:
            msg["ibgda"] = [self._qp_wire(d, q, r) for d, q, r in ibgda]
        reply = await peer.request(msg)
        answers = _accepted(reply, len(qps), peer.address)
        ibgda_answers = _accepted({"t": reply.get("t"), "qps": reply.get("ibgda")}, len(ibgda), peer.address) \
            if ibgda else []
        # a device retired during the await destroyed our QPs on it
        self._check_live(peer, {dev.index for dev, _, _ in qps})
        # the target's receive window: writes go against its credit
        window = reply.get("window", 0)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ProtocolError(f"{peer.address}: rdma_accept: bad window {window!r}")
        ch.set_window(window)
        for (dev, qp, rdev), (qpn, psn, gid, lid, mtu) in zip(qps + (ibgda or []), answers + ibgda_answers):
            qp.connect(qpn, psn, gid, lid, mtu)
        if ibgda:
            self._ibgda[ch.token] = [IbgdaEndpoint(self, peer, qp, rdev, answer[0])
                                     for (dev, qp, rdev), answer in zip(ibgda, ibgda_answers)]
        added = []
        for (dev, qp, rdev), answer in zip(qps, answers):
            added.append(ch.add_qp(qp, rdev, False))
            self._remote_qpns[ch.token].append(answer[0])
        return added

    def _check_live(self, peer: PeerLink, indexes: set[int]) -> None:
        gone = sorted(self.devices[i].name for i in indexes if i in self.device_gone)
        if gone:
            raise ProviderUnavailableError(f"{peer.address}: rdma device(s) {', '.join(gone)} went away "
                                           "while connecting", peer=peer.address)

    async def notify(self, peer: PeerLink, ch: Any, data: bytes) -> bool:
        """Sends a notification as an RDMA SEND on a live QP: it lands
        after every write that completed before. False when it does not fit
        a receive buffer (the caller uses the control connection)."""
        if len(data) > _verbs.RECV_BYTES:
            return False
        async with self._notify_sem:
            slot = self._notify_free.pop()
            try:
                base = slot * _verbs.RECV_BYTES
                self._notify_buf[base:base + len(data)] = np.frombuffer(data, dtype=np.uint8)
                addr = int(self._notify_buf.__array_interface__["data"][0]) + base
                for i, st in enumerate(ch.qp_stats()):
                    if st["state"] == 1:
                        dev = ch.qp_device(i)
                        status, bid = ch.post_one(i, _verbs.OP_SEND, addr, self.notify_keys[0][dev.index],
                                                  0, 0, len(data))
                        if status:
                            break
                        await self.ctx.batches.track(bid, peer.address, 0, len(data), None)
                        return True
                raise PeerLostError(f"notify to {peer.address}: no live rdma queue pair", peer=peer.address)
            finally:
                self._notify_free.append(slot)

    # ------------------------------------------------------------ target
    def on_control(self, peer_address: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Creates and connects this side's QPs for a peer's rdma_connect."""
        qps = msg.get("qps")
        ibgda = msg.get("ibgda") or []
        if not isinstance(qps, list) or not qps or len(qps) > MAX_TARGET_QPS:
            raise ProtocolError("rdma_connect: bad QP list")
        if not isinstance(ibgda, list) or len(ibgda) > MAX_TARGET_QPS:
            raise ProtocolError("rdma_connect: bad IBGDA QP list")
        mine = self._session_qps.setdefault(session, [])
        if len(mine) + len(qps) + len(ibgda) > MAX_TARGET_QPS:
            raise ProtocolError(f"rdma_connect: more than {MAX_TARGET_QPS} QPs for one peer")
        replace = msg.get("replace") or []
        if not isinstance(replace, list):
            raise ProtocolError("rdma_connect: bad replace list")
        for old in replace:
            if isinstance(old, list) and len(old) == 2:
                self._drop_target(session, tuple(old))
        out = []
        made = []
        try:
            # the IBGDA ones (after the channel's) are plain target QPs
            # outside the receive window: a device's writes take no credit
            for n, item in enumerate(qps + ibgda):
                try:
                    rdev, qpn, psn, gid, lid, mtu = item
                    ok = (isinstance(rdev, int) and 0 <= rdev < len(self.devices) and isinstance(qpn, int)
                          and 0 < qpn < 1 << 24 and isinstance(psn, int) and 0 <= psn < 1 << 24
                          and isinstance(gid, bytes) and len(gid) == 16 and isinstance(lid, int)
                          and 0 <= lid < 1 << 16 and isinstance(mtu, int) and 1 <= mtu <= 5)
                except (TypeError, ValueError):
                    ok = False
                if not ok:
                    raise ProtocolError("rdma_connect: malformed QP entry")
                dev = self.devices[rdev]
                qp = dev.create_qp(1, target=True, credits=self.ctx.receive_window > 0 and n < len(qps))
                made.append(qp)
                qp.connect(qpn, psn, gid, lid, mtu)
                out.append([qp.qpn, qp.psn, dev.gid, dev.lid, dev.mtu])
        except OSError as e:
            for qp in made:
                qp.destroy()
            return {"t": "rdma_error", "message": str(e)}
        except BaseException:
            for qp in made:
                qp.destroy()
            raise
        for qp in made:
            key = (qp.dev.index, qp.qpn)
            self._targets[key] = (peer_address, qp)
            mine.append(key)
        reply = {"t": "rdma_accept", "qps": out[:len(qps)], "window": self.ctx.receive_window}
        if ibgda:
            reply["ibgda"] = out[len(qps):]
        return reply

    def _drop_target(self, session: Any, key: tuple[Any, ...]) -> None:
        """Destroys this session's target QP `key` = (device index, qpn):
        QP numbers are per device, so both are needed."""
        mine = self._session_qps.get(session, [])
        if key in mine:
            mine.remove(key)
            _, qp = self._targets.pop(key)
            qp.destroy()

    def drop_session(self, session: Any) -> None:
        for key in self._session_qps.pop(session, []):
            entry = self._targets.pop(key, None)
            if entry is not None:
                entry[1].destroy()

    # ------------------------------------------------------------ events
    def _on_events(self) -> None:
        for kind, dev, qpn, qp_index, token, wc_status, data in self.events.take():
            if kind == _verbs.EV_NOTIFY:
                entry = self._targets.get((dev, qpn))
                if entry is not None:
                    self.ctx.deliver(entry[0], data)
            elif kind == _verbs.EV_BROKEN:
                entry = self._channels.get(token)
                if entry is None or (token, qp_index) in self._repairing:
                    continue
                peer, ch = entry
                name = WC_STATUS[wc_status] if 0 <= wc_status < len(WC_STATUS) else str(wc_status)
                log.warning("kvflow: rdma QP %d to %s on %s broke (verbs status IBV_WC_%s); reconnecting",
                            qp_index, peer.address, self.devices[dev].name, name)
                self._start_repair(peer, ch, qp_index)

    def closed(self, ch: Any) -> None:
        token = getattr(ch, "token", -1)
        self._channels.pop(token, None)
        self._all_down.pop(token, None)
        self._remote_qpns.pop(token, None)
        self._qp_counts.pop(token, None)
        for ep in self._ibgda.pop(token, []):
            ep.destroy()

    def connections(self, channel: Any) -> list[dict[str, Any]]:
        """One entry per QP: index, device (its name), device_index and
        remote_device (this engine's and the peer's device numbers),
        state ("up", "probing", "broken", "closed", "gone"), work requests
        and bytes posted, its queue (queued_slices and queued_bytes waiting
        to be posted; inflight_slices and inflight_bytes: work requests
        posted and not retired), failures (times it broke), repairs (times
        it came back) and repair_attempts."""
        counts = self._qp_counts.get(getattr(channel, "token", -1), {})
        out = []
        for i, st in enumerate(channel.qp_stats()):
            breaks, repairs, attempts = counts.get(i, (0, 0, 0))
            dev = self.devices[st["dev"]] if st["dev"] < len(self.devices) else None
            out.append({"index": i, "device": dev.name if dev is not None else str(st["dev"]), "device_index": st["dev"],
                        "remote_device": st["rdev"], "state": QP_STATES.get(st["state"], str(st["state"])),
                        "up": st["state"] == 1, "wrs": st["wrs"], "bytes": st["bytes"], "qpn": st["qpn"],
                        **{k: st[k] for k in QUEUE_FIELDS},
                        "failures": breaks, "repairs": repairs, "repair_attempts": attempts})
        return out

    def count_qp(self, ch: Any, index: int, what: int) -> None:
        """Counts a break (0), a repair (1) or a repair attempt (2) of QP `index`."""
        self._qp_counts.setdefault(ch.token, {}).setdefault(index, [0, 0, 0])[what] += 1

    async def close(self) -> None:
        """Closes every device and what is on it. Repairs are cancelled
        and awaited first: a repair's QP must be destroyed (its `finally`)
        while its device is still open."""
        if self._reopen_timer is not None:
            self._reopen_timer.cancel()
            self._reopen_timer = None
        await cancel_and_wait([*self._repairs, *self._lost, self._device_check])
        loop = self.ctx.loop
        try:
            loop.remove_reader(self.events.fileno())
        except Exception:
            pass
        if self._uevents is not None:
            loop.remove_reader(self._uevents.fileno())
            self._uevents.close()
            self._uevents = None
        for index in list(self._async_fds):
            self._unwatch(index)
        for session in list(self._session_qps):
            self.drop_session(session)
        for rid in list(self._mrs):
            self.deregister(rid)
        for reg in self._internal:
            self._release(reg)
        self._internal = []
        for d in self.devices:
            d.close()
        self.events.close()
