#!/usr/bin/env python3
"""GPU-initiated puts, proxy mode, on a GPU (issue 21): a kernel computes a
layer's KV (kv = x @ w) and its blocks put their rows from the device
through kvflow's put ring; a PutProxy posts them to a kvflow engine on
this machine over tcp; every row is checked against the same product on
the host.

    python3 tools/gpu_put.py --json          # on a machine with a CUDA GPU and torch
    python3 tools/gpu_put.py --host --json   # anywhere: host threads as the producers

Prints, with --json, one JSON line: verified (every row equal), the
statuses, and the put latency from kvf_put to the kernel seeing its
completion (%globaltimer), p50 and p99 over the blocks of one launch
(`blocks` puts at once) and over `--repeats` launches of one block (one
put alone: the proxy's round trip plus the tcp write of 16 KiB).

--host: no GPU; a host thread is the producer (PutRing.post, then wait,
the same protocol), 4 KiB puts one at a time over local and tcp; beside
them the same writes with write_blocking(), and post_write() polled from
a thread (what the proxy does per put); p50 and p99 in microseconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


async def _until_done(event: Any) -> None:
    while not event.done():              # the loop stays free: the proxy's GPU writes go through it
        await asyncio.sleep(50e-6)


async def run(rows: int = 4096, dim_in: int = 64, dim_out: int = 256, rows_per_block: int = 16,
              repeats: int = 50, slots: int = 4) -> dict[str, Any]:
    import torch
    import kvflow
    from kvflow._cuda import driver as drv, kernels
    from kvflow.gpu.proxy import PutProxy, PutRing, ring_bytes

    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",)) as a, \
            kvflow.Engine("127.0.0.1:0", protocols=("tcp",)) as b:
        torch.manual_seed(0)
        x = torch.randn(rows, dim_in, device="cuda")
        w = torch.randn(dim_in, dim_out, device="cuda")
        kv = torch.zeros(rows, dim_out, device="cuda")
        a.register(kv, name="kv")
        dst = np.zeros(rows * dim_out, np.float32)
        b.register(dst, name="kv")
        peer = await a.connect(b.address)
        remote = peer.region("kv").addr
        blocks = -(-rows // rows_per_block)
        stream, event = drv.Stream(0), drv.Event(0)
        out = torch.zeros(2 * blocks, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()

        async def launch(ring_dev: int, nrows: int, into: Any) -> None:
            kernels.layer_put(stream, x.data_ptr(), w.data_ptr(), kv.data_ptr(), nrows, dim_in, dim_out,
                              rows_per_block, ring_dev, 0, remote, into.data_ptr())
            event.record(stream)
            await asyncio.wait_for(_until_done(event), 60)

        stats = []
        # one launch: every block puts its rows at once, a channel each
        pinned = drv.PinnedHost(ring_bytes(blocks, slots), mapped=True)
        try:
            with PutProxy(PutRing(blocks, slots, addr=pinned.addr, size=pinned.size), [peer], spin=True) as proxy:
                await launch(pinned.device_addr, rows, out)
                stats.append(proxy.stats())
        finally:
            pinned.close()
        res = out.cpu().numpy().reshape(blocks, 2)
        statuses = set(int(s) for s in res[:, 0])
        many = res[:, 1].astype(float)
        expect = (x.double() @ w.double()).float().cpu().numpy().ravel()
        verified = bool(np.allclose(dst, expect, rtol=1e-4, atol=1e-3))
        # one put alone, `repeats` times: one block, one channel
        single = []
        one = torch.zeros(2, dtype=torch.int64, device="cuda")
        pinned = drv.PinnedHost(ring_bytes(1, slots), mapped=True)
        try:
            with PutProxy(PutRing(1, slots, addr=pinned.addr, size=pinned.size), [peer], spin=True) as proxy:
                for _ in range(repeats):
                    await launch(pinned.device_addr, rows_per_block, one)
                    st, ns = one.cpu().tolist()
                    statuses.add(int(st))
                    single.append(float(ns))
                stats.append(proxy.stats())
        finally:
            pinned.close()
        statuses = sorted(statuses)
        return {"verified": verified, "statuses": statuses, "blocks": blocks,
                "bytes_per_put": rows_per_block * dim_out * 4,
                "launch_p50_us": round(float(np.median(many)) / 1e3, 2),
                "launch_p99_us": round(float(np.quantile(many, 0.99)) / 1e3, 2),
                "single_p50_us": round(float(np.median(single)) / 1e3, 2),
                "single_p99_us": round(float(np.quantile(single, 0.99)) / 1e3, 2),
                "proxy": stats}


async def run_host(protocol: str, n: int = 2000, size: int = 4096) -> dict[str, Any]:
    """The proxy's cost per put without a GPU (see the module's text)."""
    import time
    import kvflow
    from kvflow.gpu.proxy import OP_PUT, PutProxy, PutRing

    def quantiles(xs: list[float]) -> tuple[float, float]:
        return round(float(np.median(xs)) * 1e6, 1), round(float(np.quantile(xs, 0.99)) * 1e6, 1)

    async with kvflow.Engine("127.0.0.1:0", protocols=(protocol,)) as a, \
            kvflow.Engine("127.0.0.1:0", protocols=(protocol,)) as b:
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        s = a.register(src)
        dst = np.zeros(size, np.uint8)
        b.register(dst, name="kv")
        peer = await a.connect(b.address)
        remote = peer.region("kv").addr
        ring = PutRing(1, 64)

        def timed(one: Any) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                one()
                out.append(time.perf_counter() - t0)
            return out

        def through_ring() -> None:
            if ring.wait(0, ring.post(0, OP_PUT, 0, s.addr, remote, size)) != 0:
                raise RuntimeError("a put failed")

        def posted() -> None:
            p = peer.post_write([s.addr], [remote], [size])
            while not p.poll():
                pass

        loop = asyncio.get_running_loop()
        with PutProxy(ring, [peer]):
            put = await loop.run_in_executor(None, timed, through_ring)
        blocking = await loop.run_in_executor(None, timed, lambda: peer.write_blocking([s.addr], [remote], [size]))
        poll = await loop.run_in_executor(None, timed, posted)
        assert np.array_equal(dst, src)
        return {"protocol": protocol, "bytes": size, "puts": n, "put_p50_us": quantiles(put)[0],
                "put_p99_us": quantiles(put)[1], "write_blocking_p50_us": quantiles(blocking)[0],
                "post_poll_p50_us": quantiles(poll)[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rows-per-block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--host", action="store_true", help="no GPU: host threads as producers, local and tcp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.host:
        rows = [asyncio.run(run_host(p)) for p in ("local", "tcp")]
        for r in rows:
            print(json.dumps(r) if args.json else "  ".join(f"{k} {v}" for k, v in r.items()))
        return 0
    res = asyncio.run(run(args.rows, rows_per_block=args.rows_per_block, repeats=args.repeats))
    print(json.dumps(res) if args.json else "\n".join(f"{k:>16}: {v}" for k, v in res.items()))
    return 0 if res["verified"] and res["statuses"] == [0] else 1


if __name__ == "__main__":
    sys.exit(main())
