"""vLLM's MooncakeStoreConnector (vLLM 0.32's own, unchanged) on kvflow's
Mooncake Store API: `mooncake.store` is kvflow.compat.mooncake.store (the
shim first on the servers' PYTHONPATH), the master is `python -m
kvflow.store master`.

Two vLLM servers (the venv's python, the tiny local Llama of
tests/_vllm_model.py) share the pool, both `kv_both`: A serves a prompt and
its connector saves the prompt's KV blocks into the pool (a segment in A's
process); B then serves the same prompt and its connector finds the blocks
in the pool (vLLM's lookup through batch_is_exist) and loads them
(batch_get_into_multi_buffers) instead of computing them: B's metrics count
external prefix-cache hits, and B's greedy completion is A's.

The conductor's router finds what A's connector saved under the keys it
computes itself (kvflow/conductor/pool_keys.py's vLLM scheme, the model's
name as the router takes it from /v1/models): every full block of the
prompt, with the router's own pool lookup (RouterPool over a StoreClient,
as ``python -m kvflow.cli.router --store`` makes it)."""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import random
import subprocess
import sys
import time

import pytest

import _vllm
from kvflow.cli.router import store_connect
from kvflow.compat.mooncake import shim_path
from kvflow.conductor.pool_keys import make_scheme
from kvflow.conductor.router_pool import RouterPool
from kvflow.conductor.types import Request

pytestmark = [pytest.mark.vllm]


def _master() -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, text=True, cwd=_vllm.ROOT, stdin=subprocess.DEVNULL)
    line = p.stdout.readline()
    assert "ready" in line, line
    return p, line.split()[-1]


async def _complete(session, server: _vllm.VllmServer, model: str, text: str) -> str:
    body = {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0.0, "seed": 0}
    async with session.post(server.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def _router_lookup(session, server: _vllm.VllmServer, address: str, text: str) -> tuple[int, int]:
    """(blocks of the prompt the router finds in the pool, full blocks of it)."""
    async with session.get(server.url + "/v1/models") as r:
        served = (await r.json())["data"][0]["id"]
    async with session.post(server.url + "/tokenize", json={"model": served, "prompt": text}) as r:
        ids = (await r.json())["tokens"]
    pool = RouterPool(store_connect(address), make_scheme("vllm", model=served), address=address)
    assert await pool.start()
    try:
        held = await pool.held(Request.from_tokens("q", ids, block_tokens=_vllm.BLOCK_SIZE), ids)
    finally:
        await pool.close()
    return held.blocks, len(ids) // _vllm.BLOCK_SIZE


def test_vllm_mooncake_store_connector_on_kvflow(tmp_path):
    _vllm.require_vllm()
    import aiohttp

    # Two vLLM CPU servers' start-up alone takes 100-170 s on a loaded 2-core
    # host: past conftest's 150 s watchdog, which would end the whole run.
    faulthandler.dump_traceback_later(900, exit=True)
    model = _vllm.make_model(str(tmp_path / "model"))
    master, address = _master()
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": address,
                               "protocol": "tcp", "device_name": "", "global_segment_size": "128MB",
                               "local_buffer_size": "16MB"}))
    env = {"MOONCAKE_CONFIG_PATH": str(cfg),
           "PYTHONPATH": os.pathsep.join([shim_path(), _vllm.shim_root(), _vllm.ROOT])}
    kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    servers = [_vllm.VllmServer(name, model, str(tmp_path / f"{name}.log"), kv_transfer=kv, extra_env=env)
               for name in ("A", "B")]
    text = _vllm.prompt(random.Random(5), 600)

    async def run() -> dict:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 600
            for s in servers:
                await s.wait_ready(session, deadline)
            a = await _complete(session, servers[0], model, text)
            await asyncio.sleep(3)          # A's connector saves asynchronously
            held = await _router_lookup(session, servers[0], address, text)
            before = await servers[1].metrics(session)
            b = await _complete(session, servers[1], model, text)
            after = await servers[1].metrics(session)
            return {"a": a, "b": b, "before": before, "after": after, "held": held}

    try:
        out = asyncio.run(run())
        hits = {k: out["after"].get(k, 0) - out["before"].get(k, 0) for k in out["after"]
                if "external_prefix_cache" in k or "connector" in k}
        print("B's connector counters during its request:", hits)
        print("the router's lookup (held blocks, full blocks of the prompt):", out["held"])
        assert all(any(_vllm.uses_kvflow(pid) for pid in s.pids()) for s in servers)
        assert out["a"] == out["b"], out
        assert hits.get("vllm:external_prefix_cache_hits_total", 0) > 0, (hits, servers[1].tail())
        held, full = out["held"]
        assert held == full > 0, out["held"]
    finally:
        for s in servers:
            s.stop()
        master.terminate()
        master.wait(10)
        faulthandler.cancel_dump_traceback_later()
