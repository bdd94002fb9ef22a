"""Ceilings: the simplest way to move the same bytes, to put engines in context.

    python tools/baselines/ceilings.py --kind memcpy --block-size 65536 --batch 64
    python tools/baselines/ceilings.py --kind socket --block-size 65536 --batch 64 --concurrency 2
    python tools/baselines/ceilings.py --kind pvm    --block-size 65536 --batch 64

memcpy: one process, one thread, np.copyto of each block-size entry.
        No second process, no kernel: the memory-bandwidth ceiling for any
        same-host path that copies once.
socket: plain Python sockets over loopback TCP, 2 connections (TCP_NODELAY).
        The sender (this process) has one thread per connection doing sendall
        of each block; each connection has its own receiver *process* doing
        recv_into at the entry's offset (processes, so receivers do not share
        a GIL) and answering one ack byte per batch-share.  `concurrency`
        batches may be un-acked per connection.  Ceiling for a TCP engine.
pvm:    process_vm_writev from this process into a child's buffer through
        ctypes: one iovec per block, the whole batch in one call; `concurrency`
        threads each issue such calls (ctypes drops the GIL in the syscall).
        Ceiling for a same-host "local" engine (it is what CMA does).
Ceilings are driven from Python (ctypes, numpy, socket calls): for the tiny
single-write latency points their per-call interpreter overhead (~1-3 us) is
part of the number, so a compiled engine can beat them there.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import threading
import time
from collections import deque

import common

CONNS = 2


# --------------------------------------------------------------------------- memcpy
def run_memcpy(args) -> dict:
    import numpy as np

    offs, region = common.layout(args.block_size, args.batch, args.scatter, args.max_region)
    src, dst = common.alloc(region, 0xAB), common.alloc(region)
    # Views built once: we time the copies, not the slicing.
    pairs = [(dst[int(o):int(o) + args.block_size], src[int(o):int(o) + args.block_size])
             for o in offs]

    def submit():
        for d, s in pairs:
            np.copyto(d, s)

    # One thread: with 2 threads small copies fight over the GIL (numpy keeps
    # it for small arrays) and 4 KiB entries measured 3x slower.
    batches, secs, lats = common.run_threads(submit, args.duration, 1)
    entries = batches * args.batch
    res = common.result("memcpy", "local", args, entries * args.block_size, secs,
                        lats, entries)
    res["verified"] = common.verify(dst, offs, args.block_size)
    return res


# --------------------------------------------------------------------------- pvm
class IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def iovecs(base: int, offs, block: int):
    arr = (IOVec * len(offs))()
    for i, o in enumerate(offs):
        arr[i].iov_base = base + int(o)
        arr[i].iov_len = block
    return arr


def pvm_target(args) -> None:
    offs, region = common.layout(args.block_size, args.batch, args.scatter, args.max_region)
    buf = common.alloc(region)
    common.ready({"pid": os.getpid(), "addr": buf.ctypes.data})
    common.wait_for_stdin_eof()
    common.ready({"verified": common.verify(buf, offs, args.block_size)})


def run_pvm(args) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    pvw = libc.process_vm_writev
    pvw.restype = ctypes.c_ssize_t
    pvw.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                    ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    offs, region = common.layout(args.block_size, args.batch, args.scatter, args.max_region)
    peer, info = common.spawn_peer(
        [__file__, "--kind", "pvm", "--role", "target", "--block-size", str(args.block_size),
         "--batch", str(args.batch), "--max-region", str(args.max_region)]
        + (["--scatter"] if args.scatter else []))
    try:
        src = common.alloc(region, 0xAB)
        local = iovecs(src.ctypes.data, offs, args.block_size)
        remote = iovecs(info["addr"], offs, args.block_size)
        pid, n, want = info["pid"], len(offs), len(offs) * args.block_size

        def submit():
            got = pvw(pid, ctypes.addressof(local), n, ctypes.addressof(remote), n, 0)
            if got != want:  # partial writes only happen on a bad address
                raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got}/{want}")

        # One thread per batch in flight: each call copies a whole batch.
        batches, secs, lats = common.run_threads(submit, args.duration, args.concurrency)
        entries = batches * args.batch
        res = common.result("process_vm_writev", "local", args,
                            entries * args.block_size, secs, lats, entries)
        res = common.finish_peer(peer, res)
        peer = None
        return res
    finally:
        if peer is not None:
            common.stop_peer(peer)


# --------------------------------------------------------------------------- socket
def socket_receiver(args) -> None:
    """One connection's receiver: recv_into each of its entries, ack per batch."""
    offs, region = common.layout(args.block_size, args.batch, args.scatter, args.max_region)
    mine = [int(o) for i, o in enumerate(offs) if i % args.conns == args.conn]
    buf = common.alloc(region)
    mv = memoryview(buf)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    common.ready({"port": ls.getsockname()[1]})
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bs = args.block_size
    try:
        while True:
            for o in mine:
                got = 0
                while got < bs:
                    n = s.recv_into(mv[o + got:o + bs])
                    if n == 0:
                        raise EOFError
                    got += n
            s.sendall(b"a")
    except (EOFError, ConnectionError):
        pass
    common.ready({"verified": common.verify(buf, mine, bs)})


def run_socket(args) -> dict:
    offs, region = common.layout(args.block_size, args.batch, args.scatter, args.max_region)
    conns = min(CONNS, args.batch)  # batch 1 (latency): one connection carries it
    peers, socks = [], []
    try:
        for k in range(conns):
            p, info = common.spawn_peer(
                [__file__, "--kind", "socket", "--role", "target", "--conn", str(k),
                 "--conns", str(conns), "--block-size", str(args.block_size),
                 "--batch", str(args.batch), "--max-region", str(args.max_region)]
                + (["--scatter"] if args.scatter else []))
            peers.append(p)
            s = socket.create_connection(("127.0.0.1", info["port"]))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
        src = common.alloc(region, 0xAB)
        mv = memoryview(src)
        bs = args.block_size
        shares = [[mv[int(o):int(o) + bs] for i, o in enumerate(offs) if i % conns == k]
                  for k in range(conns)]
        stats = [None] * conns

        def sender(k: int, length: float, record: bool) -> None:
            s, share = socks[k], shares[k]
            pending: deque = deque()
            lats, done = [], 0
            deadline = time.perf_counter() + length

            def take_acks() -> None:
                nonlocal done
                data = s.recv(4096)  # one byte per completed batch-share
                if not data:
                    raise ConnectionError("receiver closed")
                for _ in data:
                    t0 = pending.popleft()
                    done += 1
                    if record:
                        lats.append(time.perf_counter() - t0)

            while time.perf_counter() < deadline:
                pending.append(time.perf_counter())
                for v in share:
                    s.sendall(v)
                while len(pending) >= args.concurrency:
                    take_acks()
            while pending:
                take_acks()
            stats[k] = (done, lats)

        def phase(length: float, record: bool):
            ts = [threading.Thread(target=sender, args=(k, length, record))
                  for k in range(conns)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            return time.perf_counter() - t0

        phase(0.3, False)  # warm-up: TCP windows grow, pages get touched
        secs = phase(args.duration, True)
        # Each connection completed `done` shares of a batch; count entries.
        entries = sum(d * len(shares[k]) for k, (d, _) in enumerate(stats))
        lats = [x for _, lat in stats for x in lat]
        res = common.result("socket", "tcp", args, entries * bs, secs, lats, entries)
        res["connections"] = conns
        res["concurrency"] = args.concurrency
        for s in socks:
            s.shutdown(socket.SHUT_WR)
        ok = True
        for p in peers:
            ok = ok and common.stop_peer(p).get("verified", False)
        peers = []
        res["verified"] = ok
        return res
    finally:
        for s in socks:
            s.close()
        for p in peers:
            common.stop_peer(p)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_point_args(p)
    p.add_argument("--kind", required=True, choices=["memcpy", "socket", "pvm"])
    p.add_argument("--role", default="initiator", choices=["initiator", "target"])
    p.add_argument("--conn", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--conns", type=int, default=CONNS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "target":
        (socket_receiver if args.kind == "socket" else pvm_target)(args)
        return
    res = {"memcpy": run_memcpy, "socket": run_socket, "pvm": run_pvm}[args.kind](args)
    res.setdefault("concurrency", 1 if args.kind == "memcpy" else args.concurrency)
    res["scatter"] = args.scatter
    common.emit(res)


if __name__ == "__main__":
    sys.exit(main())
