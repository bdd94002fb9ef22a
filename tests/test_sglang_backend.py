"""kvflow as SGLang's transfer backend (kvflow.compat.sglang), against the
real SGLang package: install() registers "kvflow" where SGLang's schedulers
look backends up, and SGLang's own disaggregation code (bootstrap server,
manager, senders, receivers, on its real CPU KV pool and metadata buffers,
prefill and decode in two processes) moves every page through kvflow. The
same harness on SGLang's Mooncake backend with real Mooncake is the
reference. SGLang comes from .ci/setup; elsewhere these skip without it."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _sglang_missing() -> str | None:
    # find_spec, not an import: SGLang's import chain (torch, transformers, its
    # kernels' Python side) stays out of the pytest process; the subprocesses
    # below import it and fail with its error if a dependency is missing.
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed"
    return None


MISSING = _sglang_missing()
if MISSING and os.environ.get("CI"):
    raise RuntimeError(f"{MISSING} (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pd(tmp_path: Path, backend: str, rooms: str, pool: str = "mha") -> tuple[dict, dict]:
    port = free_port()
    from kvflow.compat.sglang.shim import shim_path
    path = [shim_path()] if backend == "kvflow" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    outs = {role: tmp_path / f"{role}.json" for role in ("prefill", "decode")}
    procs = {role: subprocess.Popen([sys.executable, str(HERE / "_sglang_pd.py"), role, backend, str(port), rooms,
                                     str(outs[role]), pool], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for role in ("prefill", "decode")}
    logs = {}
    try:
        for role, p in procs.items():
            logs[role] = p.communicate(timeout=240)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for role, p in procs.items():
        assert p.returncode == 0, f"{role} exited {p.returncode}:\n{logs[role][-4000:]}"
    return json.loads(outs["prefill"].read_text()), json.loads(outs["decode"].read_text())


INSTALL_CHECK = """
import argparse, warnings
warnings.filterwarnings("ignore")
from sglang.srt.disaggregation import decode, prefill     # the schedulers' modules, imported first
import kvflow.compat.sglang as ks
from sglang.srt.disaggregation import utils
from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVReceiver, BaseKVSender
from sglang.srt.server_args import ServerArgs

member = ks.install()
assert ks.install() is member                           # idempotent
assert utils.TransferBackend("kvflow") is member is utils.TransferBackend.KVFLOW
assert utils.TransferBackend("mooncake") is utils.TransferBackend.MOONCAKE
assert "kvflow" in [b.value for b in utils.TransferBackend]
get = utils.get_kv_class
assert get(member, utils.KVClassType.MANAGER).__name__ == "KVFlowKVManager"
assert issubclass(get(member, utils.KVClassType.MANAGER), BaseKVManager)
assert issubclass(get(member, utils.KVClassType.SENDER), BaseKVSender)
assert issubclass(get(member, utils.KVClassType.RECEIVER), BaseKVReceiver)
assert get(member, utils.KVClassType.KVARGS) is get(utils.TransferBackend.MOONCAKE, utils.KVClassType.KVARGS)
# the other backends are still SGLang's own
assert get(utils.TransferBackend.MOONCAKE, utils.KVClassType.MANAGER).__name__ == "MooncakeKVManager"
# modules that imported get_kv_class before install() see the new one
assert prefill.get_kv_class is decode.get_kv_class is utils.get_kv_class
from sglang.srt.managers import disagg_service                # and one imported after
assert disagg_service.get_kv_class is utils.get_kv_class
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "kvflow"])
assert args.disaggregation_transfer_backend == "kvflow"
print("ok")
"""


def test_install_registers_kvflow_where_sglang_looks():
    """In a process of its own: install() changes SGLang's module state."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", INSTALL_CHECK], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_the_shim_installs_only_once_sglang_is_imported():
    from kvflow.compat.sglang.shim import shim_path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([shim_path(), str(HERE.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    code = ("import sys; assert 'kvflow.compat.sglang' not in sys.modules; "
            "from sglang.srt.disaggregation.utils import TransferBackend; "
            "import kvflow.compat.sglang as ks; assert ks.installed(); print(TransferBackend('kvflow'))")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and "TransferBackend.KVFLOW" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("pool", ["mha", "mla"])
def test_sglang_moves_every_page_through_kvflow(tmp_path, pool):
    """MHA: K and V buffers per layer; MLA: one latent buffer per layer
    (SGLang's MLA transfer path)."""
    rooms = "11,12,13,14,15,16"
    prefill, decode = run_pd(tmp_path, "kvflow", rooms, pool)
    assert decode["buffers"] == (4 if pool == "mla" else 8)
    assert prefill["manager"] == decode["manager"] == "KVFlowKVManager"
    assert prefill["engine"] == "KVFlowTransferEngine"
    for room in rooms.split(","):
        assert prefill["rooms"][room]["state"] == "Success", prefill["rooms"][room]
        d = decode["rooms"][room]
        assert d["state"] == "Success" and d["bad_items"] == 0, d
        assert d["verified_bytes"] > 0
    assert decode["stray_pages"] == 0


def test_bad_decode_pages_fail_that_request_and_write_nothing(tmp_path):
    """Page indices past the end of the decode pool: kvflow refuses the
    writes (outside registered memory), SGLang fails the request on both
    sides, and nothing lands anywhere in the pool. (SGLang's Mooncake
    protocol then marks the decode session failed, so the requests that
    follow fail too until its session probe revives it: SGLang's policy.)"""
    prefill, decode = run_pd(tmp_path, "kvflow", "21,22x")
    assert decode["rooms"]["21"]["state"] == "Success" and decode["rooms"]["21"]["bad_items"] == 0
    assert prefill["rooms"]["22"]["state"] == "Failed"
    assert decode["rooms"]["22"]["state"] == "Failed"
    assert decode["stray_pages"] == 0


def test_the_same_harness_on_sglangs_mooncake_backend(tmp_path):
    """The reference: SGLang's Mooncake backend on real Mooncake runs the
    same requests the same way (what kvflow's backend must match)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Mooncake is not installed: {e}")
    rooms = "31,32,33"
    prefill, decode = run_pd(tmp_path, "mooncake", rooms)
    assert decode["manager"] == "MooncakeKVManager"
    for room in rooms.split(","):
        assert decode["rooms"][room]["state"] == "Success" and decode["rooms"][room]["bad_items"] == 0
    assert decode["stray_pages"] == 0
