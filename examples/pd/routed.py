"""Several prefill and decode servers behind an HTTP router that routes with
kvflow's conductor (KVCache-centric scheduling), each prefill server keeping
a prefix cache of real KV pages, and prefixes replicated between prefill
servers with kvflow.

Roles, each its own process:

  python -m examples.pd.routed bootstrap --port 8998
  python -m examples.pd.routed prefill --port 8100 --bootstrap 127.0.0.1:8998 --cache-pages 1024
  python -m examples.pd.serve  decode  --port 8200            # serve.py's decode server
  python -m examples.pd.routed router --port 8000 \\
      --prefill p0=127.0.0.1:8100@127.0.0.1:8998 --decode d0=127.0.0.1:8200
  curl -s localhost:8000/generate -d '{"tokens": [1, 2, 3], "max_new_tokens": 8}'

or all of them, with a multi-turn workload and a check against
single-process generation:

  python -m examples.pd.routed run --prefill-servers 2 --decode-servers 2 --check

What happens to one request (POST /generate on the router):
1. The router cuts the prompt into page-sized blocks with chained keys and
   asks the conductor for a decision: a prefill server, a decode server and,
   when the best prefix holder is busier than moving its pages costs, the
   holder to fetch the prefix from (the conductor's estimates: a prefill
   time model fitted online from what the servers report, the queue it
   routed there, and a kvflow peer's `estimate()` for the move). Rejected:
   HTTP 429 (503 without servers).
2. It forwards the request to the decode server, naming the prefill server,
   its bootstrap, and the prefix to fetch. The decode server allocates pages
   and asks the prefill server to compute (serve.py's decode path).
3. The prefill server first fetches the prefix, if told to: it leases the
   pages from the holder (POST /lease pins them there) and reads them, every
   layer's K and V of every page, with one kvflow read from the holder's
   engine; they join its own prefix cache (a replica). Then it computes only
   the part of the prompt its cache does not hold (`Model.prefill(...,
   cached=)`), streaming every layer's K/V, cached prefix included, to the
   decode server as it goes, and caches the prompt's full pages.
4. The router reports back to the conductor what happened (the move
   landed, the prefill ended with what it evicted, the decode ended), and
   answers with the tokens and where their prefix came from.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np

import kvflow
from kvflow.conductor import (
    Conductor, Decision, DecodeModel, InstanceSpec, PeerTransferModel, PrefillModel, Rejected, Request, Role,
)
from kvflow.conductor.online import OnlineFit
from kvflow.conductor.blocks import block_keys
from kvflow.connector import DisaggregationMode, KVManager, KVPoll, KVSender

try:                                        # run as a module or as a script
    from examples.pd import serve
    from examples.pd.model import KVPool
    from examples.pd.prefix_cache import PrefixCache
except ImportError:                         # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from examples.pd import serve
    from examples.pd.model import KVPool
    from examples.pd.prefix_cache import PrefixCache


# ---------------------------------------------------------------- prefill with a prefix cache

#: Seconds a prefix lease pins its pages at most (a reader reads in milliseconds).
LEASE_S = 60.0


def region_names(layers: int) -> list[str]:
    return [f"k{i}" for i in range(layers)] + [f"v{i}" for i in range(layers)]


class PrefillState:
    """A prefill server's model, pool, prefix cache and replication engine
    (a kvflow engine of its own with every K/V buffer registered, which
    other prefill servers read prefixes from)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.worker = serve.Worker(args)
        self.pool: KVPool = self.worker.pool
        self.cache = PrefixCache(self.pool, args.cache_pages)
        self.engine: kvflow.Engine | None = None
        self.peers: dict[str, kvflow.Peer] = {}
        self.leases: dict[int, tuple[list[int], float]] = {}   # id -> (keys pinned, expiry)
        self.lease_ids = itertools.count(1)
        self.lock = asyncio.Lock()           # the pool allocator and the cache are not shared safely
        self.turn = asyncio.Lock()           # one forward pass at a time, in arrival order

    async def start(self, args: argparse.Namespace) -> None:
        self.engine = kvflow.Engine(listen=f"{args.host}:0", protocols=serve.protocols(args.protocol))
        await self.engine.start()
        for name, t in zip(region_names(self.pool.config.num_layers), self.pool.buffers()):
            self.engine.register((t.data_ptr(), t.numel() * t.element_size()), name=name)

    async def peer(self, address: str) -> kvflow.Peer:
        p = self.peers.get(address)
        if p is None:
            assert self.engine is not None
            p = self.peers[address] = await self.engine.connect(address)
        return p

    async def fetch(self, http: Any, source: str, keys: list[int], wait_s: float = 0.0) -> tuple[list[int], list[int]]:
        """Lease the pages of `keys` on prefill server `source` and read
        them into pages of our own; returns (keys fetched, our pages), the
        prefix of `keys` the source had. The source may be computing some
        of them still (the conductor fetches what requests queued there
        compute): until `wait_s` has passed, a lease that does not hold
        them all is given back and asked again."""
        until = time.monotonic() + wait_s
        while True:
            async with http.post(f"http://{source}/lease", json={"keys": keys}) as r:
                lease = await r.json()
            if len(lease["pages"]) == len(keys) or time.monotonic() >= until:
                break
            async with http.post(f"http://{source}/unlease", json={"lease": lease["lease"]}) as r:
                await r.read()
            await asyncio.sleep(0.005)
        try:
            n = len(lease["pages"])
            if n == 0:
                return [], []
            async with self.lock:
                mine = self.cache.alloc(n)
            try:
                peer = await self.peer(lease["engine"])
                pb = self.pool.page_bytes
                local, remote = [], []
                for name, t in zip(region_names(self.pool.config.num_layers), self.pool.buffers()):
                    base_l, base_r = t.data_ptr(), peer.region(name).addr
                    for src_page, dst_page in zip(lease["pages"], mine):
                        local.append(base_l + dst_page * pb)
                        remote.append(base_r + src_page * pb)
                # One batch: every layer's K and V of every page.
                await peer.read(local, remote, [pb] * len(local), timeout=30.0)
            except BaseException:
                async with self.lock:
                    self.pool.free(mine)
                raise
            return keys[:n], mine
        finally:
            try:
                async with http.post(f"http://{source}/unlease", json={"lease": lease["lease"]}) as r:
                    await r.read()
            except Exception as e:      # the source expires the lease on its own
                print(f"unlease {lease['lease']} at {source}: {e!r}", file=sys.stderr)


async def prefill_server(args: argparse.Namespace) -> None:
    import aiohttp
    from aiohttp import web
    st = PrefillState(args)
    await st.start(args)
    w, pool, cache = st.worker, st.pool, st.cache
    mgr = KVManager(serve.pool_args(pool), DisaggregationMode.PREFILL, bootstrap_addr=args.bootstrap,
                    listen=f"{args.host}:0", protocols=serve.protocols(args.protocol))
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout))
    ps = pool.page_size

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        room, tokens = int(body["room"]), [int(t) for t in body["tokens"]]
        keys = block_keys(tokens, ps)
        t0 = time.perf_counter()
        moved = 0
        fetched: list[int] = []
        fetch = body.get("fetch")
        if fetch:
            # The prefix the conductor told us to replicate: it joins our
            # cache (pinned until this request has matched it) before the
            # prompt is matched. A fetch that fails costs only the compute.
            try:
                fetched, mine = await st.fetch(http, fetch["from"], [int(k) for k in fetch["keys"]],
                                               float(fetch.get("wait_s", 0.0)))
            except Exception as e:
                print(f"prefill room {room}: fetching the prefix from {fetch['from']} failed: {e!r}",
                      file=sys.stderr)
            else:
                async with st.lock:
                    dup = cache.insert(fetched, mine)     # pinned until matched below
                    pool.free(dup)          # blocks cached meanwhile: nobody reads these copies
                moved = len(fetched) - len(dup)
        fetch_s = time.perf_counter() - t0
        sender = KVSender(mgr, args.bootstrap, room)
        full = len(tokens) // ps
        # One prefill at a time, in arrival order (asyncio.Lock wakes its
        # waiters in order): the prompt is matched against the cache when
        # its turn comes, so blocks that requests ahead of it computed count,
        # as the conductor assumed when it routed it here.
        async with st.turn:
            async with st.lock:
                hit = cache.acquire(keys)
                cache.release(fetched)
                # Whole pages only, and never the last token (it gives the
                # first output token): the page holding it is computed from its start.
                hit_used = min(len(hit), (len(tokens) - 1) // ps)
                if hit_used < len(hit):
                    cache.release(keys[hit_used:len(hit)])
                    hit = hit[:hit_used]
                cached = hit_used * ps
                new: list[int] = []
                try:
                    new = cache.alloc(pool.pages_for(len(tokens)) - len(hit))
                    slot = pool.alloc_slot()
                except Exception as e:
                    cache.release(keys[:len(hit)])
                    pool.free(new)
                    sender.abort()
                    sender.clear()
                    return web.json_response({"room": room, "state": "Failed", "error": f"no room: {e!r}",
                                              "evicted": cache.take_evicted()}, status=503)
            pages = np.array(hit + new, dtype=np.int32)
            sender.init(len(pages), aux_index=slot)

            def forward() -> tuple[int, float]:
                t1 = time.perf_counter()
                first = w.model.prefill(tokens, pool, pages, on_layer=lambda i: sender.send_layer(i, pages),
                                        cached=cached)
                pool.set_aux(slot, first_token=first, prompt_len=len(tokens))
                sender.finish()
                return first, time.perf_counter() - t1
            try:
                first, compute_s = await w.run(forward)
                ok = True
            except Exception as e:
                sender.abort()
                first, compute_s, ok = -1, 0.0, False
                print(f"prefill room {room}: {e!r}", file=sys.stderr)
            own = list(new)
            pinned = keys[:len(hit)]
            if ok:
                # The prompt's full pages join the cache as soon as they are
                # computed (the next request in line may reuse them), pinned
                # until the decode server has them all.
                async with st.lock:
                    fresh = keys[len(hit):full]
                    not_taken = set(cache.insert(fresh, new[:full - len(hit)]))
                    pinned = keys[:full]
                own = [p for p in new[:full - len(hit)] if p in not_taken] + new[full - len(hit):]
        try:
            state = await sender.wait(args.request_timeout) if ok else KVPoll.Failed
        except Exception as e:
            state = KVPoll.Failed
            print(f"prefill room {room}: {e!r}", file=sys.stderr)
        finally:
            sender.clear()
        async with st.lock:
            cache.release(pinned)
            pool.free(own)
            pool.free_slot(slot)
            evicted = cache.take_evicted()
        reply = {"room": room, "state": state.name, "first_token": first, "prefill_compute_s": compute_s,
                 "fetch_s": fetch_s, "cached_tokens": cached, "computed_tokens": len(tokens) - cached,
                 "moved_blocks": moved, "fetched_blocks": len(fetched), "evicted": evicted, "cache_pages": len(cache),
                 "bytes": sender.metric.transfer_total_bytes, "entries": sender.metric.entries,
                 "layer_transfer_s": None}
        if state is KVPoll.Failed:
            reply["error"] = str(sender.error)
        return web.json_response(reply, status=200 if state is KVPoll.Success else 502)

    def expire_leases(now: float) -> None:
        """Leases whose reader never said it was done (it died, or its
        unlease was lost) release their pins after LEASE_S."""
        for lid in [lid for lid, (_, until) in st.leases.items() if until < now]:
            cache.release(st.leases.pop(lid)[0])

    async def lease(request: web.Request) -> web.Response:
        keys = [int(k) for k in (await request.json())["keys"]]
        async with st.lock:
            now = time.monotonic()
            expire_leases(now)
            pages = cache.acquire(keys)
            lid = next(st.lease_ids)
            st.leases[lid] = (keys[:len(pages)], now + LEASE_S)
        assert st.engine is not None
        return web.json_response({"lease": lid, "pages": pages, "engine": st.engine.address})

    async def unlease(request: web.Request) -> web.Response:
        lid = int((await request.json())["lease"])
        async with st.lock:
            held = st.leases.pop(lid, None)
            if held is not None:
                cache.release(held[0])
            expire_leases(time.monotonic())
        return web.json_response({"ok": held is not None})

    async def info(_: web.Request) -> web.Response:
        assert st.engine is not None
        return web.json_response({"engine": st.engine.address, "page_bytes": pool.page_bytes,
                                  "page_size": ps, "layers": pool.config.num_layers, "cache_pages": len(cache)})

    try:
        await serve.serve(args, [("POST", "/prefill", prefill), ("POST", "/lease", lease),
                                 ("POST", "/unlease", unlease), ("GET", "/info", info)], mgr)
    finally:
        await http.close()
        assert st.engine is not None
        await st.engine.close()


# ---------------------------------------------------------------- the router

def parse_instances(items: list[str], with_bootstrap: bool) -> dict[str, tuple[str, str]]:
    """NAME=HTTP[@BOOTSTRAP] items -> {name: (http, bootstrap)}."""
    out: dict[str, tuple[str, str]] = {}
    for item in items:
        name, _, rest = item.partition("=")
        http, _, boot = rest.partition("@")
        if not name or not http or (with_bootstrap and not boot):
            raise SystemExit(f"bad instance {item!r}: want NAME=HOST:PORT{'@BOOTSTRAP' if with_bootstrap else ''}")
        out[name] = (http, boot)
    return out


class Router:
    """The conductor in front of the servers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prefill = parse_instances(args.prefill, True)
        self.decode = parse_instances(args.decode, False)
        self.engine: kvflow.Engine | None = None
        self.peers: dict[str, kvflow.Peer] = {}
        self.conductor: Conductor | None = None
        self.page_size = args.page_size
        self.ids = itertools.count(1)

    async def start(self, http: Any) -> None:
        # The router's own engine, connected to each prefill server's
        # replication engine: its provider's estimate() is the transfer
        # time model for moves (same host, same provider as between them).
        self.engine = kvflow.Engine(protocols=serve.protocols(self.args.protocol))
        await self.engine.start()
        page_bytes = block_bytes = 0
        for name, (addr, _) in self.prefill.items():
            async with http.get(f"http://{addr}/info") as r:
                info = await r.json()
            self.peers[name] = await self.engine.connect(info["engine"])
            page_bytes = info["page_bytes"]
            block_bytes = page_bytes * 2 * info["layers"]     # one block: every layer's K and V page
        self.fit = OnlineFit(PrefillModel(linear_s=2e-4, attention_s=2e-8, overhead_s=0.01, load_s_per_token=0.0),
                             DecodeModel())
        self.conductor = Conductor(
            prefill_model=self.fit.prefill,
            kv_bytes_per_token=max(1, block_bytes // self.page_size),
            links=lambda src, dst: PeerTransferModel(self.peers[src].estimate, entry_bytes=page_bytes),
            slo_ttft_s=self.args.slo_ttft)
        for name in self.prefill:
            self.conductor.register(InstanceSpec(name, Role.PREFILL, cache_blocks=self.args.cache_pages))
        for name in self.decode:
            self.conductor.register(InstanceSpec(name, Role.DECODE))

    def learn(self, tokens: int, cached: int, seconds: float) -> None:
        """Refit the prefill time model to what the servers measured (their
        compute time: a sample whatever else was in flight)."""
        assert self.conductor is not None
        self.conductor.prefill_model = self.fit.add_prefill(tokens, cached, seconds)

    async def generate(self, http: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        c = self.conductor
        assert c is not None
        tokens = [int(t) for t in body.get("tokens") or []]
        max_new = int(body.get("max_new_tokens", 16))
        if not tokens or max_new < 1:
            return 400, {"error": "need tokens and max_new_tokens >= 1"}
        rid = f"r{next(self.ids)}"
        req = Request(rid, len(tokens), tuple(block_keys(tokens, self.page_size)), 0, self.page_size)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        dec = c.route(req, t0)
        if isinstance(dec, Rejected):
            return dec.http_status, {"error": dec.detail, "reason": dec.reason.value}
        assert isinstance(dec, Decision)
        paddr, boot = self.prefill[dec.prefill]
        extra: dict[str, Any] = {}
        if dec.prefix_source is not None:
            # Only the blocks the conductor moves: the rest of the prefix is
            # in the prefill server's cache already.
            # (wait_s: requests queued there are still computing some of
            # them; the conductor's estimate of when they are done, with slack)
            wait = 2.0 * dec.est_source_wait_s + 0.5 if dec.est_source_wait_s > 0 else 0.0
            extra["fetch"] = {"from": self.prefill[dec.prefix_source][0], "keys": list(dec.blocks_to_move),
                              "wait_s": wait}
        try:
            async with http.post(f"http://{self.decode[dec.decode][0]}/generate",
                                 json={"tokens": tokens, "max_new_tokens": max_new, "prefill": paddr,
                                       "bootstrap": boot, "prefill_request": extra}) as r:
                reply = await r.json()
                status = r.status
        except Exception as e:
            c.forget(rid)
            return 502, {"error": f"decode server {dec.decode}: {e!r}"}
        pinfo = reply.get("prefill") or {}
        now = loop.time()
        evicted = [int(k) for k in pinfo.get("evicted", [])]
        if evicted:
            c.on_evict(dec.prefill, evicted)
        if status != 200:
            c.forget(rid)
            return status, reply
        # The router hears of each stage only with the reply: it reports
        # them at the times the servers measured (the conductor's queue
        # estimate for the prefill server is high until then).
        t_kv = t0 + float(reply.get("ttft_s", now - t0))
        c.on_transfer_done(rid, t0 + float(pinfo.get("fetch_s", 0.0)), pinfo.get("fetched_blocks"))
        c.on_prefill_done(rid, t_kv)
        c.admit_decode(rid, t_kv)
        c.on_decode_done(rid, now, max_new)
        self.learn(len(tokens), int(pinfo.get("cached_tokens", 0)), float(pinfo.get("prefill_compute_s", 0.0)))
        reply["route"] = {"prefill": dec.prefill, "decode": dec.decode, "prefix_source": dec.prefix_source,
                          "moved_blocks": len(dec.blocks_to_move), "cached_blocks": dec.cached_blocks,
                          "est_ttft_s": dec.est_ttft_s}
        return 200, reply


async def router_server(args: argparse.Namespace) -> None:
    import aiohttp
    from aiohttp import web
    router = Router(args)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout))
    await router.start(http)

    async def generate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON"}, status=400)
        status, reply = await router.generate(http, body)
        return web.json_response(reply, status=status)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def stats(_: web.Request) -> web.Response:
        assert router.conductor is not None
        s = router.conductor.stats
        return web.json_response({"routed": s.routed, "rejected": s.rejected, "blocks": s.blocks,
                                  "reused_blocks": s.reused_blocks, "moved_blocks": s.moved_blocks,
                                  "moved_bytes": s.moved_bytes})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"router serving on {args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await http.close()
        assert router.engine is not None
        await router.engine.close()


# ---------------------------------------------------------------- run everything

class RoutedCluster(serve.ServerGroup):
    """Bootstraps, prefill servers (with prefix caches), decode servers and
    the router, as child processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        flags = serve.model_flags(args)
        self.prefill: list[str] = []
        self.decode: list[str] = []
        self.router_args: list[str] = []
        for i in range(args.prefill_servers):
            bport, pport = serve.free_port(), serve.free_port()
            self.spawn("examples.pd.routed", ["bootstrap", "--port", str(bport)])
            self.spawn("examples.pd.routed", ["prefill", "--port", str(pport), "--bootstrap", f"127.0.0.1:{bport}",
                                              "--cache-pages", str(args.cache_pages)] + flags)
            self.prefill.append(f"127.0.0.1:{pport}")
            self.router_args += ["--prefill", f"p{i}=127.0.0.1:{pport}@127.0.0.1:{bport}"]
        for i in range(args.decode_servers):
            dport = serve.free_port()
            self.spawn("examples.pd.serve", ["decode", "--port", str(dport)] + flags)
            self.decode.append(f"127.0.0.1:{dport}")
            self.router_args += ["--decode", f"d{i}=127.0.0.1:{dport}"]
        self.router = f"127.0.0.1:{serve.free_port()}"

    async def start(self, timeout: float = 180.0) -> None:
        """Wait for the servers, then start the router (it asks each
        prefill server for its replication engine on start-up)."""
        await self.wait_healthy(self.prefill + self.decode, timeout)
        a = self.args
        self.spawn("examples.pd.routed", ["router", "--port", self.router.rsplit(":", 1)[1],
                                          "--page-size", str(a.page_size), "--cache-pages", str(a.cache_pages),
                                          "--protocol", a.protocol, "--request-timeout", str(a.request_timeout)]
                   + self.router_args)
        await self.wait_healthy([self.router], timeout)

    async def generate(self, tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
        return await self.post_generate(self.router, tokens, max_new_tokens)

    async def stats(self) -> dict[str, Any]:
        import aiohttp
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{self.router}/stats") as r:
                return await r.json()


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """`--sessions` multi-turn conversations of `--turns` turns: each turn's
    prompt is the previous prompt plus new tokens (what the open traces'
    hash_ids describe)."""
    rng = random.Random(args.seed)
    vocab = serve.model_config(args).vocab_size
    system = [rng.randrange(vocab) for _ in range(args.prompt_tokens // 2)]    # shared by every session
    out = []
    for _ in range(args.sessions):
        prompt = system + [rng.randrange(vocab) for _ in range(rng.randint(16, args.prompt_tokens // 2))]
        turns = [list(prompt)]
        for _ in range(args.turns - 1):
            prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
            turns.append(list(prompt))
        out.append(turns)
    return out


async def run(args: argparse.Namespace) -> int:
    cluster = RoutedCluster(args)
    try:
        await cluster.start()
        sessions = conversations(args)
        results: list[tuple[list[int], dict[str, Any]]] = []
        t0 = time.perf_counter()
        for turn in range(args.turns):          # sessions concurrently, turns in order
            replies = await asyncio.gather(*(cluster.generate(s[turn], args.max_new_tokens) for s in sessions))
            results += [(s[turn], r) for s, r in zip(sessions, replies)]
        wall = time.perf_counter() - t0
        print(f"\n{len(results)} requests ({args.sessions} sessions x {args.turns} turns) through the router in"
              f" {wall:.2f} s: {args.prefill_servers} prefill + {args.decode_servers} decode servers")
        print(f"{'prompt':>6} {'prefill':>7} {'from':>5} {'moved':>5} {'cached':>6} {'computed':>8} "
              f"{'compute ms':>10} {'ttft ms':>8}  tokens")
        for prompt, r in results:
            p, rt = r["prefill"], r["route"]
            print(f"{len(prompt):>6} {rt['prefill']:>7} {rt['prefix_source'] or '-':>5} {p['moved_blocks']:>5} "
                  f"{p['cached_tokens']:>6} {p['computed_tokens']:>8} {p['prefill_compute_s'] * 1e3:>10.1f} "
                  f"{r['ttft_s'] * 1e3:>8.1f}  {r['tokens'][:6]}")
        print("router:", json.dumps(await cluster.stats()))
        if args.check:
            return serve.check_against_reference(args, [(p, r["tokens"]) for p, r in results])
        return 0
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["bootstrap", "prefill", "router", "run"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bootstrap", default="127.0.0.1:8998", help="prefill: its bootstrap server")
    ap.add_argument("--prefill", action="append", default=[], help="router: NAME=HTTP@BOOTSTRAP (repeat)")
    ap.add_argument("--decode", action="append", default=[], help="router: NAME=HTTP (repeat)")
    serve.add_model_args(ap, threads=1)
    ap.add_argument("--cache-pages", type=int, default=1024, help="prefill: pages its prefix cache may keep")
    ap.add_argument("--slo-ttft", type=float, default=30.0, help="router: TTFT SLO (s)")
    ap.add_argument("--prefill-servers", type=int, default=2, help="run")
    ap.add_argument("--decode-servers", type=int, default=2, help="run")
    ap.add_argument("--sessions", type=int, default=3, help="run: concurrent conversations")
    ap.add_argument("--turns", type=int, default=3, help="run: turns per conversation")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="run: first-turn prompt size")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--check", action="store_true", help="run: compare with single-process generation")
    args = ap.parse_args(argv)
    role = {"bootstrap": serve.bootstrap_server, "prefill": prefill_server, "router": router_server, "run": run}
    return asyncio.run(role[args.role](args)) or 0


if __name__ == "__main__":
    sys.exit(main())
