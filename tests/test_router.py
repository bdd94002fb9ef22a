"""The PD router's parts that need no vLLM server: KV cache events keyed the
conductor's way, the online model fit, and the router's answers to bad input
and to instances that do not answer (tests/test_vllm_router.py runs it in
front of real vLLM servers)."""
from __future__ import annotations

import json
import random
import socket
import subprocess

import aiohttp
import msgpack
import pytest

from kvflow.conductor import PrefillModel, Role, block_keys
from kvflow.conductor.blocks import chain_keys
from kvflow.conductor.kv_events import KVEventLog
from kvflow.conductor.online import OnlineFit
from kvflow.conductor.estimators import DecodeModel
from kvflow.conductor.router import Instance, PDRouter, parse_instance, prefill_body

B = 16


def _batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events)], use_bin_type=True)


def _stored(hashes, parent, tokens, size=B) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU"}


def test_chain_keys_continue_a_prompts_keys():
    rng = random.Random(1)
    toks = [rng.randrange(50000) for _ in range(10 * B + 5)]
    whole = block_keys(toks, B)
    a = chain_keys(None, toks[:3 * B], B)
    b = chain_keys(a[-1], toks[3 * B:], B)
    assert a + b == whole and len(whole) == 10


def test_event_log_keys_stored_blocks_as_the_prompts_keys_and_forgets_removed_ones():
    toks = list(range(100, 100 + 5 * B))
    log = KVEventLog(B)
    # vLLM publishes a prompt's blocks in pieces, each after the block it follows
    s1, r1, c1 = log.apply(_batch(_stored([b"h0", b"h1"], None, toks[:2 * B])))
    s2, _, _ = log.apply(_batch(_stored([b"h2", b"h3"], b"h1", toks[2 * B:4 * B])))
    assert s1 + s2 == block_keys(toks[:4 * B], B) and not r1 and not c1
    # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) work the same
    s3, _, _ = log.apply(_batch(_stored([77], b"h3", toks[4 * B:5 * B])))
    assert s3 == block_keys(toks, B)[4:]
    _, gone, _ = log.apply(_batch({"type": "BlockRemoved", "block_hashes": [b"h3", b"nope"], "medium": "GPU"}))
    assert gone == [block_keys(toks, B)[3]]
    assert log.counts.stored == 5 and log.counts.removed == 1 and len(log) == 4
    stored, removed, cleared = log.apply(_batch({"type": "AllBlocksCleared"}, _stored([b"x"], None, toks[:B])))
    assert cleared and stored == block_keys(toks, B)[:1] and len(log) == 1


def test_event_log_counts_what_it_cannot_key_and_survives_garbage():
    log = KVEventLog(B)
    toks = list(range(B))
    assert log.apply(_batch(_stored([b"a"], b"never-seen", toks))) == ([], [], False)
    assert log.counts.unkeyed == 1
    assert log.apply(_batch(_stored([b"a"], None, list(range(32)), size=32))) == ([], [], False)   # other block size
    assert log.apply(_batch(_stored([b"a", b"b"], None, toks))) == ([], [], False)                # tokens short
    assert log.apply(b"\xc1 not msgpack") == ([], [], False)
    assert log.apply(msgpack.packb({"not": "a batch"})) == ([], [], False)
    assert log.apply(_batch({"type": "SomethingNew"}, "not a map")) == ([], [], False)
    assert log.counts.malformed == 6 and len(log) == 0
    log.sequence(0)
    log.sequence(1)
    log.sequence(5)
    assert log.counts.gaps == 3
    with pytest.raises(ValueError):
        KVEventLog(0)


@pytest.mark.vllm
def test_event_log_reads_what_vllm_itself_encodes():
    """The payload made by vLLM's own event classes and encoder (its venv)."""
    import _vllm

    _vllm.require_vllm()
    toks = list(range(3, 3 + 3 * B))
    code = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved\n"
        f"t = {toks!r}\n"
        f"a = BlockStored(block_hashes=[b'h0', b'h1'], parent_block_hash=None, token_ids=t[:{2 * B}],"
        f" block_size={B}, lora_id=None, medium='GPU', lora_name=None)\n"
        f"b = BlockStored(block_hashes=[b'h2'], parent_block_hash=b'h1', token_ids=t[{2 * B}:],"
        f" block_size={B}, lora_id=None, medium='GPU', lora_name=None)\n"
        "r = BlockRemoved(block_hashes=[b'h0'], medium='GPU')\n"
        "sys.stdout.write(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=[a, b, r])).hex())\n")
    out = subprocess.run([_vllm.VENV_PY, "-c", code], env=_vllm.child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    log = KVEventLog(B)
    stored, removed, cleared = log.apply(bytes.fromhex(out.stdout.strip()))
    keys = block_keys(toks, B)
    assert stored == keys and removed == keys[:1] and not cleared and log.counts.malformed == 0


def test_online_fit_follows_measured_prefills_and_decodes():
    true = PrefillModel(linear_s=2e-4, attention_s=5e-8, overhead_s=0.03, load_s_per_token=0.0)
    fit = OnlineFit(PrefillModel(), DecodeModel())
    for n, p in [(100, 0), (400, 0), (800, 0), (800, 512), (1200, 256), (300, 128)]:
        fit.add_prefill(n, p, true.time(n, p))
    m = fit.prefill
    for n, p in [(1000, 0), (1000, 768), (50, 0)]:
        assert m.time(n, p) == pytest.approx(true.time(n, p), rel=0.02)
    for b, ctx in [(1, 500), (2, 1500), (4, 3000), (8, 9000)]:
        fit.add_decode(b, ctx, 0.01 + 0.002 * b + 1e-6 * ctx)
    assert fit.decode.step_time(3, 2000) == pytest.approx(0.01 + 0.006 + 0.002, rel=0.02)
    # nonsense samples are not taken
    fit.add_prefill(0, 0, 1.0)
    fit.add_prefill(10, 0, -1.0)
    assert len(fit.prefill_samples) == 6


def test_parse_instance_and_prefill_body():
    i = parse_instance("p0=http://127.0.0.1:8100@tcp://127.0.0.1:5557", Role.PREFILL)
    assert (i.name, i.url, i.events) == ("p0", "http://127.0.0.1:8100", "tcp://127.0.0.1:5557")
    assert parse_instance("d0=http://h:1/", Role.DECODE).events is None
    for bad in ("p0", "=http://x", "p0=ftp://x", "p0="):
        with pytest.raises(ValueError):
            parse_instance(bad, Role.PREFILL)
    body = {"prompt": "w1", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 3}
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["kv_transfer_params"]["do_remote_decode"]
    assert "stream_options" not in pre and "min_tokens" not in pre and body["max_tokens"] == 9
    with pytest.raises(ValueError):
        PDRouter([], [Instance("d0", Role.DECODE, "http://x")], block_tokens=B)
    with pytest.raises(ValueError):
        PDRouter([Instance("a", Role.PREFILL, "http://x")], [Instance("a", Role.DECODE, "http://y")], block_tokens=B)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_router_answers_bad_input_and_dead_instances_with_clear_errors():
    dead = f"http://127.0.0.1:{_closed_port()}"
    router = PDRouter([Instance("p0", Role.PREFILL, dead)], [Instance("d0", Role.DECODE, dead)], block_tokens=B)
    url = await router.start()
    try:
        async with aiohttp.ClientSession() as s:
            async def post(body, raw=None):
                data = raw if raw is not None else json.dumps(body)
                async with s.post(url + "/v1/completions", data=data,
                                  headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            assert (await post(None, raw="{not json"))[0] == 400
            assert (await post(None, raw="[1, 2]"))[0] == 400
            st, err = await post({"model": "m", "prompt": {"a": 1}})
            assert st == 400 and "prompt" in err["error"]["message"]
            async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r:
                assert r.status == 400
            # a string prompt must be tokenized by an instance: none answers
            st, err = await post({"model": "m", "prompt": "w1 w2"})
            assert st == 502 and err["error"]["type"] == "upstream_error"
            # token ids route without tokenizing; the prefill instance does not answer
            st, err = await post({"model": "m", "prompt": list(range(3 * B)), "max_tokens": 4})
            assert st == 502
            # the failed request left nothing booked in the conductor
            assert router.conductor.decode_load("d0") == (0, 0)
            assert router.conductor.stats.routed == 1
            async with s.get(url + "/stats") as r:
                stats = await r.json()
            assert stats["failed"] == 2 and stats["instances"]["p0"]["in_flight"] == 0
            async with s.get(url + "/health") as r:
                assert r.status == 200
    finally:
        await router.close()
