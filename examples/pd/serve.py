"""Prefill/decode disaggregated serving of the example model, over kvflow's connector.

Three roles, each its own process (asyncio + aiohttp):

  python -m examples.pd.serve bootstrap --port 8998
  python -m examples.pd.serve prefill --port 8100 --bootstrap 127.0.0.1:8998
  python -m examples.pd.serve decode  --port 8200 --bootstrap 127.0.0.1:8998 --prefill 127.0.0.1:8100
  curl -s localhost:8200/generate -d '{"prompt": "hello", "max_new_tokens": 8}'

or everything at once, with a few concurrent requests, their TTFT breakdown
and a check against single-process generation:

  python -m examples.pd.serve run --protocol tcp --requests 4 --prompt-tokens 4096

The decode server is also the router: for POST /generate it allocates the
request's pages and aux slot, sends their indices to the prefill rank
(KVReceiver.send_metadata), asks the prefill server to compute the prompt
(POST /prefill), and waits for the connector to say every page and the aux
record have landed (a notification on the data path, not a poll). The
prefill server streams each layer's K/V as soon as the layer has written
them (KVSender.send_layer from the model's on_layer hook), so the transfer
overlaps the next layer's compute; finish() after the last layer sends the
aux record (first token, prompt length).

TTFT breakdown per request (decode server's clock unless noted):
  prefill_compute_s  the prefill forward pass (prefill server)
  exposed_s          prefill finished → decode knows all data landed
  ttft_s             request arrival → first token known on decode
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

from kvflow.connector import BootstrapServer, DisaggregationMode, KVArgs, KVManager, KVPoll, KVReceiver, KVSender

try:                                        # run as a module or as a script
    from examples.pd.model import KVPool, Model, ModelConfig, encode
except ImportError:                         # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from examples.pd.model import KVPool, Model, ModelConfig, encode

REQUEST_TIMEOUT = 120.0


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden)


def pool_args(pool: KVPool, rank: int = 0) -> KVArgs:
    bufs = pool.buffers()
    return KVArgs(engine_rank=rank, kv_data_ptrs=[t.data_ptr() for t in bufs],
                  kv_data_lens=[t.numel() * t.element_size() for t in bufs],
                  kv_item_lens=[pool.page_bytes] * len(bufs),
                  aux_data_ptrs=[pool.aux.data_ptr()], aux_data_lens=[pool.aux.numel() * pool.aux.element_size()],
                  aux_item_lens=[pool.aux_row_bytes], page_size=pool.page_size,
                  kv_head_num=pool.config.num_kv_heads, total_kv_head_num=pool.config.num_kv_heads)


def protocols(name: str) -> tuple[str, ...] | None:
    return None if name == "auto" else (name,)


class Worker:
    """The model and its pool; forward passes run one at a time on one
    thread (torch releases the GIL, so the event loop and kvflow keep going)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        torch.set_num_threads(args.threads)
        self.config = model_config(args)
        self.model = Model(self.config, seed=args.seed, device=args.device)
        self.pool = KVPool(self.config, args.pages, args.page_size, max_slots=args.slots, device=args.device)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forward")

    async def run(self, fn: Any, *a: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *a)


# ---------------------------------------------------------------- prefill

async def prefill_server(args: argparse.Namespace) -> None:
    from aiohttp import web
    w = Worker(args)
    mgr = KVManager(pool_args(w.pool), DisaggregationMode.PREFILL, bootstrap_addr=args.bootstrap,
                    listen=f"{args.host}:0", protocols=protocols(args.protocol))

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        room, tokens = int(body["room"]), [int(t) for t in body["tokens"]]
        pages = w.pool.alloc(w.pool.pages_for(len(tokens)))
        slot = w.pool.alloc_slot()
        sender = KVSender(mgr, args.bootstrap, room)
        sender.init(len(pages), aux_index=slot)

        def forward() -> tuple[int, float]:
            t0 = time.perf_counter()
            first = w.model.prefill(tokens, w.pool, pages,
                                    on_layer=lambda i: sender.send_layer(i, pages, after=layer_done(args.device)))
            w.pool.set_aux(slot, first_token=first, prompt_len=len(tokens))
            sender.finish()
            return first, time.perf_counter() - t0
        try:
            first, compute_s = await w.run(forward)
            state = await sender.wait(args.request_timeout)
        except Exception as e:
            sender.abort()
            state, first, compute_s = KVPoll.Failed, -1, 0.0
            print(f"prefill room {room}: {e!r}", file=sys.stderr)
        finally:
            sender.clear()
        layer_s = sorted(sender.batch_seconds[:-1] or sender.batch_seconds)   # the last batch is the aux record
        reply = {"room": room, "state": state.name, "first_token": first, "prefill_compute_s": compute_s,
                 "bytes": sender.metric.transfer_total_bytes, "entries": sender.metric.entries,
                 "layer_transfer_s": layer_s[len(layer_s) // 2] if layer_s else None}
        if state is KVPoll.Failed:
            reply["error"] = str(sender.error)
        w.pool.free(pages)
        w.pool.free_slot(slot)
        return web.json_response(reply, status=200 if state is KVPoll.Success else 502)

    await serve(args, [("POST", "/prefill", prefill)], mgr)


# ---------------------------------------------------------------- decode

async def decode_server(args: argparse.Namespace) -> None:
    import aiohttp
    from aiohttp import web
    w = Worker(args)
    mgr = KVManager(pool_args(w.pool), DisaggregationMode.DECODE, listen=f"{args.host}:0",
                    protocols=protocols(args.protocol), transfer_timeout=args.transfer_timeout)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout))

    async def generate(request: web.Request) -> web.Response:
        t_arrival = time.perf_counter()
        body = await request.json()
        tokens = body.get("tokens") or encode(body.get("prompt", ""), w.config.vocab_size)
        max_new = int(body.get("max_new_tokens", 16))
        if not tokens or max_new < 1:
            return web.json_response({"error": "need a prompt and max_new_tokens >= 1"}, status=400)
        # A router in front (examples/pd/routed.py) names the prefill server
        # (and its bootstrap) per request, and adds fields for the prefill
        # request (which prefix to fetch first); without one, --prefill.
        prefill_addr = str(body.get("prefill") or args.prefill)
        bootstrap = str(body.get("bootstrap") or args.bootstrap)
        extra = body.get("prefill_request") or {}
        room = random.getrandbits(63)
        pages = w.pool.alloc(w.pool.pages_for(len(tokens) + max_new - 1))
        slot = w.pool.alloc_slot()
        receiver = KVReceiver(mgr, bootstrap, room, prefill_dp_rank=0)
        receiver.send_metadata(pages[:w.pool.pages_for(len(tokens))], aux_index=slot)

        async def ask_prefill() -> dict[str, Any]:
            try:
                async with http.post(f"http://{prefill_addr}/prefill",
                                     json={**extra, "room": room, "tokens": tokens}) as resp:
                    return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                receiver.abort()            # nobody will send: do not wait out the timeout
                return {"error": f"prefill server {prefill_addr}: {e!r}"}
        prefill = asyncio.create_task(ask_prefill())
        try:
            state = await receiver.wait(args.request_timeout)
            t_landed = time.perf_counter()
            pinfo = await prefill
            if state is not KVPoll.Success:
                return web.json_response({"error": str(receiver.error), "prefill": pinfo}, status=502)
            first, prompt_len = w.pool.get_aux(slot)
            rest = await w.run(w.model.decode, first, prompt_len, max_new - 1, w.pool, pages)
            reply = {"room": room, "tokens": [first, *rest], "prompt_tokens": len(tokens),
                     "ttft_s": t_landed - t_arrival, "prefill_compute_s": pinfo["prefill_compute_s"],
                     "exposed_s": receiver.metric.exposed_s, "bytes": receiver.metric.transfer_total_bytes,
                     "entries": pinfo["entries"], "layer_transfer_s": pinfo["layer_transfer_s"],
                     "total_s": time.perf_counter() - t_arrival, "prefill": pinfo}
            return web.json_response(reply)
        finally:
            if not prefill.done():
                prefill.cancel()
            if receiver.poll() is not KVPoll.Success:
                receiver.abort()
                deadline = time.monotonic() + 10
                while not receiver.release_safe and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)      # pages are reused only once nobody writes them
            receiver.clear()
            w.pool.free(pages)
            w.pool.free_slot(slot)

    try:
        await serve(args, [("POST", "/generate", generate)], mgr)
    finally:
        await http.close()


async def serve(args: argparse.Namespace, routes: list[tuple[str, str, Any]], mgr: KVManager) -> None:
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(request: web.Request) -> web.Response:
        if request.query.get("format") == "prometheus":     # needs prometheus-client
            from prometheus_client import CollectorRegistry, generate_latest

            from kvflow.connector.prometheus import register
            registry = CollectorRegistry()
            register(mgr, registry)
            return web.Response(body=await asyncio.to_thread(generate_latest, registry),
                                content_type="text/plain")
        return web.json_response(await asyncio.to_thread(mgr.metrics))

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"{args.role} serving on {args.host}:{args.port} (kvflow engine {mgr.address})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await asyncio.to_thread(mgr.close)


async def bootstrap_server(args: argparse.Namespace) -> None:
    srv = BootstrapServer(args.host, args.port)
    await srv.start()
    print(f"bootstrap serving on {srv.address}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await srv.close()


# ---------------------------------------------------------------- run everything

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer_done(device: str) -> Any:
    """On a GPU, an event recorded behind the layer's K/V writes: the
    layer's transfer starts once it fires (send_layer's after=); on the
    CPU the writes are done when on_layer runs."""
    if device == "cpu":
        return None
    import torch
    event = torch.cuda.Event()
    event.record()
    return event


def add_model_args(ap: argparse.ArgumentParser, threads: int = 2) -> None:
    """The options every server process of the example takes (the model,
    its pool, the transport, timeouts): what model_flags passes on."""
    ap.add_argument("--protocol", default="auto", choices=["auto", "local", "tcp", "rdma"])
    ap.add_argument("--device", default="cpu", help="where the model runs and the KV pool lives: cpu, cuda, cuda:N")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (and per prefix block)")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--transfer-timeout", type=float, default=60.0,
                    help="decode: seconds a request may wait for its KV once its metadata is sent "
                         "(prefill queueing included)")
    ap.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT,
                    help="seconds one HTTP request may take, end to end")


def reference_tokens(args: argparse.Namespace, prompt: list[int]) -> list[int]:
    """What single-process generation gives for `prompt` (the same weights,
    one pool): what every disaggregated run must reproduce."""
    import torch
    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    pool = KVPool(cfg, args.pages, args.page_size, device=args.device)
    pages = pool.alloc(pool.pages_for(len(prompt) + args.max_new_tokens - 1))
    return Model(cfg, seed=args.seed, device=args.device).generate(prompt, args.max_new_tokens, pool, pages)


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--layers", str(args.layers), "--hidden", str(args.hidden), "--seed", str(args.seed),
            "--pages", str(args.pages), "--page-size", str(args.page_size), "--slots", str(args.slots),
            "--threads", str(args.threads), "--protocol", args.protocol,
            "--transfer-timeout", str(args.transfer_timeout), "--request-timeout", str(args.request_timeout)]


class ServerGroup:
    """Server processes started by one runner: waits for their /health,
    posts /generate requests, stops them (SIGTERM, then SIGKILL)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.env = {**os.environ, "PYTHONPATH": self.root + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def spawn(self, module: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", module, *argv], env=self.env, cwd=self.root)
        self.procs.append(p)
        return p

    async def wait_healthy(self, addrs: list[str], timeout: float) -> None:
        import aiohttp
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            for addr in addrs:
                while True:
                    if any(p.poll() is not None for p in self.procs):
                        raise RuntimeError("a server exited during start-up")
                    try:
                        async with http.get(f"http://{addr}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{addr} did not come up in {timeout:g} s")
                    await asyncio.sleep(0.2)

    async def post_generate(self, addr: str, tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.args.request_timeout)) as http:
            async with http.post(f"http://{addr}/generate",
                                 json={"tokens": tokens, "max_new_tokens": max_new_tokens}) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"generate failed ({r.status}): {body}")
                return body

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Cluster(ServerGroup):
    """Bootstrap, prefill and decode servers as child processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        ports = [free_port() for _ in range(3)]
        self.bootstrap = f"127.0.0.1:{ports[0]}"
        self.prefill = f"127.0.0.1:{ports[1]}"
        self.decode = f"127.0.0.1:{ports[2]}"
        me = "examples.pd.serve"
        self.spawn(me, ["bootstrap", "--port", str(ports[0])])
        self.spawn(me, ["prefill", "--port", str(ports[1]), "--bootstrap", self.bootstrap] + model_flags(args))
        self.spawn(me, ["decode", "--port", str(ports[2]), "--bootstrap", self.bootstrap,
                        "--prefill", self.prefill] + model_flags(args))

    async def wait_ready(self, timeout: float = 120.0) -> None:
        await self.wait_healthy([self.bootstrap, self.prefill, self.decode], timeout)

    async def generate(self, tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
        return await self.post_generate(self.decode, tokens, max_new_tokens)

    async def metrics(self) -> dict[str, Any]:
        import aiohttp
        async with aiohttp.ClientSession() as http:
            out = {}
            for role, addr in (("prefill", self.prefill), ("decode", self.decode)):
                async with http.get(f"http://{addr}/metrics") as r:
                    out[role] = await r.json()
            return out


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [args.prompt_tokens] + [rng.randint(1, max(1, args.prompt_tokens // 2))
                                      for _ in range(args.requests - 1)]
    return [[rng.randrange(model_config(args).vocab_size) for _ in range(n)] for n in lengths]


def check_against_reference(args: argparse.Namespace, pairs: list[tuple[list[int], list[int]]]) -> int:
    """Compare (prompt, tokens) pairs with single-process generation; prints
    the verdict, returns the exit status (1 on any mismatch)."""
    bad = sum(reference_tokens(args, prompt) != tokens for prompt, tokens in pairs)
    print("check against single-process generation:", "OK" if not bad else f"{bad} MISMATCHES")
    return 1 if bad else 0


async def run(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    try:
        await cluster.wait_ready()
        reqs = prompts(args)
        await cluster.generate(reqs[0][:8], 2)         # warm up: connections, torch kernels
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(cluster.generate(p, args.max_new_tokens) for p in reqs))
            rounds.append(results)
        wall = time.perf_counter() - t0
        print(f"\n{len(reqs)} concurrent requests over {args.protocol} in {wall:.2f} s (last of {args.rounds} rounds)")
        print(f"{'prompt':>7} {'ttft ms':>8} {'prefill ms':>10} {'exposed ms':>10} {'layer xfer ms':>13} "
              f"{'KV MiB':>7} {'entries':>7}  tokens")
        for p, r in zip(reqs, results):
            print(f"{len(p):>7} {r['ttft_s'] * 1e3:>8.1f} {r['prefill_compute_s'] * 1e3:>10.1f} "
                  f"{r['exposed_s'] * 1e3:>10.2f} {(r['layer_transfer_s'] or 0) * 1e3:>13.2f} "
                  f"{r['bytes'] / 2**20:>7.2f} {r['entries']:>7}  {r['tokens'][:8]}")
        if args.rounds > 1:
            first = sorted(rs[0]["exposed_s"] for rs in rounds)
            layer = sorted(rs[0]["layer_transfer_s"] or 0 for rs in rounds)
            print(f"prompt of {len(reqs[0])} tokens over {args.rounds} rounds: exposed p50 "
                  f"{first[len(first) // 2] * 1e3:.2f} ms, one layer's transfer p50 {layer[len(layer) // 2] * 1e3:.2f} ms")
        print("metrics:", json.dumps(await cluster.metrics()))
        if args.check:
            return check_against_reference(args, [(p, r["tokens"]) for p, r in zip(reqs, results)])
        return 0
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["bootstrap", "prefill", "decode", "run"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bootstrap", default="127.0.0.1:8998")
    ap.add_argument("--prefill", default="127.0.0.1:8100", help="decode: the prefill server's HTTP address")
    add_model_args(ap)
    ap.add_argument("--requests", type=int, default=4, help="run: concurrent requests")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="run: the longest prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="run: repeat the requests (p50 of the first one's times)")
    ap.add_argument("--check", action="store_true", help="run: compare with single-process generation")
    args = ap.parse_args(argv)
    role = {"bootstrap": bootstrap_server, "prefill": prefill_server, "decode": decode_server, "run": run}
    return asyncio.run(role[args.role](args)) or 0


if __name__ == "__main__":
    sys.exit(main())
