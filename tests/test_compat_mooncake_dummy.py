"""Mooncake's dummy clients on kvflow (kvflow.compat.mooncake.dummy, .client,
.shm): a standalone real client process (`mooncake_client`, here `python -m
kvflow.compat.mooncake.client`) and MooncakeDistributedStore.setup_dummy()
stores that forward every call to it, their buffers in shared memory the
real client maps.

- the real client's flags (mooncake_client's);
- bytes: put_from / get_into and their batch, multi-buffer and range forms
  through a dummy, every byte compared; what is refused (memory that is not
  a registered shared allocation: -600, and nothing written);
- two dummy processes, the real client dropping a dummy's mappings when it
  goes; no real client (-1); the real client gone (a code, no hang);
- SGLang HiCache's MooncakeStore in standalone_storage mode (the installed
  SGLang's file, unchanged), on kvflow and on the real wheel for reference.
Mooncake's own dummy-client tests run in tests/test_mooncake_ci.py."""
from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvflow.compat.mooncake import shm
from kvflow.compat.mooncake.client import parse_client_flags
from kvflow.compat.mooncake.store import MooncakeDistributedStore
from kvflow.errors import InvalidArgumentError
from test_mooncake_ci import CiMaster, CiRealClient, _env, _free_port, _wheel_missing

HERE = Path(__file__).parent
INVALID_PARAMS = -600


def _maps(pid: int) -> int:
    """How many of the real client's mappings are dummies' shared memory."""
    with open(f"/proc/{pid}/maps") as f:
        return sum("kvflow-mooncake-shm" in line for line in f)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A kvflow master and a kvflow real client (from PATH, as the CI starts
    it) on a port of its own."""
    m = CiMaster("kvflow")
    c = CiRealClient("kvflow", m, tmp_path_factory.mktemp("client"), port=_free_port())
    yield m, c
    c.stop()
    m.stop()
    assert c.proc.returncode == 0, c.log.read_text()[-2000:]


@pytest.fixture
def dummy(pool):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 << 20, 16 << 20, f"127.0.0.1:{pool[1].port}") == 0, s.last_error
    yield s
    errors = list(s._thread.loop_errors)
    assert s.close() == 0
    assert not errors, errors


def _alloc(s: MooncakeDistributedStore, size: int, seed: int) -> tuple[int, bytes]:
    ptr = s.alloc_from_mem_pool(size)
    assert ptr
    data = random.Random(seed).randbytes(size)
    ctypes.memmove(ptr, data, size)
    return ptr, data


# -- the real client's flags ---------------------------------------------------------

def test_client_flags():
    v = parse_client_flags([])
    assert (v["host"], v["master_server_address"], v["port"], v["global_segment_size"], v["local_buffer_size"],
            v["protocol"]) == ("0.0.0.0", "127.0.0.1:50051", 50052, 4 << 30, 0, "tcp")
    v = parse_client_flags(["--port", "6000", "--global_segment_size=1.5 GB", "--local_buffer_size=16MB",
                            "--master_server_address=10.0.0.1:7000", "--threads=8", "--noenable_offload",
                            "--metadata_server=P2PHANDSHAKE", "--device_names=mlx5_0"])
    assert (v["port"], v["global_segment_size"], v["local_buffer_size"], v["master_server_address"],
            v["enable_offload"]) == (6000, 3 << 29, 16 << 20, "10.0.0.1:7000", False)
    for argv, why in ((["--global_segment_size=lots"], "not a size"), (["--protocol=ib"], "--protocol"),
                      (["--tenant_id=t1"], "no tenants"), (["--port=0"], "not a port"),
                      (["--bogus"], "unknown flag '--bogus'")):
        with pytest.raises(InvalidArgumentError, match=why):
            parse_client_flags(argv)
    run = subprocess.run([sys.executable, "-m", "kvflow.compat.mooncake.client", "--enable_cxl=true"],
                         env=_env("kvflow"), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "unknown flag '--enable_cxl=true'" in run.stderr
    for flag in ("--master_server_address", "--port", "--global_segment_size", "--host", "--protocol"):
        assert flag in run.stderr


def test_second_client_on_a_port_is_refused(pool):
    m, c = pool
    run = subprocess.run([sys.executable, "-m", "kvflow.compat.mooncake.client", f"--port={c.port}",
                          f"--master_server_address={m.address}"], env=_env("kvflow"), capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 1 and f"port {c.port}" in run.stderr, run.stderr


# -- bytes through a dummy ------------------------------------------------------------

def test_put_from_get_into_every_byte(dummy, pool):
    """Objects of odd sizes put from one registered allocation, read back
    with get (bytes), batch_get_into and the multi-buffer and range forms
    into another: every byte as written; the real client maps each
    registered allocation."""
    real_pid = pool[1].proc.pid
    before = _maps(real_pid)
    src, data = _alloc(dummy, 6 << 20, 1)
    dst = dummy.alloc_from_mem_pool(6 << 20)
    assert dummy.register_buffer(src, 6 << 20) == 0 and dummy.register_buffer(dst, 6 << 20) == 0
    assert _maps(real_pid) == before + 2
    sizes = [1, 7, 4095, 4096, 4097, 65537, 1 << 20, (2 << 20) + 3]
    offs = [sum(sizes[:i]) + 13 * i for i in range(len(sizes))]
    keys = [f"dummy-bytes-{os.getpid()}-{i}" for i in range(len(sizes))]
    assert dummy.batch_put_from(keys, [src + o for o in offs], sizes) == [0] * len(sizes)
    assert dummy.get_batch(keys) == [data[o:o + n] for o, n in zip(offs, sizes)]
    assert [dummy.get_size(k) for k in keys] == sizes
    ctypes.memset(dst, 0xEE, 6 << 20)
    assert dummy.batch_get_into(keys, [dst + o for o in offs], sizes) == sizes
    got = ctypes.string_at(dst, 6 << 20)
    for o, n in zip(offs, sizes):
        assert got[o:o + n] == data[o:o + n]
    # what lies between the objects was not written
    assert all(got[o + n:o + n + 13] == b"\xee" * 13 for o, n in zip(offs, sizes) if o + n + 13 <= len(got))
    # one object from two buffers, read back spread over three
    mkey = f"dummy-multi-{os.getpid()}"
    assert dummy.batch_put_from_multi_buffers([mkey], [[src + 100, src + 5000]], [[3000, 70000]]) == [0]
    want = data[100:3100] + data[5000:75000]
    assert dummy.get(mkey) == want
    ctypes.memset(dst, 0, 6 << 20)
    assert dummy.batch_get_into_multi_buffers([mkey], [[dst, dst + 10000, dst + 90000]],
                                              [[9000, 50000, 14000]]) == [73000]
    assert ctypes.string_at(dst, 9000) + ctypes.string_at(dst + 10000, 50000) + \
        ctypes.string_at(dst + 90000, 14000) == want
    # byte ranges of two objects into the registered buffer
    ctypes.memset(dst, 0, 64)
    assert dummy.get_into_ranges([dst], [[keys[3], mkey]], [[[0, 10], [30]]], [[[5, 4000], [2999]]],
                                 [[[10, 20], [2]]]) == [[[10, 20], [2]]]
    o3 = offs[3]
    assert ctypes.string_at(dst, 32) == data[o3 + 5:o3 + 15] + data[o3 + 4000:o3 + 4020] + want[2999:3001]
    assert dummy.batch_remove(keys + [mkey], force=True) == [0] * (len(keys) + 1)
    assert dummy.unregister_buffer(src) == 0 and dummy.unregister_buffer(dst) == 0
    assert _maps(real_pid) == before
    assert shm.free(src) == 0 and shm.free(dst) == 0


def test_refused_memory(dummy):
    """Mooncake's rules: register_buffer takes one shared allocation whole;
    an address outside what was registered is refused (-600) by the real
    client, and neither the pool nor the memory is touched."""
    ptr, data = _alloc(dummy, 1 << 20, 2)
    plain = (ctypes.c_ubyte * 4096)()
    assert dummy.register_buffer(ctypes.addressof(plain), 4096) == INVALID_PARAMS      # not shared memory
    assert "not in shared memory" in str(dummy.last_error)
    assert dummy.register_buffer(ptr + 4096, 4096) == INVALID_PARAMS                     # a part of one
    assert dummy.register_buffer(ptr, 4096) == INVALID_PARAMS
    assert "registered whole" in str(dummy.last_error)
    key = f"dummy-refused-{os.getpid()}"
    assert dummy.put_from(key, ptr, 100) == INVALID_PARAMS                                 # not registered yet
    assert dummy.is_exist(key) == 0
    assert dummy.register_buffer(ptr, 1 << 20) == 0
    assert dummy.register_buffer(ptr, 1 << 20) == INVALID_PARAMS                          # twice
    # a batch: the item inside goes in, the ones reaching past the end or
    # pointing elsewhere are refused
    keys = [f"{key}-{i}" for i in range(3)]
    assert dummy.batch_put_from(keys, [ptr, ptr + (1 << 20) - 10, ctypes.addressof(plain)], [4000, 11, 8]) == \
        [0, INVALID_PARAMS, INVALID_PARAMS]
    assert dummy.batch_is_exist(keys) == [1, 0, 0]
    assert dummy.get(keys[0]) == data[:4000]
    ctypes.memset(ctypes.addressof(plain), 0x5A, 4096)
    assert dummy.get_into(keys[0], ctypes.addressof(plain), 4096) == INVALID_PARAMS
    assert bytes(plain) == b"\x5a" * 4096
    assert dummy.get_into(keys[0], ptr + (1 << 20) - 100, 4000) == INVALID_PARAMS       # past the end
    assert ctypes.string_at(ptr + (1 << 20) - 100, 100) == data[-100:]
    assert dummy.get_into(keys[0], ptr + 8192, 100) == INVALID_PARAMS                   # too small, as Mooncake
    assert dummy.unregister_buffer(ptr) == 0
    assert dummy.unregister_buffer(ptr) == INVALID_PARAMS
    assert dummy.put_from(f"{key}-after", ptr, 100) == INVALID_PARAMS
    assert dummy.batch_remove(keys[:1], force=True) == [0]
    assert shm.free(ptr) == 0 and shm.free(ptr) == -1


def test_threads_at_once(dummy):
    """Eight threads, each its own objects from its own part of one buffer,
    through the dummy's connections at once: every byte."""
    size = 8 << 20
    ptr, data = _alloc(dummy, size, 3)
    out = dummy.alloc_from_mem_pool(size)
    assert dummy.register_buffer(ptr, size) == 0 and dummy.register_buffer(out, size) == 0
    errors = []

    def work(t: int) -> None:
        base = t * (1 << 20)
        keys = [f"dummy-thread-{os.getpid()}-{t}-{i}" for i in range(8)]
        addrs = [base + i * (128 << 10) for i in range(8)]
        if dummy.batch_put_from(keys, [ptr + a for a in addrs], [128 << 10] * 8) != [0] * 8:
            errors.append((t, "put", dummy.last_error))
        if dummy.batch_get_into(keys, [out + a for a in addrs], [128 << 10] * 8) != [128 << 10] * 8:
            errors.append((t, "get", dummy.last_error))
        dummy.batch_remove(keys, force=True)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert ctypes.string_at(out, size) == data
    assert dummy.unregister_buffer(ptr) == 0 and dummy.unregister_buffer(out) == 0


# -- processes --------------------------------------------------------------------------

DUMMY_PROCESS = textwrap.dedent("""
    import ctypes, random, sys, time
    from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, sys.argv[1]) == 0
    ptr = MooncakeHostMemAllocator().alloc(1 << 20)
    data = random.Random(4).randbytes(1 << 20)
    ctypes.memmove(ptr, data, 1 << 20)
    assert s.register_buffer(ptr, 1 << 20) == 0
    print(s.put_from(sys.argv[2], ptr, 1 << 20), flush=True)
    time.sleep(600)         # killed by the test: the real client must notice
""")


def test_two_processes_and_a_dummy_that_dies(dummy, pool):
    """A dummy in another process (the shim's mooncake.store) puts from its
    shared memory; this one reads every byte; when that process is killed
    the real client unmaps its memory."""
    real_pid = pool[1].proc.pid
    before = _maps(real_pid)
    key = f"dummy-other-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-c", DUMMY_PROCESS, f"127.0.0.1:{pool[1].port}", key],
                         env=_env("kvflow"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline().strip() == "0", p.stderr.read() if p.poll() is not None else ""
        assert _maps(real_pid) == before + 1
        assert dummy.get(key) == random.Random(4).randbytes(1 << 20)
    finally:
        p.kill()
        p.wait(30)
    deadline = time.monotonic() + 20
    while _maps(real_pid) != before:
        assert time.monotonic() < deadline, "the real client kept a dead dummy's memory"
        time.sleep(0.1)
    assert dummy.get(key) == random.Random(4).randbytes(1 << 20)     # the object is the pool's
    assert dummy.remove(key, force=True) == 0


def test_no_real_client():
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, f"127.0.0.1:{_free_port()}") == -1
    assert "no kvflow real client" in str(s.last_error)
    assert s.setup_dummy(1 << 20, 1 << 20, "nowhere") == -1
    assert s.put("k", b"v") != 0 and s.get("k") == b"" and s.health_check() == 1
    with pytest.raises(TypeError):
        s.setup_dummy(-1, 0, "127.0.0.1:1")


def test_real_client_gone(tmp_path):
    """The real client exits: the dummy's calls answer with codes at once."""
    m = CiMaster("kvflow")
    c = CiRealClient("kvflow", m, tmp_path, port=_free_port())
    s = MooncakeDistributedStore()
    try:
        assert s.setup_dummy(1 << 20, 1 << 20, f"127.0.0.1:{c.port}") == 0
        assert s.put("gone", b"v") == 0 and s.health_check() == 0
        c.stop()
        t0 = time.monotonic()
        assert s.put("gone2", b"v") < 0 and s.get("gone") == b"" and s.is_exist("gone") < 0
        assert s.health_check() == 2
        assert time.monotonic() - t0 < 10
        assert s.close() == 0
    finally:
        if c.proc.poll() is None:
            c.stop()
        m.stop()


# -- SGLang's standalone storage --------------------------------------------------------

@pytest.mark.parametrize("impl", ["kvflow", "mooncake"])
def test_sglang_standalone_storage(impl, tmp_path):
    """SGLang HiCache's MooncakeStore with standalone_storage (the installed
    SGLang's file, unchanged): its host pool from MooncakeHostTensorAllocator,
    setup_dummy to a mooncake_client, MHA and MLA pages set and got through
    the real client, every byte compared (tests/_sglang_mooncake_store.py)."""
    pytest.importorskip("sglang")
    if impl == "mooncake" and (why := _wheel_missing()):
        pytest.skip(why)
    m = CiMaster(impl)
    c = CiRealClient(impl, m, tmp_path, port=_free_port())
    try:
        env = _env(impl, MOONCAKE_MASTER=m.address, MOONCAKE_CLIENT=f"127.0.0.1:{c.port}",
                   MOONCAKE_STANDALONE_STORAGE="true", MOONCAKE_PROTOCOL="tcp", MOONCAKE_DEVICE="",
                   MOONCAKE_TE_META_DATA_SERVER=m.metadata)
        run = subprocess.run([sys.executable, str(HERE / "_sglang_mooncake_store.py"), "--standalone"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    finally:
        c.stop()
        m.stop()
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["dummy"] and ("kvflow" in report["store_module"]) == (impl == "kvflow"), report["store_module"]
    for ch in report["checks"]:
        assert ch["set"] == ch["set_again"] == ch["get"] == [True] * 9, ch
        assert ch["exists"] == 9 and ch["exists_gap"] == 3, ch
        assert ch["bytes_equal"] and ch["raw_bytes_equal"], ch
        assert ch["missing_get"] == [False], ch
    mha, mla = report["checks"]
    assert mha["calls"].get("batch_put_from") and mha["calls"].get("batch_get_into"), mha["calls"]
    assert mla["calls"].get("batch_put_from_multi_buffers") and mla["calls"].get("batch_get_into_multi_buffers"), \
        mla["calls"]
    print(f"{impl}: SGLang standalone_storage: MHA and MLA, 9 pages each, every byte equal")
