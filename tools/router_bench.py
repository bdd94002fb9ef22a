"""Routing rules in front of real vLLM prefill/decode servers, side by side.

    python tools/router_bench.py [--runs 2] [--rules proxy,sglang_cache_aware,kvcache]

Starts two prefill instances and one decode instance of vLLM (the CPU
build, its venv from .ci/setup: tests/_vllm.py) on a small random-weight
Llama made here (4 layers, hidden 256: CPU prefill time grows with the
tokens, so a cache hit shows), with NixlConnector on kvflow's NIXL
stand-in, KV cache events over ZMQ and a prefix cache of
``--cache-blocks`` blocks per instance. Then, for each rule in turn (the
order rotated per run), the same multi-turn workload: ``--conversations``
conversations of ``--turns`` turns sharing a system prompt, each with a
document of its own after it, each turn the
conversation so far plus a new user message, sent when the last answer came
back and a think time passed (exponential, seeded: the same schedule and the
same words for every rule), streamed, its TTFT timed at the client. Between
rules every instance's prefix cache is emptied (vLLM's dev endpoint).

Rules: ``proxy`` is vLLM's toy PD proxy's round-robin (tests/_pd_proxy.py);
the others are `kvflow.conductor.router.PDRouter` with that policy
(``sglang_cache_aware``: SGLang router's prefix-aware rule; ``kvcache``:
Mooncake's Algorithm 1, with online-fitted models and KV events).

Prints per rule and run: TTFT p50/p90, goodput (requests with TTFT within
``--slo`` per second), the share of prompt tokens the prefill instances
reused (their own counters), and at the end each rule's ratios to the
first rule, per run and their mean. ``--json FILE`` writes it all.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import aiohttp  # noqa: E402

import _vllm  # noqa: E402
from _pd_proxy import PDProxy  # noqa: E402

from kvflow.conductor.router import Instance, PDRouter  # noqa: E402
from kvflow.conductor.types import RejectionMode, Role  # noqa: E402

MODEL_SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 768, "max_positions": 4096}
KV_BYTES_PER_TOKEN = 4 * 2 * 64 * 2 * 4      # layers x kv heads x head dim x (K, V) x float32


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 1000)}" for _ in range(n))


class Servers:
    def __init__(self, tmp: str, args: argparse.Namespace) -> None:
        model = _vllm.make_model(os.path.join(tmp, "model"), **MODEL_SHAPE)
        self.model = model
        kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
        common = ["--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(args.cache_blocks),
                  "--max-num-seqs", "8"]
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        self.events = {}
        self.prefill = []
        for i in range(2):
            port = _vllm.free_port()
            # vLLM binds a wildcard endpoint (it would connect to any other)
            ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
            s = _vllm.VllmServer(f"p{i}", model, os.path.join(tmp, f"p{i}.log"),
                                 kv_transfer={**kv, "kv_role": "kv_producer"}, extra_env=env,
                                 extra_args=[*common, "--kv-events-config", json.dumps(ev)], max_model_len=4096,
                                 cpus=str(i) if args.pin else None)
            self.events[s.name] = f"tcp://127.0.0.1:{port}"
            self.prefill.append(s)
        self.decode = _vllm.VllmServer("d0", model, os.path.join(tmp, "d0.log"),
                                       kv_transfer={**kv, "kv_role": "kv_consumer"}, extra_env=env,
                                       extra_args=["--num-gpu-blocks-override", str(4 * args.cache_blocks),
                                                   "--max-num-seqs", "8"], max_model_len=4096)

    @property
    def all(self):
        return [*self.prefill, self.decode]

    async def ready(self, session) -> None:
        deadline = time.monotonic() + 900
        for s in self.all:
            await s.wait_ready(session, deadline)

    async def reset(self, session) -> None:
        for s in self.all:
            async with session.post(s.url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()

    async def reused(self, session) -> tuple[float, float]:
        """(prompt tokens, of them served from the prefix cache) over the prefill instances."""
        tot = hit = 0.0
        for s in self.prefill:
            m = await s.metrics(session)
            tot += m.get("vllm:prefix_cache_queries_total", 0.0)
            hit += m.get("vllm:prefix_cache_hits_total", 0.0)
        return tot, hit

    def stop(self) -> None:
        for s in self.all:
            s.stop()


async def conversation(session, url: str, model: str, c: int, args: argparse.Namespace, system: str,
                       t_start: float, out: list) -> None:
    rng = random.Random(args.seed * 1000 + c)
    await asyncio.sleep(rng.uniform(0, args.think))
    history = system + " " + words(rng, args.doc_tokens) if args.doc_tokens else system
    for turn in range(args.turns):
        prompt = history + " " + words(rng, args.user_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": args.answer_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        t0 = time.monotonic()
        ttft = None
        text = []
        status = 0
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                status = r.status
                if r.status == 200:
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                else:
                    await r.read()
        except aiohttp.ClientError as exc:
            status = -1
            print(f"  conversation {c} turn {turn}: {exc!r}", flush=True)
        out.append({"conv": c, "turn": turn, "status": status, "ttft": ttft, "sent": t0 - t_start,
                    "tokens": len(prompt.split())})
        history = prompt + " " + "".join(text).strip() if text else prompt
        await asyncio.sleep(rng.expovariate(1.0 / args.think))


async def run_rule(rule: str, servers: Servers, session, args: argparse.Namespace, run: int) -> dict:
    await servers.reset(session)
    if rule == "proxy":
        front = PDProxy([s.url for s in servers.prefill], [servers.decode.url])
        url = await front.start()
    else:
        front = PDRouter([Instance(s.name, Role.PREFILL, s.url, servers.events[s.name]) for s in servers.prefill],
                         [Instance("d0", Role.DECODE, servers.decode.url)], block_tokens=_vllm.BLOCK_SIZE,
                         policy=rule, rejection=RejectionMode.NONE, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                         tokenizer=servers.model)
        url = await front.start()
        await front.calibrate()
        await servers.reset(session)
    tot0, hit0 = await servers.reused(session)
    system = words(random.Random(run), args.system_tokens)
    out: list = []
    t0 = time.monotonic()
    await asyncio.gather(*(conversation(session, url, servers.model, c, args, system, t0, out)
                           for c in range(args.conversations)))
    wall = time.monotonic() - t0
    await asyncio.sleep(1.0)
    tot1, hit1 = await servers.reused(session)
    stats = None
    if isinstance(front, PDRouter):
        async with session.get(url + "/stats") as r:
            stats = await r.json()
    await front.close()
    ok = [r["ttft"] for r in out if r["status"] == 200 and r["ttft"] is not None]
    ok.sort()
    good = sum(1 for t in ok if t <= args.slo)
    q = statistics.quantiles(ok, n=10) if len(ok) >= 2 else [float("nan")] * 9
    res = {"rule": rule, "run": run, "requests": len(out), "ok": len(ok), "wall_s": wall,
           "ttft_p50": statistics.median(ok) if ok else float("nan"), "ttft_p90": q[8],
           "goodput_rps": good / wall, "slo_met": good / max(1, len(out)),
           "reused": (hit1 - hit0) / max(1.0, tot1 - tot0), "router": stats}
    print(f"  run {run} {rule:20s} TTFT p50 {res['ttft_p50'] * 1e3:7.0f} ms  p90 {res['ttft_p90'] * 1e3:7.0f} ms  "
          f"goodput {res['goodput_rps']:.2f}/s ({good}/{len(out)} within {args.slo} s)  "
          f"reused {res['reused']:.0%}  wall {wall:.0f} s", flush=True)
    return res


async def main_async(args: argparse.Namespace) -> int:
    _vllm.require_vllm()
    rules = args.rules.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = Servers(tmp, args)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(force_close=True)) as session:
                await servers.ready(session)
                print(f"servers ready; {args.conversations} conversations x {args.turns} turns, "
                      f"system {args.system_tokens} tokens, document {args.doc_tokens}, user {args.user_tokens}, "
                      f"answer {args.answer_tokens}",
                      flush=True)
                for run in range(args.runs):
                    order = rules[run % len(rules):] + rules[:run % len(rules)]
                    for rule in order:
                        results.append(await run_rule(rule, servers, session, args, run))
        finally:
            if args.keep_logs:
                for s in servers.all:
                    print(f"--- {s.name}\n{s.tail(3000)}")
            servers.stop()
    base = rules[0]
    print(f"\nratios to {base} (TTFT: {base}/rule, >1 is faster; goodput: rule/{base})")
    summary = {}
    for rule in rules[1:]:
        rows = []
        for run in range(args.runs):
            b = next(r for r in results if r["rule"] == base and r["run"] == run)
            x = next(r for r in results if r["rule"] == rule and r["run"] == run)
            rows.append((b["ttft_p50"] / x["ttft_p50"], b["ttft_p90"] / x["ttft_p90"],
                         x["goodput_rps"] / b["goodput_rps"] if b["goodput_rps"] else float("inf")))
        mean = [statistics.mean(c) for c in zip(*rows)]
        summary[rule] = {"per_run": rows, "mean": mean}
        print(f"  {rule:20s} TTFT p50 x{mean[0]:.2f}  p90 x{mean[1]:.2f}  goodput x{mean[2]:.2f}  "
              f"(runs: {', '.join(f'{a:.2f}/{b:.2f}/{c:.2f}' for a, b, c in rows)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": summary}, f, indent=1, default=str)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default="proxy,sglang_cache_aware,kvcache")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--doc-tokens", type=int, default=768, help="a document of each conversation's own, after the system prompt")
    ap.add_argument("--user-tokens", type=int, default=100)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--think", type=float, default=3.0, help="mean seconds between an answer and the next turn")
    ap.add_argument("--cache-blocks", type=int, default=48, help="prefix cache blocks per prefill instance")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT SLO in seconds, for goodput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill instance i on core i (taskset): instances that do not share cores")
    ap.add_argument("--json")
    ap.add_argument("--keep-logs", action="store_true")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
