"""The store's SSD tier against the device it sits on, in one run.

    python tools/ssd_bench.py --dir /var/tmp --size 16777216 --count 32 --rounds 5

Per round: the device's sequential read of a file of the same bytes on the
same filesystem (`dd iflag=direct bs=<size>`, and the same read in Python:
O_DIRECT preadv into an aligned buffer), then a `batch_get_into` of
`count` objects of `size` bytes that live only on the client's SSD (put
with ssd_offload="eager" into a segment that holds a few of them, the rest
evicted from DRAM; promotion off, so every round reads the SSD), into an
aligned registered buffer, and the same objects read one get_into per call
(one read in flight, as dd), and the tier's own files read whole with
O_DIRECT one by one (every file of the tier, so a little more than the
objects read: the device on those very blocks). Prints each one's GB/s (median over rounds),
the ratio store / dd, the filesystem (`df -T`) and whether the tier used
O_DIRECT; `--json` for one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvflow.store import StoreClient
from kvflow.store.ssd import BLOCK


def fs_type(path: str) -> str:
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=False).stdout.splitlines()
    return " ".join(out[1].split()[:2]) if len(out) > 1 else "?"


def make_file(path: str, size: int, count: int) -> None:
    chunk = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.writelines(chunk for _ in range(count))
        f.flush()
        os.fsync(f.fileno())


def dd_read(path: str, size: int) -> float:
    """GB/s of dd's direct sequential read of the whole file."""
    t = time.perf_counter()
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={size}", "iflag=direct"],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out.stderr)
    return int(m.group(1)) / float(m.group(2)) / 1e9 if m else os.path.getsize(path) / wall / 1e9


def py_direct_read(path: str, size: int) -> float:
    buf = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = os.path.getsize(path)
        t = time.perf_counter()
        off = 0
        while off < total:
            off += os.preadv(fd, [buf], off)
        return total / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def files_direct_read(d: str, size: int) -> float:
    """GB/s of reading the tier's own files, whole, one after another
    (O_DIRECT preadv into one aligned buffer): the device on those blocks."""
    paths = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".kvo")]
    buf = mmap.mmap(-1, size + 2 * BLOCK)
    total = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            total += os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t) / 1e9


async def store_rounds(d: str, size: int, count: int, rounds: int) -> tuple[list[float], list[float], list[float], bool, int]:
    seg = max(4 * size, 64 << 20)
    async with StoreClient(segment_size=seg, local_buffer_size=0, ssd_path=d, ssd_offload="eager",
                           ssd_capacity=(count + 8) * (size + 2 * BLOCK), ssd_promote=False) as c:
        src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
        sreg = c.register_buffer(src)
        keys = [f"bench/{i}" for i in range(count)]
        for k in keys:
            await c.put_from(k, sreg.addr, size)
            await c.ssd_flush()
        model = c._embedded.model
        cold = [k for k in keys if not model.objects[k].replicas]
        dst = np.empty(len(cold) * size + BLOCK, np.uint8)
        reg = c.register_buffer(dst)
        base = reg.addr + (-reg.addr) % BLOCK
        addrs = [base + i * size for i in range(len(cold))]
        out, one, files = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            res = await c.batch_get_into(cold, addrs, [size] * len(cold))
            wall = time.perf_counter() - t
            assert all(r == size for r in res), res[:3]
            out.append(len(cold) * size / wall / 1e9)
            t = time.perf_counter()         # one object per call: one read in flight, as dd
            for k, a in zip(cold, addrs):
                assert await c.get_into(k, a, size) == size
            one.append(len(cold) * size / (time.perf_counter() - t) / 1e9)
            files.append(files_direct_read(d, size))
        off = base - reg.addr
        for i in range(len(cold)):          # every byte of the last round
            assert bytes(dst[off + i * size:off + (i + 1) * size]) == src.tobytes(), cold[i]
        return out, one, files, c.ssd.tier.direct, len(cold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    ap.add_argument("--size", type=int, default=16 << 20, help="object size (a multiple of 4096)")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvflow-ssd-bench-", dir=a.dir)
    try:
        tier = os.path.join(work, "tier")
        asyncio.run(store_rounds(tier, a.size, 2, 1))        # warm: imports, engine, threads
        shutil.rmtree(tier)
        store, one, files, direct, n = asyncio.run(store_rounds(tier, a.size, a.count, a.rounds))
        path = os.path.join(work, "seq")
        make_file(path, a.size, n)
        dd = [dd_read(path, a.size) for _ in range(a.rounds)]
        py = [py_direct_read(path, a.size) for _ in range(a.rounds)]
        row = {"dir": a.dir, "fs": fs_type(a.dir), "direct": direct, "object": a.size, "objects": n,
               "dd_GBps": round(statistics.median(dd), 3), "python_odirect_GBps": round(statistics.median(py), 3),
               "store_ssd_get_GBps": round(statistics.median(store), 3),
               "store_ssd_get_one_GBps": round(statistics.median(one), 3),
               "tier_files_odirect_GBps": round(statistics.median(files), 3),
               "store_rounds": [round(x, 3) for x in store], "dd_rounds": [round(x, 3) for x in dd]}
        row["ratio_store_dd"] = round(row["store_ssd_get_GBps"] / row["dd_GBps"], 3)
        row["ratio_one_dd"] = round(row["store_ssd_get_one_GBps"] / row["dd_GBps"], 3)
        if a.json:
            print(json.dumps(row))
        else:
            print(f"{row['dir']} ({row['fs']}), tier {'O_DIRECT' if direct else 'buffered'}, "
                  f"{n} objects of {a.size} bytes from SSD")
            print(f"  dd iflag=direct bs={a.size}:   {row['dd_GBps']:.3f} GB/s  {row['dd_rounds']}")
            print(f"  python O_DIRECT preadv:       {row['python_odirect_GBps']:.3f} GB/s")
            print(f"  store batch_get_into (SSD):   {row['store_ssd_get_GBps']:.3f} GB/s  {row['store_rounds']}")
            print(f"  store get_into, one per call: {row['store_ssd_get_one_GBps']:.3f} GB/s")
            print(f"  the tier's files, O_DIRECT:   {row['tier_files_odirect_GBps']:.3f} GB/s (all its files, one by one)")
            print(f"  store / dd: batch {row['ratio_store_dd']:.2f}, one per call {row['ratio_one_dd']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
