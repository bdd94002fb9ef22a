"""Shared helpers for the baseline benchmark scripts in tools/baselines/.

Every script measures one benchmark point and prints exactly one JSON object
(the last line of stdout) with the keys in RESULT_KEYS, so tools/compare.py
can treat kvflow's own bench CLI and every baseline the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

RESULT_KEYS = ("engine", "protocol", "op", "block_size", "batch", "bytes", "seconds",
               "gbps", "latency_p50_us", "latency_p99_us", "entries_per_s")

# Big blocks x batch 64 would need 1 GiB per side for 16 MiB blocks. Entries
# wrap around inside a region of at most this size instead (the same
# destination being written twice in a batch does not matter for a
# bandwidth test, and it keeps two processes well inside a 24 GiB machine).
DEFAULT_MAX_REGION = 256 << 20


def add_point_args(p: argparse.ArgumentParser) -> None:
    """The options every baseline accepts (same names as `kvflow.cli.bench pair`)."""
    p.add_argument("--op", default="write", choices=["write"])
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=1,
                   help="batches kept in flight at once")
    p.add_argument("--scatter", action="store_true",
                   help="entries at non-adjacent addresses (one block gap)")
    p.add_argument("--max-region", type=int, default=DEFAULT_MAX_REGION)
    p.add_argument("--json", action="store_true", help="accepted for CLI symmetry; "
                   "the result is always printed as JSON")
    p.add_argument("--memory", default="host", choices=["host", "cuda"],
                   help="where both sides' buffers live: host memory, or GPU 0 (a torch tensor)")


def layout(block: int, batch: int, scatter: bool, max_region: int):
    """Return (offsets, region_size) for one batch.

    Contiguous: entry i at i*block, so engines may coalesce neighbours.
    Scatter: a one-block gap between entries so nothing can be merged.
    """
    stride = 2 * block if scatter else block
    region = min(batch * stride, max(max_region, stride))
    per_region = max(1, region // stride)
    offs = np.array([(i % per_region) * stride for i in range(batch)], dtype=np.uint64)
    region = per_region * stride
    return offs, region


def alloc(nbytes: int, fill: int = 0, memory: str = "host"):
    """Allocate and touch a buffer so page faults are not measured: a numpy
    array, or with memory="cuda" a torch tensor on GPU 0."""
    if memory == "cuda":
        import torch
        buf = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return buf
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)
    return buf


def addr(buf) -> int:
    """A buffer's address (host or device)."""
    return int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)


def host(buf) -> np.ndarray:
    """A buffer's bytes in host memory (a GPU buffer is copied back)."""
    if hasattr(buf, "data_ptr"):
        import torch
        torch.cuda.synchronize()
        return buf.cpu().numpy()
    return buf


def result(engine: str, protocol: str, args, nbytes: int, seconds: float,
           latencies_s, entries: int) -> dict:
    lat = np.asarray(latencies_s, dtype=np.float64) * 1e6
    return {
        "engine": engine,
        "protocol": protocol,
        "op": args.op,
        "block_size": args.block_size,
        "batch": args.batch,
        "bytes": int(nbytes),
        "seconds": round(seconds, 6),
        "gbps": round(nbytes / seconds / 1e9, 4) if seconds > 0 else 0.0,
        "latency_p50_us": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "latency_p99_us": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "entries_per_s": round(entries / seconds, 1) if seconds > 0 else 0.0,
    }


def emit(res: dict) -> None:
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()


def spawn_peer(argv: list[str], env: dict | None = None, timeout: float = 60.0):
    """Start a child process (the passive side of a pair) and read its first
    stdout line, a JSON object with whatever the initiator needs (addresses,
    metadata).  The child runs until its stdin is closed; see stop_peer().

    The initiator is the parent on purpose: process_vm_writev/CMA is allowed
    towards one's own children even under a restrictive ptrace policy.
    """
    proc = subprocess.Popen([sys.executable] + argv, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            return proc, json.loads(line)
    proc.kill()
    raise RuntimeError(f"peer {argv[0]} did not report ready (exit={proc.poll()}, last={line!r})")


def stop_peer(proc, timeout: float = 10.0) -> dict:
    """Close the child's stdin (its signal to finish) and return the JSON
    object it prints last (targets report whether the data really landed)."""
    last = {}
    try:
        proc.stdin.close()
        for line in proc.stdout:
            if line.startswith("{"):
                last = json.loads(line)
        proc.wait(timeout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    return last


def verify(buf: np.ndarray, offs, block: int, fill: int = 0xAB) -> bool:
    """Target side: did the initiator's bytes land?  Checks the first and
    last byte of every entry (cheap, and catches a silent no-op engine)."""
    return all(buf[int(o)] == fill and buf[int(o) + block - 1] == fill for o in offs)


def finish_peer(proc, res: dict) -> dict:
    """Stop the peer and fold its verification into the result."""
    info = stop_peer(proc)
    if "verified" in info:
        res["verified"] = info["verified"]
    return res


def wait_for_stdin_eof() -> None:
    """What a passive peer does while the initiator runs: block on stdin."""
    try:
        sys.stdin.read()
    except KeyboardInterrupt:
        pass


def ready(info: dict) -> None:
    """Tell the parent we are ready (first JSON line on stdout)."""
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def script(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def run_window(submit, wait, duration: float, concurrency: int, warmup: float = 0.3):
    """Keep `concurrency` batches in flight for `duration` seconds.

    submit() starts one batch and returns a token; wait(token) blocks until that
    batch has completed.  Batches complete in order of the window (we always wait
    for the oldest), which is how a KV-cache sender with a bounded number of
    outstanding requests behaves.  Returns (batches, seconds, latencies).
    A short warm-up first opens connections / handshakes so they are not timed.
    """
    from collections import deque

    def phase(length: float, record: bool):
        inflight: deque = deque()
        lats = []
        done = 0
        t_start = time.perf_counter()
        deadline = t_start + length
        while True:
            now = time.perf_counter()
            while len(inflight) < concurrency and now < deadline:
                t0 = time.perf_counter()
                inflight.append((submit(), t0))
                now = time.perf_counter()
            if not inflight:
                break
            tok, t0 = inflight.popleft()
            wait(tok)
            t1 = time.perf_counter()
            done += 1
            if record:
                lats.append(t1 - t0)
            now = t1
        return done, time.perf_counter() - t_start, lats

    if warmup > 0:
        phase(warmup, False)
    return phase(duration, True)


def run_threads(call, duration: float, threads: int, warmup: float = 0.3):
    """Run a blocking call() in a loop on `threads` threads for `duration` s.

    For synchronous ceilings (a syscall through ctypes releases the GIL), so
    `--concurrency N` means N batches being copied at once, as in an engine
    with N batches in flight.  Returns (batches, seconds, latencies).
    """
    import threading

    def phase(length: float):
        results = [None] * threads
        deadline = time.perf_counter() + length

        def worker(k: int) -> None:
            lats = []
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                call()
                lats.append(time.perf_counter() - t0)
            results[k] = lats

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        t_start = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = time.perf_counter() - t_start
        lats = [x for r in results for x in r]
        return len(lats), secs, lats

    if warmup > 0:
        phase(warmup)
    return phase(duration)
