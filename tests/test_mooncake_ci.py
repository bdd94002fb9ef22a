"""Mooncake CI's store tests and scripts on kvflow (issue 40, item 3).

- `mooncake_master` on kvflow (kvflow.compat.mooncake.master, and the
  executable of `python -m kvflow.compat.mooncake.shim --bin`): its flags
  parsed into kvflow's master options, the `ready` line, Mooncake's HTTP
  metadata protocol served, an unknown flag refused with the list.
- MooncakeConfig.load_from_env() (the shim's mooncake.mooncake_config):
  Mooncake's variables and defaults.
- Mooncake's CI, unchanged: each store test and script its CI runs
  (.github/workflows/ci.yml, scripts/run_tests.sh), read from a Mooncake
  checkout at the pinned commit (never kept here, as in
  test_compat_mooncake_store.py), started the way that CI starts it: a
  `mooncake_master` from PATH with the CI's flags (kvflow's executable
  first on PATH, or the real wheel's), the CI's environment, and for the
  dummy clients' tests a `mooncake_client` from PATH (kvflow's:
  kvflow.compat.mooncake.client) that they forward to. On kvflow and,
  where the wheel is installed, on the real Mooncake for reference. What
  kvflow does not pass yet is an xfail that says why (KVFLOW_GAPS).
"""
from __future__ import annotations

import faulthandler
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import kvflow
from kvflow.compat.mooncake.master import MasterOptions, parse_flags, store_argv
from kvflow.compat.mooncake.shim import bin_path, shim_path
from kvflow.errors import InvalidArgumentError

ROOT = str(Path(kvflow.__file__).resolve().parents[1])
MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
MOONCAKE_SRC = os.environ.get("KVFLOW_MOONCAKE_SRC", "/work/.mirror/kvcache-ai+Mooncake/repo")
# The flags Mooncake's CI starts its master with (ci.yml, "Start Mooncake Master")
CI_FLAGS = ["--default_kv_lease_ttl=500", "--eviction_high_watermark_ratio=0.95", "--cluster_id=ci_test_cluster",
            "--enable_http_metadata_server=true"]

# name -> (path at the commit, sha256, arguments, which CI step's environment)
UPSTREAM = {
    # run_tests.sh runs these two against `mooncake_master --enable_http_metadata_server`
    # (test_compat_mooncake_store.py runs them with P2PHANDSHAKE)
    "test_distributed_object_store.py": (
        "mooncake-wheel/tests/test_distributed_object_store.py",
        "5d3b3ec43915a402889def77d71ff863479ee7ec5889a257af9de8884b1f8e3a", [], "wheel"),
    "test_replicated_distributed_object_store.py": (
        "mooncake-wheel/tests/test_replicated_distributed_object_store.py",
        "da47ceedfeaccd89816da81330ce11712a734d54cf76725f5c1fb34e9c72e236", [], "wheel"),
    "test_put_get_tensor.py": ("mooncake-wheel/tests/test_put_get_tensor.py",
                               "8416867879f65d62467d61d2a55d0f4abc34715bb3b7d50597d22b9f25fb5464", [], "wheel"),
    "test_safetensor_functions.py": ("mooncake-wheel/tests/test_safetensor_functions.py",
                                     "91a64e214674654218d23da903c4bcb6ce2ee2121781604326df1bf8437d2ce5", [], "wheel"),
    "test_tensor_api.py": ("scripts/test_tensor_api.py",
                           "0d003331aa27571bac102d0ba21cd83dbd2167cd573dc7cc0a2cb68aedf7ad56", ["-n", "1"], "script"),
    "test_async_store.py": ("scripts/test_async_store.py",
                            "1d7e081815c2c9cf445dc45713e70cec8faca78c18fd914902c2a15feb054f77", [], "script"),
    "test_copy_move_api.py": ("scripts/test_copy_move_api.py",
                              "02eb911eb52a851cea34730207684f3737b842bb0cdca452c63368830e150c58", [], "script"),
    # run_tests.sh starts a bare `mooncake_client` beside the master, then
    # these (the second as two processes at once, client1 and client2)
    "test_dummy_client.py": ("mooncake-wheel/tests/test_dummy_client.py",
                             "f728d16f1085241cee0e9c99565441f4331c961c6ee296015c25d02f1e0ce008", [], "wheel"),
    "test_multi_dummy_clients.py": ("mooncake-wheel/tests/test_multi_dummy_clients.py",
                                    "bc33aa89534ad4b3a9c62d6101bad7ac4f5bd7c495c27fcb054682740a162baa", [], "wheel"),
}
# Those that need `mooncake_client` (the standalone real client that dummy
# clients, setup_dummy(..., "127.0.0.1:50052"), forward to), and the
# processes run_tests.sh starts of each at once (their arguments).
REAL_CLIENT = {"test_dummy_client.py": [[]],
               "test_multi_dummy_clients.py": [["--client-id", "client1"], ["--client-id", "client2"]]}
REAL_CLIENT_PORT = 50052        # the scripts' real_client_address
# What kvflow does not pass yet, and why (an xfail, strict: a pass fails the
# test until the entry goes).
KVFLOW_GAPS: dict[str, str] = {}
# Cases kvflow skips that Mooncake runs: (how many, why). The run passes;
# the count is checked (none for a script not listed) so that a new skip is
# seen. Empty: scripts/test_tensor_api.py ran its 39 unified-parallelism
# cases skipped until kvflow built that API (kvflow/compat/mooncake/parallelism.py).
KVFLOW_SKIPS: dict[str, tuple[int, str]] = {}
# Cases a script skips on Mooncake as on kvflow, here: (how many, why).
BOTH_SKIP: dict[str, tuple[int, str]] = {
    "test_put_get_tensor.py": (1, "its CUDA case: skipUnless(cuda_available()), and this host has no GPU"),
    "test_dummy_client.py": (2, "its two CUDA IPC stream-readiness cases: skipped without CUDA"),
}


def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def _cuda() -> bool:
    """Whether torch sees a GPU here (then Mooncake's CUDA cases run)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _wheel_missing() -> str | None:
    import importlib.util
    if importlib.util.find_spec("mooncake") is None or shutil.which("mooncake_master") is None:
        return "the Mooncake wheel (mooncake.store, mooncake_master) is not installed"
    return None


def _env(impl: str, **extra: str) -> dict:
    """This environment without Mooncake's and kvflow's variables; for
    kvflow the stand-in package first on PYTHONPATH and kvflow's
    mooncake_master first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_", "KVFLOW_"))}
    paths = [shim_path(), ROOT] if impl == "kvflow" else [ROOT]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if impl == "kvflow":
        env["PATH"] = bin_path() + os.pathsep + env.get("PATH", "")
        env["KVFLOW_PYTHON"] = sys.executable
    env.update(extra)
    return env


def _wait_bindable(port: int, timeout: float = 30) -> None:
    """Waits until `port` can be bound as a listener the way Mooncake's
    client binds it (no SO_REUSEADDR); it is in the ephemeral range, so a
    connection of another test may hold it as its source port for a while
    (.ci/setup reserves it where it may)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as so:
            try:
                so.bind(("0.0.0.0", port))
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    held = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout
                    pytest.fail(f"port {port} (the scripts' real client's) stays taken: {e}\n"
                                + "\n".join(ln for ln in held.splitlines() if f":{port} " in ln))
        time.sleep(0.5)


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, f"{what} exited ({proc.returncode})"
            assert time.monotonic() < deadline, f"{what} did not listen on {port}"
            time.sleep(0.1)


class CiMaster:
    """`mooncake_master` from PATH (kvflow's or the wheel's) with the CI's
    flags, on free ports (the CI's are 50051 and 8080)."""

    def __init__(self, impl: str, *flags: str) -> None:
        self.impl = impl
        self.port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        env = _env(impl)
        exe = shutil.which("mooncake_master", path=env["PATH"])
        assert exe is not None
        if impl == "kvflow":
            assert exe.startswith(bin_path()), exe
        argv = [exe, *CI_FLAGS, "--port", str(self.port), f"--http_metadata_server_port={self.http_port}",
                f"--metrics_port={self.metrics_port}", *flags]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        if impl == "kvflow":
            lines = [self.proc.stdout.readline() for _ in range(2)]
            assert "ready" in lines[-1], lines
            self.lines = lines
        _wait_port(self.port, self.proc, "mooncake_master")
        _wait_port(self.http_port, self.proc, "the HTTP metadata server")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# -- the launcher -------------------------------------------------------------------

def test_flags_parsed_into_master_options():
    opts, values = parse_flags(["--default_kv_lease_ttl=500", "--eviction_high_watermark_ratio=0.95",
                                "--cluster_id=ci_test_cluster", "--port", "50051",
                                "--enable_http_metadata_server=true", "--eviction_ratio", "0.1",
                                "--root_fs_dir=/tmp/x", "--client_ttl=20", "--metrics_port", "9100"])
    assert opts == MasterOptions(listen="0.0.0.0:50051", lease_ttl=0.5, high_watermark=0.95, low_watermark=0.85,
                                 cluster="ci_test_cluster", etcd=None, client_grace=20.0,
                                 http_metadata=("0.0.0.0", 8080), root_fs_dir="/tmp/x", metrics_port=9100)
    assert values["metrics_port"] == 9100
    assert store_argv(opts) == ["master", "--listen", "0.0.0.0:50051", "--lease-ttl", "0.5", "--high-watermark",
                                "0.95", "--low-watermark", "0.85", "--client-grace", "20.0", "--cluster",
                                "ci_test_cluster", "--root-fs-dir", "/tmp/x", "--metrics-port", "9100"]
    # the metrics port only when given, and not with --enable_metric_reporting=false
    assert parse_flags([])[0].metrics_port is None
    assert parse_flags(["--metrics_port=9", "--enable_metric_reporting=false"])[0].metrics_port is None
    # rpc_port over port, rpc_address, durations with units, bare and negated bools
    opts, _ = parse_flags(["--port=1", "--rpc_port=7000", "--rpc_address", "127.0.0.1", "--default_kv_lease_ttl=5s",
                           "--enable_http_metadata_server", "--http_metadata_server_port=9",
                           "--http_metadata_server_host=127.0.0.1", "--noenable_metric_reporting"])
    assert (opts.listen, opts.lease_ttl, opts.http_metadata) == ("127.0.0.1:7000", 5.0, ("127.0.0.1", 9))
    # Mooncake's defaults when nothing is given
    opts, _ = parse_flags([])
    assert (opts.listen, opts.lease_ttl, opts.high_watermark, opts.http_metadata) == ("0.0.0.0:50051", 5.0, 0.9, None)
    # HA: etcd's first endpoint, the cluster id as kvflow's cluster
    opts, _ = parse_flags(["--enable_ha=true", "--etcd_endpoints=10.0.0.1:2379;10.0.0.2:2379", "--cluster_id=c7"])
    assert store_argv(opts)[-4:] == ["--cluster", "c7", "--etcd", "10.0.0.1:2379"]


@pytest.mark.parametrize("argv, why", [
    (["--bogus=1"], "unknown flag '--bogus=1'"),
    (["--enable_ha"], "--enable_ha needs --etcd_endpoints"),
    (["--port"], "--port needs a value"),
    (["--port=x"], "--port"),
    (["--default_kv_lease_ttl=soon"], "not a duration"),
    (["--enable_http_metadata_server=maybe"], "not a boolean"),
    (["50051"], "flags only"),
])
def test_bad_flags(argv, why):
    with pytest.raises(InvalidArgumentError, match=re.escape(why)):
        parse_flags(argv)


def test_unknown_flag_lists_what_is_taken():
    run = subprocess.run([sys.executable, "-m", "kvflow.compat.mooncake.master", "--enable_cxl=true"],
                         env=_env("kvflow"), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2
    assert "unknown flag '--enable_cxl=true'" in run.stderr
    for flag in ("--port", "--rpc_port", "--default_kv_lease_ttl", "--eviction_high_watermark_ratio",
                 "--cluster_id", "--root_fs_dir", "--enable_http_metadata_server", "--etcd_endpoints"):
        assert flag in run.stderr


def _http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_launcher_ready_and_http_metadata():
    """The executable on PATH, the CI's flags: `ready`, the master answers a
    client, and Mooncake's HTTP metadata protocol is served (Mooncake's
    answers, kvflow's own HttpStore client reads what a PUT wrote)."""
    m = CiMaster("kvflow")
    try:
        assert "HTTP metadata server" in m.lines[0] and m.lines[1].startswith("kvflow.store master ready on")
        url = m.metadata
        assert _http("GET", url + "?key=k") == (404, b"metadata not found")
        assert _http("PUT", url + "?key=k", b"\x00v1") == (200, b"metadata updated")
        assert _http("GET", url + "?key=k") == (200, b"\x00v1")
        assert _http("PUT", url + "?key=a/rpc_meta", b"1")[0] == 200
        assert _http("PUT", url + "?key=a/rpc_meta", b"2") == (400, b"Duplicate rpc_meta key not allowed")
        assert _http("GET", url)[0] == 400
        assert _http("DELETE", url + "?key=k") == (200, b"metadata deleted")
        assert _http("DELETE", url + "?key=k")[0] == 404
        status, body = _http("GET", f"http://127.0.0.1:{m.metrics_port}/metrics")       # --metrics_port
        assert status == 200 and b"kvflow" in body, body[:200]
        run = subprocess.run([sys.executable, "-c", (
            "import asyncio, sys; from kvflow.metadata.http_store import HttpStore\n"
            "async def main():\n"
            f"    s = HttpStore('127.0.0.1', {m.http_port})\n"
            "    await s.publish('x', b'abc', 5); v = await s.lookup('x'); await s.remove('x')\n"
            "    print(v == b'abc', await s.lookup('x') is None); await s.close()\n"
            "asyncio.run(main())")], env=_env("kvflow"), capture_output=True, text=True, timeout=60)
        assert run.stdout.split() == ["True", "True"], run.stdout + run.stderr
        # a store client joins through the launcher's master
        run = subprocess.run([sys.executable, "-c", (
            "from mooncake.store import MooncakeDistributedStore as S\n"
            f"s = S(); print(s.setup('localhost', '{url}', 16 << 20, 16 << 20, 'tcp', '', '{m.address}'),"
            " s.put('k', b'v'), s.get('k'), s.close())")], env=_env("kvflow"), capture_output=True, text=True,
            timeout=120, stdin=subprocess.DEVNULL)
        assert run.stdout.split() == ["0", "0", "b'v'", "0"], run.stdout + run.stderr
    finally:
        m.stop()
    assert m.proc.returncode == 0


def test_standalone_http_metadata_server():
    """The shim's `mooncake_http_metadata_server` (run_tests.sh starts one
    on 8080): ready line, Mooncake's answers, SIGTERM stops it."""
    port = _free_port()
    env = _env("kvflow")
    exe = shutil.which("mooncake_http_metadata_server", path=env["PATH"])
    assert exe is not None and exe.startswith(bin_path()), exe
    p = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    try:
        assert "ready" in p.stdout.readline()
        url = f"http://127.0.0.1:{port}/metadata?key=seg"
        assert _http("PUT", url, b"x") == (200, b"metadata updated")
        assert _http("GET", url) == (200, b"x")
    finally:
        p.terminate()
        assert p.wait(10) == 0


def test_metadata_port_taken():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        so.listen()
        port = so.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "kvflow.compat.mooncake.master", f"--port={_free_port()}",
                              "--enable_http_metadata_server", "--http_metadata_server_host=127.0.0.1",
                              f"--http_metadata_server_port={port}"], env=_env("kvflow"), capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 1 and "HTTP metadata server" in run.stderr, run.stderr


# -- MooncakeConfig -----------------------------------------------------------------

def test_config_from_env(monkeypatch, tmp_path):
    from kvflow.compat.mooncake.config import MooncakeConfig
    for k in list(os.environ):
        if k.startswith("MOONCAKE_"):
            monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    c = MooncakeConfig.load_from_env()
    assert (c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size, c.protocol,
            c.device_name) == ("localhost", "P2PHANDSHAKE", 3355443200, 1 << 30, "tcp", "")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://127.0.0.1:8080/metadata")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "TCP")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1.5gb")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "512M")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.1")
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "on")
    c = MooncakeConfig.load_from_env()
    assert (c.metadata_server, c.protocol, c.global_segment_size, c.local_buffer_size, c.local_hostname,
            c.enable_ssd_offload) == ("http://127.0.0.1:8080/metadata", "tcp", 3 << 29, 512 << 20, "10.0.0.1", True)
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "perhaps")
    with pytest.raises(ValueError, match="boolean"):
        MooncakeConfig.load_from_env()
    path = tmp_path / "c.json"
    path.write_text('{"local_hostname": "h", "metadata_server": "P2PHANDSHAKE", "master_server_address": "m:1",'
                    ' "global_segment_size": "4GB"}')
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    c = MooncakeConfig.load_from_env()
    assert (c.local_hostname, c.master_server_address, c.global_segment_size) == ("h", "m:1", 4 << 30)


# -- tensor objects: Mooncake's layout, byte for byte -------------------------------

def test_tensor_metadata_is_mooncakes():
    """kvflow's TensorMetadata bytes equal the real wheel's
    (_serialize_tensor), and each side decodes the other's objects."""
    torch = pytest.importorskip("torch")
    from kvflow.compat.mooncake import tensor as kt
    tensors = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(2, 3, dtype=torch.bfloat16),
               torch.empty(2, 0, 3), torch.randint(0, 9, (2, 2, 2, 2), dtype=torch.int64),
               torch.tensor([1.5, -2.0], dtype=torch.float16), torch.zeros(5, dtype=torch.bool)]
    assert kt.METADATA_SIZE == 304
    for t in tensors:
        meta, data = kt.tensor_object(t)
        obj = meta + bytes(data.numpy())
        assert torch.equal(kt.to_tensor(obj, len(obj), copy=True), t)
    if _wheel_missing() is not None:
        pytest.skip("the Mooncake wheel is not installed: kvflow's own round trip only")
    import importlib
    real = importlib.import_module("mooncake.store")
    if not hasattr(real, "_serialize_tensor") or "kvflow" in real.__file__:
        pytest.skip("the installed mooncake.store has no _serialize_tensor")
    assert real._tensor_metadata_size() == kt.METADATA_SIZE
    for t in tensors:
        meta, data = kt.tensor_object(t)
        assert real._serialize_tensor(t)[0] == meta, t.dtype
        theirs = real._deserialize_tensor(meta + bytes(data.numpy()))
        assert theirs.dtype == t.dtype and torch.equal(theirs, t)
    # a TP shard's header: SHARD, the full shape as global shape, one TP axis
    full = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    meta, _ = kt.tensor_object(kt.shard(full, 1, 2, 1), [(kt.AXIS_TP, 0, 1, 2, 1)], [4, 6])
    got = kt.decode_metadata(meta + bytes(4 * 3 * 4), len(meta) + 48)
    assert got["kind"] == kt.SHARD and got["global_shape"] == [4, 6] and got["local_shape"] == [4, 3]


# -- Mooncake's CI, unchanged ---------------------------------------------------------

def _upstream_file(name: str, into: Path) -> Path:
    path, digest, _, _ = UPSTREAM[name]
    run = subprocess.run(["git", f"--git-dir={MOONCAKE_SRC}", "show", f"{MOONCAKE_COMMIT}:{path}"], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"no Mooncake checkout with commit {MOONCAKE_COMMIT[:12]} at {MOONCAKE_SRC} "
                    "(set KVFLOW_MOONCAKE_SRC): Mooncake's tests are not kept in this repository")
    assert hashlib.sha256(run.stdout).hexdigest() == digest, f"{path} is not the pinned upstream file"
    out = into / name
    out.write_bytes(run.stdout)
    return out


def _ci_env(impl: str, m: CiMaster, step: str) -> dict:
    if step == "wheel":         # scripts/run_tests.sh: the wheel tests read these themselves
        return _env(impl, MC_METADATA_SERVER=m.metadata, DEFAULT_KV_LEASE_TTL="500", MASTER_SERVER=m.address,
                    PROTOCOL="tcp")
    # ci.yml's steps for the scripts (MooncakeConfig.load_from_env)
    return _env(impl, MOONCAKE_MASTER=m.address, MOONCAKE_TE_META_DATA_SERVER=m.metadata, MOONCAKE_PROTOCOL="tcp",
                LOCAL_HOSTNAME="127.0.0.1")


class CiRealClient:
    """`mooncake_client` from PATH (kvflow's or the wheel's), as run_tests.sh
    starts it, pointed at the test's master (run_tests.sh's are on the
    default ports); the port is the scripts' 50052."""

    def __init__(self, impl: str, m: CiMaster, workdir: Path, port: int = REAL_CLIENT_PORT) -> None:
        self.port = port
        env = _env(impl)
        exe = shutil.which("mooncake_client", path=env["PATH"])
        assert exe is not None
        if impl == "kvflow":
            assert exe.startswith(bin_path()), exe
        _wait_bindable(port)
        self.log = workdir / "mooncake_client.log"
        # a 1 GB segment, not the default 4 GB: this host is shared
        argv = [exe, f"--master_server_address={m.address}", f"--metadata_server={m.metadata}",
                f"--port={port}", "--global_segment_size=1GB"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=log, text=True, start_new_session=True)
        if impl == "kvflow":
            line = self.proc.stdout.readline()
            assert "kvflow mooncake_client ready on port" in line, (line, self.log.read_text()[-2000:])
        else:       # Mooncake's serves its RPC on the TCP port
            _wait_port(port, self.proc, "mooncake_client")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _run_all(argvs: list[list[str]], workdir: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Runs the processes at once: (the first failure's status or 0, their outputs)."""
    procs = [subprocess.Popen(a, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, stdin=subprocess.DEVNULL) for a in argvs]
    deadline = time.monotonic() + timeout
    rcs, outs = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            rcs.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
            rcs.append(124)
    return next((rc for rc in rcs if rc), 0), "".join(outs)


def run_upstream(name: str, impl: str, workdir: Path, timeout: float = 900) -> tuple[int, str]:
    """Runs one of Mooncake's CI tests or scripts as its CI does, against
    a fresh `mooncake_master` of `impl` (and `mooncake_client`, for the
    dummy clients' tests): (exit status, output)."""
    test = _upstream_file(name, workdir)
    m = CiMaster(impl)
    client = None
    try:
        env = _ci_env(impl, m, UPSTREAM[name][3])
        if name in REAL_CLIENT:
            client = CiRealClient(impl, m, workdir)
            return _run_all([[sys.executable, test.name, *UPSTREAM[name][2], *a] for a in REAL_CLIENT[name]],
                            workdir, env, timeout)
        run = subprocess.run([sys.executable, test.name, *UPSTREAM[name][2]], cwd=workdir, env=env,
                             capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return 124, (out.decode("utf-8", "replace") if isinstance(out, bytes) else out)
    finally:
        if client is not None:
            client.stop()
            if impl == "kvflow":        # leaves on SIGTERM with status 0
                assert client.proc.returncode == 0, client.log.read_text()[-2000:]
        m.stop()
    return run.returncode, run.stdout + run.stderr


# reference runs on the real wheel left out of CI (see test_ci_run)
SLOW_REFERENCE = frozenset({"test_tensor_api.py"})


def _summary(out: str) -> str:
    ran = re.findall(r"^Ran (\d+) tests? in", out, re.M)
    tail = re.findall(r"^(OK.*|FAILED \(.*\))$", out, re.M)
    return f"ran {ran[-1] if ran else '?'}: {tail[-1] if tail else 'no unittest summary'}"


@pytest.mark.parametrize("impl", ["kvflow", "mooncake"])
@pytest.mark.parametrize("name", list(UPSTREAM))
def test_ci_run(name, impl, tmp_path):
    """The test or script passes as a whole (exit 0), unchanged."""
    if impl == "mooncake" and (why := _wheel_missing()):
        pytest.skip(why)
    if impl == "mooncake" and name in SLOW_REFERENCE and os.environ.get("KVFLOW_MOONCAKE_REFERENCE") != "all":
        # a reference run, not kvflow's: on these 2 shared cores it ran past
        # 20 minutes (the wheel's client timing out on its master in the
        # benchmark cases); KVFLOW_MOONCAKE_REFERENCE=all runs it
        pytest.skip(f"the real Mooncake's {name} is a reference that does not finish here in CI's time")
    faulthandler.dump_traceback_later(1200, exit=True)     # longer than the watchdog: whole upstream suites
    rc, out = run_upstream(name, impl, tmp_path)
    print(f"{impl}: {name}: exit {rc}, {_summary(out)}")
    if impl == "kvflow" and name in KVFLOW_GAPS:
        if rc != 0:
            pytest.xfail(f"{KVFLOW_GAPS[name]} ({_summary(out)})")
        pytest.fail(f"{name} passes on kvflow now: drop it from KVFLOW_GAPS")
    if impl == "mooncake" and rc == 124:
        # the reference only: seen with scripts/test_tensor_api.py on a
        # loaded 2-core host (the wheel's client logs RPC timeouts to its
        # master in the benchmark cases)
        pytest.xfail(f"the real Mooncake did not finish in time here ({_summary(out)})")
    assert rc == 0, out[-6000:]
    skipped = re.findall(r"^OK \(skipped=(\d+)\)$", out, re.M)
    if impl == "kvflow":
        ours, why = KVFLOW_SKIPS.get(name, (0, "kvflow skips none of its cases"))
        both, why_both = BOTH_SKIP.get(name, (0, ""))
        if both and _cuda():
            both = 0
        assert skipped == ([str(ours + both)] if ours + both else []), (_summary(out), why, why_both)
