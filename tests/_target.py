"""Transfer target for the kvflow test suite.

One module, two uses:

* imported by ``conftest.py``: ``GuardedBuffer``, ``pattern`` and ``TargetCore``
  give an in-process target (same event loop as the test);
* run as a script (``python tests/_target.py '<json config>'``): a child
  process that owns an Engine and serves the same operations as JSON lines over
  stdin/stdout, so the test process reaches it through a real socket or through
  process_vm_writev.

Wire format of the child: every line the child writes for the parent starts with
``@@KVT `` followed by one JSON object, so that anything else the engine might
print on stdout cannot be mistaken for a reply. The first such line is the
``hello`` object (address, pid, regions); then one reply per request:
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"type": "ExcName", "error": "message"}``. The child exits when stdin closes, so
it never outlives a crashed test process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import traceback
from typing import Any

import numpy as np

MARK = "@@KVT "

# Guard bytes: an odd count, so the registered middle of a buffer starts at an
# address that is not aligned to anything (the engine must not assume alignment).
GUARD = 4099
_GUARD_PATTERN = ((np.arange(GUARD, dtype=np.uint32) * 37 + 11) % 251).astype(np.uint8) ^ 0x5A


def pattern(seed: int, n: int) -> np.ndarray:
    """Deterministic pseudo-random bytes; the same on both sides of a test."""
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()


def sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).data).hexdigest()


class GuardedBuffer:
    """A numpy buffer whose middle ``length`` bytes are handed to the engine.

    The bytes before and after the middle hold a known pattern; ``guards_ok()``
    says whether anything (a buggy engine) wrote outside the registered range.
    """

    def __init__(self, length: int, *, shift: int = 0):
        self.length = length
        self._start = GUARD + shift
        self._raw = np.empty(length + 2 * GUARD + shift, dtype=np.uint8)
        self._raw[: self._start] = np.resize(_GUARD_PATTERN, self._start)
        self._raw[self._start + length :] = _GUARD_PATTERN
        self.view = self._raw[self._start : self._start + length]
        # Fill the usable part with something that is neither zero nor a seed pattern.
        self.view[:] = 0xC3

    @property
    def addr(self) -> int:
        return int(self.view.ctypes.data)

    def guards_ok(self) -> bool:
        head = self._raw[: self._start]
        tail = self._raw[self._start + self.length :]
        return bool(
            np.array_equal(head, np.resize(_GUARD_PATTERN, self._start))
            and np.array_equal(tail, _GUARD_PATTERN)
        )


def find_data_ports(eng) -> list[int]:
    """Data-path ports of an engine, if it exposes them under a name we know."""
    for attr in ("data_ports", "data_port", "data_addresses", "data_address"):
        val = getattr(eng, attr, None)
        if val is None:
            continue
        if callable(val):
            try:
                val = val()
            except Exception:
                continue
        vals = val if isinstance(val, (list, tuple, set)) else [val]
        ports = []
        for v in vals:
            if isinstance(v, int):
                ports.append(v)
            elif isinstance(v, str) and ":" in v:
                ports.append(int(v.rsplit(":", 1)[1]))
            elif isinstance(v, tuple) and len(v) == 2:
                ports.append(int(v[1]))
        if ports:
            return ports
    return []


class TargetCore:
    """The target side of a test: an Engine plus guarded, registered regions."""

    def __init__(self, *, protocols=None, secret=None, listen: str = "127.0.0.1:0"):
        self.protocols = tuple(protocols) if protocols is not None else None
        self.secret = secret
        self.listen = listen
        self.eng = None
        self.buffers: dict[str, GuardedBuffer] = {}
        self.regions: dict[str, Any] = {}  # name -> kvflow Region (currently registered)
        self.retired: list[GuardedBuffer] = []  # deregistered, kept alive, guards still checked
        self.notes: list[dict] = []
        self.loop_errors: list[str] = []
        self._watch_task: asyncio.Task | None = None
        self._hammer_task: asyncio.Task | None = None
        self._hammer_writes = 0
        self._hammer_error: str | None = None
        self._out_peers: list = []  # peers this target opened itself (notify, hammer)

    async def start(self) -> None:
        import kvflow

        if _IS_CHILD:
            # In the child nobody else watches the loop: record what reaches the
            # exception handler and let the parent assert that it stayed empty.
            asyncio.get_running_loop().set_exception_handler(self._on_loop_error)
        self.eng = kvflow.Engine(listen=self.listen, protocols=self.protocols, secret=self.secret)
        await self.eng.start()

    def _on_loop_error(self, loop, ctx) -> None:
        exc = ctx.get("exception")
        text = ctx.get("message", "")
        if exc is not None:
            text += " | " + "".join(traceback.format_exception(exc))
        self.loop_errors.append(text)

    # -- operations (each also a command of the child) ----------------------------

    def info(self) -> dict:
        return {
            "address": self.eng.address,
            "pid": os.getpid(),
            "regions": {n: self._region_info(n) for n in self.regions},
            "data_ports": find_data_ports(self.eng),
        }

    def _region_info(self, name: str) -> dict:
        r = self.regions[name]
        return {"name": name, "addr": int(r.addr), "length": int(r.length), "access": int(r.access)}

    def register(self, name: str, length: int, access: int = 3) -> dict:
        import kvflow

        if name in self.regions:
            raise KeyError(f"region {name!r} already registered")
        buf = GuardedBuffer(length)
        region = self.eng.register(buf.view, name=name, access=kvflow.Access(access))
        self.buffers[name] = buf
        self.regions[name] = region
        return self._region_info(name)

    def deregister(self, name: str) -> None:
        region = self.regions.pop(name)
        self.eng.deregister(region)
        # Keep the memory: a buggy engine that still writes there must not crash
        # the child, and its guards are still checked.
        self.retired.append(self.buffers.pop(name))

    def _range(self, name: str, offset: int, length: int | None) -> np.ndarray:
        view = self.buffers[name].view
        if length is None:
            length = len(view) - offset
        if offset < 0 or offset + length > len(view):
            raise IndexError(f"{name}: [{offset}, {offset + length}) outside {len(view)}")
        return view[offset : offset + length]

    def fill(self, name: str, seed: int, offset: int = 0, length: int | None = None) -> None:
        rng = self._range(name, offset, length)
        rng[:] = pattern(seed, len(rng))

    def sha(self, name: str, offset: int = 0, length: int | None = None) -> str:
        return hashlib.sha256(self._range(name, offset, length).data).hexdigest()

    def sha_many(self, name: str, ranges: list) -> list[str]:
        return [self.sha(name, int(o), int(n)) for o, n in ranges]

    def get(self, name: str, offset: int, length: int) -> str:
        """Bytes of a small range, hex (for failure messages)."""
        return self._range(name, offset, length).tobytes().hex()

    def guards(self) -> list[str]:
        """Names of regions whose guard bytes were overwritten ([] when all intact)."""
        bad = [n for n, b in self.buffers.items() if not b.guards_ok()]
        bad += [f"retired#{i}" for i, b in enumerate(self.retired) if not b.guards_ok()]
        return bad

    def watch(self) -> None:
        """Start consuming notifications.

        A notification's payload is JSON ``{"seq", "region", "offset", "length",
        "sha"}``; at the moment the notification arrives we hash that range and
        record whether the data the sender wrote before notifying is already here.
        """
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        async for peer_address, data in self.eng.notifications():
            note: dict = {"from": peer_address, "raw": bytes(data).hex()}
            try:
                req = json.loads(bytes(data))
                note["seq"] = req.get("seq")
                if "sha" in req:
                    got = self.sha(req["region"], req["offset"], req["length"])
                    note["ok"] = got == req["sha"]
            except Exception as e:  # a payload the test did not make; record it as is
                note["error"] = repr(e)
            self.notes.append(note)

    def notifications(self) -> list[dict]:
        return list(self.notes)

    async def notify(self, address: str, data_hex: str) -> None:
        peer = await self.eng.connect(address)
        self._out_peers.append(peer)
        await peer.notify(bytes.fromhex(data_hex))

    async def close_peers(self) -> None:
        """Stop acting as an initiator: end hammer() and close the peers this
        target connected to (so that its resources can return to baseline)."""
        if self._hammer_task is not None:
            self._hammer_task.cancel()
            try:
                await self._hammer_task
            except (asyncio.CancelledError, Exception):
                pass
            self._hammer_task = None
        peers, self._out_peers = self._out_peers, []
        for peer in {id(p): p for p in peers}.values():
            await peer.close()

    async def hammer(self, address: str, remote_addr: int, length: int, region: str = "rw") -> None:
        """Act as an initiator: connect to ``address`` and write ``length`` bytes
        of our ``region`` to ``remote_addr`` over and over, in the background
        (until this process dies). Returns once the first write has landed."""
        peer = await self.eng.connect(address)
        self._out_peers.append(peer)
        src = self.regions[region]
        await peer.write([src.addr], [remote_addr], [length])

        async def loop() -> None:
            try:
                while True:
                    await peer.write([src.addr], [remote_addr], [length])
                    self._hammer_writes += 1
            except Exception as e:
                self._hammer_error = f"{type(e).__name__}: {e}"

        self._hammer_task = asyncio.get_running_loop().create_task(loop())

    def hammer_stats(self) -> dict:
        """hammer()'s writes so far and the error that ended it (None: running)."""
        return {"writes": self._hammer_writes, "error": self._hammer_error}

    def hold_gil(self, seconds: float) -> None:
        """A host application's thread that holds the GIL for `seconds`
        (a C call made with it held: ctypes.PyDLL does not release it), so
        that this process's event loop cannot run meanwhile."""
        import ctypes
        import threading

        libc = ctypes.PyDLL("libc.so.6")
        threading.Thread(target=libc.usleep, args=(int(seconds * 1e6),), daemon=True).start()

    def counters(self) -> dict:
        """The engine's live native resources, if it reports them (not in the
        contract; STYLE rule 7: the teardown checks that they balance)."""
        fn = getattr(self.eng, "counters", None)
        return {k: int(v) for k, v in fn().items()} if callable(fn) else {}

    def get_loop_errors(self) -> list[str]:
        return list(self.loop_errors)

    async def close(self) -> None:
        await self.close_peers()
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except (asyncio.CancelledError, Exception):
                pass
            self._watch_task = None
        if self.eng is not None:
            await self.eng.close()


# ----------------------------------------------------------------- child process

_IS_CHILD = False


def _send(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _serve(core: TargetCore) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    ops = {
        "info": core.info,
        "register": core.register,
        "deregister": core.deregister,
        "fill": core.fill,
        "sha": core.sha,
        "sha_many": core.sha_many,
        "get": core.get,
        "guards": core.guards,
        "watch": core.watch,
        "notifications": core.notifications,
        "notify": core.notify,
        "loop_errors": core.get_loop_errors,
        "counters": core.counters,
        "hammer": core.hammer,
        "hammer_stats": core.hammer_stats,
        "hold_gil": core.hold_gil,
        "close_peers": core.close_peers,
    }
    while True:
        line = await reader.readline()
        if not line:
            return  # parent went away
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            await core.close()       # its counters once closed: the parent checks they are all zero
            _send({"id": req["id"], "ok": True, "result": core.counters()})
            return
        try:
            res = ops[op](**req.get("args", {}))
            if asyncio.iscoroutine(res):
                res = await res
            _send({"id": req["id"], "ok": True, "result": res})
        except Exception as e:
            _send({"id": req["id"], "ok": False, "type": type(e).__name__, "error": str(e)})


async def _child_main(cfg: dict) -> None:
    secret = cfg.get("secret")
    if secret is not None and cfg.get("secret_is_bytes"):
        secret = secret.encode()
    core = TargetCore(protocols=cfg.get("protocols"), secret=secret)
    await core.start()
    try:
        for spec in cfg.get("regions", []):
            core.register(spec["name"], spec["length"], spec.get("access", 3))
        _send({"hello": core.info()})
        await _serve(core)
    finally:
        await core.close()


if __name__ == "__main__":
    _IS_CHILD = True
    asyncio.run(_child_main(json.loads(sys.argv[1])))
