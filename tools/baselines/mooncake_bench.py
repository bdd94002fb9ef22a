"""Mooncake Transfer Engine baseline: one point, two processes, TCP (or RDMA) transport.

    python tools/baselines/mooncake_bench.py --block-size 65536 --batch 64 \
        --duration 3 --concurrency 2
    python tools/baselines/mooncake_bench.py --protocol rdma --device rxe0 ...   # in the RDMA VM
    python tools/baselines/mooncake_bench.py --impl kvflow ...   # same script, kvflow's Mooncake API

This process is the initiator; it starts the target as a child process.  Both
use metadata "P2PHANDSHAKE" (no etcd: the segment is looked up from the
target's RPC port) and protocol "tcp" (default) or "rdma" on 127.0.0.1.  The
target registers one buffer and idles; the initiator registers its source
buffer and writes.

--protocol rdma: both engines open --device (default: the first name in
$KVFLOW_RDMA_DEVICES, else rxe0); Mooncake's MC_* environment knobs
(MC_WORKERS_PER_CTX, MC_GID_INDEX, ...) reach both processes unchanged and are
echoed in the result as "mc_env".

API used (see --api):
  * batch 1, concurrency 1: transfer_sync_write (the single-write latency).
  * concurrency 1: batch_transfer_sync_write, one call per batch.
  * concurrency > 1: batch_transfer_async_write + get_batch_transfer_status,
    keeping `concurrency` batches in flight (same window as kvflow's bench).
Config: Mooncake's TCP transport runs its own asio worker threads in each
process; nothing here adds threads.

--impl kvflow: initiator and target use kvflow.compat.mooncake.TransferEngine
(Mooncake's API on kvflow: one engine thread per process, protocol "tcp" =
kvflow's tcp provider only) with the same calls, so the two rows differ only
in the engine under the API.  The result's "engine" is "mooncake-compat".
"""
from __future__ import annotations

import argparse
import os
import sys

import common

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_device() -> str:
    names = [d.strip() for d in os.environ.get("KVFLOW_RDMA_DEVICES", "").split(",") if d.strip()]
    return names[0] if names else "rxe0"


def engine_class(impl: str):
    if impl == "kvflow":
        if ROOT not in sys.path:    # run as a script: sys.path[0] is tools/baselines
            sys.path.insert(0, ROOT)
        from kvflow.compat.mooncake import TransferEngine
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


def make_engine(protocol: str = "tcp", device: str = "", impl: str = "mooncake"):
    TransferEngine = engine_class(impl)
    eng = TransferEngine()
    # local_hostname without a port: with P2PHANDSHAKE the engine picks a free
    # RPC port itself, which get_rpc_port() reports.  tcp takes no device name.
    rc = eng.initialize(HOST, "P2PHANDSHAKE", protocol, device if protocol != "tcp" else "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({protocol!r}, device={device!r}) failed: {rc}")
    return eng


def target(args) -> None:
    eng = make_engine(args.protocol, args.device, args.impl)
    offs, region = common.layout(args.block_size, args.batch, args.scatter,
                                 args.max_region)
    buf = common.alloc(region, memory=args.memory)
    if eng.register_memory(common.addr(buf), region) != 0:
        raise RuntimeError("register_memory failed on target")
    common.ready({"session": f"{HOST}:{eng.get_rpc_port()}", "addr": common.addr(buf)})
    common.wait_for_stdin_eof()
    common.ready({"verified": common.verify(common.host(buf), offs, args.block_size)})
    eng.unregister_memory(common.addr(buf))


def initiator(args) -> None:
    peer, info = common.spawn_peer(
        [__file__, "--role", "target", "--block-size", str(args.block_size),
         "--batch", str(args.batch), "--max-region", str(args.max_region),
         "--protocol", args.protocol, "--device", args.device, "--impl", args.impl, "--memory", args.memory]
        + (["--scatter"] if args.scatter else []))
    try:
        eng = make_engine(args.protocol, args.device, args.impl)
        offs, region = common.layout(args.block_size, args.batch, args.scatter,
                                     args.max_region)
        src = common.alloc(region, fill=0xAB, memory=args.memory)
        if eng.register_memory(common.addr(src), region) != 0:
            raise RuntimeError("register_memory failed on initiator")
        session = info["session"]
        # Plain Python int lists: that is what the pybind11 binding takes.
        local = [common.addr(src) + int(o) for o in offs]
        remote = [info["addr"] + int(o) for o in offs]
        lengths = [args.block_size] * args.batch

        api = args.api
        if api == "auto":
            if args.batch == 1 and args.concurrency == 1:
                api = "single"
            else:
                api = "async" if args.concurrency > 1 else "sync"

        if api == "single":
            def submit():
                if eng.transfer_sync_write(session, local[0], remote[0], lengths[0]) != 0:
                    raise RuntimeError("transfer_sync_write failed")
            wait = lambda tok: None
        elif api == "sync":
            def submit():
                if eng.batch_transfer_sync_write(session, local, remote, lengths) != 0:
                    raise RuntimeError("batch_transfer_sync_write failed")
            wait = lambda tok: None
        else:
            def submit():
                bid = eng.batch_transfer_async_write(session, local, remote, lengths)
                if not bid:
                    raise RuntimeError("batch_transfer_async_write failed")
                return bid

            def wait(bid):
                if eng.get_batch_transfer_status([bid]) != 0:
                    raise RuntimeError("batch transfer failed")

        batches, secs, lats = common.run_window(submit, wait, args.duration,
                                                args.concurrency)
        entries = batches * args.batch
        engine = "mooncake-compat" if args.impl == "kvflow" else "mooncake"
        res = common.result(engine, args.protocol, args, entries * args.block_size, secs,
                            lats, entries)
        res["api"] = api
        if args.protocol != "tcp":
            res["device"] = args.device
            res["mc_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")}
        res["concurrency"] = args.concurrency
        res["scatter"] = args.scatter
        res["memory"] = args.memory
        eng.unregister_memory(common.addr(src))
        common.emit(common.finish_peer(peer, res))
        peer = None
    finally:
        if peer is not None:
            common.stop_peer(peer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_point_args(p)
    p.add_argument("--api", default="auto", choices=["auto", "single", "sync", "async"])
    p.add_argument("--role", default="initiator", choices=["initiator", "target"])
    p.add_argument("--impl", default="mooncake", choices=["mooncake", "kvflow"],
                   help="TransferEngine class: Mooncake's (mooncake.engine) or kvflow's "
                        "Mooncake-compatible one (kvflow.compat.mooncake)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"],
                   help="Mooncake transport (default tcp; rdma needs an RDMA device)")
    p.add_argument("--device", default=None,
                   help="RDMA device for --protocol rdma (default: first of "
                        "$KVFLOW_RDMA_DEVICES, else rxe0); ignored for tcp")
    args = p.parse_args()
    if args.device is None:
        args.device = default_device() if args.protocol == "rdma" else ""
    (target if args.role == "target" else initiator)(args)


if __name__ == "__main__":
    sys.exit(main())
