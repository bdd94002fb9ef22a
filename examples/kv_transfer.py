"""A KV-cache transfer between two engines on this machine: the main job.

A "decode" process owns a paged KV pool (layers x pages x page_bytes) and
registers it. A "prefill" process computes a prompt's KV cache layer by
layer and writes each layer's pages into the decode pages it was given as
soon as the layer exists, then notifies; decode learns of completion from
the notification (ordered after the data) and checks every page.

    python examples/kv_transfer.py [--protocol auto|tcp|local] [--layers 32] [--pages 64]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time

import numpy as np

import kvflow
import kvflow.metrics


def layer_kv(seed: int, layer: int, pages: int, page_bytes: int) -> np.ndarray:
    """The KV bytes prefill computes for one layer (deterministic, so decode can check)."""
    rng = np.random.default_rng(seed * 1000 + layer)
    return rng.integers(0, 256, size=(pages, page_bytes), dtype=np.uint8)


async def decode(args: argparse.Namespace) -> None:
    pool = np.zeros((args.layers, args.pool_pages, args.page_bytes), dtype=np.uint8)
    async with kvflow.Engine(protocols=None if args.protocol == "auto" else (args.protocol,)) as engine:
        engine.register(pool, name="kv_pool")
        print(json.dumps({"address": engine.address}), flush=True)
        async for sender, data in engine.notifications():
            msg = json.loads(data)
            pages = np.array(msg["pages"])
            ok = all(np.array_equal(pool[layer, pages], layer_kv(msg["seed"], layer, len(pages), args.page_bytes))
                     for layer in range(args.layers))
            digest = hashlib.sha256(pool[:, pages].tobytes()).hexdigest()[:16]
            print(json.dumps({"request": msg["request"], "from": sender, "verified": ok, "sha256": digest}),
                  flush=True)
            if msg.get("last"):
                return


async def prefill(args: argparse.Namespace) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "decode", "--protocol", args.protocol,
        "--layers", str(args.layers), "--pages", str(args.pages), "--page-bytes", str(args.page_bytes),
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    address = json.loads(await proc.stdout.readline())["address"]
    kv = np.zeros((args.layers, args.pages, args.page_bytes), dtype=np.uint8)
    page_bytes = args.page_bytes
    failures = 0
    async with kvflow.Engine(protocols=None if args.protocol == "auto" else (args.protocol,)) as engine:
        local = engine.register(kv, name="prefill_kv")
        peer = await engine.connect(address)
        remote = peer.region("kv_pool")
        rng = np.random.default_rng(0)
        for request in range(args.requests):
            # The decode side's free pages for this request (scattered, as in a real pool).
            pages = np.sort(rng.choice(args.pool_pages, size=args.pages, replace=False)).astype(np.uint64)
            t0 = time.perf_counter()
            pending = []
            for layer in range(args.layers):
                kv[layer] = layer_kv(request, layer, args.pages, page_bytes)   # "compute" the layer
                src = np.uint64(local.addr + layer * args.pages * page_bytes) + \
                    np.arange(args.pages, dtype=np.uint64) * np.uint64(page_bytes)
                dst = np.uint64(remote.addr + layer * args.pool_pages * page_bytes) + pages * np.uint64(page_bytes)
                # Stream the layer while the next one is computed.
                pending.append(peer.write_nowait(src, dst, np.full(args.pages, page_bytes, np.uint64)))
            for t in pending:
                await t
            elapsed = time.perf_counter() - t0
            await peer.notify(json.dumps({"request": request, "seed": request, "pages": pages.tolist(),
                                          "last": request == args.requests - 1}).encode())
            line = json.loads(await proc.stdout.readline())
            failures += not line["verified"]
            nbytes = args.layers * args.pages * page_bytes
            print(f"request {request}: {nbytes / 2**20:.1f} MiB in {args.layers} layers via {peer.transport}, "
                  f"{elapsed * 1e3:.1f} ms (incl. compute), verified={line['verified']}")
        print(kvflow.metrics.summary(engine, peer.address))
    await proc.wait()
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--protocol", choices=["auto", "tcp", "local"], default="auto")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64, help="pages per request")
    ap.add_argument("--page-bytes", type=int, default=16 << 10)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    args.pool_pages = args.pages * 4
    if args.role == "decode":
        asyncio.run(decode(args))
    else:
        sys.exit(asyncio.run(prefill(args)))


if __name__ == "__main__":
    main()
