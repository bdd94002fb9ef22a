"""kvflow.compat.mooncake: Mooncake Transfer Engine's Python API on kvflow.

The scenario tests run twice, against kvflow's TransferEngine and against
Mooncake's own (`mooncake.engine.TransferEngine`, skipped when it is not
importable), and assert the same return codes for the same calls: that is
what proves the conventions match. The kvflow-only tests cover what Mooncake
does differently or cannot do (see the module docstring), thread-safety, a
target in another process and a peer that stops answering.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvflow
from kvflow.compat import mooncake as compat
from _providers import closed_leaks, rdma_devices as compat_rdma_devices

MiB = 1 << 20
GUARD = 0x5A        # fill of the bytes around a target's registered range


def _mooncake_engine_module():
    try:
        import mooncake.engine as m
    except Exception as e:  # noqa: BLE001 - absent, or its .so lacks libibverbs: a skip
        return None, f"mooncake.engine is not importable ({type(e).__name__}: {e})"
    return m, ""


MOONCAKE, MOONCAKE_WHY = _mooncake_engine_module()


@pytest.fixture(params=["kvflow", "mooncake"])
def api(request):
    """The module whose TransferEngine, TransferNotify and TransferOpcode a
    scenario uses."""
    if request.param == "mooncake":
        if MOONCAKE is None:
            pytest.skip(MOONCAKE_WHY)
        return MOONCAKE
    return compat


@pytest.fixture
def make():
    """make(module=compat) -> an initialized engine of `module` on
    127.0.0.1. kvflow's are closed at teardown, and nothing may have
    reached their loop's exception handler."""
    made = []

    def factory(module=compat, hostname="127.0.0.1", protocol="tcp"):
        eng = module.TransferEngine()
        assert eng.initialize(hostname, "P2PHANDSHAKE", protocol, "") == 0
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        if isinstance(eng, compat.TransferEngine):
            thread = eng._thread
            eng.close()
            errors = getattr(thread, "loop_errors", [])
            assert not errors, f"the engine loop's exception handler fired: {errors}"
            if thread is not None and thread.engine is not None:
                left = closed_leaks(thread.engine.counters())
                assert not left, f"native resources left after close: {left}"
    made.clear()


def name(eng) -> str:
    return f"127.0.0.1:{eng.get_rpc_port()}"


def ptr(arr: np.ndarray, offset: int = 0) -> int:
    return arr.ctypes.data + offset


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Target:
    """A peer with one registered range inside a guarded buffer: 1 MiB of
    GUARD bytes on each side that nobody may ever write."""

    def __init__(self, eng, size: int = MiB) -> None:
        self.eng = eng
        self.size = size
        self.buf = np.full(size + 2 * MiB, GUARD, np.uint8)
        self.view = self.buf[MiB:MiB + size]
        self.view[:] = 0
        assert eng.register_memory(self.addr, size) == 0

    @property
    def addr(self) -> int:
        return ptr(self.buf, MiB)

    def guards_intact(self) -> bool:
        return bool((self.buf[:MiB] == GUARD).all() and (self.buf[MiB + self.size:] == GUARD).all())


def make_pair(make, module):
    """(initiator, Target, local source buffer): both engines of `module`;
    the source (1 MiB of a pattern) registered with the initiator."""
    a, b = make(module), make(module)
    src = pattern(MiB, 1)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    return a, Target(b), src


@pytest.fixture
def pair(api, make):
    return make_pair(make, api)


@pytest.fixture
def kpair(make):
    """make_pair of kvflow's engines only."""
    return make_pair(make, compat)


# ---------------------------------------------------------------- same codes as Mooncake


def test_register_codes(api, make):
    eng = make(api)
    x, y = np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)
    assert eng.register_memory(ptr(x), x.nbytes) == 0
    assert eng.register_memory(ptr(x), x.nbytes) == -7          # the same again
    assert eng.register_memory(ptr(x, 4096), 100) == -7         # inside it
    assert eng.register_memory(ptr(y), 0) == -1                 # empty
    assert eng.unregister_memory(ptr(x)) == 0
    assert eng.unregister_memory(ptr(x)) == -3
    assert eng.batch_register_memory([ptr(x), ptr(y)], [x.nbytes, y.nbytes]) == 0
    assert eng.batch_unregister_memory([ptr(x), ptr(y)]) == 0
    assert eng.register_memory(ptr(x), x.nbytes) == 0           # usable again
    assert eng.unregister_memory(ptr(x)) == 0


def test_sync_write_and_read(pair):
    a, t, src = pair
    assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr, 4096) == 0
    assert (t.view[:4096] == src[:4096]).all()
    t.view[8192:8192 + 1000] = pattern(1000, 2)
    assert a.transfer_sync_read(name(t.eng), ptr(src, 100), t.addr + 8192, 1000) == 0
    assert (src[100:1100] == t.view[8192:9192]).all()
    assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr, 0) == 0     # empty: nothing to do
    assert t.guards_intact()


def test_batch_sync_write_and_read(pair):
    a, t, src = pair
    offs = [0, 70_000, 300_000, 900_000]
    lens = [4096, 1, 65536, 100_000]
    assert a.batch_transfer_sync_write(name(t.eng), [ptr(src, o) for o in offs],
                                       [t.addr + o for o in offs], lens) == 0
    for o, n in zip(offs, lens):
        assert (t.view[o:o + n] == src[o:o + n]).all()
    t.view[:] = pattern(MiB, 3)
    back = [ptr(src, 500_000 + i * 8192) for i in range(3)]
    assert a.batch_transfer_sync_read(name(t.eng), back, [t.addr + o for o in offs[:3]], [4096] * 3) == 0
    for i, o in enumerate(offs[:3]):
        assert (src[500_000 + i * 8192:][:4096] == t.view[o:o + 4096]).all()
    assert a.batch_transfer_sync_write(name(t.eng), [], [], []) == 0        # empty batch
    assert t.guards_intact()


def test_async_batches_and_status(pair):
    a, t, src = pair
    ids = [a.batch_transfer_async_write(name(t.eng), [ptr(src, i * 65536)], [t.addr + i * 65536], [65536])
           for i in range(4)]
    assert all(isinstance(b, int) and b != 0 for b in ids)
    assert a.get_batch_transfer_status(ids) == 0
    assert (t.view[:4 * 65536] == src[:4 * 65536]).all()
    assert a.get_batch_transfer_status([]) == 0
    t.view[:65536] = 7
    rid = a.batch_transfer_async_read(name(t.eng), [ptr(src)], [t.addr], [65536])
    assert rid != 0 and a.get_batch_transfer_status([rid]) == 0
    assert (src[:65536] == 7).all()


def test_submit_write_and_check_status(pair):
    a, t, src = pair
    bid = a.transfer_submit_write(name(t.eng), ptr(src), t.addr + 4096, 4096)
    assert bid != 0
    deadline = time.monotonic() + 10
    while (status := a.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert status == 1
    assert (t.view[4096:8192] == src[:4096]).all()


def test_opcode_calls_and_notifications(api, pair):
    a, t, src = pair
    note = api.TransferNotify("req-1", "layer 0 done")
    assert a.transfer_sync(name(t.eng), ptr(src), t.addr, 100, api.TransferOpcode.Write, note) == 0
    assert a.batch_transfer_sync(name(t.eng), [ptr(src, 100)], [t.addr + 100], [100],
                                 api.TransferOpcode.Write, api.TransferNotify("req-2", "bye")) == 0
    bid = a.batch_transfer_async(name(t.eng), [ptr(src, 200)], [t.addr + 200], [100], api.TransferOpcode.Write)
    assert bid != 0 and a.get_batch_transfer_status([bid]) == 0
    assert (t.view[:300] == src[:300]).all()
    deadline = time.monotonic() + 10
    got: list = []
    while len(got) < 2 and time.monotonic() < deadline:
        got += t.eng.get_notifies()
        time.sleep(0.01)
    assert [(n.name, n.msg) for n in got] == [("req-1", "layer 0 done"), ("req-2", "bye")]
    assert t.eng.get_notifies() == []


def test_first_buffer_address(api, make):
    a, b, c = make(api), make(api), make(api)
    assert a.get_first_buffer_address(name(c)) == 0                 # a peer with nothing registered
    # registration order, not address order: the higher address goes first
    first, second = sorted([np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)], key=ptr, reverse=True)
    assert b.register_memory(ptr(first), MiB) == 0
    assert b.register_memory(ptr(second), MiB) == 0
    assert a.get_first_buffer_address(name(b)) == ptr(first)
    assert b.get_first_buffer_address(name(b)) == ptr(first)        # its own
    if api is compat:
        # Mooncake answers from the descriptor it cached at the first lookup;
        # kvflow asks the peer again
        assert b.unregister_memory(ptr(first)) == 0
        assert a.get_first_buffer_address(name(b)) == ptr(second)
        assert c.register_memory(ptr(first), MiB) == 0
        assert a.get_first_buffer_address(name(c)) == ptr(first)


def test_managed_buffers(pair):
    a, t, _ = pair
    m = a.allocate_managed_buffer(65536)
    assert m != 0
    assert a.write_bytes_to_buffer(m, b"hello", 5) == 0
    assert a.read_bytes_from_buffer(m, 5) == b"hello"
    assert a.transfer_sync_write(name(t.eng), m, t.addr, 5) == 0     # it is registered
    assert bytes(t.view[:5]) == b"hello"
    t.view[100:200] = 9
    assert a.transfer_sync_read(name(t.eng), m + 1000, t.addr + 100, 100) == 0
    assert a.read_bytes_from_buffer(m + 1000, 100) == b"\x09" * 100
    assert a.free_managed_buffer(m, 65536) == 0


def test_failures_give_the_same_codes(pair):
    a, t, src = pair
    peer = name(t.eng)
    # outside the peer's registered range: refused, nothing around it touched
    assert a.transfer_sync_write(peer, ptr(src), t.addr + t.size + 4096, 4096) == -1
    assert a.transfer_sync_write(peer, ptr(src), t.addr + t.size - 100, 4096) == -1
    assert a.transfer_sync_write(peer, ptr(src), t.addr - 4096, 4096) == -1
    assert a.batch_transfer_sync_write(peer, [ptr(src)] * 2, [t.addr, t.addr + t.size], [64, 64]) == -1
    bid = a.batch_transfer_async_write(peer, [ptr(src)], [t.addr + 2 * t.size], [4096])
    assert bid != 0 and a.get_batch_transfer_status([bid]) == -1
    assert t.guards_intact()
    # lists of different lengths
    assert a.batch_transfer_sync_write(peer, [ptr(src)], [t.addr, t.addr + 64], [64]) == -1
    assert a.batch_transfer_async_write(peer, [ptr(src)], [t.addr, t.addr + 64], [64]) == 0
    # nobody there, no port, a name that does not resolve: quick failures
    t0 = time.monotonic()
    assert a.transfer_sync_write("127.0.0.1:1", ptr(src), t.addr, 64) == -1
    assert a.batch_transfer_async_write("127.0.0.1:1", [ptr(src)], [t.addr], [64]) == 0
    assert a.transfer_sync_write("127.0.0.1", ptr(src), t.addr, 64) == -1
    assert a.send_probe("127.0.0.1:1") == -102
    assert a.get_first_buffer_address("127.0.0.1:1") == 0
    assert time.monotonic() - t0 < 10
    # and the engine still works
    assert a.send_probe(peer) == 0
    assert a.transfer_sync_write(peer, ptr(src), t.addr, 4096) == 0
    assert (t.view[:4096] == src[:4096]).all()


def test_write_into_unregistered_memory_fails_then_works_again(pair):
    a, t, src = pair
    peer = name(t.eng)
    assert a.transfer_sync_write(peer, ptr(src), t.addr, 4096) == 0
    assert t.eng.unregister_memory(t.addr) == 0
    t.view[:] = 0
    assert a.transfer_sync_write(peer, ptr(src), t.addr, 4096) == -1
    assert (t.view == 0).all() and t.guards_intact()
    assert t.eng.register_memory(t.addr, t.size) == 0
    assert a.transfer_sync_write(peer, ptr(src), t.addr, 4096) == 0
    assert (t.view[:4096] == src[:4096]).all()


# ---------------------------------------------------------------- kvflow only


def test_initialize_refuses_what_kvflow_cannot_do(make):
    eng = compat.TransferEngine()
    for server in ("etcd://127.0.0.1:1", "redis://127.0.0.1:1", "http://127.0.0.1:1/metadata", "127.0.0.1:1"):
        t0 = time.monotonic()
        assert eng.initialize("127.0.0.1", server, "tcp", "") == -1      # nobody there: as Mooncake, -1
        assert time.monotonic() - t0 < 5
        assert isinstance(eng.last_error, kvflow.PeerUnreachableError), (server, eng.last_error)
    for server in ("zk://127.0.0.1:2181", "etcd://a:1,b:2", ""):
        assert eng.initialize("127.0.0.1", server, "tcp", "") == -1
        assert "P2PHANDSHAKE" in str(eng.last_error) or "one etcd endpoint" in str(eng.last_error)
    assert eng.initialize_ext("127.0.0.1", "redis://127.0.0.1:1", "tcp", "", "etcd") == -1   # type mismatch
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    # before initialize(): negative codes, not a crash
    assert eng.register_memory(4096, 4096) == -1
    assert eng.transfer_sync_write("127.0.0.1:1", 4096, 4096, 1) == -1
    assert eng.batch_transfer_async_write("127.0.0.1:1", [4096], [4096], [1]) == 0
    assert eng.get_rpc_port() == -1
    assert eng.get_engine() is None
    with pytest.raises(NotImplementedError, match="no C\\+\\+ TransferEngine"):
        eng.get_engine_ptr()
    eng = make()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1     # twice
    assert isinstance(eng.get_engine(), kvflow.Engine)


def test_module_flags_say_what_kvflow_has(api):
    names = ("SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL", "SUPPORT_MUSA")
    for n in names:
        assert isinstance(getattr(api, n), bool), n
    if api is compat:
        assert compat.SUPPORT_CUDA == kvflow.features["cuda"]
        assert not any(getattr(compat, n) for n in names[1:])


def test_rdma_without_a_device_falls_back_to_tcp(make, caplog, monkeypatch):
    """Mooncake warns and uses tcp when protocol "rdma" finds no device
    (SGLang's wrapper passes "rdma" unless told otherwise); MC_FORCE_TCP too."""
    if compat_rdma_devices():
        pytest.skip("this host has RDMA devices: no fallback to see")
    with caplog.at_level("WARNING", logger="kvflow.compat.mooncake"):
        eng = make(protocol="rdma")
    assert "falling back to tcp" in caplog.text
    monkeypatch.setenv("MC_FORCE_TCP", "true")
    other = make(protocol="rdma")
    buf, src = np.zeros(4096, np.uint8), pattern(4096, 9)
    assert eng.register_memory(ptr(buf), 4096) == 0 and other.register_memory(ptr(src), 4096) == 0
    assert other.transfer_sync_write(name(eng), ptr(src), ptr(buf), 4096) == 0
    assert (buf == src).all()
    assert eng.get_engine().descriptor().data and not eng.get_engine().descriptor().rdma


def test_hostname_with_port_and_auto(make):
    probe = make()
    port = probe.get_rpc_port()
    probe.close()                       # its port is free again
    eng = make(hostname=f"127.0.0.1:{port}")
    assert eng.get_rpc_port() == port
    auto = make(protocol="auto")
    buf = np.zeros(4096, np.uint8)
    src = pattern(4096, 4)
    assert eng.register_memory(ptr(buf), 4096) == 0 and auto.register_memory(ptr(src), 4096) == 0
    assert auto.transfer_sync_write(name(eng), ptr(src), ptr(buf), 4096) == 0    # same process: memcpy
    assert (buf == src).all()


def test_last_error_is_the_typed_exception(kpair):
    a, t, src = kpair
    assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr + t.size, 64) == -1
    assert isinstance(a.last_error, kvflow.RemoteAccessError)
    assert a.transfer_sync_write("127.0.0.1:1", ptr(src), t.addr, 64) == -1
    assert isinstance(a.last_error, kvflow.PeerUnreachableError)
    # kvflow needs the local side registered (Mooncake's tcp transport does not)
    other = np.zeros(4096, np.uint8)
    assert a.transfer_sync_write(name(t.eng), ptr(other), t.addr, 64) == -1
    assert isinstance(a.last_error, kvflow.UnregisteredMemoryError)


def test_batch_ids_are_collected_once(kpair):
    a, t, src = kpair
    bid = a.batch_transfer_async_write(name(t.eng), [ptr(src)], [t.addr], [64])
    assert a.get_batch_transfer_status([bid]) == 0
    assert a.get_batch_transfer_status([bid]) == -1
    assert a.transfer_check_status(bid) == -1
    assert a.get_batch_transfer_status([123456789]) == -1
    assert a.free_managed_buffer(ptr(src), 64) == -1         # not from allocate_managed_buffer
    assert a.write_bytes_to_buffer(ptr(src), b"abc", 4) == -1


def test_sync_transfers_skip_the_loop_once_connected(kpair, monkeypatch):
    """After the first transfer to a target (which connects through the
    engine's loop), synchronous transfers are submitted and waited for on
    the caller's thread: no loop hop, so the loop path is never taken."""
    a, t, src = kpair
    assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr, 4096) == 0

    def no_loop(*args, **kw):
        raise AssertionError("took the loop path")
    monkeypatch.setattr(a, "_start", no_loop)
    for i in range(20):
        src[:4096] = pattern(4096, i)
        assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr + i * 4096, 4096) == 0
        assert (t.view[i * 4096:(i + 1) * 4096] == src[:4096]).all()
        assert a.transfer_sync_read(name(t.eng), ptr(src, 8192), t.addr + i * 4096, 4096) == 0
    assert a.batch_transfer_sync_write(name(t.eng), [ptr(src), ptr(src, 4096)], [t.addr, t.addr + 65536],
                                       [4096, 0]) == 0
    monkeypatch.undo()
    # outside the peer's regions: the loop path refreshes its table, then fails
    assert a.transfer_sync_write(name(t.eng), ptr(src), t.addr + (1 << 40), 4096) == -1
    assert isinstance(a.last_error, kvflow.RemoteAccessError), a.last_error
    assert a._engine.counters()["batches"] == 0           # every detached batch was freed
    assert t.guards_intact()


def test_threads_share_one_engine(make):
    a, b = make(), make()
    t = Target(b, 4 * MiB)
    src = pattern(4 * MiB, 5)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    peer = name(b)
    codes: list[int] = []

    def worker(k: int) -> None:
        base = k * MiB
        for i in range(40):
            o = base + i * 8192
            if i % 2:
                codes.append(a.transfer_sync_write(peer, ptr(src, o), t.addr + o, 8192))
            else:
                bid = a.batch_transfer_async_write(peer, [ptr(src, o)], [t.addr + o], [8192])
                codes.append(a.get_batch_transfer_status([bid]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert codes == [0] * 160
    for k in range(4):
        o = k * MiB
        assert (t.view[o:o + 40 * 8192] == src[o:o + 40 * 8192]).all()


def test_close_while_threads_transfer(make):
    """Every call racing close() returns (0 before, -1 after); none hangs."""
    a, b = make(), make()
    t = Target(b)
    src = pattern(MiB, 8)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    peer = name(b)
    codes: list[int] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        while not stop.is_set():
            o = k * 65536
            if k % 2:
                codes.append(a.transfer_sync_write(peer, ptr(src, o), t.addr + o, 65536))
            else:
                bid = a.batch_transfer_async_write(peer, [ptr(src, o)], [t.addr + o], [65536])
                codes.append(a.get_batch_transfer_status([bid]) if bid else -1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    a.close()
    time.sleep(0.1)
    stop.set()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a call hung across close()"
    assert set(codes) <= {0, -1} and codes.count(0) > 0 and codes[-1] == -1


def test_close_while_connecting(make):
    """A call stuck in a handshake (the peer accepts and never answers)
    returns -1 as soon as the engine closes."""
    import socket

    a = make()
    buf = np.zeros(4096, np.uint8)
    assert a.register_memory(ptr(buf), 4096) == 0
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        codes: list[int] = []
        th = threading.Thread(target=lambda: codes.append(
            a.transfer_sync_write(f"127.0.0.1:{silent.getsockname()[1]}", ptr(buf), ptr(buf), 64)))
        th.start()
        time.sleep(0.3)
        assert codes == []                          # still connecting
        t0 = time.monotonic()
        a.close()
        th.join(5)
        assert codes == [-1] and time.monotonic() - t0 < 5


def test_close(make):
    a = make()
    buf = np.zeros(4096, np.uint8)
    assert a.register_memory(ptr(buf), 4096) == 0
    a.close()
    a.close()                               # idempotent
    assert a.transfer_sync_write("127.0.0.1:1", ptr(buf), ptr(buf), 64) == -1
    assert a.register_memory(ptr(buf, 64), 64) == -1
    with compat.TransferEngine() as e:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.register_memory(ptr(buf), 64) == -1
    assert "closed" in repr(e)


# ---------------------------------------------------------------- a target in another process

CHILD = r"""
import json, sys
import numpy as np
from kvflow.compat.mooncake import TransferEngine
eng = TransferEngine()
assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", sys.argv[1], "") == 0
buf = np.zeros(1 << 20, np.uint8)
assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(json.dumps({"session": f"127.0.0.1:{eng.get_rpc_port()}", "addr": buf.ctypes.data}), flush=True)
for line in sys.stdin:
    off, n = map(int, line.split())
    print(json.dumps(buf[off:off + n].tolist()), flush=True)
"""


@pytest.fixture
def child():
    """Starts the target process; returns (proc, info)."""
    procs = []

    def start(protocol: str):
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([sys.executable, "-c", CHILD, protocol], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        return proc, json.loads(proc.stdout.readline())

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def stop(proc) -> None:
    """SIGSTOP, and wait until every thread of it is stopped (delivery is
    asynchronous: a receiver thread could still take one more write)."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        if all(s in "tT" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not stop")


def read_back(proc, off: int, n: int) -> np.ndarray:
    proc.stdin.write(f"{off} {n}\n")
    proc.stdin.flush()
    return np.array(json.loads(proc.stdout.readline()), dtype=np.uint8)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_cross_process(make, child, protocol):
    proc, info = child(protocol)
    a = make(protocol=protocol)
    src = pattern(65536, 6)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    peer, raddr = info["session"], info["addr"]
    assert a.get_first_buffer_address(peer) == raddr
    assert a.transfer_sync_write(peer, ptr(src), raddr + 100, 1000) == 0
    bid = a.batch_transfer_async_write(peer, [ptr(src, 1000), ptr(src, 5000)],
                                       [raddr + 20000, raddr + 30000], [3000, 4096])
    assert a.get_batch_transfer_status([bid]) == 0
    assert (read_back(proc, 100, 1000) == src[:1000]).all()
    assert (read_back(proc, 20000, 3000) == src[1000:4000]).all()
    assert (read_back(proc, 30000, 4096) == src[5000:9096]).all()
    assert a.transfer_sync_read(peer, ptr(src, 60000), raddr + 100, 1000) == 0
    assert (src[60000:61000] == src[:1000]).all()
    assert a.transfer_sync_write(peer, ptr(src), raddr + (1 << 20) - 10, 100) == -1


def test_peer_that_stops_answering_times_out_then_works(make, child, monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")       # Mooncake's knob; 5 s is its minimum
    proc, info = child("tcp")
    a = make()
    src = pattern(65536, 7)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    peer, raddr = info["session"], info["addr"]
    assert a.transfer_sync_write(peer, ptr(src), raddr, 4096) == 0
    stop(proc)
    bid = a.transfer_submit_write(peer, ptr(src), raddr, 4096)
    assert bid != 0
    t0 = time.monotonic()
    while (status := a.transfer_check_status(bid)) == 0 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    # Mooncake's timeout (-2): a stopped peer is slow, not lost (its kernel
    # answers: kvflow.control.liveness), so the transfer's own timeout ends it
    assert status == -2 and 4.5 < time.monotonic() - t0 < 15, status
    assert isinstance(a.last_error, kvflow.TransferTimeoutError)
    os.kill(proc.pid, signal.SIGCONT)
    assert a.transfer_sync_write(peer, ptr(src, 8192), raddr + 8192, 4096) == 0
    assert (read_back(proc, 8192, 4096) == src[8192:12288]).all()


@pytest.mark.parametrize("where", ["between", "during"])
def test_peer_stopped_for_7_s_is_slow_not_lost(make, child, monkeypatch, where):
    """A target stopped for 7 keepalives between two writes, or while one
    is in flight: the same TransferEngine and segment go on, the write in
    flight completes once it runs again (within Mooncake's 30 s timeout),
    every byte right."""
    monkeypatch.setenv("KVFLOW_KEEPALIVE", "1")         # both engines: the stall is 7 of them
    proc, info = child("tcp")
    a = make()
    src = pattern(65536, 9)
    assert a.register_memory(ptr(src), src.nbytes) == 0
    peer, raddr = info["session"], info["addr"]
    assert a.transfer_sync_write(peer, ptr(src), raddr, 4096) == 0
    stop(proc)
    try:
        if where == "during":
            bid = a.transfer_submit_write(peer, ptr(src, 4096), raddr + 4096, 4096)
            assert bid != 0
        time.sleep(7)
        if where == "during":
            assert a.transfer_check_status(bid) == 0        # waits for the peer, not failed
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    if where == "during":
        t0 = time.monotonic()
        while (status := a.transfer_check_status(bid)) == 0 and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert status == 1, (status, a.last_error)
    else:
        assert a.transfer_sync_write(peer, ptr(src, 4096), raddr + 4096, 4096) == 0
    assert a.transfer_sync_write(peer, ptr(src, 8192), raddr + 8192, 8192) == 0
    assert (read_back(proc, 0, 16384) == src[:16384]).all()


# ---------------------------------------------------------------- kvflow's option: priorities


def test_transfer_priority_option(make):
    """set_transfer_priority / transfer_priority (kvflow only): a HIGH
    write from one thread passes a LOW stream another thread started; bad
    values give -1 (or InvalidArgumentError from the context manager)."""
    a, b = make(), make()
    size = 256 * MiB
    src = np.ones(size, np.uint8)
    dst = np.zeros(size + MiB, np.uint8)
    assert a.register_memory(ptr(src), size) == 0 and b.register_memory(ptr(dst), dst.nbytes) == 0
    assert a.set_transfer_priority("urgent") == -1
    assert isinstance(a.last_error, kvflow.InvalidArgumentError)
    assert a.set_transfer_priority(kvflow.Priority.NORMAL, deadline=-1) == -1
    with pytest.raises(kvflow.InvalidArgumentError):
        with a.transfer_priority(7):
            pass
    assert a.transfer_sync_write(name(b), ptr(src), ptr(dst), MiB) == 0     # connected
    assert a.set_transfer_priority(kvflow.Priority.LOW) == 0
    n = 16
    stream = a.batch_transfer_async_write(name(b), [ptr(src) + k * (size // n) for k in range(n)],
                                          [ptr(dst) + k * (size // n) for k in range(n)], [size // n] * n)
    assert stream
    high_done = []

    def high():
        with a.transfer_priority(kvflow.Priority.HIGH):
            assert a.transfer_sync_write(name(b), ptr(src), ptr(dst) + size, 64 << 10) == 0
        high_done.append(a.transfer_check_status(stream))

    t = threading.Thread(target=high)
    t.start()
    t.join(60)
    assert high_done == [0], "the HIGH write did not pass the LOW stream"     # 0: still in flight
    assert a.get_batch_transfer_status([stream]) == 0
    assert (dst[:size] == 1).all() and (dst[size:size + (64 << 10)] == 1).all()
    assert a.set_transfer_priority() == 0
