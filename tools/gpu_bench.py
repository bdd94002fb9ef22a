#!/usr/bin/env python3
"""GPU memory over kvflow, side by side with kvflow's own host-memory rate
and the copy-engine ceilings, in one run: two processes on this machine
(an initiator here, a target child), batches of 64 blocks of 64 KiB to
16 MiB, written from the initiator's memory into the target's.

    python3 tools/gpu_bench.py --json out.json          # GPU -> GPU and host -> host over tcp
    python3 tools/gpu_bench.py --memory host --quick    # the harness alone, without a GPU

Rows: kvflow over `--protocol` (tcp by default) with GPU memory on both
sides (staged through pinned host memory) and with host memory on both
sides, and, with a GPU: kvflow's local provider with GPU memory (CUDA IPC
between the two processes), the ceilings (cuMemcpyDtoDAsync within one GPU
and pinned cuMemcpyHtoDAsync / DtoHAsync, issued the same way: 64 copies
per batch on one stream, timed to the stream's end), and the anchors with
GPU buffers where installed (`--anchors`: Mooncake TE tcp, NIXL UCX over
tcp with cuda_copy and same-host cuda_ipc), with kvflow's ratio to each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 64
BLOCKS = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]

TARGET = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import kvflow
async def main():
    memory, nbytes, protocol = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    async with kvflow.Engine(protocols=[protocol]) as eng:
        if memory == "cuda":
            import torch
            pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        else:
            import numpy as np
            pool = np.zeros(nbytes, np.uint8)
        eng.register(pool, name="pool")
        print(eng.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def _buffer(memory: str, nbytes: int):
    if memory == "cuda":
        import torch
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    import numpy as np
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)


async def kvflow_rate(memory: str, protocol: str, block: int, rounds: int) -> float:
    import numpy as np
    import kvflow
    nbytes = BATCH * block
    child = subprocess.Popen([sys.executable, "-c", TARGET, ROOT, memory, str(nbytes), protocol],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        async with kvflow.Engine(protocols=[protocol]) as eng:
            src = _buffer(memory, nbytes)
            region = eng.register(src)
            peer = await eng.connect(address)
            dst = peer.region("pool")
            offs = np.arange(BATCH, dtype=np.uint64) * np.uint64(block)
            la, ra, ln = region.addr + offs, dst.addr + offs, np.full(BATCH, block, np.uint64)
            await peer.write(la, ra, ln)                # warm: connections, staging memory
            t = time.perf_counter()
            for _ in range(rounds):
                await peer.write(la, ra, ln)
            return rounds * nbytes / (time.perf_counter() - t) / 1e9
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def ceiling(kind: str, block: int, rounds: int) -> float:
    """GB/s of 64 copies of `block` per batch on one stream (the driver
    API, as kvflow's copy engine issues them)."""
    import torch
    from kvflow._cuda import driver as drv
    nbytes = BATCH * block
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = drv.PinnedHost(nbytes)
    stream = drv.Stream(0)
    cu = drv.driver()
    src, dst = {"DtoD": (a.data_ptr(), b.data_ptr()), "HtoD": (pinned.addr, a.data_ptr()),
                "DtoH": (a.data_ptr(), pinned.addr)}[kind]

    def batch() -> None:
        for i in range(BATCH):
            drv.copy_async(dst + i * block, src + i * block, block, stream)

    with drv.on_device(0):
        batch()
        drv.check(cu.cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
        t = time.perf_counter()
        for _ in range(rounds):
            batch()
        drv.check(cu.cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
        took = time.perf_counter() - t
    stream.close()
    pinned.close()
    return rounds * nbytes / took / 1e9


def anchor(name: str, block: int, duration: float) -> float | None:
    """GB/s of another engine with GPU buffers on both sides, the same
    point (batch 64 of `block`, two processes): Mooncake TE over tcp,
    NIXL/UCX over tcp (cuda_copy) and same-host (cuda_ipc). None where it
    is not installed (carry its wheel) or fails."""
    base = os.path.join(ROOT, "tools", "baselines")
    cmd = {"mooncake-tcp": [os.path.join(base, "mooncake_bench.py")],
           "nixl-tcp": [os.path.join(base, "nixl_bench.py"), "--transport", "cuda-tcp"],
           "nixl-ipc": [os.path.join(base, "nixl_bench.py"), "--transport", "cuda-ipc"]}[name]
    try:
        out = subprocess.run([sys.executable, *cmd, "--memory", "cuda", "--block-size", str(block),
                              "--batch", str(BATCH), "--duration", str(duration)],
                             capture_output=True, text=True, timeout=60 + 4 * duration)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
        res = json.loads(line)
        return float(res["gbps"]) if res.get("verified", True) else None
    except (subprocess.TimeoutExpired, IndexError, ValueError, KeyError) as e:
        print(f"anchor {name} at {block}: {type(e).__name__}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", choices=["cuda", "host"], default="cuda",
                    help="cuda: GPU rows and the host row; host: the host row only (no GPU needed)")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="blocks of 64 KiB and 1 MiB only")
    ap.add_argument("--blocks", default=None, help="block sizes in KiB, comma-separated (default: 64 KiB to 16 MiB)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--anchors", default="mooncake-tcp,nixl-tcp,nixl-ipc",
                    help="other engines with GPU buffers, side by side (comma-separated; empty: none)")
    ap.add_argument("--anchor-seconds", type=float, default=2.0)
    args = ap.parse_args()
    blocks = [64 << 10, 1 << 20] if args.quick else BLOCKS
    if args.blocks:
        blocks = [int(k) << 10 for k in args.blocks.split(",")]
    rows = []
    for block in blocks:
        row: dict[str, float | int] = {"block": block}
        row["kvflow_host"] = asyncio.run(kvflow_rate("host", args.protocol, block, args.rounds))
        if args.memory == "cuda":
            row["kvflow_cuda"] = asyncio.run(kvflow_rate("cuda", args.protocol, block, args.rounds))
            row["cuda_vs_host"] = row["kvflow_cuda"] / row["kvflow_host"]
            row["kvflow_cuda_local"] = asyncio.run(kvflow_rate("cuda", "local", block, args.rounds))
            for kind in ("DtoD", "HtoD", "DtoH"):
                row[f"ceiling_{kind}"] = ceiling(kind, block, args.rounds)
            for name in filter(None, args.anchors.split(",")):
                rate = anchor(name, block, args.anchor_seconds)
                if rate is not None:
                    row[name] = rate
                    ours = row["kvflow_cuda_local"] if name.endswith("ipc") else row["kvflow_cuda"]
                    row[f"kvflow_vs_{name}"] = ours / rate
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"protocol": args.protocol, "batch": BATCH, "rounds": args.rounds, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
