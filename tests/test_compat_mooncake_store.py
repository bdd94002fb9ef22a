"""Mooncake Store's Python API on kvflow.store (kvflow.compat.mooncake.store,
`mooncake.store` through the shim), beside the real Mooncake wheel.

- Mooncake's own store tests (mooncake-wheel/tests/test_distributed_object_
  store.py and test_replicated_distributed_object_store.py, unchanged,
  read from a Mooncake checkout at the pinned commit, see
  tests/upstream/mooncake/README.md) against kvflow's class and a kvflow
  master (`python -m kvflow.store master`), and against the real wheel and
  mooncake_master for reference.
- One sequence of 71 calls (tests/_mooncake_store_ops.py) on both: the same
  results, codes included.
- SGLang HiCache's Mooncake backend (the installed SGLang's
  mooncake_store.py, unchanged, and SGLang's own test of it) with byte
  checks (tests/_sglang_mooncake_store.py).
- In process: where kvflow answers otherwise on purpose, bad input, calls
  before setup and after close, an absent master (codes, no hang)."""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvflow
from kvflow.compat.mooncake import shim_path
from kvflow.compat.mooncake.store import (BufferHandle, MooncakeDistributedStore, ReplicaStatus, ReplicateConfig,
                                          SoftPinAction, TaskStatus, TaskType)

HERE = Path(__file__).parent
ROOT = str(Path(kvflow.__file__).resolve().parents[1])
LEASE_MS = 500          # Mooncake's CI runs its store tests with this lease (scripts/run_tests.sh)

# Mooncake's store tests, read unchanged from a Mooncake checkout (not kept
# in this repository): the commit and each file's sha256.
MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
UPSTREAM = {
    "test_distributed_object_store.py":
        ("mooncake-wheel/tests/test_distributed_object_store.py",
         "5d3b3ec43915a402889def77d71ff863479ee7ec5889a257af9de8884b1f8e3a", 16),
    "test_replicated_distributed_object_store.py":
        ("mooncake-wheel/tests/test_replicated_distributed_object_store.py",
         "da47ceedfeaccd89816da81330ce11712a734d54cf76725f5c1fb34e9c72e236", 5),
}
# run as scripts/run_tests.sh runs it (a master with --root_fs_dir), kvflow only: below
UPSTREAM_SSD = ("mooncake-wheel/tests/test_ssd_offload_in_evict.py",
                "c6e3cb341c87f9c2434c8a4571e9c09fe4374581590707f15b8534f5b63ccb17", 3)
MOONCAKE_SRC = os.environ.get("KVFLOW_MOONCAKE_SRC", "/work/.mirror/kvcache-ai+Mooncake/repo")


def _wheel_missing() -> str | None:
    if importlib.util.find_spec("mooncake") is None or shutil.which("mooncake_master") is None:
        return "the Mooncake wheel (mooncake.store, mooncake_master) is not installed"
    return None


def _upstream_file(name: str, into: Path) -> Path:
    path, digest, _ = UPSTREAM.get(name, UPSTREAM_SSD)
    run = subprocess.run(["git", f"--git-dir={MOONCAKE_SRC}", "show", f"{MOONCAKE_COMMIT}:{path}"],
                         capture_output=True)
    if run.returncode != 0:
        run = subprocess.run(["git", "-C", MOONCAKE_SRC, "show", f"{MOONCAKE_COMMIT}:{path}"], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"no Mooncake checkout with commit {MOONCAKE_COMMIT[:12]} at {MOONCAKE_SRC} "
                    "(set KVFLOW_MOONCAKE_SRC): Mooncake's store tests are not kept in this repository")
    if digest is not None:
        assert hashlib.sha256(run.stdout).hexdigest() == digest, f"{path} is not the pinned upstream file"
    out = into / name
    out.write_bytes(run.stdout)
    return out


def _env(impl: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_", "KVFLOW_"))}
    paths = [shim_path(), ROOT] if impl == "kvflow" else [ROOT]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


class _Master:
    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc, self.address = proc, address

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _free_port() -> int:
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def start_master(impl: str) -> _Master:
    """kvflow: `python -m kvflow.store master`; mooncake: mooncake_master.
    Both with a 500 ms lease, as Mooncake's CI runs its store tests."""
    if impl == "kvflow":
        p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0",
                              "--lease-ttl", str(LEASE_MS / 1000)], stdout=subprocess.PIPE, text=True,
                             env=_env("kvflow"), stdin=subprocess.DEVNULL)
        line = p.stdout.readline()
        assert "ready" in line, line
        return _Master(p, line.split()[-1])
    port = _free_port()
    p = subprocess.Popen(["mooncake_master", f"--rpc_port={port}", f"--metrics_port={_free_port()}",
                          "--enable_metric_reporting=false", f"--default_kv_lease_ttl={LEASE_MS}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    import socket
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert p.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.1)
    return _Master(p, f"127.0.0.1:{port}")


@pytest.fixture(params=["kvflow", "mooncake"])
def master(request):
    if request.param == "mooncake" and (why := _wheel_missing()):
        pytest.skip(why)
    m = start_master(request.param)
    m.impl = request.param
    yield m
    m.stop()


@pytest.fixture(scope="module")
def kvflow_master():
    m = start_master("kvflow")
    yield m
    m.stop()


# -- Mooncake's own store tests -----------------------------------------------------

@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_store_tests(name, master, tmp_path):
    """Every case of Mooncake's file passes: 16 of 16 in
    test_distributed_object_store.py, 5 of 5 in the replicated one (no skips
    there), on kvflow and on the real wheel."""
    test = _upstream_file(name, tmp_path)
    env = _env(master.impl, MASTER_SERVER=master.address, DEFAULT_KV_LEASE_TTL=str(LEASE_MS),
               MC_METADATA_SERVER="P2PHANDSHAKE", PROTOCOL="tcp")
    run = subprocess.run([sys.executable, "-m", "unittest", "-v", test.stem], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    out = run.stdout + run.stderr
    cases = UPSTREAM[name][2]
    assert run.returncode == 0, out[-5000:]
    assert re.search(rf"^Ran {cases} tests? in", out, re.M) and re.search(r"^OK$", out, re.M), out[-5000:]
    print(f"{master.impl}: {name}: {cases} of {cases} passed")
    if master.impl == "kvflow":
        assert "kvflow" in _module_file(env), "mooncake.store did not resolve to kvflow's"


def _module_file(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", "import mooncake.store as m; print(m.__file__)"], env=env,
                          capture_output=True, text=True, timeout=120).stdout


# -- the same calls, the same results -----------------------------------------------

def _ops(impl: str, address: str) -> dict:
    run = subprocess.run([sys.executable, str(HERE / "_mooncake_store_ops.py"), address, str(LEASE_MS / 1000)],
                         env=_env(impl), capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_same_results_as_mooncake():
    """71 calls, good and bad, on kvflow and on the real Mooncake Store:
    every result equal (return codes, bytes, sizes, lists)."""
    if why := _wheel_missing():
        pytest.skip(why)
    got = {}
    for impl in ("kvflow", "mooncake"):
        m = start_master(impl)
        try:
            got[impl] = _ops(impl, m.address)
        finally:
            m.stop()
    assert got["kvflow"]["setup"] == 0 and got["kvflow"]["get_into_bytes"] is True
    diff = {k: (got["kvflow"].get(k), v) for k, v in got["mooncake"].items() if got["kvflow"].get(k) != v}
    assert not diff, f"(kvflow, mooncake) differ: {diff}"
    assert len(got["kvflow"]) == len(got["mooncake"]) == 71


# -- SGLang HiCache's Mooncake backend ------------------------------------------------

@pytest.mark.parametrize("impl", ["kvflow", "mooncake"])
def test_sglang_hicache_mooncake_backend(impl, tmp_path):
    """SGLang's MooncakeStore (its file unchanged; the real SGLang package)
    on the store: SGLang's own test of the backend, then byte checks of
    batch_set_v1 / batch_exists / batch_get_v1 for MHA pages (K and V keys:
    batch_put_from / batch_get_into) and MLA pages of two buffers
    (batch_put_from_multi_buffers / batch_get_into_multi_buffers)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    if impl == "mooncake" and (why := _wheel_missing()):
        pytest.skip(why)
    m = start_master(impl)
    try:
        env = _env(impl, MOONCAKE_MASTER=m.address, MOONCAKE_PROTOCOL="tcp", MOONCAKE_DEVICE="",
                   MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE", MOONCAKE_GLOBAL_SEGMENT_SIZE=str(256 << 20))
        run = subprocess.run([sys.executable, str(HERE / "_sglang_mooncake_store.py")], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    finally:
        m.stop()
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert ("kvflow" in report["store_module"]) == (impl == "kvflow"), report["store_module"]
    assert len(report["sglang_own_tests"]) == 5
    for c in report["checks"]:
        assert c["set"] == c["set_again"] == c["get"] == [True] * 9, c
        assert c["exists"] == 9 and c["exists_gap"] == 3, c
        assert c["bytes_equal"] and c["raw_bytes_equal"], c
        assert c["missing_get"] == [False], c
    mha, mla = report["checks"]
    assert mha["calls"].get("batch_put_from") and mha["calls"].get("batch_get_into"), mha["calls"]
    assert mla["calls"].get("batch_put_from_multi_buffers") and mla["calls"].get("batch_get_into_multi_buffers"), \
        mla["calls"]


# -- in process: kvflow's own answers -------------------------------------------------

@pytest.fixture
def store(kvflow_master):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 4 << 20, "tcp", "", kvflow_master.address) == 0
    yield s
    errors = list(s._thread.loop_errors) if s._thread is not None else []
    assert s.close() == 0
    assert not errors, errors          # nothing reached the store loop's exception handler


def test_where_kvflow_answers_otherwise(store):
    """The documented differences (docs/store.md): each a deliberate code."""
    assert store.get_batch([]) == []                      # Mooncake: [b""]
    assert store.put_parts("p0") == -600                  # Mooncake: 0 (an empty object is refused here)
    buf = (ctypes.c_ubyte * 4096)()
    ptr = ctypes.addressof(buf)
    # memory not registered: refused before anything moves (Mooncake's tcp
    # transport reads and writes any address, registered or not)
    assert store.put_from("u", ptr, 100) == -600
    assert store.get_into("u", ptr, 100) == -600
    assert store.register_buffer(ptr, 4096) == 0
    assert store.put_from("zero", ptr, 0) == -600         # Mooncake: 0
    # a get's lease ends with the get: the object can be removed at once
    # (Mooncake keeps the lease its full TTL: -706)
    assert store.put("leased", b"x") == 0 and store.get("leased") == b"x"
    assert store.remove("leased") == 0
    assert store.put_batch(["rx_a1", "rx_a2", "rx_b1"], [b"1", b"2", b"3"]) == 0
    assert store.remove_by_regex("^rx_a") == 2             # a master call: one scan of the index
    assert store.batch_is_exist(["rx_a1", "rx_a2", "rx_b1"]) == [0, 0, 1]
    assert store.remove_by_regex("([") == -600
    assert store.unregister_buffer(ptr) == 0


def test_bad_input_gives_codes(store):
    buf = (ctypes.c_ubyte * 4096)()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 4096) == 0
    assert store.register_buffer(0, 10) == -600
    assert store.batch_put_from(["a", "b"], [ptr], [1, 2]) == [-600, -600]
    assert store.batch_get_into_multi_buffers(["a"], [[ptr, ptr + 8]], [[8]]) == [-600]
    assert store.put_from("a", ptr + 4000, 200) == -600    # runs past the registered buffer
    assert store.put_from("k" * 5000, ptr, 10) == -600     # kvflow's keys are at most 4096 bytes
    cfg = ReplicateConfig()
    cfg.soft_pin_action = SoftPinAction.DISABLE
    cfg.soft_pin_ttl_ms = 10
    assert store.put("a", b"x", cfg) == -600
    with pytest.raises(TypeError):
        cfg.soft_pin_ttl_ms = -1
    for bad in (lambda: store.put(1, b"x"), lambda: store.put("a", "text"), lambda: store.get_into("a", -1, 4),
                lambda: store.batch_is_exist([1]), lambda: store.put("a", b"x", config=3)):
        with pytest.raises(TypeError):       # as the wheel's binding: wrong argument types raise
            bad()
    # the store still works after all of that
    assert store.put("after", b"ok") == 0 and store.get("after") == b"ok"
    handle = store.get_buffer("after")
    assert isinstance(handle, BufferHandle) and handle.size() == 2 and bytes(memoryview(handle)) == b"ok"
    assert ctypes.string_at(handle.ptr(), 2) == b"ok"


def test_before_setup_and_after_close(kvflow_master):
    """Mooncake's wheel dereferences a null client here (the process
    dies); kvflow answers with codes."""
    s = MooncakeDistributedStore()
    assert (s.put("a", b"x"), s.get("a"), s.is_exist("a"), s.get_size("a")) == (-1, b"", -1, -1)
    assert (s.health_check(), s.remove_all(), s.get_buffer("a"), s.batch_is_exist(["a"])) == (1, -1, None, [-1])
    assert s.register_buffer(4096, 10) == -600 and s.get_hostname() == ""
    assert s.close() == 0
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", kvflow_master.address) == 0
    assert s.health_check() == 0 and s.put("a", b"x") == 0
    assert s.close() == 0 and s.close() == 0
    assert (s.put("a", b"x"), s.get("a"), s.batch_put_from(["a"], [4096], [1])) == (-1, b"", [-1])


def test_setup_failures_are_codes():
    s = MooncakeDistributedStore()
    t0 = time.monotonic()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", f"127.0.0.1:{_free_port()}") == -900
    assert time.monotonic() - t0 < 15
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "bogus", "", "127.0.0.1:1") == -1
    assert s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "50%"}) == -600
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", "127.0.0.1:1",
                   enable_ssd_offload=True, ssd_offload_path=__file__) == -600     # a file, not a directory
    assert s.health_check() == 1 and s.close() == 0


def test_a_store_never_closed_is_closed_when_collected(kvflow_master):
    """SGLang never calls close() (Mooncake frees its client in the
    destructor): the engine thread and the master's record go with the object."""
    import gc
    import threading
    # the threads this store started, by identity: an earlier test's thread
    # that ends meanwhile (a loaded host) must not count
    before = set(threading.enumerate())
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", kvflow_master.address) == 0
    assert s.put("collected", b"x") == 0
    assert set(threading.enumerate()) - before, "the store started no thread?"
    del s
    gc.collect()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, set(threading.enumerate()) - before


def test_rdma_protocol_works_with_or_without_a_device(kvflow_master):
    """SGLang's MOONCAKE_PROTOCOL defaults to "rdma": without an RDMA device
    the store falls back to tcp (a warning), as Mooncake does."""
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        for s in (a, b):
            assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "rdma", "", kvflow_master.address) == 0
        assert a.put("over-rdma-or-tcp", b"abc") == 0 and b.get("over-rdma-or-tcp") == b"abc"
    finally:
        a.close()
        b.close()


def test_ports_taken_or_seeded_random(kvflow_master):
    """A port already in use is skipped for another in 12300-14300, and two
    stores in processes that seeded `random` alike (vLLM seeds it) do not
    draw the same ports. A port given in local_hostname that is taken: -600."""
    import random
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    stores = []
    try:
        s = MooncakeDistributedStore()
        stores.append(s)
        assert s.setup(f"127.0.0.1:{port}", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "",
                       kvflow_master.address) == -600
        for _ in range(2):
            random.seed(0)
            s = MooncakeDistributedStore()
            stores.append(s)
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", kvflow_master.address) == 0
        assert stores[1].get_hostname() != stores[2].get_hostname()
    finally:
        taken.close()
        for s in stores:
            s.close()


def test_master_address_list_follows_the_live_master(kvflow_master):
    """master_server_addr "host:port,host:port" (kvflow's durable masters:
    the client follows the leader): a dead first address is passed over."""
    s = MooncakeDistributedStore()
    try:
        addrs = f"127.0.0.1:{_free_port()},{kvflow_master.address}"
        assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", addrs) == 0
        assert s.put("listed", b"x") == 0 and s.get("listed") == b"x"
    finally:
        s.close()


# -- the SSD tier through Mooncake's API ----------------------------------------------

def test_ssd_offload_through_mooncake_api(kvflow_master, tmp_path, monkeypatch):
    """enable_ssd_offload with ssd_offload_path (and, without it,
    $MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, as Mooncake's FileStorage reads):
    puts past the segment go to SSD (eager, as Mooncake's PutEnd queues
    them), every value comes back; -200 only while the copies are written."""
    values = {f"ssd_{i}": os.urandom(1 << 20) for i in range(40)}
    for how in ("arg", "env"):
        d = tmp_path / how
        s = MooncakeDistributedStore()
        if how == "env":
            monkeypatch.setenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", str(d))
        assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 8 << 20, "tcp", "", kvflow_master.address, None,
                       True, str(d) if how == "arg" else "") == 0
        try:
            for k, v in values.items():
                deadline = time.monotonic() + 30
                while (rc := s.put(f"{how}/{k}", v)) == -200:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert rc == 0
            for k, v in values.items():
                assert s.get(f"{how}/{k}") == v
            assert len(list(d.glob("*/*.kvo"))) >= 24
        finally:
            assert s.remove_all() >= 0 and s.close() == 0


def test_upstream_ssd_offload_in_evict(tmp_path):
    """Mooncake's test_ssd_offload_in_evict.py, unchanged, as Mooncake's
    scripts/run_tests.sh runs it: the master with --root_fs_dir (kvflow's
    takes the flag), MC_METADATA_SERVER an HTTP URL, a 500 ms lease. 1000
    objects of 1 MiB through a 512 MiB segment, then every one read back
    (get, batch_get_into; and four threads putting and getting the same
    1000 keys). The file asserts nothing about what the gets return (it
    prints statistics), so this reads them: every get succeeded, with the
    right bytes, and so did every put."""
    test = _upstream_file("test_ssd_offload_in_evict.py", tmp_path)
    root = tmp_path / "root_fs"
    p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0",
                          "--lease-ttl", str(LEASE_MS / 1000), "--root_fs_dir", str(root)], stdout=subprocess.PIPE,
                         text=True, env=_env("kvflow"), stdin=subprocess.DEVNULL)
    m = _Master(p, "")
    try:
        line = p.stdout.readline()
        assert "ready" in line, line
        env = _env("kvflow", MASTER_SERVER=line.split()[-1], DEFAULT_KV_LEASE_TTL=str(LEASE_MS),
                   MC_METADATA_SERVER="http://127.0.0.1:8080/metadata", PROTOCOL="tcp")
        run = subprocess.run([sys.executable, "-m", "unittest", "-v", test.stem], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, check=False)
    finally:
        m.stop()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert re.search(rf"^Ran {UPSTREAM_SSD[2]} tests in", out, re.MULTILINE) and re.search(r"^OK$", out, re.MULTILINE), out[-5000:]
    stats = re.findall(r"^=== (.+) STATISTICS ===\nOperations: (\d+) \(Success: (\d+), Failure: (\d+)\)", out, re.MULTILINE)
    assert len(stats) == 6, out[-5000:]
    for name, ops, ok, failed in stats:
        assert int(failed) == 0 and int(ok) == int(ops) > 0, (name, ops, ok, failed)
    assert list(root.glob("default/*/*/*.kvo")) or list(root.glob("default/*")), "no SSD tier was opened"
    print("kvflow: test_ssd_offload_in_evict.py: 3 of 3 passed; " +
          "; ".join(f"{n}: {ok}/{ops}" for n, ops, ok, _ in stats))


def test_copy_and_move_tasks_with_mooncakes_conventions(store, kvflow_master):
    """create_copy_task / create_move_task / query_task / get_replica_desc:
    Mooncake's tuples, codes and types (its scripts/test_copy_move_api.py
    runs unchanged in test_mooncake_ci.py); segments are named by their
    stores' get_hostname()."""
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", kvflow_master.address) == 0
    try:
        here, there = store.get_hostname(), other.get_hostname()
        cfg = ReplicateConfig()
        cfg.preferred_segment = there
        payload = os.urandom(300_000)
        assert store.put("cmv", payload, cfg) == 0
        endpoints = lambda: sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint  # noqa: E731
                                   for d in store.get_replica_desc("cmv"))
        assert endpoints() == [there]
        task_id, err = store.create_copy_task("cmv", [here])
        assert err == 0 and isinstance(task_id, tuple) and len(task_id) == 2
        deadline = time.monotonic() + 30
        while (resp := store.query_task(task_id))[0].status not in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            assert resp[1] == 0 and time.monotonic() < deadline
            time.sleep(0.05)
        resp, err = store.query_task(task_id)
        assert (err, resp.status, resp.type, resp.id, resp.message) == (0, TaskStatus.SUCCESS,
                                                                         TaskType.REPLICA_COPY, task_id, "")
        assert endpoints() == sorted([here, there])
        desc = store.get_replica_desc("cmv")[0]
        assert desc.is_memory_replica() and desc.status == ReplicaStatus.COMPLETE
        assert desc.get_memory_descriptor().buffer_descriptor.size == len(payload)
        task_id, err = other.create_move_task("cmv", here, there)        # there holds one: here's goes
        assert err == 0
        while (resp := other.query_task(task_id)[0]).status not in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            time.sleep(0.05)
        assert resp.status == TaskStatus.SUCCESS and endpoints() == [there]
        assert store.get("cmv") == payload
        assert list(store.batch_get_replica_desc(["cmv", "none"])) == ["cmv"]

        assert store.create_copy_task("none", [there]) == ((0, 0), -704)
        assert store.create_move_task("none", here, there) == ((0, 0), -704)
        assert store.create_copy_task("cmv", ["unknown"]) == ((0, 0), -600)
        assert store.create_copy_task("cmv", []) == ((0, 0), -600)
        assert store.create_move_task("cmv", there, there) == ((0, 0), -600)
        assert store.create_move_task("cmv", here, there) == ((0, 0), -600)     # here holds none now
        assert store.query_task((5, 5)) == (None, -1400)
        assert store.get_replica_desc("none") == []
        for bad in (lambda: store.create_copy_task("cmv", there), lambda: store.create_move_task("cmv", 1, there),
                    lambda: store.query_task("id"), lambda: store.query_task((-1, 0))):
            with pytest.raises(TypeError):
                bad()
        assert store.remove("cmv") == 0
    finally:
        assert other.close() == 0
    closed = MooncakeDistributedStore()
    assert closed.create_copy_task("k", ["x"]) == ((0, 0), -1) and closed.query_task((1, 1)) == (None, -1)
    assert closed.get_replica_desc("k") == []
