"""Fixtures for the kvflow test suite.

Everything here is real: engines listen on loopback sockets, cross-process targets
are child processes (``tests/_target.py``), nothing is mocked.

* ``loop_exception_guard`` (autouse): a test fails if anything reached the event
  loop's exception handler (an unretrieved task exception, an exception in a
  callback, ...), the way asyncpg's test base does it.
* ``provider``: parametrises a test over "tcp", "local", "local-xproc", "tcp-xproc",
  "rdma" (marked ``rdma``: it skips without an RDMA device and runs inside the
  Soft-RoCE VM, see tests/test_rdma_vm.py). Cross-process rdma ("rdma-xproc") is
  in ``xproc_provider`` only (the kill tests): the verbs path is the same in
  one process, and a child interpreter costs ~20 s to start under emulation.
* ``make_engine``, ``make_target``, ``make_pair``, ``local_mem``: factories whose
  teardown closes what they made and checks the guard bytes around every
  registered region, local and remote, and (where the engine has counters())
  that no batch or slice is left in flight and that a target's sockets and
  threads return to their value after start() once its initiators closed
  (KVFLOW_TEST_BALANCE=0 skips the latter).
"""

from __future__ import annotations

# Upstream projects' own tests (unchanged copies) run in subprocesses, with
# their own configuration: tests/test_upstream_*.py.
collect_ignore = ["upstream"]

import asyncio
import faulthandler
import gc
import json
import os
import sys
import time
from typing import Any, NamedTuple

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # so that ``import _target`` works under any import mode
    sys.path.insert(0, TESTS_DIR)

from _batches import TIME_SCALE, Pair, bounded  # noqa: E402
from _providers import (IDLE_ZERO, PROVIDERS, Provider, closed_leaks, param, rdma_devices,  # noqa: E402,F401
                        skip_unavailable, xproc_vm_probe)
from _target import MARK, GuardedBuffer, TargetCore  # noqa: E402

TARGET_SCRIPT = os.path.join(TESTS_DIR, "_target.py")

# Upper bound for one test; past it faulthandler dumps every thread's stack and
# exits, so a hang in the engine shows where it hangs instead of stalling CI.
TEST_WATCHDOG_S = float(os.environ.get("KVFLOW_TEST_WATCHDOG_S", str(150 * TIME_SCALE)))

# ---------------------------------------------------------------- the local loop

# Files whose tests are marked (besides their own marks), so that a plain
# `python3 -m pytest -q` on a developer's machine is a short loop:
#   interop: runs another project's code (NIXL, Mooncake, SGLang, vLLM, their tests);
#   e2e: servers or members in processes of their own, stopped and killed;
#   slow: long by design (soaks, the Soft-RoCE VM, stalls of 7-30 s, fuzzing).
# The loop leaves them out; CI=true, KVFLOW_TESTS=all, a -m expression or
# naming test files runs them (CI runs everything).
LOOP_MARKS = {
    "test_compat_mooncake.py": ("interop",), "test_compat_mooncake_store.py": ("interop",),
    "test_compat_mooncake_tensor.py": ("interop",),
    "test_compat_nixl.py": ("interop",), "test_upstream_mooncake.py": ("interop",),
    "test_upstream_nixl.py": ("interop",), "test_sglang_backend.py": ("interop",),
    "test_sglang_hicache.py": ("interop",), "test_vllm_connector.py": ("interop",),
    "test_vllm_mooncake_store.py": ("interop",), "test_mooncake_ci.py": ("interop",),
    "test_vllm_pd.py": ("interop", "e2e"),
    "test_vllm_router.py": ("interop", "e2e"), "test_compare_rdma.py": ("interop",),
    "test_pd_e2e.py": ("e2e",), "test_pd_routed.py": ("e2e",), "test_store_process.py": ("e2e",),
    "test_store_durable.py": ("e2e",), "test_netns.py": ("e2e",), "test_metadata.py": ("e2e",),
    "test_liveness.py": ("slow",), "test_soak.py": ("slow",), "test_soak_rdma.py": ("slow",),
    "test_rdma_vm.py": ("slow",), "test_fuzz_decoders.py": ("slow",), "test_fuzz_control.py": ("slow",),
    "test_fuzz_data.py": ("slow",), "test_cuda_standin.py": ("slow",),
    "test_local_fence.py": ("slow",), "test_failover.py": ("slow",), "test_incast.py": ("slow",),
    "test_bench.py": ("e2e",),
}
LOOP_LEAVES_OUT = ("interop", "e2e", "slow", "vllm", "xproc")


def _whole_loop(config) -> bool:
    return (os.environ.get("CI", "").lower() == "true" or os.environ.get("KVFLOW_TESTS") == "all"
            or bool(config.option.markexpr) or config.args_source is not pytest.Config.ArgsSource.TESTPATHS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in LOOP_MARKS.get(os.path.basename(str(item.fspath)), ()):
            item.add_marker(mark)
        # the same test against a target in a child process: CI runs it,
        # the local loop runs the in-process variant only
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(isinstance(v, str) and v in PROVIDERS and PROVIDERS[v].xproc
                                        for v in callspec.params.values()):
            item.add_marker("xproc")
    if _whole_loop(config):
        return
    keep, left = [], []
    for i in items:
        (left if any(i.get_closest_marker(m) for m in LOOP_LEAVES_OUT) else keep).append(i)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
        config._kvflow_left_out = len(left)


def pytest_sessionstart(session):
    # the reaper (tests/_reaper.py): kills what this run started and left
    # running, however the run ends (a watchdog's os._exit, a kill for memory)
    if os.environ.get("KVFLOW_TEST_REAPER", "1") != "0" and sys.platform == "linux":
        import subprocess
        session.config._kvflow_reaper = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "_reaper.py"), str(os.getpid())],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_kvflow_left_out", 0)
    if n:
        terminalreporter.write_line(f"the local loop left out {n} tests marked {'/'.join(LOOP_LEAVES_OUT)}: "
                                    "KVFLOW_TESTS=all (or CI=true) runs everything")


# Regions every target registers unless a test asks for others.
DEFAULT_REGIONS = (
    {"name": "rw", "length": 4 << 20, "access": 3},
    {"name": "ro", "length": 64 << 10, "access": 1},
    {"name": "wo", "length": 64 << 10, "access": 2},
)



# ---------------------------------------------------------------- asyncio hygiene


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(TEST_WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# A full gc.collect() walks every object alive: with the suite's imports
# (numpy, torch, the conductor, SGLang's modules) that is ~0.2-1 s per test,
# most of the local loop's time. So what survives a test's collection is
# frozen (gc.freeze: left out of later collections), and each test's
# collect walks only what the test made. Every FULL_COLLECT_EVERY tests the
# frozen objects are let go and collected once, so that cyclic garbage a
# test left referenced and a later one released is still reclaimed.
FULL_COLLECT_EVERY = 100
_collections = 0


def _collect_this_tests_garbage() -> None:
    global _collections
    _collections += 1
    if _collections % FULL_COLLECT_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
async def loop_exception_guard():
    """Fail the test if the loop's exception handler fired during it.

    Autouse fixtures are set up first and torn down last, so this also sees what
    goes wrong while the other fixtures close engines and peers.
    """
    loop = asyncio.get_running_loop()
    calls: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: calls.append(ctx))
    try:
        yield calls
        # Let pending callbacks run, and collect garbage so that "Task exception
        # was never retrieved" (reported from __del__) is reported now.
        for _ in range(3):
            await asyncio.sleep(0)
        _collect_this_tests_garbage()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    if calls:
        lines = []
        for ctx in calls:
            exc = ctx.get("exception")
            rest = {k: v for k, v in ctx.items() if k not in ("message", "exception")}
            lines.append(f"{ctx.get('message')!r} exception={exc!r} ctx={rest}")
        pytest.fail("event loop exception handler fired:\n  " + "\n  ".join(lines))


# ---------------------------------------------------------------- providers


# The variants (tests/_providers.py: the one list every suite uses).
_param = param
_skip_unavailable = skip_unavailable


@pytest.fixture(params=[_param(n) for n in PROVIDERS if n != "rdma-xproc"])
def provider(request) -> Provider:
    p = PROVIDERS[request.param]
    _skip_unavailable(p)
    return p


@pytest.fixture(params=[_param(n) for n in PROVIDERS if PROVIDERS[n].xproc])
def xproc_provider(request) -> Provider:
    """Only the providers whose target is a separate process (kill tests)."""
    p = PROVIDERS[request.param]
    _skip_unavailable(p)
    return p


# ---------------------------------------------------------------- targets


class RegionInfo(NamedTuple):
    name: str
    addr: int
    length: int
    access: int


class TargetError(Exception):
    """An operation of the target failed (its type and message are in the text)."""


class Target:
    """What a test may do with the other side. Same methods in-process and cross-process."""

    xproc: bool
    address: str
    pid: int
    regions: dict[str, RegionInfo]
    data_ports: list[int]

    def raddr(self, name: str, offset: int = 0) -> int:
        return self.regions[name].addr + offset

    def _set_info(self, info: dict) -> None:
        self.address = info["address"]
        self.pid = info["pid"]
        self.regions = {n: RegionInfo(**r) for n, r in info["regions"].items()}
        self.data_ports = list(info.get("data_ports", []))

    async def register(self, name: str, length: int, access: int = 3) -> RegionInfo:
        info = RegionInfo(**await self._op("register", name=name, length=length, access=int(access)))
        self.regions[name] = info
        return info

    async def deregister(self, name: str) -> None:
        await self._op("deregister", name=name)
        del self.regions[name]

    async def fill(self, name: str, seed: int, offset: int = 0, length: int | None = None) -> None:
        await self._op("fill", name=name, seed=seed, offset=offset, length=length)

    async def sha(self, name: str, offset: int = 0, length: int | None = None) -> str:
        return await self._op("sha", name=name, offset=offset, length=length)

    async def sha_many(self, name: str, ranges) -> list[str]:
        return await self._op("sha_many", name=name, ranges=[[int(o), int(n)] for o, n in ranges])

    async def get(self, name: str, offset: int, length: int) -> bytes:
        return bytes.fromhex(await self._op("get", name=name, offset=offset, length=length))

    async def guards(self) -> list[str]:
        return await self._op("guards")

    async def watch(self) -> None:
        await self._op("watch")

    async def notifications(self) -> list[dict]:
        return await self._op("notifications")

    async def notify(self, address: str, data: bytes) -> None:
        await self._op("notify", address=address, data_hex=data.hex())

    async def loop_errors(self) -> list[str]:
        return await self._op("loop_errors")

    async def counters(self) -> dict[str, int]:
        return await self._op("counters")

    async def hammer(self, address: str, remote_addr: int, length: int, region: str = "rw") -> None:
        await self._op("hammer", address=address, remote_addr=int(remote_addr), length=int(length), region=region)

    async def _op(self, op: str, **args) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


class InprocTarget(Target):
    xproc = False

    def __init__(self, core: TargetCore):
        self.core = core

    @classmethod
    async def start(cls, *, protocols, secret, regions) -> "InprocTarget":
        core = TargetCore(protocols=protocols, secret=secret)
        self = cls(core)
        await core.start()
        try:
            for spec in regions:
                core.register(spec["name"], spec["length"], spec.get("access", 3))
        except BaseException:
            await core.close()
            raise
        self._set_info(core.info())
        return self

    async def _op(self, op: str, **args) -> Any:
        fn = {"loop_errors": self.core.get_loop_errors}.get(op) or getattr(self.core, op)
        try:
            res = fn(**args)
            if asyncio.iscoroutine(res):
                res = await res
        except (KeyError, IndexError) as e:
            raise TargetError(f"{type(e).__name__}: {e}") from e
        return json.loads(json.dumps(res))  # same shapes as across the pipe

    async def close(self) -> dict:
        """Closes the target; its engine's counters once closed."""
        await self.core.close()
        return self.core.counters()

    def kill(self) -> None:
        raise RuntimeError("an in-process target cannot be killed")


def _child_env() -> dict[str, str]:
    """The child imports the very kvflow this process imported (an in-place
    build is not on the child's sys.path otherwise: its sys.path[0] is tests/)."""
    import kvflow

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class XprocTarget(Target):
    xproc = True

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self._lock = asyncio.Lock()
        self._id = 0
        self.killed = False

    @classmethod
    async def start(cls, *, protocols, secret, regions) -> "XprocTarget":
        cfg = {
            "protocols": list(protocols) if protocols is not None else None,
            "secret": secret.decode() if isinstance(secret, bytes) else secret,
            "secret_is_bytes": isinstance(secret, bytes),
            "regions": list(regions),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            TARGET_SCRIPT,
            json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 26,
            env=_child_env(),
        )
        self = cls(proc)
        try:
            hello = await bounded(self._read_msg(), 60)
        except BaseException:
            await self._reap(force=True)
            raise
        self._set_info(hello["hello"])
        return self

    async def _read_msg(self) -> dict:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                rc = await bounded(self.proc.wait(), 10)
                raise TargetError(f"target process exited (rc={rc})")
            text = line.decode(errors="replace")
            if text.startswith(MARK):
                return json.loads(text[len(MARK) :])
            sys.stderr.write("[target stdout] " + text)

    async def _op(self, op: str, **args) -> Any:
        async with self._lock:
            self._id += 1
            req = {"id": self._id, "op": op, "args": args}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            await self.proc.stdin.drain()
            msg = await bounded(self._read_msg(), 60)
            assert msg.get("id") == self._id, msg
            if not msg["ok"]:
                raise TargetError(f"{msg['type']}: {msg['error']}")
            return msg["result"]

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()  # SIGKILL

    async def _reap(self, force: bool = False) -> None:
        if self.proc.returncode is None and force:
            self.proc.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            self.proc.kill()
            await asyncio.wait_for(self.proc.wait(), 10)

    async def close(self) -> dict:
        """Closes the child's engine and ends it; the engine's counters once
        closed ({} when the child was killed or did not answer)."""
        final: dict = {}
        if self.proc.returncode is None and not self.killed:
            try:
                final = await self._op("exit") or {}
            except Exception:
                self.proc.kill()
            try:
                self.proc.stdin.close()
            except Exception:
                pass
        await self._reap(force=self.killed)
        return final


# Counters (Engine.counters(), where the engine has it) that must drop to zero
# once nothing is in flight, and those that must return to their value right
# after start() once every peer has gone.
# KVFLOW_TEST_BALANCE=0 turns the baseline part off (to look past a known leak).
AT_BASELINE = ("sockets", "threads") if os.environ.get("KVFLOW_TEST_BALANCE", "1") != "0" else ()


async def _unbalanced(read_counters, baseline: dict, wait_s: float = 3.0) -> dict:
    """Poll the counters for up to ``wait_s``; return the ones still off ({} when balanced)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = await bounded(read_counters()) if asyncio.iscoroutinefunction(read_counters) else read_counters()
        off = {k: now[k] for k in IDLE_ZERO if now.get(k, 0) != 0}
        off.update({k: f"{now[k]} (baseline {baseline[k]})" for k in AT_BASELINE
                    if k in now and k in baseline and now[k] > baseline[k]})
        if not off or time.monotonic() > deadline:
            return off
        await asyncio.sleep(0.05)


async def _staging_settled(eng, wait_s: float = 3.0) -> dict:
    """Polls engine.staging_stats() for up to ``wait_s``: the staging slots
    still in use and inbox leases still held ({} when all are back;
    kvflow._testing.staging_leaks)."""
    from kvflow._testing import staging_leaks

    deadline = time.monotonic() + wait_s
    while True:
        off = staging_leaks(eng.staging_stats())
        if not off or time.monotonic() > deadline:
            return off
        await asyncio.sleep(0.05)


@pytest.fixture
async def make_target(request):
    """``await make_target(regions=..., secret=..., protocols=...)`` -> Target.

    The target lives in this process or in a child, per ``provider`` (or, without
    a provider, in this process speaking tcp). Teardown fails the test when guard
    bytes were overwritten or the target's loop exception handler fired.
    """
    targets: list[Target] = []
    default: Provider = (
        request.getfixturevalue("provider")
        if "provider" in request.fixturenames
        else request.getfixturevalue("xproc_provider")
        if "xproc_provider" in request.fixturenames
        else PROVIDERS["tcp"]
    )

    async def make(*, regions=DEFAULT_REGIONS, secret=None, protocols=None, xproc=None) -> Target:
        # protocols: None = the provider's; "auto" = let the engine choose (protocols=None)
        protocols = default.protocols if protocols is None else None if protocols == "auto" else protocols
        xproc = default.xproc if xproc is None else xproc
        cls = XprocTarget if xproc else InprocTarget
        t = await bounded(cls.start(protocols=protocols, secret=secret, regions=regions), 60)
        targets.append(t)
        t.baseline = await bounded(t.counters())
        return t

    yield make

    problems = []
    for t in reversed(targets):
        if t.xproc and (t.killed or t.proc.returncode is not None):
            await t.close()
            continue
        try:
            bad = await bounded(t.guards())
            if bad:
                problems.append(f"target {t.address}: guard bytes overwritten around {bad}")
            errs = await bounded(t.loop_errors())
            if errs:
                problems.append(f"target {t.address}: loop exception handler fired: {errs}")
            await bounded(t._op("close_peers"))
            leak = await _unbalanced(t.counters, t.baseline)
            if leak:
                problems.append(f"target {t.address}: native resources did not return to baseline "
                                f"after every initiator closed: {leak}")
        finally:
            final = await bounded(t.close())
        leak = closed_leaks(final or {})
        if leak:
            problems.append(f"target {t.address}: native resources left after close: {leak}")
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
async def make_engine(request, make_target):
    """``await make_engine(protocols=..., secret=...)`` -> started kvflow.Engine.

    Depends on make_target so that it is torn down first: initiators close
    before the targets check that their resources returned to baseline.
    Teardown fails when batches or slices are still in flight, or staging
    slots in use or leased (engine.staging_stats())."""
    import kvflow

    engines = []
    default: Provider = (
        request.getfixturevalue("provider")
        if "provider" in request.fixturenames
        else request.getfixturevalue("xproc_provider")
        if "xproc_provider" in request.fixturenames
        else PROVIDERS["tcp"]
    )

    async def make(*, protocols=None, secret=None, **kw):
        # protocols: None = the provider's; "auto" = let the engine choose (protocols=None)
        protocols = default.protocols if protocols is None else None if protocols == "auto" else protocols
        eng = kvflow.Engine(listen="127.0.0.1:0", protocols=protocols, secret=secret, **kw)
        await bounded(eng.start())
        engines.append(eng)
        return eng

    yield make
    problems = []
    for eng in reversed(engines):
        try:
            if callable(getattr(eng, "counters", None)):
                leak = await _unbalanced(lambda e=eng: {k: int(v) for k, v in e.counters().items()}, {})
                if leak:
                    problems.append(f"engine {eng.address}: still in flight at teardown: {leak}")
                staged = await _staging_settled(eng)
                if staged:
                    problems.append(f"engine {eng.address}: staging slots or leases held at teardown: {staged}")
        finally:
            await bounded(eng.close())
        leak = closed_leaks(eng.counters())
        if leak:
            problems.append(f"engine {eng.address}: native resources left after close: {leak}")
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def local_mem():
    """``local_mem(eng, length, name=None, access=None)`` -> GuardedBuffer registered
    on ``eng`` (``.region`` set). Teardown checks every buffer's guard bytes."""
    bufs: list[GuardedBuffer] = []

    def make(eng, length: int, *, name=None, access=None, shift: int = 0) -> GuardedBuffer:
        buf = GuardedBuffer(length, shift=shift)
        kw = {} if access is None else {"access": access}
        buf.region = eng.register(buf.view, name=name, **kw)
        bufs.append(buf)
        return buf

    yield make
    bad = [i for i, b in enumerate(bufs) if not b.guards_ok()]
    if bad:
        pytest.fail(f"guard bytes overwritten around local buffers #{bad}")


@pytest.fixture
async def make_pair(provider, make_engine, make_target):
    """``await make_pair(regions=..., target_secret=..., local_secret=...)`` -> Pair."""
    pairs: list[Pair] = []

    async def make(*, regions=DEFAULT_REGIONS, target_secret=None, local_secret=None) -> Pair:
        target = await make_target(regions=regions, secret=target_secret)
        eng = await make_engine(secret=local_secret)
        peer = await bounded(eng.connect(target.address))
        p = Pair(provider, eng, target, peer)
        pairs.append(p)
        return p

    yield make
    for p in reversed(pairs):
        await bounded(p.peer.close())


@pytest.fixture
async def pair(make_pair) -> Pair:
    return await make_pair()
