"""A StoreClient's SSD tier, client side: the cleaner that copies objects
of the client's own segment to its directory, adoption at start, and the
reads of SSD copies (ssd.py has the files, model.py's SSD section what the
master records).

Who writes: the holder of a DRAM replica, from its own segment (a memmove
source, no network), under a read lease so the object is neither evicted
nor removed mid-copy. "eager": every object that lands in the segment is
copied (the cleaner polls the master, and a put by this client wakes it at
once); "evict": only the objects nearest eviction (the master's
ssd_candidates). A copy is reported to the master (batch_ssd_add) only
once its file is fsync'd and renamed: from then on an eviction frees the
object's DRAM only and the object stays readable from SSD.

Who reads: a get that finds no DRAM replica gets the SSD copies' holders
(client, engine, host, directory). A holder in this process or on this host
is read straight from its file (O_DIRECT into the caller's memory when
that is BLOCK-aligned: no DRAM hop, no holder involved); a reader on
another host gets ReplicaUnavailableError (not built yet: the holder would
stage the file into its segment for a kvflow read). After the read, the
reader promotes the object back to DRAM: it writes the bytes it now holds
into a replica the master allocates (batch_promote_start/end), so the next
gets are DRAM hits.

Re-adoption: a client started on a directory that holds files scans it
(ssd.py: checksums; torn and corrupt files deleted), and reports each
object with adopt=True: objects the pool lost (a restart of the client,
the master or both) come back as SSD-only objects; a key that exists with
another size is refused and its file deleted. The same report goes to each
new master leader the client attaches to.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kvflow.errors import InvalidArgumentError, KVFlowError

from .datapath import Moves, finish_before_cancel
from .errors import ReplicaUnavailableError
from .ssd import SsdTier, read_object

__all__ = ["OFFLOAD_MODES", "SsdAgent", "SsdCopies", "read_copies"]

log = logging.getLogger("kvflow.store.ssd")

OFFLOAD_MODES = ("evict", "eager")
# the cleaner's poll of the master when it found nothing to do, and when it did
IDLE_POLL = 0.2
BUSY_POLL = 0.0
BATCH = 16          # objects per ssd_sync


class SsdCopies(list):
    """A get's answer for an object with no DRAM replica: its SSD copies'
    holders, [[client, engine, host, directory], ...]."""
    __slots__ = ()


async def _in_threads(calls: list[Callable[[], Any]]) -> list:
    """Runs blocking calls on worker threads, all at once (the SSD takes
    several reads in flight better than one); returns each one's result or
    exception. A cancel waits for every call to finish before it is raised:
    they write into memory the caller gets back."""
    loop = asyncio.get_running_loop()
    return await finish_before_cancel(
        asyncio.gather(*(loop.run_in_executor(None, c) for c in calls), return_exceptions=True))


async def read_copies(client: Any, keys: Any, items: list, parts: Any, results: list) -> list[int]:
    """Reads SSD-only objects (i, size, SsdCopies) into parts[i]; results[i]
    becomes the size or the error. Returns the indices read."""
    agent: SsdAgent | None = client._ssd
    calls, idx, errs, remote = [], [], {}, []
    for i, size, copies in items:
        key = keys[i]
        own = next((h for h in copies if h[0] == client.client_id), None)
        local = own or next((h for h in copies if h[2] == client.host and h[3]), None)
        if local is None or client._on_device(parts[i]):
            # a file is read by the CPU, which may not write GPU memory: the
            # holder loads it into a DRAM replica, read then over kvflow
            remote.append((i, size))
            continue
        ps = [(int(a), int(s)) for a, s in parts[i]]
        if own is not None and agent is not None:
            agent.tier.touch(key)
            calls.append(lambda k=key, n=size, p=ps: agent.tier.read_into(k, n, p))
        else:
            path = os.path.join(local[3], _file_name(key))
            calls.append(lambda p=path, k=key, n=size, d=ps: _read_other(p, k, n, d))
        idx.append(i)
        errs[i] = local
    done = []
    for i, r in zip(idx, await _in_threads(calls)):
        if r is None:
            results[i] = next(s for j, s, _ in items if j == i)
            done.append(i)
        else:
            results[i] = ReplicaUnavailableError(f"the SSD copy of {keys[i]!r} on {errs[i][2]} could not be "
                                                 f"read: {r}", key=keys[i])
    if remote:
        await _read_remote(client, keys, remote, parts, results)
    return done


async def _read_remote(client: Any, keys: Any, items: list, parts: Any, results: list) -> None:
    """Objects only on other hosts' SSDs: their holders are asked to load
    them into DRAM replicas in their own segments (the file read straight
    into the segment), then read as any DRAM replica, over kvflow. The
    holder acts at its cleaner's next poll; the reader polls the master
    until the replica is there, within half its timeout."""
    want = [keys[i] for i, _ in items]
    asked = await client._call("batch_ssd_request", want)
    pending = {keys[i]: (i, size) for (i, size), ok in zip(items, asked) if ok}
    for (i, _), ok in zip(items, asked):
        if not ok:
            results[i] = ReplicaUnavailableError(f"{keys[i]!r} is only on an SSD that cannot serve it", key=keys[i])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + client.timeout / 2
    delay = 0.005
    while pending and loop.time() < deadline:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
        t0 = time.monotonic()
        reply = await client._call("batch_get_replicas", list(pending))
        try:
            found, segs = reply["items"], reply["segments"]
            holders = client._holders(segs)
            ready = []
            for key, item in zip(list(pending), found):
                if item[0] == 0 and item[1][1]:
                    i, size = pending.pop(key)
                    ready.append((i, size, client._nearest(item[1][1], holders)))
                elif item[0] != 0:
                    i, _ = pending.pop(key)
                    results[i] = ReplicaUnavailableError(f"{key!r}: {item[2]}", key=key)
            if ready:
                await client._read(keys, ready, parts, results, client._lease_keeper.hold(reply.get("lease"), t0))
        finally:
            client._release(reply)
    for key, (i, _) in pending.items():
        results[i] = ReplicaUnavailableError(f"{key!r} is only on another host's SSD, whose holder did not "
                                             f"load it within {client.timeout / 2} s", key=key)


def _file_name(key: str) -> str:
    from .ssd import file_name
    return file_name(key)


def _read_other(path: str, key: str, size: int, parts: list) -> None:
    """Another client's file on this host: O_DIRECT where its filesystem
    takes it (EINVAL at open: buffered)."""
    try:
        read_object(path, key, size, parts, direct=True)
    except OSError as e:
        if e.errno != 22:
            raise
        read_object(path, key, size, parts, direct=False)


async def promote(client: Any, keys: Any, done: list[int], parts: Any) -> int:
    """Writes objects just read from SSD back into DRAM replicas (from the
    reader's memory, which holds them now). Returns how many were promoted;
    a failure leaves the object on SSD (the next get reads it there again)."""
    if not done:
        return 0
    try:
        reply = await client._call("batch_promote_start", [keys[i] for i in done])
        items, segs = reply["items"], reply["segments"]
        moves = Moves()
        writing = []
        for i, item in zip(done, items):
            if item[0] != 0 or item[1] is None:
                continue
            for sid, addr in item[1]:
                off = 0
                for a, s in parts[i]:
                    moves.add(int(a), segs[sid][1], addr + off, int(s))
                    off += int(s)
            writing.append((i, item[1]))
        if not writing:
            return 0
        failed = await client._mover.run("write", moves, timeout=client.write_timeout)
        ends = [[keys[i], not any(segs[sid][1] in failed for sid, _ in reps)] for i, reps in writing]
        return sum(await client._call("batch_promote_end", ends))
    except KVFlowError as e:
        log.debug("promotion failed: %s", e)
        return 0


class SsdAgent:
    """The tier of one StoreClient: `path`, `capacity` bytes of files,
    `mode` "evict" or "eager", `verify` (checksum every read), `promote`
    (a get from SSD puts the object back in DRAM)."""

    def __init__(self, client: Any, path: str, capacity: int, *, mode: str = "evict", verify: bool = False,
                 promote: bool = True, direct: bool | None = None) -> None:
        if mode not in OFFLOAD_MODES:
            raise InvalidArgumentError(f"ssd_offload must be one of {OFFLOAD_MODES}, not {mode!r}")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidArgumentError(f"ssd_path must be a directory path, not {path!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise InvalidArgumentError(f"ssd_capacity must be an int > 0, not {capacity!r}")
        self.client = client
        self.path = os.fspath(path)
        self.capacity = capacity
        self.mode = mode
        self.verify = verify
        self.promote = promote
        self._direct = direct
        self.tier: SsdTier | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()         # one sync at a time (the loop's and flush()'s)
        self.written = 0
        self.adopted = 0
        self.evicted = 0

    def __repr__(self) -> str:
        return f"<SsdAgent {self.mode} {self.tier!r}>"

    async def open(self) -> None:
        """Opens the directory and adopts its files (before the client attaches)."""
        loop = asyncio.get_running_loop()
        self.tier = await loop.run_in_executor(
            None, lambda: SsdTier(self.path, self.capacity, direct=self._direct, verify=self.verify))
        if not self.tier.direct:
            log.info("%s: buffered I/O (%s)", self.tier.directory, self.tier.direct_reason)
        await loop.run_in_executor(None, self.tier.scan)
        over = self.tier.make_room(0)           # a smaller capacity than last time
        if over:
            await self._remove_files(over)

    async def attach(self, link: Any, timeout: float) -> None:
        """Tells the master (a new one too) about the tier and what it holds."""
        await link.call("ssd_attach", self.tier.directory, self.mode, timeout=timeout)
        items = [[k, e.size] for k, e in self.tier.index.items()]
        refused = []
        for j in range(0, len(items), 4096):
            chunk = items[j:j + 4096]
            ok = await link.call("batch_ssd_add", chunk, True, timeout=timeout)
            refused += [k for (k, _), good in zip(chunk, ok) if not good]
            self.adopted += sum(1 for good in ok if good)
        for k in refused:
            self.tier.forget(k)
        if refused:
            await self._remove_files(refused)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.tier is not None:
            self.tier.close()

    async def flush(self) -> int:
        """Runs the cleaner until the master has nothing more for it; returns
        how many copies were written."""
        n = 0
        while True:
            got = await self.sync()
            n += got
            if not got:
                return n

    async def _run(self) -> None:
        delay = IDLE_POLL
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                delay = BUSY_POLL if await self.sync() else IDLE_POLL
            except KVFlowError as e:
                log.debug("ssd sync: %s", e)
                delay = IDLE_POLL
            except OSError as e:
                log.warning("ssd tier %s: %s", self.path, e)
                delay = IDLE_POLL

    async def sync(self) -> int:
        """One round: delete the copies of removed objects, copy what the
        master hands out. Returns the number of copies written."""
        async with self._lock:
            c = self.client
            reply = await c._call("ssd_sync", BATCH)
            if reply["drop"]:
                for k in reply["drop"]:
                    self.tier.forget(k)
                await self._remove_files(reply["drop"])
            if reply.get("load"):
                await self._load(reply["load"])
            todo = reply["offload"]
            if not todo:
                return 0
            try:
                wrote, skipped = [], []
                for key, addr, size in todo:
                    if key in self.tier.index:
                        wrote.append([key, size])          # the master forgot it (a restart): say again
                        continue
                    need = self.tier.file_bytes(key, size)
                    if need > self.capacity:
                        skipped.append(key)
                        continue
                    gone = self.tier.make_room(need)
                    if gone:
                        await self._evicted(gone)
                    (r,) = await _in_threads([lambda k=key, a=addr, n=size: self.tier.write(k, a, n)])
                    if isinstance(r, OSError):
                        # the disk refused it (full, read-only, failing): declined,
                        # so an eager pool does not wait on a copy that cannot be made
                        log.warning("ssd tier %s: %r not copied: %s", self.path, key[:64], r)
                        skipped.append(key)
                        continue
                    if isinstance(r, BaseException):
                        raise r
                    self.tier.add(key, size)
                    wrote.append([key, size])
                if skipped:
                    await c._call("batch_ssd_drop", skipped, True)
                ok = await c._call("batch_ssd_add", wrote, False) if wrote else []
                bad = [k for (k, _), good in zip(wrote, ok) if not good]
                for k in bad:               # removed while being copied
                    self.tier.forget(k)
                if bad:
                    await self._remove_files(bad)
                self.written += len(wrote) - len(bad)
                return len(wrote) + len(skipped)
            finally:
                if reply["lease"] and c._link is not None:
                    c._link.notify("release_lease", reply["lease"])

    async def _load(self, keys: list[str]) -> None:
        """Readers on other hosts want these: each file read straight into a
        DRAM replica the master places in this client's segment."""
        c = self.client
        rows = [r for r in await c._call("batch_ssd_load_start", [k for k in keys if k in self.tier.index])]
        if not rows:
            return
        res = await _in_threads([lambda k=k, a=a, n=n: self.tier.read_into(k, n, [(a, n)]) for k, a, n in rows])
        await c._call("batch_promote_end", [[k, r is None] for (k, _, _), r in zip(rows, res)])

    async def _evicted(self, keys: list[str]) -> None:
        """The tier's own LRU let these go: the master told first (no reader
        is sent to them after this), then the files deleted (a reader already
        sent there gets ReplicaUnavailableError, or its open file's bytes)."""
        self.evicted += len(keys)
        await self.client._call("batch_ssd_drop", keys, True)
        await self._remove_files(keys)

    async def _remove_files(self, keys: list[str]) -> None:
        tier = self.tier
        await asyncio.get_running_loop().run_in_executor(None, lambda: [tier.remove_file(k) for k in keys])

