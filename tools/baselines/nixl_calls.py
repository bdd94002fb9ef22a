"""Per-call cost of the NIXL API's per-batch calls (make_prepped_xfer,
transfer, check_xfer_state, release_xfer_handle) on one host, NIXL itself
(UCX sm) or kvflow.compat.nixl (same-host provider): medians over N rounds
of one batch each, one batch in flight.

    python tools/baselines/nixl_calls.py --impl kvflow --batch 64 --rounds 10000
    python tools/baselines/nixl_calls.py --impl nixl --batch 1

Alternate the two several times and compare the minima of the medians:
this is about a microsecond of Python around a copy, on shared cores.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time

import common
import nixl_bench
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="kvflow", choices=["kvflow", "nixl"])
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10000)
    p.add_argument("--skip-desc-merge", action="store_true")
    args = p.parse_args()
    if args.impl == "kvflow":
        nixl_bench.use_kvflow("cma")
    else:
        os.environ["UCX_TLS"] = nixl_bench.TLS["sm"]
    region = args.block_size * args.batch
    peer, info = common.spawn_peer(
        [nixl_bench.__file__, "--role", "target", "--block-size", str(args.block_size), "--batch",
         str(args.batch), "--max-region", str(region), "--target-progress", "lazy", "--memory", "host",
         "--impl", args.impl], env=dict(os.environ))
    try:
        agent = nixl_bench.make_agent("initiator", progress_thread=False)
        offs, region = common.layout(args.block_size, args.batch, False, region)
        src = common.alloc(region, fill=0xAB)
        reg = agent.register_memory([(common.addr(src), region, 0, "")], "DRAM")
        remote = agent.add_remote_agent(base64.b64decode(info["meta"]))
        remote = remote.decode() if isinstance(remote, bytes) else remote
        local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", nixl_bench.descs(common.addr(src), offs,
                                                                               args.block_size), "DRAM")
        remote_side = agent.prep_xfer_dlist(remote, nixl_bench.descs(info["addr"], offs, args.block_size), "DRAM")
        idx = np.arange(args.batch, dtype=np.int32)
        t = np.zeros((4, args.rounds))
        clock = time.perf_counter_ns
        for i in range(args.rounds):
            t0 = clock()
            h = agent.make_prepped_xfer("WRITE", local_side, idx, remote_side, idx,
                                        skip_desc_merge=args.skip_desc_merge)
            t1 = clock()
            if agent.transfer(h) == "ERR":
                raise RuntimeError("transfer() failed")
            t2 = clock()
            while (st := agent.check_xfer_state(h)) != "DONE":
                if st == "ERR":
                    raise RuntimeError("the transfer failed")
            t3 = clock()
            agent.release_xfer_handle(h)
            t[:, i] = (t1 - t0, t2 - t1, t3 - t2, clock() - t3)
        med = np.median(t, axis=1) / 1e3
        res = {"impl": args.impl, "batch": args.batch, "block_size": args.block_size,
               "make_us": round(med[0], 2), "transfer_us": round(med[1], 2), "check_us": round(med[2], 2),
               "release_us": round(med[3], 2), "round_us": round(float(np.median(t.sum(axis=0))) / 1e3, 2)}
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
        print(json.dumps(common.finish_peer(peer, res)))
        peer = None
    finally:
        if peer is not None:
            common.stop_peer(peer)
    sys.stdout.flush()
    os._exit(0)     # nixl-cu12 1.5.1 may segfault in its destructors at exit (nixl_bench.py)


if __name__ == "__main__":
    main()
