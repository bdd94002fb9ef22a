"""A same-host peer in its own process, for tests/test_local_fence.py: it
streams writes into (or reads out of) a region of the test's engine over
the local provider, until they fail, on command.

    python _fence_peer.py ADDRESS

Commands (one a line on stdin), answers (one a line on stdout, after
"ready PID"):
    write ADDR LEN   -> "running", then "stopped OK ERROR MARKER_BYTES"
    read ADDR LEN    -> the same; MARKER_BYTES: bytes equal to MARKER that
                        a read brought back (0 unless a read copied from the
                        region after its deregister() returned)
    hold ADDR LEN    -> "held STATUS": enters the target's fence for that
                        range and stays inside (a copier stalled there)
    exit
Writes carry PAYLOAD bytes; a stream mixes 4 MiB batches (cut in 1 MiB
slices, copied by the workers) and 4 KiB ones (copied inline), a few in
flight at once, and stops at its first error."""
from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import kvflow

PAYLOAD = 0x5A
MARKER = 0xEE
BIG = 4 << 20
SMALL = 4 << 10
IN_FLIGHT = 3


async def stream(peer, op: str, addr: int, length: int, bufs: list[np.ndarray],
                 announce=lambda: print("running", flush=True)) -> str:
    """Streams `op` into [addr, addr+length) of the peer from (into)
    `bufs` until the first error; calls announce() once a transfer
    succeeded (or once it stopped). "stopped OK ERROR MARKER_BYTES"."""
    await peer.refresh()          # the region is new: its table here must know it
    pending: set[asyncio.Future] = set()
    ok = 0
    err = ""
    marker = 0
    turn = 0
    announced = False
    owner: dict[asyncio.Future, np.ndarray] = {}
    free = list(bufs)

    def settle(t: asyncio.Future) -> None:
        nonlocal ok, err, marker
        buf = owner.pop(t)
        exc = t.exception()
        if exc is None:
            ok += 1
        elif not err:
            err = type(exc).__name__
        if op == "read":
            marker += int(np.count_nonzero(buf == MARKER))
            buf[:] = 0
        free.append(buf)

    while not err:
        while len(pending) < IN_FLIGHT and free and not err:
            n = BIG if turn % 3 == 0 else SMALL
            n = min(n, length)
            off = (turn * SMALL) % (length - n + 1)
            turn += 1
            buf = free.pop()
            fn = peer.write_nowait if op == "write" else peer.read_nowait
            try:
                t = asyncio.ensure_future(fn([buf.ctypes.data], [addr + off], [n]))
            except kvflow.KVFlowError as e:      # refused whole at submission
                err = type(e).__name__
                free.append(buf)
                break
            owner[t] = buf
            pending.add(t)
        if not pending:
            break
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            settle(t)
        if ok and not announced:
            announced = True
            announce()
    if pending:
        done, _ = await asyncio.wait(pending)
        for t in done:
            settle(t)
    if not announced:
        announce()
    return f"stopped {ok} {err or '-'} {marker}"


async def main() -> None:
    address = sys.argv[1]
    loop = asyncio.get_running_loop()
    async with kvflow.Engine(protocols=("local",)) as eng:
        peer = await eng.connect(address)
        assert peer.transport == "local", peer.transport
        bufs = [np.full(BIG, PAYLOAD, np.uint8) for _ in range(IN_FLIGHT)]
        for b in bufs:
            eng.register(b)
        print(f"ready {os.getpid()}", flush=True)
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            words = line.split()
            if not words or words[0] == "exit":
                break
            cmd, addr, length = words[0], int(words[1]), int(words[2])
            if cmd == "hold":
                status = peer._channel._hold(addr, length, True)
                print(f"held {status}", flush=True)
            else:
                if cmd == "read":
                    for b in bufs:
                        b[:] = 0
                else:
                    for b in bufs:
                        b[:] = PAYLOAD
                print(await stream(peer, cmd, addr, length, bufs), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
