"""The conductor as the router of vLLM's own prefill/decode servers (issue 42,
items 2 (c) and 3).

Two prefill instances (kv_producer) publishing their KV cache events over ZMQ
and one decode instance (kv_consumer), vLLM 0.32 on the tiny random-weight
Llama (tests/_vllm.py), NixlConnector on kvflow's NIXL stand-in, with
``python -m kvflow.conductor.router`` in front (a process of its own, as a
user runs it). Checked:
- greedy completions through the router carry exactly the tokens a plain
  completion on one instance gives;
- the router learns each instance's cache from its events (every stored
  block keyed, none malformed), and a conversation's next turn goes to the
  instance holding its prefix, which then computes only the rest (vLLM's
  own ``cached_tokens``);
- the decode instance stopped (SIGSTOP, all its processes) for 7 s with a
  request in flight: everything is served, the same tokens;
- the router tokenizes prompts itself (``--tokenizer``) exactly as the
  servers do; the second router below asks the servers (``/tokenize``);
- overload: a second router (in this process) with a TTFT SLO a burst cannot
  meet answers 429 to the requests it cannot serve in time, before any
  server works on them, and serves the others.
"""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

import _vllm
from kvflow.conductor.router import Instance, PDRouter
from kvflow.conductor.types import Role

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

B = _vllm.BLOCK_SIZE
MAX_TOKENS = 8
STOP_S = 7.0


async def _complete(session, url: str, model: str, prompt, max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text.startswith("{") else {"raw": text})


def _ids(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


async def _stats(session, url: str) -> dict:
    async with session.get(url + "/stats") as r:
        return await r.json()


async def _until(pred, timeout: float = 30.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        v = await pred()
        if v or time.monotonic() > deadline:
            return v
        await asyncio.sleep(every)


def _start_router(args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.conductor.router", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=_vllm.ROOT)
    line = proc.stdout.readline().decode()
    assert "ready on" in line, f"router did not start: {line!r}\n{open(log_path).read()[-3000:]}"
    return proc, line.rsplit(" ", 1)[1].strip()


async def test_conductor_routes_vllm_pd_servers_by_their_caches_through_a_stop(tmp_path):
    _vllm.require_vllm()
    faulthandler.dump_traceback_later(1800, exit=True)
    model = _vllm.make_model(str(tmp_path / "model"))
    kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    events = {}
    servers = []
    for name in ("p0", "p1"):
        port = _vllm.free_port()
        # vLLM binds a wildcard endpoint (it would connect to any other)
        ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        events[name] = f"tcp://127.0.0.1:{port}"
        servers.append(_vllm.VllmServer(name, model, str(tmp_path / f"{name}.log"),
                                        kv_transfer={**kv, "kv_role": "kv_producer"},
                                        extra_args=["--enable-prompt-tokens-details",
                                                    "--kv-events-config", json.dumps(ev)]))
    dec = _vllm.VllmServer("d0", model, str(tmp_path / "d0.log"), kv_transfer={**kv, "kv_role": "kv_consumer"})
    servers.append(dec)
    p0, p1 = servers[0], servers[1]
    router = None
    inproc = None
    rng = random.Random(7)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(force_close=True)) as s:
            deadline = time.monotonic() + 900
            for srv in servers:
                await srv.wait_ready(s, deadline)
            for srv in (p0, p1):            # vLLM's own NIXL handshake of each pair, before the router's events
                await _vllm.warm_up_pd(s, srv, dec, model)
            router, url = _start_router(
                ["--block-tokens", str(B), "--calibrate", "--decode", f"d0={dec.url}", "--tokenizer", model,
                 *(a for srv in (p0, p1) for a in ("--prefill", f"{srv.name}={srv.url}@{events[srv.name]}"))],
                str(tmp_path / "router.log"))

            # The router tokenizes here (--tokenizer) as the servers do.
            from transformers import AutoTokenizer

            text = _vllm.prompt(rng, 50)
            async with s.post(p0.url + "/tokenize", json={"model": model, "prompt": text}) as r:
                assert (await r.json())["tokens"] == AutoTokenizer.from_pretrained(model)(text)["input_ids"]

            # 1. The same tokens as one instance alone.
            for n in (40, 300):
                prompt = _vllm.prompt(rng, n)
                st, ref = await _complete(s, p0.url, model, prompt)
                assert st == 200, ref
                st, got = await _complete(s, url, model, prompt)
                assert st == 200, got
                assert _ids(got) == _ids(ref), (n, _ids(got), _ids(ref))

            # 2. A conversation's next turn goes where its prefix is cached.
            turn1 = _vllm.prompt(rng, 3 * B + 20)
            before = (await _stats(s, url))["instances"]
            st, r1 = await _complete(s, url, model, turn1)
            assert st == 200, r1
            after = (await _stats(s, url))["instances"]
            holder = next(n for n in ("p0", "p1") if after[n]["routed"] > before[n]["routed"])

            async def holds_prefix():
                st = (await _stats(s, url))["instances"][holder]
                return st["events"]["stored"] >= 3 and st

            assert await holds_prefix() or await _until(holds_prefix), await _stats(s, url)
            turn2 = turn1 + " " + r1["choices"][0]["text"].strip() + " " + _vllm.prompt(rng, 60)
            st, ref2 = await _complete(s, (p1 if holder == "p0" else p0).url, model, turn2)
            assert st == 200
            before = await _stats(s, url)
            st, r2 = await _complete(s, url, model, turn2)
            assert st == 200, r2
            after = await _stats(s, url)
            assert after["instances"][holder]["routed"] == before["instances"][holder]["routed"] + 1, after
            # vLLM's own count: the holder computed only what its cache lacked
            assert after["cached_tokens"] - before["cached_tokens"] >= 3 * B, after
            assert _ids(r2) == _ids(ref2)
            for name in ("p0", "p1"):
                ev = after["instances"][name]["events"]
                assert ev["malformed"] == 0 and ev["unkeyed"] == 0 and ev["gaps"] == 0, after
            assert after["models"]["prefill"]["samples"] >= 4, after

            # 3. The decode instance stopped for 7 s with a request in flight.
            prompt = _vllm.prompt(rng, 200)
            st, ref3 = await _complete(s, p0.url, model, prompt)
            dec.signal(signal.SIGSTOP)
            try:
                pending = asyncio.ensure_future(_complete(s, url, model, prompt))
                await asyncio.sleep(STOP_S)
                assert not pending.done()
            finally:
                dec.signal(signal.SIGCONT)
            st, r3 = await asyncio.wait_for(pending, 300)
            assert st == 200, r3
            assert _ids(r3) == _ids(ref3)
            st, r4 = await _complete(s, url, model, prompt)
            assert st == 200 and _ids(r4) == _ids(ref3)
            _vllm.echo(f"router stats: {json.dumps(await _stats(s, url))}")

            # 4. Overload: 429 for what cannot meet the TTFT SLO, before any server works on it.
            inproc = PDRouter([Instance(n, Role.PREFILL, srv.url, events[n]) for n, srv in (("p0", p0), ("p1", p1))],
                              [Instance("d0", Role.DECODE, dec.url)], block_tokens=B,
                              slo_tbt_s=60.0,   # the TTFT gate is what this checks
                              # tokenized here: tokenizing at a server that is busy
                              # with the burst's first prefills delays each later
                              # request's routing until those are done, so the burst
                              # no longer meets a queue (seen in CI: all 8 served)
                              tokenizer=model)
            iurl = await inproc.start()
            await inproc.calibrate()
            one = inproc.conductor.prefill_model.time(900)
            inproc.conductor.slo_ttft_s = 2.5 * one
            burst = [_vllm.prompt(rng, 900) for _ in range(8)]
            routed0 = {n: i.routed for n, i in inproc.prefill.items()}
            res = await asyncio.gather(*(_complete(s, iurl, model, p, 2) for p in burst))
            codes = [st for st, _ in res]
            _vllm.echo(f"burst of 8 with SLO {inproc.conductor.slo_ttft_s * 1e3:.0f} ms: {codes}")
            assert 200 in codes and 429 in codes, codes
            assert all(c in (200, 429) for c in codes), res
            rejected = [r for st, r in res if st == 429]
            assert all("ttft_slo" in r["error"]["message"] for r in rejected), rejected
            served = sum(i.routed - routed0[n] for n, i in inproc.prefill.items())
            assert served == codes.count(200)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if inproc is not None:
            await inproc.close()
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(15)
            except subprocess.TimeoutExpired:
                router.kill()
        for srv in servers:
            srv.stop()
        for srv in servers:
            if os.environ.get("KVFLOW_VLLM_LOGS"):
                _vllm.echo(f"--- {srv.name}\n{srv.tail()}")
