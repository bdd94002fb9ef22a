"""The PD router with the global KVCache pool (kvflow/conductor/router_pool.py,
``python -m kvflow.cli.router --store``): a real kvflow.store master and a
holder (a pool member in a process of its own) that puts pages under the
keys the servers name them by, the router in front of real HTTP servers that
speak what vLLM's prefill and decode instances speak to it (each records the
prompts it got: where the router sent them).

- A prompt whose prefix the pool holds is routed to fetch it, not to
  recompute it; with the pool holding the prefix an instance that caches it
  but is busy loses to an idle one that fetches it (the same request
  without the pool's prefix goes to the busy one).
- A store that cannot be reached: the router serves on without the pool
  (a PoolUnavailableWarning), turns it on once the master answers, off
  (a warning) when the master hangs (SIGSTOP: the lookup's timeout) and
  on again when it resumes, off when it goes away, serving throughout.
- The command line (`python -m kvflow.cli.router`) routes with the pool.
- The keys match the servers': SGLang's own page hashes (its
  get_hash_str), vLLM's own block hashes and PoolKey (its venv).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from _store_master import ROOT, standalone_master, store_env
from kvflow.cli.router import store_connect
from kvflow.conductor.blocks import block_keys
from kvflow.conductor.estimators import PrefillModel
from kvflow.conductor.pool import StorePoolIndex
from kvflow.conductor.pool_keys import ConductorKeys, make_scheme
from kvflow.conductor.router import Instance, PDRouter, main as conductor_router_main
from kvflow.conductor.router_pool import PoolUnavailableWarning, RouterPool
from kvflow.conductor.types import Role

B = 16                     # tokens per page (the servers' --block-size)
MODEL = "/models/tiny-llama"
# 2 ms per token computed: a 2048-token prefix is 4 s to recompute, its
# fetch from the pool (4 MiB at 2 GB/s) 3 ms: the estimates the router
# decides on, whatever the test servers take
PREFILL = PrefillModel(linear_s=2e-3, attention_s=0.0, overhead_s=0.02, load_s_per_token=0.0)


class PDServer:
    """One prefill or decode instance: a real HTTP server on loopback that
    answers the router as vLLM does (a prefill's answer carries
    kv_transfer_params; a decode's is the completion), recording each
    prompt as it arrives. While `gate` is clear, prefills wait on it after
    being recorded (an instance busy with them)."""

    def __init__(self, name: str, role: Role) -> None:
        self.name, self.role = name, role
        self.prompts: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> PDServer:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def instance(self) -> Instance:
        return Instance(self.name, self.role, self.url)

    async def wait_for(self, prompt: list[int], timeout: float = 10.0) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: prompt in self.prompts), timeout)

    async def _models(self, _request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request):
        body = await request.json()
        prompt = body["prompt"]
        async with self.arrived:
            self.prompts.append(prompt)
            self.arrived.notify_all()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body.get("max_tokens", 16)}
        if self.role is Role.PREFILL:
            assert body["kv_transfer_params"]["do_remote_decode"] is True and body["max_tokens"] == 1
            await self.gate.wait()
            return web.json_response({"id": request.headers["X-Request-Id"], "choices": [{"index": 0, "text": "x"}],
                                      "usage": {**usage, "completion_tokens": 1},
                                      "kv_transfer_params": {"remote_engine_id": self.name,
                                                             "remote_block_ids": list(range(len(prompt) // B))}})
        assert body["kv_transfer_params"]["remote_engine_id"].startswith("p")
        return web.json_response({"id": request.headers["X-Request-Id"], "choices": [{"index": 0, "text": "ok"}],
                                  "usage": usage})


@contextlib.asynccontextmanager
async def servers():
    ss = [await PDServer(n, r).start() for n, r in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE))]
    try:
        yield ss
    finally:
        for s in ss:
            await s.close()


class Holder:
    """tests/_store_holder.py: puts pages into the pool from its own process."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def put(self, keys: list[str]) -> None:
        self.proc.stdin.write((json.dumps(keys) + "\n").encode())
        await self.proc.stdin.drain()
        reply = json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 30))
        assert reply["put"] == [1] * len(keys), reply


@contextlib.asynccontextmanager
async def holder(master: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(ROOT, "tests", "_store_holder.py"), master, str(16 << 20), "1024",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert json.loads(line)["ready"], line
        yield Holder(proc)
    finally:
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 15) == 0


def _router(ss, pool: RouterPool | None) -> PDRouter:
    return PDRouter([ss[0].instance(), ss[1].instance()], [ss[2].instance()], block_tokens=B,
                    prefill_model=PREFILL, pool=pool)


async def _post(session, url: str, prompt: list[int]) -> int:
    async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}) as r:
        await r.read()
        return r.status


async def _stats(session, url: str) -> dict:
    async with session.get(url + "/stats") as r:
        return await r.json()


def _prompt(first: int, blocks: int, tail: int = 5) -> list[int]:
    """`blocks` full pages of distinct tokens starting at `first`, and a partial page."""
    return list(range(first, first + blocks * B + tail))


# e2e: a master and a holder in processes of their own
@pytest.mark.e2e
async def test_pool_prefix_is_fetched_not_recomputed_and_moves_the_choice():
    scheme = make_scheme("sglang", key_prefix="m/")
    async with standalone_master() as (address, _), holder(address) as h, servers() as ss:
        p0, p1, _d0 = ss
        pool = RouterPool(store_connect(address), scheme, address=address)
        router = _router(ss, pool)
        url = await router.start()
        try:
            async with aiohttp.ClientSession() as s:
                assert pool.state == "connected"
                # 1. nothing in the pool: the prompt is computed, on p0 (both idle: the first)
                x = _prompt(1000, 128)
                assert await _post(s, url, x) == 200 and x in p0.prompts
                st = (await _stats(s, url))["pool"]
                assert (st["lookups"], st["held_blocks"], st["fetch_requests"]) == (1, 0, 0)

                # 2. a prompt whose 128 pages a server put into the pool (under
                # SGLang HiCache's keys): fetched, not recomputed
                y = _prompt(20000, 128)
                await h.put(scheme.object_keys(y, B))
                assert await _post(s, url, y) == 200
                st = await _stats(s, url)
                assert st["pool"]["hit_requests"] == 1 and st["pool"]["held_blocks"] == 128
                assert (st["pool"]["fetch_requests"], st["pool"]["fetch_blocks"]) == (1, 128)
                assert st["conductor"]["pool_blocks"] == 128

                # 3. p0 busy with a 512-token prompt (its server holds it);
                # x's next turn: waiting for p0, which caches x, beats
                # recomputing x's 2048 tokens on p1
                for srv in (p0, p1):
                    srv.gate.clear()
                busy = _prompt(40000, 32)
                tasks = [asyncio.ensure_future(_post(s, url, busy))]
                await p0.wait_for(busy)
                x2 = x[:128 * B] + [7] * 20
                tasks.append(asyncio.ensure_future(_post(s, url, x2)))
                await p0.wait_for(x2)
                assert x2 not in p1.prompts

                # 4. the same, with x's pages in the pool: p1 fetches them
                # while p0 is still busy (the decision changes with the pool)
                await h.put(scheme.object_keys(x, B))
                x3 = x[:128 * B] + [9] * 20
                tasks.append(asyncio.ensure_future(_post(s, url, x3)))
                await p1.wait_for(x3)
                assert x3 not in p0.prompts
                for srv in (p0, p1):
                    srv.gate.set()
                assert await asyncio.gather(*tasks) == [200, 200, 200]
                st = await _stats(s, url)
                assert (st["pool"]["fetch_requests"], st["pool"]["fetch_blocks"]) == (2, 256)
                assert st["pool"]["lookups"] == 5 and st["pool"]["errors"] == 0
                assert st["served"] == 5 and st["failed"] == 0
        finally:
            await router.close()
        assert pool.state == "closed"


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.e2e
async def test_router_serves_without_the_pool_when_the_store_is_unreachable():
    port = _free_port()
    address = f"127.0.0.1:{port}"
    scheme = make_scheme("sglang")
    async with servers() as ss:
        pool = RouterPool(store_connect(address, timeout_s=2.0), scheme, address=address, retry_s=0.2)
        router = _router(ss, pool)
        with pytest.warns(PoolUnavailableWarning, match="unreachable"):
            url = await router.start()
        try:
            async with aiohttp.ClientSession() as s:
                # no store: served, routed on the instances' caches only
                assert await _post(s, url, _prompt(1000, 4)) == 200
                st = await _stats(s, url)
                assert st["pool"]["state"] == "unreachable" and "MasterUnavailableError" in st["pool"]["last_error"]
                assert st["pool"]["skipped"] == 1 and st["pool"]["lookups"] == 0 and st["served"] == 1

                # the master comes up where --store said: the router reconnects
                async with standalone_master("--listen", address) as (addr, master):
                    assert addr == address
                    await _until(lambda: pool.state == "connected")
                    assert await _post(s, url, _prompt(2000, 4)) == 200
                    assert (await _stats(s, url))["pool"]["lookups"] == 1
                    # the master hung: the lookup gives up at the pool's timeout
                    # (0.5 s), one warning, served anyway
                    master.send_signal(signal.SIGSTOP)
                    try:
                        t0 = time.monotonic()
                        with pytest.warns(PoolUnavailableWarning, match="TimeoutError"):
                            assert await _post(s, url, _prompt(3000, 4)) == 200
                        assert time.monotonic() - t0 < 5
                    finally:
                        master.send_signal(signal.SIGCONT)
                    await _until(lambda: pool.state == "connected")
                    assert await _post(s, url, _prompt(4000, 4)) == 200
                    # the master gone: the next lookup fails, one warning, served anyway
                    master.terminate()
                    await master.wait()
                    with pytest.warns(PoolUnavailableWarning, match="MasterUnavailableError"):
                        assert await _post(s, url, _prompt(5000, 4)) == 200
                    assert await _post(s, url, _prompt(6000, 4)) == 200
                st = await _stats(s, url)
                assert st["pool"]["state"] == "unreachable" and st["pool"]["errors"] == 2
                assert st["pool"]["lookups"] == 2 and st["pool"]["skipped"] == 2
                assert st["pool"]["outages"] == 3 and st["pool"]["connects"] == 2
                assert st["served"] == 6 and st["failed"] == 0
        finally:
            await router.close()


@pytest.mark.e2e
async def test_router_command_line_routes_with_the_pool():
    # vLLM's keys, the model's name taken from the first prefill instance's /v1/models
    scheme = make_scheme("vllm", model=MODEL)
    port = _free_port()
    async with standalone_master() as (address, _), holder(address) as h, servers() as ss:
        y = _prompt(5000, 8)
        await h.put(scheme.object_keys(y, B))
        cmd = [sys.executable, "-m", "kvflow.cli.router", "--port", str(port), "--block-tokens", str(B),
               "--prefill", f"p0={ss[0].url}", "--prefill", f"p1={ss[1].url}", "--decode", f"d0={ss[2].url}",
               "--store", address,
               "--prefill-model", "0.02,0.002,0"]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=store_env())
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert "ready" in line, line
            url = line.split()[-1]
            async with aiohttp.ClientSession() as s:
                assert await _post(s, url, y) == 200
                st = await _stats(s, url)
            assert st["pool"]["state"] == "connected" and st["pool"]["keys"] == "vllm"
            assert (st["pool"]["held_blocks"], st["pool"]["fetch_blocks"]) == (8, 8)
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0


def test_conductor_router_points_store_users_to_the_cli():
    with pytest.raises(SystemExit, match="kvflow.cli.router"):
        conductor_router_main(["--block-tokens", "16", "--prefill", "p0=http://h:1", "--decode", "d0=http://h:2",
                               "--store", "127.0.0.1:1"])


# -- the keys ---------------------------------------------------------------------

def test_key_schemes_name_full_pages_and_refuse_nonsense():
    toks = list(range(3 * B + 4))
    for kind in ("vllm", "sglang", "kvflow"):
        keys = make_scheme(kind, model=MODEL).object_keys(toks, B)
        assert len(keys) == 3 and len(set(keys)) == 3
        # chained: a page's key names the prefix up to it
        assert make_scheme(kind, model=MODEL).object_keys(toks[:B] + [0] * (2 * B), B)[0] == keys[0]
        assert make_scheme(kind, model=MODEL).object_keys([1] + toks[1:], B)[2] != keys[2]
    assert make_scheme("vllm", model=MODEL).object_keys(toks, B)[0].startswith(
        "tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@")
    assert make_scheme("vllm", model=MODEL, key_prefix="dep").object_keys(toks, B)[0].startswith("dep@tiny-llama@")
    assert make_scheme("sglang", rank="mla").object_keys(toks, B)[0].endswith("_mla")
    # kvflow's: what StorePoolIndex names the conductor's block keys by default
    assert ConductorKeys().object_keys(toks, B) == StorePoolIndex(_Exists()).object_keys(
        block_keys(toks, B))
    for bad in (dict(kind="nope"), dict(kind="vllm"), dict(kind="vllm", model=MODEL, rank="mla"),
                dict(kind="sglang", rank="x")):
        with pytest.raises(ValueError):
            make_scheme(bad.pop("kind"), **bad)


class _Exists:
    async def batch_exists(self, keys):
        return [False] * len(keys)


@pytest.mark.interop
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_sglang_keys_are_sglangs_own_page_hashes():
    """SGLang's get_hash_str (what HiRadixCache names pages by) under
    kvflow.compat.sglang.hicache's key format (prefix, hash, _rank)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    toks = [(i * 7919) % 150000 for i in range(4 * B + 3)]
    hashes = get_hash_str(toks, None, page_size=B)[:4]
    assert make_scheme("sglang", key_prefix="m/", rank="1").object_keys(toks, B) == [f"m/{x}_1" for x in hashes]
    wide = toks[:B - 1] + [1 << 33]                 # SGLang's wide pages (ids past 32 bits)
    assert make_scheme("sglang").object_keys(wide, B) == [get_hash_str(wide, None, page_size=B)[0] + "_0"]


@pytest.mark.vllm
@pytest.mark.interop
def test_vllm_keys_are_vllms_own_block_hashes_and_pool_keys():
    """vLLM's hash_block_tokens (sha256, its NONE_HASH seed, with and without
    PYTHONHASHSEED) under its MooncakeStoreConnector's PoolKey."""
    import _vllm

    _vllm.require_vllm()
    toks = [(i * 7919) % 32000 for i in range(3 * B + 3)]
    # one interpreter (importing vLLM's connector takes half a minute):
    # NONE_HASH is derived again after PYTHONHASHSEED is set, as a server
    # started with it derives it
    code = (
        "import json, os\n"
        "from vllm.utils.hashing import sha256\n"
        "from vllm.v1.core import kv_cache_utils as k\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, PoolKey\n"
        f"t = {toks!r}\n"
        "meta = KeyMetadata(model_name='tiny-llama', tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0,"
        " cache_prefix='dep')\n"
        "res = {}\n"
        "for seed in (None, '1234'):\n"
        "    if seed:\n"
        "        os.environ['PYTHONHASHSEED'] = seed\n"
        "    k.init_none_hash(sha256)\n"
        "    p, out = None, []\n"
        f"    for i in range(0, len(t) - {B} + 1, {B}):\n"
        f"        p = k.hash_block_tokens(sha256, p, t[i:i + {B}], None)\n"
        "        out.append(PoolKey(meta, bytes(p).hex()).to_string())\n"
        "    res[str(seed)] = out\n"
        "print(json.dumps(res))\n")
    env = _vllm.child_env()
    env.pop("PYTHONHASHSEED", None)
    r = subprocess.run([_vllm.VENV_PY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    for seed in (None, "1234"):
        ours = make_scheme("vllm", model=MODEL, key_prefix="dep", hash_seed=seed).object_keys(toks, B)
        assert ours == theirs[str(seed)] and len(ours) == 3
    assert theirs["None"] != theirs["1234"]
