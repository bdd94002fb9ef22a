"""The rdma provider's Python side: which devices an engine uses, memory
registration on every one of them, connecting queue pairs through the
handshake server (both ends), the reachability probe, notifications over
the data path, and reconnecting a QP that broke.

Hot-path work is native (kvflow/_native/rdma.c); everything here runs once
per connection, registration or failure.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np

from kvflow.errors import InvalidArgumentError, PeerLostError, ProtocolError, ProviderUnavailableError
from kvflow.status import WC_STATUS
from kvflow.memory import Access
from kvflow.topology import NicKind, Topology, match_rails

try:
    from kvflow import _verbs
except ImportError:          # built without libibverbs headers
    _verbs = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from kvflow.engine.engine import Engine
    from kvflow.engine.peer import Peer

__all__ = ["RdmaProvider", "available", "device_names"]

log = logging.getLogger("kvflow")

QP_DEPTH = 128                 # send-queue entries per QP
QP_UP = 1                      # RdmaChannel.stats() "state": 1 up, 2 probing, 0 broken, -1 closed,
QP_GONE = -2                   # -2 destroyed with its (removed) device
PROBE_TIMEOUT = 5.0            # reachability read per QP
MAX_TARGET_QPS = 256           # per control session
REPAIR_MIN = 0.2               # first back-off of a broken QP's repair (doubles)
REPAIR_MAX = 8.0
DEAD_AFTER = 10.0              # no QP of a peer up this long (at least keepalive): the peer is lost
NOTIFY_SLOTS = 64              # registered send buffers for notifications
LARGE_REGION = 64 << 20        # registrations at least this big are logged with their time
DEVICE_CHECK = 2.0             # seconds between checks that each device still exists (uevents are faster)
REOPEN_RETRY = 0.1             # first wait before opening a returning device again (doubles to DEVICE_CHECK)
NETLINK_KOBJECT_UEVENT = 15    # linux/netlink.h: the kernel's device add/remove announcements
ACK_TIMEOUT_HW = 14            # RC ACK timeout exponents, see choose_ack_timeout()
ACK_TIMEOUT_SOFT = 17


def available() -> bool:
    return _verbs is not None


def device_names() -> list[str]:
    """RDMA devices on this host ([] when none or not built)."""
    return _verbs.device_names() if _verbs is not None else []


def is_software(name: str, sysfs: str = "/sys/class/infiniband") -> bool:
    """Device `name` has no parent in sysfs: Soft-RoCE or siw, no NIC."""
    return not os.path.exists(f"{sysfs}/{name}/device")


def choose_worker_posts(name: str, sysfs: str = "/sys/class/infiniband") -> bool:
    """Whether device `name`'s worker thread posts the work requests of
    unpolled batches (not the submitting thread): env
    KVFLOW_RDMA_WORKER_POSTS (0 or 1), else for software devices only. On
    Soft-RoCE ibv_post_send does the transfer inside the system call, so
    posting on the event loop's thread stalls the loop for the whole batch;
    a NIC's post is a doorbell write (see kvflow/_native/rdma.h)."""
    env = os.environ.get("KVFLOW_RDMA_WORKER_POSTS", "")
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise InvalidArgumentError(f"KVFLOW_RDMA_WORKER_POSTS={env!r} is not 0 or 1")
    return is_software(name, sysfs)


def choose_ack_timeout(name: str, override: int | None = None, sysfs: str = "/sys/class/infiniband") -> int:
    """The RC ACK timeout exponent (4.096 us * 2^n) for device `name`:
    `override` (the Engine's rdma_ack_timeout), else env
    KVFLOW_RDMA_ACK_TIMEOUT, else 14 (67 ms) for a device with a parent in
    sysfs (a hardware NIC) and 17 (537 ms) for one without (rxe, siw:
    emulated ACKs can be later than 67 ms, see kvflow/_verbs.pyx). Raises
    InvalidArgumentError for a value outside 1..31."""
    if override is None:
        env = os.environ.get("KVFLOW_RDMA_ACK_TIMEOUT", "")
        if env:
            try:
                override = int(env)
            except ValueError:
                raise InvalidArgumentError(f"KVFLOW_RDMA_ACK_TIMEOUT={env!r} is not a whole number "
                                           "from 1 to 31") from None
    if override is not None:
        return check_ack_timeout(override)
    return ACK_TIMEOUT_SOFT if is_software(name, sysfs) else ACK_TIMEOUT_HW


def check_ack_timeout(value: Any) -> int:
    """`value` if it is a valid ACK timeout exponent (1..31), else InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 31:
        raise InvalidArgumentError(f"rdma ACK timeout {value!r} is not a whole number from 1 to 31 "
                                   "(4.096 us * 2^n)")
    return value


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


class RdmaProvider:
    """The rdma provider of one engine."""

    def __init__(self, engine: "Engine", *, devices: list[str] | None = None, gid_index: int | None = None,
                 qps_per_pair: int = 2, slice_size: int = 256 << 10, ack_timeout: int | None = None) -> None:
        if _verbs is None:
            raise ProviderUnavailableError("kvflow was built without libibverbs (install libibverbs-dev "
                                           "and reinstall kvflow)")
        names = devices
        if names is None:
            env = os.environ.get("KVFLOW_RDMA_DEVICES", "")
            names = [n for n in env.split(",") if n] or _verbs.device_names()
        if not names:
            raise ProviderUnavailableError("no RDMA device on this host")
        self._engine = engine
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
                self.devices.append(_verbs.Device(engine._core, self.events, name, len(self.devices),
                                                  gid_index=gid_index, ack_timeout=timeouts[name],
                                                  worker_posts=worker_posts[name]))
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
        self._channels: dict[int, tuple["Peer", Any]] = {}            # token -> (peer, channel)
        self._next_token = 1
        self._repairs: set[asyncio.Task[None]] = set()
        self._lost: set[asyncio.Task[None]] = set()                 # peers being closed (no device left)
        self._repairing: set[tuple[int, int]] = set()                 # (token, QP index)
        self._extending: set[int] = set()                             # channel tokens being extended
        self._extend_again: set[int] = set()
        self._all_down: dict[int, float] = {}                         # token -> since when no QP is up
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
        self._reopen_delay = REOPEN_RETRY
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
        engine._loop.add_reader(self.events.fileno(), self._on_events)
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

    def register(self, rid: int, addr: int, length: int, access: Access, writable: bool
                 ) -> tuple[list[int], list[int], float]:
        """Registers a region on every device: (lkeys, rkeys, seconds)."""
        t0 = time.perf_counter()
        reg = self._reg_all(addr, length, self._flags(access, writable))
        took = time.perf_counter() - t0
        self._mrs[rid] = reg
        if length >= LARGE_REGION:
            log.info("kvflow: rdma registration of %d MiB on %d device(s) took %.3f s (%.2f GB/s)",
                     length >> 20, len(self.devices), took, length / max(took, 1e-9) / 1e9)
        return list(reg.lkeys), list(reg.rkeys), took

    def deregister(self, rid: int) -> None:
        reg = self._mrs.pop(rid, None)
        if reg is not None:
            self._release(reg)

    def describe(self) -> dict[str, Any]:
        # "up": in service. A device whose port is down counts as up only
        # when no device is in service (peers then pair it and repair
        # until the port is back, as this side's connect does)
        serving = [d.index for d in self.devices if d.index not in self.device_down]
        return {"devices": [{**d.info(), "up": d.index not in self.device_gone
                             and (d.index in serving or not serving)} for d in self.devices],
                "probe": [int(self._probe.__array_interface__["data"][0]), self.probe_keys[1],
                          self._probe.tobytes()[:16]]}

    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    # ------------------------------------------------------------ initiator
    def _qp_wire(self, dev: Any, qp: Any, rdev: int) -> list[Any]:
        return [rdev, qp.qpn, qp.psn, dev.gid, dev.lid, dev.mtu]

    async def connect(self, peer: "Peer", remote: dict[str, Any],
                      request: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Any:
        """Connects QPs to the peer's devices (a pair of devices per rail,
        qps_per_pair QPs each), probes each QP with a read of the peer's
        cookie, and returns the channel. Raises ProviderUnavailableError
        when the devices do not reach each other."""
        pairs = self._wanted_pairs(peer, remote["devices"])
        token = self._next_token
        self._next_token += 1
        ch = _verbs.RdmaChannel(self._engine._core, peer._table, peer.address, self.slice_size, token)
        qps = []
        try:
            qps = self._new_qps(pairs)
            peer._rdma_remote_qpns = []
            added = await self._join(peer, ch, qps, request)
            self._channels[token] = (peer, ch)
            await self._probe_all(peer, ch, added)
        except BaseException:
            ch.close()
            self._channels.pop(token, None)
            for dev, qp, rdev in qps:
                qp.destroy()                   # those not handed to the channel
            raise
        return ch

    def _wanted_pairs(self, peer: "Peer", rdevs: list[dict[str, Any]]) -> list[tuple[int, int]]:
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
        return _pairs(local, _ordered(live, self._engine.topology, self._engine.location),
                      rnames, _ordered(rlive, desc.topology, desc.location or "cpu"))

    def _new_qps(self, pairs: list[tuple[int, int]]) -> list[tuple[Any, Any, int]]:
        """qps_per_pair new QPs per device pair: (device, QP, remote index)."""
        qps: list[tuple[Any, Any, int]] = []
        try:
            for ldev, rdev in pairs:
                dev = self.devices[ldev]
                for _ in range(self.qps_per_pair):
                    if not dev.reserve(QP_DEPTH):
                        raise ProviderUnavailableError(f"{dev.name}: completion queue full (too many QPs)")
                    qps.append((dev, dev.create_qp(QP_DEPTH), rdev))
        except BaseException:
            for _, qp, _ in qps:
                qp.destroy()
            raise
        return qps

    async def _join(self, peer: "Peer", ch: Any, qps: list[tuple[Any, Any, int]],
                    request: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> list[int]:
        """Has the peer make the other ends of `qps`, connects them and
        hands them to the channel, not in service before their probe
        (_probe_all). Returns their indexes in the channel."""
        reply = await request({"t": "rdma_connect", "qps": [self._qp_wire(d, q, r) for d, q, r in qps]})
        answers = _accepted(reply, len(qps), peer.address)
        # a device retired during the await destroyed our QPs on it
        self._check_live(peer, {dev.index for dev, _, _ in qps})
        for (dev, qp, rdev), (qpn, psn, gid, lid, mtu) in zip(qps, answers):
            qp.connect(qpn, psn, gid, lid, mtu)
        added = []
        for (dev, qp, rdev), answer in zip(qps, answers):
            added.append(ch.add_qp(qp, rdev, False))
            peer._rdma_remote_qpns.append(answer[0])
        return added

    def _check_live(self, peer: "Peer", indexes: set[int]) -> None:
        gone = sorted(self.devices[i].name for i in indexes if i in self.device_gone)
        if gone:
            raise ProviderUnavailableError(f"{peer.address}: rdma device(s) {', '.join(gone)} went away "
                                           "while connecting", peer=peer.address)

    async def _probe_all(self, peer: "Peer", ch: Any, indexes: list[int], required: bool = True) -> None:
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

    def _extend_soon(self, peer: "Peer", ch: Any) -> None:
        """Runs _extend for this channel (once more if one is running)."""
        if ch.token in self._extending:
            self._extend_again.add(ch.token)
            return
        self._extending.add(ch.token)
        task = self._engine._loop.create_task(self._extend(peer, ch))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _extend(self, peer: "Peer", ch: Any) -> None:
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
                have = {(st["dev"], st["rdev"]) for st in ch.stats()}
                missing = [p for p in pairs if p not in have]
                if missing:
                    qps = []
                    try:
                        qps = self._new_qps(missing)
                        added = await self._join(peer, ch, qps, peer._request)
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

    async def _probe_qp(self, peer: "Peer", ch: Any, i: int) -> None:
        """Reads the peer's cookie over QP `i` (a posted READ that must come
        back with the right bytes). Raises ProviderUnavailableError."""
        raddr, rkeys, cookie = peer.descriptor.rdma["probe"]
        dev = ch.qp_device(i)
        rdev = ch.stats()[i]["rdev"]
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
                    await self._engine._batches.track(bid, peer.address, 1, len(cookie), PROBE_TIMEOUT)
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

    async def notify(self, peer: "Peer", ch: Any, data: bytes) -> bool:
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
                for i, st in enumerate(ch.stats()):
                    if st["state"] == 1:
                        dev = ch.qp_device(i)
                        status, bid = ch.post_one(i, _verbs.OP_SEND, addr, self.notify_keys[0][dev.index],
                                                  0, 0, len(data))
                        if status:
                            break
                        await self._engine._batches.track(bid, peer.address, 0, len(data), None)
                        return True
                raise PeerLostError(f"notify to {peer.address}: no live rdma queue pair", peer=peer.address)
            finally:
                self._notify_free.append(slot)

    # ------------------------------------------------------------ target
    def accept(self, peer_address: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Creates and connects this side's QPs for a peer's rdma_connect."""
        qps = msg.get("qps")
        if not isinstance(qps, list) or not qps or len(qps) > MAX_TARGET_QPS:
            raise ProtocolError("rdma_connect: bad QP list")
        mine = self._session_qps.setdefault(session, [])
        if len(mine) + len(qps) > MAX_TARGET_QPS:
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
            for item in qps:
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
                qp = dev.create_qp(1, target=True)
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
        return {"t": "rdma_accept", "qps": out}

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
                    self._engine._notifications.put_nowait((entry[0], data))
            elif kind == _verbs.EV_BROKEN:
                entry = self._channels.get(token)
                if entry is None or (token, qp_index) in self._repairing:
                    continue
                peer, ch = entry
                name = WC_STATUS[wc_status] if 0 <= wc_status < len(WC_STATUS) else str(wc_status)
                log.warning("kvflow: rdma QP %d to %s on %s broke (verbs status IBV_WC_%s); reconnecting",
                            qp_index, peer.address, self.devices[dev].name, name)
                self._start_repair(peer, ch, qp_index)

    def _start_repair(self, peer: "Peer", ch: Any, index: int) -> None:
        if (ch.token, index) in self._repairing:
            return
        task = self._engine._loop.create_task(self._repair(peer, ch, index))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    # ------------------------------------------------------------ device health
    def _watch_devices(self) -> None:
        """Watches each device's async events (port error/active, fatal
        errors) and its removal: a kernel uevent when a device node goes
        (Soft-RoCE's removal sends no verbs event at all, see
        _check_gone), with a periodic check behind it for where uevents do
        not reach (another user namespace)."""
        loop = self._engine._loop
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
            self._engine._loop.add_reader(fd, self._on_async, d.index)
            self._async_fds[d.index] = fd     # the fd it was watched by, for remove_reader
        except OSError as e:
            log.warning("kvflow: rdma device %s: its events cannot be watched: %s", d.name, e)

    def _unwatch(self, index: int) -> None:
        fd = self._async_fds.pop(index, None)
        if fd is not None:
            try:
                self._engine._loop.remove_reader(fd)
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
            d = _verbs.Device(self._engine._core, self.events, name, index, gid_index=self._gid_index,
                              ack_timeout=choose_ack_timeout(name, self._ack_timeout),
                              worker_posts=choose_worker_posts(name))
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
        self._reopen_delay = REOPEN_RETRY
        self._watch(d)
        self._engine._rdma_rekeyed({rid: (reg.lkeys, reg.rkeys) for rid, reg in self._mrs.items()})
        gone = [(peer, ch, i) for peer, ch, i in self._qps_on(index) if ch.stats()[i]["state"] == QP_GONE]
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
        if self._reopen_timer is not None or self._reopen_delay >= DEVICE_CHECK:
            return                           # the periodic check tries from then on
        self._reopen_timer = self._engine._loop.call_later(self._reopen_delay, self._reopen_again)
        self._reopen_delay *= 2

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
            st = ch.stats()[i]
            if st["qpn"] == qpn:
                log.warning("kvflow: rdma device %s: QP %d (QP %d to %s): %s; reconnecting",
                            d.name, qpn, i, peer.address, what)
                if st["state"] in (1, 2):
                    ch.break_qp(i)
                self._start_repair(peer, ch, i)
                return
        log.warning("kvflow: rdma device %s: QP %d: %s", d.name, qpn, what)

    def _qps_on(self, index: int) -> list[tuple["Peer", Any, int]]:
        return [(peer, ch, i) for peer, ch in self._channels.values()
                for i, st in enumerate(ch.stats()) if st["dev"] == index]

    def _take_out(self, index: int, why: str) -> None:
        """Device `index` is out of service now (a port error): its QPs
        break at once (their slices go to other devices' QPs instead of
        waiting for retries to time out) and their repairs wait for the port
        to come back, probing with back-off."""
        if index in self.device_down:
            return
        d = self.devices[index]
        self.device_down[index] = why
        self.device_down_at[index] = self._engine._loop.time()
        self.device_errors[index] += 1
        log.warning("kvflow: rdma device %s out of service (%s): its traffic moves to the other devices",
                    d.name, why)
        for peer, ch, i in self._qps_on(index):
            if ch.stats()[i]["state"] in (1, 2):
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
        self.device_down_at.setdefault(index, self._engine._loop.time())
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
            stats = ch.stats()
            if stats and all(s["state"] == QP_GONE for s in stats):
                log.warning("kvflow: no rdma device left toward %s (all its QPs were on removed devices); "
                            "closing the peer: connect again to use the devices in service", peer.address)
                ch.close()                     # fails queued and in-flight work now
                self.forget_channel(ch)
                task = self._engine._loop.create_task(peer.close())
                self._lost.add(task)
                task.add_done_callback(self._lost.discard)

    async def _repair(self, peer: "Peer", ch: Any, index: int) -> None:
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
        delay = REPAIR_MIN
        try:
            while ch.alive and peer.alive:
                if dev.index in self.device_gone:
                    return
                if dev.index in self.device_down:
                    # no use trying before the back-off (or the port's return)
                    await self._wait_back(dev.index, delay)
                    if dev.index in self.device_gone:
                        return
                why = await self._reconnect(peer, ch, index)
                if why is None:
                    if self.device_down.pop(dev.index, None) is not None:
                        log.info("kvflow: rdma device %s answers again: back in service", dev.name)
                    self._all_down.pop(ch.token, None)
                    log.info("kvflow: rdma QP %d to %s on %s is back", index, peer.address, dev.name)
                    return
                loop = self._engine._loop
                if not any(q["state"] == QP_UP for q in ch.stats()):
                    since = self._all_down.setdefault(ch.token, loop.time())
                    if loop.time() - since > max(DEAD_AFTER, self._engine.keepalive):
                        log.warning("kvflow: no rdma QP to %s works (last: %s); closing the peer",
                                    peer.address, why)
                        await peer.close()
                        return
                log.warning("kvflow: rdma QP %d to %s on %s is still down (%s); next try in %.1f s",
                            index, peer.address, dev.name, why, delay)
                if dev.index not in self.device_down:
                    await self._wait_back(dev.index, delay)
                delay = min(delay * 2, REPAIR_MAX)
        finally:
            self._repairing.discard(key)

    async def _reconnect(self, peer: "Peer", ch: Any, index: int) -> str | None:
        """One repair attempt of QP `index`: None when it is in service
        again, else why not."""
        st = ch.stats()[index]
        dev = self.devices[st["dev"]]        # for a QP that went with its device: the one reopened
        rdev = st["rdev"]
        qp = None
        try:
            qp = dev.create_qp(QP_DEPTH)
            old = peer._rdma_remote_qpns[index]
            reply = await peer._request({"t": "rdma_connect", "qps": [self._qp_wire(dev, qp, rdev)],
                                         "replace": [[rdev, old]]})
            (qpn, psn, gid, lid, mtu), = _accepted(reply, 1, peer.address)
            # the target replaced its QP: the next attempt replaces this one
            peer._rdma_remote_qpns[index] = qpn
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

    def peer_changed(self, peer: "Peer") -> None:
        """The peer pushed its rdma devices again (one of its devices came
        back, with new probe keys): repairs toward it that wait out a
        back-off try now, and a channel that connected while that device
        was gone gets QPs on it."""
        for p, ch in list(self._channels.values()):
            if p is peer:
                for st in ch.stats():
                    if st["state"] not in (QP_UP, QP_GONE) and st["dev"] not in self.device_down:
                        self._wake(st["dev"])
                self._extend_soon(peer, ch)     # a device of the peer's it connected without

    def forget_channel(self, ch: Any) -> None:
        self._channels.pop(getattr(ch, "token", -1), None)
        self._all_down.pop(getattr(ch, "token", -1), None)

    async def close(self) -> None:
        """Closes every device and what is on it. Repairs are cancelled
        and awaited first: a repair's QP must be destroyed (its `finally`)
        while its device is still open."""
        tasks = [t for t in (*self._repairs, *self._lost, self._device_check) if t is not None]
        for t in tasks:
            t.cancel()
        if self._reopen_timer is not None:
            self._reopen_timer.cancel()
            self._reopen_timer = None
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        loop = self._engine._loop
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
