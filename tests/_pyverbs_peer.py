#!/usr/bin/env python3
"""A foreign RDMA peer of a kvflow engine, built on pyverbs (rdma-core's own
Python bindings), for cross-checking kvflow's rdma provider against an
independent verbs implementation.

It speaks kvflow's control protocol itself (plain msgpack over TCP, no kvflow
import at all), asks the engine for one RC queue pair with ``rdma_connect``,
connects its own pyverbs QP to it, and then moves bytes of one of the engine's
registered regions with one-sided verbs:

    python tests/_pyverbs_peer.py HOST:PORT kv --offset 4096 --length 65536 --read
    python tests/_pyverbs_peer.py HOST:PORT kv --offset 0 --length 4096 --write-seed 7

``--read`` RDMA-READs the range into its own MR; ``--write-seed N`` RDMA-WRITEs
``numpy.random.default_rng(N).bytes(length)`` into it (the suite's
``_target.pattern(N, length)``) and waits for every completion. Either way it
prints one JSON object on stdout whose ``sha256`` is the hex SHA-256 of the
bytes read / written (``--dump FILE`` also writes them to FILE).

Exit status: 0 on success; 2 for a usage, connection or protocol problem; 3
when a work completion failed (its IBV_WC_* status is printed); 4 when the
landing buffer's guard bytes changed (a READ wrote outside its SGE).
Diagnostics go to stderr, prefixed "pyverbs-peer:".

pyverbs lives in the system python's dist-packages; it is appended (not
inserted) to sys.path so that this interpreter's own packages win.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import struct
import sys
import time

SYSTEM_DIST = "/usr/lib/python3/dist-packages"
PROTOCOL_VERSION = 1
NONCE_BYTES = 32
MAX_FRAME = 64 << 20
GUARD = 4096                      # guard bytes either side of the landing area
GUARD_BYTE = 0xA5

# QP parameters the brief of kvflow's control protocol asks for.
ACK_TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12
RD_ATOMIC = 16
HOP_LIMIT = 64
PORT = 1

EXIT_OK, EXIT_USAGE, EXIT_COMPLETION, EXIT_GUARD = 0, 2, 3, 4

_LEN = struct.Struct(">I")
_ACCESS_READ, _ACCESS_WRITE = 1, 2      # kvflow.memory.Access bits


class PeerError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def log(msg: str) -> None:
    print(f"pyverbs-peer: {msg}", file=sys.stderr, flush=True)


def pattern(seed: int, n: int) -> bytes:
    """The bytes --write-seed writes (tests/_target.py's pattern())."""
    import numpy as np

    return np.random.default_rng(seed).bytes(n)


# ---------------------------------------------------------------- control protocol


class Control:
    """kvflow's control connection: 4-byte big-endian length + msgpack map."""

    def __init__(self, address: str, timeout: float) -> None:
        import msgpack

        self._msgpack = msgpack
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise PeerError(f"address {address!r} is not host:port")
        self.address = address
        try:
            self.sock = socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout)
        except OSError as e:
            raise PeerError(f"cannot reach the engine at {address}: {e}") from None
        self.sock.settimeout(timeout)

    def send(self, msg: dict) -> None:
        body = self._msgpack.packb({"v": PROTOCOL_VERSION, **msg}, use_bin_type=True)
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except socket.timeout:
                raise PeerError(f"{self.address}: no reply from the engine (timed out)") from None
            if not chunk:
                raise PeerError(f"{self.address} closed the control connection")
            buf += chunk
        return bytes(buf)

    def recv(self) -> dict:
        (n,) = _LEN.unpack(self._exactly(_LEN.size))
        if n > MAX_FRAME:
            raise PeerError(f"{self.address}: frame of {n} bytes is too large")
        msg = self._msgpack.unpackb(self._exactly(n), raw=False, strict_map_key=True)
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise PeerError(f"{self.address}: not a kvflow frame: {msg!r:.200}")
        if msg.get("v") != PROTOCOL_VERSION:
            raise PeerError(f"{self.address}: protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
        if msg["t"] == "error":
            raise PeerError(f"{self.address} sent an error: {msg.get('code')}: {msg.get('message')}")
        return msg

    def close(self) -> None:
        try:
            self.send({"t": "bye"})
        except OSError:
            pass
        self.sock.close()


def handshake(ctl: Control) -> dict:
    """hello → challenge → auth → welcome; returns the descriptor."""
    ctl.send({"t": "hello", "nonce": os.urandom(NONCE_BYTES), "address": f"pyverbs-peer-{os.getpid()}:1"})
    ch = ctl.recv()
    if ch["t"] != "challenge":
        raise PeerError(f"expected challenge, got {ch['t']!r}")
    if ch.get("auth"):
        raise PeerError("the engine requires a shared secret; this peer does not support one")
    ctl.send({"t": "auth", "proof": b""})
    welcome = ctl.recv()
    if welcome["t"] != "welcome":
        raise PeerError(f"expected welcome, got {welcome['t']!r}")
    desc = welcome.get("descriptor")
    if not isinstance(desc, dict):
        raise PeerError("welcome without a descriptor")
    return desc


def request(ctl: Control, desc: dict, msg: dict) -> dict:
    """Sends a request with rid 1 and returns the reply carrying that rid,
    applying region updates ("regions" frames) that arrive first."""
    ctl.send({**msg, "rid": 1})
    while True:
        m = ctl.recv()
        if m.get("rid") == 1:
            return m
        if m["t"] == "regions":
            desc["regions"] = m.get("regions", [])
        elif m["t"] == "descriptor":
            desc.update(m.get("descriptor") or {})
        else:
            raise PeerError(f"unexpected {m['t']!r} while waiting for the reply to {msg['t']!r}")


# ---------------------------------------------------------------- verbs


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _gid_bytes(gid) -> bytes:
    return bytes.fromhex(str(gid.gid if hasattr(gid, "gid") else gid).replace(":", ""))


def _sysfs(dev: str, rel: str) -> str:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{PORT}/{rel}") as f:
            return f.read().strip()
    except OSError:
        return ""


def choose_gid(ctx, dev: str, tbl_len: int, link_layer: int, e) -> tuple[int, bytes]:
    """On RoCE: the IPv4-mapped RoCE v2 GID (::ffff:a.b.c.d), else any
    non-link-local RoCE v2 one. On InfiniBand: index 0."""
    gids = []
    for i in range(min(tbl_len, 256)):
        try:
            raw = _gid_bytes(ctx.query_gid(PORT, i))
        except Exception:
            raw = bytes(16)
        gids.append(raw)
    if link_layer != int(e.IBV_LINK_LAYER_ETHERNET):
        if gids and any(gids[0]):
            return 0, gids[0]
        raise PeerError(f"{dev}: GID 0 is empty")
    best, best_rank = -1, 0
    for i, raw in enumerate(gids):
        if not any(raw) or raw[:2] == b"\xfe\x80":
            continue
        v2 = _sysfs(dev, f"gid_attrs/types/{i}").lower() == "roce v2"
        mapped = raw[:10] == bytes(10) and raw[10:12] == b"\xff\xff"
        rank = (2 if v2 else 0) + (1 if mapped else 0) + 1
        if rank > best_rank:
            best, best_rank = i, rank
    if best < 0:
        raise PeerError(f"{dev}: no usable GID (no RoCE v2 address on its netdev?)")
    return best, gids[best]


def wc_status_name(status: int, e) -> str:
    try:
        return e.ibv_wc_status(status).name
    except Exception:
        return f"IBV_WC_status_{status}"


def default_device(desc_devices: list) -> str:
    from pyverbs.device import get_device_list

    env = [n for n in os.environ.get("KVFLOW_RDMA_DEVICES", "").split(",") if n]
    names = []
    for d in get_device_list():
        n = d.name
        names.append(n.decode() if isinstance(n, bytes) else str(n))
    if not names:
        raise PeerError("no RDMA device on this host")
    for n in env + [d.get("name") for d in desc_devices]:
        if n in names:
            return n
    return names[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="the kvflow engine's handshake address, host:port")
    ap.add_argument("region", help="name of the engine's registered region")
    ap.add_argument("--offset", type=int, default=0, help="byte offset in the region (default 0)")
    ap.add_argument("--length", type=int, default=None, help="bytes to move (default: to the region's end)")
    op = ap.add_mutually_exclusive_group(required=True)
    op.add_argument("--read", action="store_true", help="RDMA READ the range and print its SHA-256")
    op.add_argument("--write-seed", type=int, metavar="N",
                    help="RDMA WRITE numpy.random.default_rng(N).bytes(length) into the range")
    ap.add_argument("--device", help="local RDMA device (default: KVFLOW_RDMA_DEVICES, else the engine's "
                                     "device name if present here, else the first)")
    ap.add_argument("--rdev", type=int, default=None,
                    help="index of the engine's device to pair with (default: the one named like ours, else 0)")
    ap.add_argument("--gid-index", type=int, default=None, help="local GID index (default: RoCE v2 IPv4-mapped)")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="bytes per work request (default 1 MiB)")
    ap.add_argument("--unchecked", action="store_true",
                    help="do not check the range and access rights locally (let the NIC judge)")
    ap.add_argument("--dump", metavar="FILE", help="also write the bytes read/written to FILE")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for the handshake and completions")
    args = ap.parse_args(argv)
    try:
        out = run(args)
    except PeerError as e:
        log(f"error: {e}")
        return e.code
    print(json.dumps(out), flush=True)
    return EXIT_OK


def run(args: argparse.Namespace) -> dict:
    if SYSTEM_DIST not in sys.path:
        sys.path.append(SYSTEM_DIST)
    try:
        import pyverbs.enums as e
        from pyverbs.addr import AHAttr, GID, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    except ImportError as ex:
        raise PeerError(f"pyverbs is not importable (python3-pyverbs installed in {SYSTEM_DIST}?): {ex}") from None
    if args.chunk <= 0:
        raise PeerError("--chunk must be positive")

    t0 = time.monotonic()
    ctl = Control(args.address, args.timeout)
    ctx = None
    try:
        desc = handshake(ctl)
        rdma = desc.get("rdma")
        if not isinstance(rdma, dict) or not rdma.get("devices"):
            raise PeerError(f"{args.address} has no rdma section in its descriptor (engine without rdma?)")
        rdevs = rdma["devices"]

        def find_region() -> list:
            for r in desc.get("regions") or []:
                if len(r) >= 4 and r[3] == args.region:
                    return r
            raise PeerError(f"{args.address} has no region named {args.region!r} "
                            f"(it has {[r[3] for r in desc.get('regions') or []]})")

        def target(region: list) -> tuple[int, int, int, int]:
            """(region address, rkey on device rdev, offset, length), checked."""
            raddr, rlen, raccess = int(region[0]), int(region[1]), int(region[2])
            rkeys = region[4] if len(region) > 4 else []
            if rdev >= len(rkeys):
                raise PeerError(f"region {args.region!r} has no rkey for the engine's device {rdev} "
                                f"(rkeys {rkeys})")
            offset = args.offset
            length = args.length if args.length is not None else rlen - offset
            if length <= 0:
                raise PeerError(f"nothing to move (offset {offset}, length {length})")
            if not args.unchecked:
                if offset < 0 or offset + length > rlen:
                    raise PeerError(f"range {offset}+{length} is outside region {args.region!r} of {rlen} bytes")
                need = _ACCESS_READ if args.read else _ACCESS_WRITE
                if not raccess & need:
                    raise PeerError(f"region {args.region!r} does not allow remote "
                                    f"{'READ' if args.read else 'WRITE'} (access {raccess})")
            return raddr, int(rkeys[rdev]), offset, length

        dev_name = args.device or default_device(rdevs)
        if args.rdev is not None:
            rdev = args.rdev
        else:
            rdev = next((i for i, d in enumerate(rdevs) if d.get("name") == dev_name), 0)
        if not 0 <= rdev < len(rdevs):
            raise PeerError(f"--rdev {rdev}: the engine has {len(rdevs)} device(s)")
        _, _, _, length = target(find_region())

        # ---- verbs resources
        try:
            ctx = Context(name=dev_name)
        except PyverbsError as ex:
            raise PeerError(f"cannot open RDMA device {dev_name}: {ex}") from None
        pattr = ctx.query_port(PORT)
        if int(pattr.state) != int(e.IBV_PORT_ACTIVE):
            raise PeerError(f"{dev_name} port {PORT} is not active (state {pattr.state})")
        dattr = ctx.query_device()
        if args.gid_index is not None:
            gid_index = args.gid_index
            my_gid = _gid_bytes(ctx.query_gid(PORT, gid_index))
        else:
            gid_index, my_gid = choose_gid(ctx, dev_name, pattr.gid_tbl_len, pattr.link_layer, e)
        my_lid, my_mtu = int(pattr.lid), int(pattr.active_mtu)
        rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_rd_atom)))
        init_rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_init_rd_atom)))

        pd = PD(ctx)
        nchunks = -(-length // args.chunk)
        depth = max(1, min(64, nchunks))
        cq = CQ(ctx, depth + 8)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        my_psn = int.from_bytes(os.urandom(3), "little")

        a = QPAttr(qp_state=e.IBV_QPS_INIT)
        a.pkey_index = 0
        a.port_num = PORT
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        try:
            qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
        except PyverbsError as ex:
            raise PeerError(f"cannot move QP {qp.qp_num} to INIT: {ex}") from None

        # ---- ask the engine for its end of the QP
        reply = request(ctl, desc, {"t": "rdma_connect",
                                    "qps": [[rdev, qp.qp_num, my_psn, my_gid, my_lid, my_mtu]]})
        if reply["t"] == "rdma_error":
            raise PeerError(f"{args.address} refused rdma_connect: {reply.get('message')}")
        if reply["t"] != "rdma_accept" or not isinstance(reply.get("qps"), list) or len(reply["qps"]) != 1:
            raise PeerError(f"malformed reply to rdma_connect: {reply!r:.300}")
        try:
            r_qpn, r_psn, r_gid, r_lid, r_mtu = reply["qps"][0]
            assert isinstance(r_gid, bytes) and len(r_gid) == 16
        except (ValueError, TypeError, AssertionError):
            raise PeerError(f"malformed rdma_accept entry: {reply['qps'][0]!r:.200}") from None
        # a "regions" update may have come first: take the region as it is now

        raddr, rkey, offset, length = target(find_region())

        # ---- RTR, RTS
        dgid = GID()
        dgid.gid = _gid_str(r_gid)
        gr = GlobalRoute(dgid=dgid, sgid_index=gid_index, hop_limit=HOP_LIMIT)
        is_global = 1 if any(r_gid) else 0
        a = QPAttr(qp_state=e.IBV_QPS_RTR)
        a.path_mtu = min(my_mtu, int(r_mtu))
        a.dest_qp_num = int(r_qpn)
        a.rq_psn = int(r_psn)
        a.max_dest_rd_atomic = rd_atomic
        a.min_rnr_timer = MIN_RNR_TIMER
        a.ah_attr = AHAttr(gr=gr, is_global=is_global, port_num=PORT, dlid=int(r_lid))
        try:
            qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
                      | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        except PyverbsError as ex:
            raise PeerError(f"cannot move QP {qp.qp_num} to RTR toward QP {r_qpn} "
                            f"(gid {_gid_str(r_gid)}, sgid_index {gid_index}): {ex}") from None
        a = QPAttr(qp_state=e.IBV_QPS_RTS)
        a.timeout = ACK_TIMEOUT
        a.retry_cnt = RETRY_CNT
        a.rnr_retry = RNR_RETRY
        a.sq_psn = my_psn
        a.max_rd_atomic = init_rd_atomic
        try:
            qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
                      | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)
        except PyverbsError as ex:
            raise PeerError(f"cannot move QP {qp.qp_num} to RTS: {ex}") from None

        # ---- the local buffer: [guard | length | guard]
        total = GUARD + length + GUARD
        mr = MR(pd, total, e.IBV_ACCESS_LOCAL_WRITE)
        guard = bytes([GUARD_BYTE]) * GUARD
        mr.write(guard, GUARD, 0)
        mr.write(guard, GUARD, GUARD + length)
        if args.read:
            mr.write(bytes([GUARD_BYTE ^ 0xFF]) * length, length, GUARD)
            payload = None
        else:
            payload = pattern(args.write_seed, length)
            mr.write(payload, length, GUARD)
        base = int(mr.buf) + GUARD
        opcode = e.IBV_WR_RDMA_READ if args.read else e.IBV_WR_RDMA_WRITE
        opname = "RDMA_READ" if args.read else "RDMA_WRITE"

        # ---- post and reap, at most `depth` outstanding
        chunks = [(off, min(args.chunk, length - off)) for off in range(0, length, args.chunk)]
        posted = done = 0
        deadline = time.monotonic() + args.timeout
        t_data = time.monotonic()
        while done < len(chunks):
            while posted < len(chunks) and posted - done < depth:
                off, n = chunks[posted]
                wr = SendWR(wr_id=posted, opcode=opcode, num_sge=1, sg=[SGE(base + off, n, mr.lkey)],
                            send_flags=e.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(rkey, raddr + offset + off)
                try:
                    qp.post_send(wr)
                except PyverbsError as ex:
                    raise PeerError(f"post_send of {opname} #{posted} ({n} bytes) failed: {ex}") from None
                posted += 1
            npolled, wcs = cq.poll(num_entries=depth)
            for wc in wcs[:npolled]:
                if wc.status != e.IBV_WC_SUCCESS:
                    off, n = chunks[wc.wr_id] if 0 <= wc.wr_id < len(chunks) else (-1, -1)
                    raise PeerError(
                        f"{opname} #{wc.wr_id} ({n} bytes at remote {raddr + offset + off:#x}, rkey {rkey:#x}) "
                        f"completed with status {wc_status_name(wc.status, e)} ({wc.status}, "
                        f"vendor_err {wc.vendor_err})", EXIT_COMPLETION)
                done += 1
            if not npolled:
                if time.monotonic() > deadline:
                    raise PeerError(f"timed out after {args.timeout:g} s with {posted - done} of "
                                    f"{len(chunks)} {opname} work requests outstanding", EXIT_COMPLETION)
                time.sleep(0.0002)
        t_data = time.monotonic() - t_data

        if mr.read(GUARD, 0) != guard or mr.read(GUARD, GUARD + length) != guard:
            raise PeerError("guard bytes around the local buffer changed", EXIT_GUARD)
        data = mr.read(length, GUARD) if args.read else payload
        if args.dump:
            with open(args.dump, "wb") as f:
                f.write(data)
        return {
            "op": "read" if args.read else "write",
            "sha256": hashlib.sha256(data).hexdigest(),
            "length": length, "offset": offset, "region": args.region,
            "remote_addr": raddr + offset, "rkey": rkey, "work_requests": len(chunks),
            "device": dev_name, "gid_index": gid_index, "rdev": rdev,
            "qpn": qp.qp_num, "remote_qpn": int(r_qpn), "path_mtu": min(my_mtu, int(r_mtu)),
            "data_seconds": round(t_data, 6), "seconds": round(time.monotonic() - t0, 6),
        }
    finally:
        ctl.close()
        if ctx is not None:
            ctx.close()          # closes the QP, MR, CQ and PD it created


if __name__ == "__main__":
    sys.exit(main())
