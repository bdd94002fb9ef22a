"""The conductor as the prefill/decode router of real vLLM servers.

    python -m kvflow.conductor.router --port 8000 --block-tokens 128 \\
        --prefill p0=http://127.0.0.1:8100@tcp://127.0.0.1:5557 \\
        --prefill p1=http://127.0.0.1:8101@tcp://127.0.0.1:5558 \\
        --decode d0=http://127.0.0.1:8200

It speaks what vLLM's PD proxy speaks: OpenAI ``/v1/completions`` and
``/v1/chat/completions`` in front; to the chosen prefill instance the
client's body with ``kv_transfer_params = {"do_remote_decode": true}``,
``max_tokens = 1``, no streaming; then to the chosen decode instance the
client's body with the ``kv_transfer_params`` the prefill answered (vLLM's
NixlConnector, or any connector with that protocol, moves the KV), its
answer relayed as it comes. What it adds is the choice:

- **What each instance caches** comes from the instances: with ``@ENDPOINT``
  after a prefill instance's URL the router subscribes to its KV cache
  events (vLLM's ``--kv-events-config`` ZMQ publisher, `kv_events`) and
  keeps the conductor's prefix index to what the instance stored and
  evicted. Prompts are keyed by their tokens in blocks of
  ``--block-tokens``, which must be the servers' ``--block-size``: tokenized
  here with ``--tokenizer`` (the model's folder or hub name, loaded with
  transformers' AutoTokenizer as vLLM loads it), or else by an instance
  (its ``/tokenize``: exact, but a round trip to a busy server). Without events the index holds what the
  router routed (the conductor's own bookkeeping), evicting by LRU at
  ``--cache-blocks``.
- **Time models fitted online** (`online`): every prefill that ran alone on
  its instance refits the prefill model (tokens, cached tokens, seconds),
  every streamed decode the decode model (seconds between its tokens); ``--calibrate`` measures a few prefills
  of each instance at start so that the first requests are not routed on
  the defaults.
- **Algorithm 1** (``--policy kvcache``, Mooncake's, the default) or any of
  the conductor's policies (``round_robin``, ``sglang_cache_aware``,
  ``prefix_greedy``, ...), so that rules can be compared through one router.
- **429 under overload**: with ``--reject early`` (default) a request whose
  estimated TTFT misses ``--slo-ttft``, or whose decode instance is over
  ``--slo-tbt`` now, is answered 429 before any server works on it.

- **The global KVCache pool** (``--store ADDR``, through
  ``python -m kvflow.cli.router``: the conductor imports nothing of the
  store): before routing a request the router asks a running kvflow.store
  (one ``batch_exists``, `router_pool`) how long a prefix of it the pool
  holds, under the keys the servers put their pages by (``--store-keys``:
  vLLM's MooncakeStoreConnector, SGLang HiCache or kvflow's own, see
  `pool_keys`), and the conductor weighs fetching it from the pool against
  recomputing it and against an instance that caches it. A store that does
  not answer turns the pool off with a `PoolUnavailableWarning`; the router
  serves on, and reconnects.

Not done: prefix moves between prefill instances (Algorithm 1's hot-spot
replication). vLLM cannot load a prefix from another instance's cache on
request, so the router gives the conductor no link between prefill
instances and it never plans one; the KV's stream to decode is modelled.
``GET /stats`` reports the routing, the fitted models and the event counts.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .blocks import block_keys
from .conductor import Conductor
from .estimators import DecodeModel, LinkModel, PrefillModel
from .kv_events import KVEventFeed
from .online import OnlineFit
from .policies import make_policy
from .pool_keys import SCHEMES, make_scheme
from .router_pool import PoolUnavailableWarning, RouterPool
from .types import Decision, InstanceSpec, RejectionMode, Rejected, Request, Role

__all__ = ["Instance", "PDRouter", "PoolUnavailableWarning", "prefill_body", "parse_instance", "main"]

log = logging.getLogger("kvflow.conductor.router")

# What a KV transfer costs the conductor's TBT check before any is seen:
# one host's loopback, generously.
DEFAULT_KV_LINK = LinkModel(bandwidth_Bps=2e9, latency_s=1e-3)


class NoLink:
    """Between two vLLM prefill instances: no way to move a prefix."""

    def time(self, nbytes: int) -> float:
        return math.inf if nbytes > 0 else 0.0


@dataclass
class Instance:
    name: str
    role: Role
    url: str
    events: str | None = None
    in_flight: int = 0
    routed: int = 0
    failed: int = 0
    feed: KVEventFeed | None = field(default=None, repr=False)


def parse_instance(text: str, role: Role) -> Instance:
    """``NAME=URL[@EVENTS_ENDPOINT]``; ValueError otherwise."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        raise ValueError(f"instance {text!r}: expected NAME=URL[@tcp://HOST:PORT]")
    url, _, events = rest.partition("@")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"instance {text!r}: the URL must start with http:// or https://")
    return Instance(name, role, url.rstrip("/"), events or None)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill instance gets it: one token, not
    streamed, asking to keep the KV for a remote decode (vLLM's PD proxy's)."""
    pre = dict(body)
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None}
    pre["stream"] = False
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        pre.pop(k, None)
    return pre


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class PDRouter:
    """Routes each request through one prefill and one decode instance."""

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance], *, block_tokens: int,
                 policy: str = "kvcache", rejection: RejectionMode = RejectionMode.EARLY,
                 slo_ttft_s: float = 30.0, slo_tbt_s: float = 1.0, cache_blocks: int | None = None,
                 kv_bytes_per_token: int = 2048, prefill_model: PrefillModel | None = None,
                 decode_model: DecodeModel | None = None, request_timeout_s: float = 600.0,
                 tokenizer: str | None = None, pool: RouterPool | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode instance")
        names = [i.name for i in (*prefill, *decode)]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be distinct: {names}")
        self.prefill = {i.name: i for i in prefill}
        self.decode = {i.name: i for i in decode}
        self.block_tokens = block_tokens
        self.fit = OnlineFit(prefill_model or PrefillModel(linear_s=1e-4, attention_s=1e-8, overhead_s=0.02,
                                                          load_s_per_token=0.0),
                             decode_model or DecodeModel(step_s=0.02, per_request_s=1e-3, per_context_token_s=1e-7))
        self.conductor = Conductor(policy=make_policy(policy), rejection=rejection, slo_ttft_s=slo_ttft_s,
                                   slo_tbt_s=slo_tbt_s, prefill_model=self.fit.prefill,
                                   decode_model=self.fit.decode, kv_bytes_per_token=kv_bytes_per_token,
                                   links=self._link,
                                   # the pool: its reads, and the instance's link they land over
                                   link=LinkModel(pool.read_Bps, pool.latency_s) if pool else None,
                                   pool_config=pool.pool_config(block_tokens * kv_bytes_per_token) if pool else None)
        self.pool = pool
        for i in prefill:
            # With events the instance reports its evictions: no LRU of ours.
            self.conductor.register(InstanceSpec(i.name, Role.PREFILL,
                                                 cache_blocks=None if i.events else cache_blocks))
        for i in decode:
            self.conductor.register(InstanceSpec(i.name, Role.DECODE))
        self.timeout_s = request_timeout_s
        self._tokenize_at = itertools.cycle(list(self.prefill.values()))
        self._tokenizer = None
        if tokenizer:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenize_s = 0.0       # time spent tokenizing, in total
        self._session = None
        self._runner = None
        self.url = ""
        self.served = 0
        self.rejected = 0
        self.failed = 0
        self.cached_tokens = 0      # what the prefill instances said they reused
        self.prompt_tokens = 0

    def _link(self, src: str, dst: str):
        return DEFAULT_KV_LINK if dst in self.decode else NoLink()

    # -- lifecycle -------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        import aiohttp
        from aiohttp import web

        # A new connection per request: a pooled keep-alive connection to a
        # server that was stopped past its keep-alive is closed as it resumes.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(force_close=True))
        for inst in self.prefill.values():
            if inst.events:
                inst.feed = KVEventFeed(inst.events, self.block_tokens,
                                        lambda s, r, c, name=inst.name: self._cache_changed(name, s, r, c))
                inst.feed.start()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"
        if self.pool is not None:
            await self.pool.start()     # warns and serves on if the store is down
        return self.url

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        for inst in self.prefill.values():
            if inst.feed is not None:
                await inst.feed.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def calibrate(self, lengths: Sequence[int] = (16, 128, 384, 768), seed: int = 0) -> None:
        """A few prefills of each prefill instance, one at a time, of random
        token ids (no prefix of any real prompt), to fit the prefill model
        before the first request."""
        rng = random.Random(seed)
        model = await self._model_name()
        for inst in self.prefill.values():
            for n in lengths:
                tokens = [rng.randrange(10, 200) for _ in range(n)]
                t0 = time.monotonic()
                status, reply = await self._post(inst, "/v1/completions",
                                                 {"model": model, "prompt": tokens, "max_tokens": 1})
                if status == 200:
                    self._learn_prefill(n, _cached_tokens(reply) or 0, time.monotonic() - t0, prior=True)

    async def _model_name(self) -> str:
        inst = next(iter(self.prefill.values()))
        async with self._session.get(inst.url + "/v1/models") as r:
            data = await r.json()
        return data["data"][0]["id"]

    # -- what the instances report --------------------------------------------

    def _cache_changed(self, name: str, stored: list[int], removed: list[int], cleared: bool) -> None:
        idx = self.conductor.index
        if name not in idx:
            return
        if cleared:
            self.conductor.on_evict(name, idx.cache(name).keys())
        if removed:
            self.conductor.on_evict(name, removed)
        if stored:
            idx.insert(name, stored)

    def _learn_prefill(self, tokens: int, cached: int, seconds: float, prior: bool = False) -> None:
        self.conductor.prefill_model = self.fit.add_prefill(tokens, cached, seconds, prior)

    def _idle(self) -> bool:
        return not any(i.in_flight for i in (*self.prefill.values(), *self.decode.values()))

    # -- HTTP ------------------------------------------------------------------

    async def _health(self, _request):
        from aiohttp import web

        return web.json_response({"ok": True})

    async def _stats(self, _request):
        from aiohttp import web

        c = self.conductor
        return web.json_response({
            "served": self.served, "rejected": self.rejected, "failed": self.failed,
            "tokenize_s": self.tokenize_s,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "conductor": {"routed": c.stats.routed, "blocks": c.stats.blocks, "reused_blocks": c.stats.reused_blocks,
                          "pool_blocks": c.stats.pool_blocks, "rejected": dict(c.stats.rejected)},
            "pool": self.pool.describe() if self.pool is not None else None,
            "instances": {i.name: {"role": i.role.value, "routed": i.routed, "failed": i.failed,
                                   "in_flight": i.in_flight,
                                   "index_blocks": len(c.index.cache(i.name)) if i.name in c.index else None,
                                   "events": vars(i.feed.log.counts) if i.feed else None}
                          for i in (*self.prefill.values(), *self.decode.values())},
            "models": self.fit.describe(),
        })

    async def _handle(self, request):
        import aiohttp

        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            return await self._route(request, body)
        except json.JSONDecodeError as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        except HTTPError as exc:
            return _error(exc.status, str(exc), exc.kind)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # an instance did not answer (a client that went away raises
            # ConnectionResetError, which aiohttp handles)
            self.failed += 1
            return _error(502, f"an instance did not answer: {exc!r}", "upstream_error")

    async def _route(self, request, body: dict[str, Any]):
        import aiohttp
        from aiohttp import web

        chat = request.path.endswith("/chat/completions")
        tokens = await self._tokens(body, chat)
        rid = f"kvflow-{uuid.uuid4()}"
        loop = asyncio.get_running_loop()
        req = Request(rid, max(1, len(tokens)), tuple(block_keys(tokens, self.block_tokens)),
                      output_tokens=0, block_tokens=self.block_tokens)
        c = self.conductor
        # the pool's prefix of it (None: no pool, or it did not answer)
        held = await self.pool.held(req, tokens) if self.pool is not None else None
        dec = c.route(req, loop.time(), pool=held)
        if isinstance(dec, Rejected):
            self.rejected += 1
            return _error(dec.http_status, f"{dec.reason.value}: {dec.detail}",
                          "rate_limit_exceeded" if dec.http_status == 429 else "service_unavailable")
        assert isinstance(dec, Decision)
        if self.pool is not None:
            self.pool.routed(dec)
        p, d = self.prefill[dec.prefill], self.decode[dec.decode]
        p.routed += 1
        headers = {"X-Request-Id": rid}
        path = request.path

        alone = self._idle()
        t0 = loop.time()
        try:
            status, reply = await self._post(p, path, prefill_body(body), headers)
        except BaseException:
            c.forget(rid)
            raise
        t1 = loop.time()
        if status != 200:
            c.forget(rid)
            self.failed += 1
            return _error(status, f"prefill {p.name}: {reply}", "upstream_error")
        cached = _cached_tokens(reply)
        if cached is not None:
            self.cached_tokens += cached
        self.prompt_tokens += len(tokens)
        if alone:
            # what the instance did not compute: its own prefix, and what it fetched from the pool
            known = req.cached_tokens(dec.cached_blocks + len(dec.pool_blocks))
            self._learn_prefill(len(tokens), cached if cached is not None else known, t1 - t0)
        c.on_prefill_done(rid, t1)
        late = c.admit_decode(rid, t1)
        if late is not None:
            # Its prefill is wasted: vLLM frees the blocks it held for us at its timeout.
            self.rejected += 1
            return _error(late.http_status, f"{late.reason.value}: {late.detail}", "rate_limit_exceeded")

        dec_body = dict(body)
        kv = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if kv:
            dec_body["kv_transfer_params"] = kv
        batch = d.in_flight + 1
        d.in_flight += 1
        d.routed += 1
        out_tokens = 0
        try:
            async with self._session.post(d.url + path, json=dec_body, headers=headers) as r:
                if r.status != 200:
                    text = await r.text()
                    c.forget(rid)
                    d.failed += 1
                    self.failed += 1
                    return _error(r.status, f"decode {d.name}: {text}", "upstream_error")
                resp = web.StreamResponse(status=200, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                streamed = body.get("stream") is True
                tail = b""
                first = last = 0.0       # when the first and the last streamed tokens came
                try:
                    async for chunk in r.content.iter_any():
                        await resp.write(chunk)
                        if streamed:
                            n = chunk.count(b"data: {")
                            if n:
                                last = loop.time()
                                first = first or last
                                out_tokens += n
                        else:
                            tail += chunk
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    # the decode instance failed mid-answer: the client has a
                    # truncated answer, the conductor forgets the request
                    c.forget(rid)
                    d.failed += 1
                    self.failed += 1
                    return resp
                await resp.write_eof()
        except BaseException:
            c.forget(rid)
            raise
        finally:
            d.in_flight -= 1
        t2 = loop.time()
        if streamed:
            # A decode step is what separates streamed tokens: the time to
            # the first one is the KV's transfer and the queue, not a step.
            if out_tokens >= 2 and last > first:
                self.conductor.decode_model = self.fit.add_decode(batch, len(tokens) + out_tokens // 2,
                                                                  (last - first) / (out_tokens - 1))
        else:
            try:
                out_tokens = int(json.loads(tail)["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                out_tokens = 0
        c.on_decode_done(rid, t2, out_tokens or None)
        self.served += 1
        return resp

    async def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids, as the instances tokenize it."""
        t0 = time.perf_counter()
        try:
            return await self._tokenize(body, chat)
        finally:
            self.tokenize_s += time.perf_counter() - t0

    async def _tokenize(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise HTTPError(400, "messages must be a non-empty list")
            if self._tokenizer is not None:
                try:
                    return list(self._tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
                except (ValueError, TypeError) as exc:
                    raise HTTPError(400, f"messages: {exc}") from None
            ask = {"model": body.get("model"), "messages": msgs, "add_generation_prompt": True}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return [int(t) for t in prompt]
            if not isinstance(prompt, str):
                raise HTTPError(400, "prompt must be one string or one list of token ids "
                                     "(the router routes one prompt per request)")
            if self._tokenizer is not None:
                return list(self._tokenizer(prompt)["input_ids"])
            ask = {"model": body.get("model"), "prompt": prompt}
        inst = next(self._tokenize_at)
        status, reply = await self._post(inst, "/tokenize", ask)
        if status != 200 or not isinstance(reply, dict) or "tokens" not in reply:
            raise HTTPError(status if status >= 400 else 502, f"tokenize at {inst.name}: {reply}")
        return [int(t) for t in reply["tokens"]]

    async def _post(self, inst: Instance, path: str, body: dict, headers: dict | None = None) -> tuple[int, Any]:
        inst.in_flight += 1
        try:
            async with self._session.post(inst.url + path, json=body, headers=headers) as r:
                text = await r.text()
                try:
                    data = json.loads(text)
                except ValueError:
                    data = text
                if r.status != 200:
                    inst.failed += 1
                return r.status, data
        finally:
            inst.in_flight -= 1


def _cached_tokens(reply: Any) -> int | None:
    """What vLLM says it reused of the prompt (``usage.prompt_tokens_details.
    cached_tokens``, with ``--enable-prompt-tokens-details``)."""
    try:
        details = reply["usage"]["prompt_tokens_details"]
        return int(details["cached_tokens"]) if details else None
    except (KeyError, TypeError, ValueError):
        return None


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _parse_model(text: str | None, cls):
    if not text:
        return None
    vals = [float(x) for x in text.split(",")]
    names = ("overhead_s", "linear_s", "attention_s") if cls is PrefillModel else \
        ("step_s", "per_request_s", "per_context_token_s")
    if len(vals) != 3:
        raise SystemExit(f"a model is three numbers: {','.join(names)}")
    return cls(**dict(zip(names, vals)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvflow.conductor.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME=URL[@EVENTS]", required=True)
    ap.add_argument("--decode", action="append", default=[], metavar="NAME=URL", required=True)
    ap.add_argument("--block-tokens", type=int, required=True, help="the servers' --block-size")
    ap.add_argument("--policy", default="kvcache")
    ap.add_argument("--reject", default="early", choices=[m.value for m in RejectionMode])
    ap.add_argument("--slo-ttft", type=float, default=30.0, help="seconds (429 above it)")
    ap.add_argument("--slo-tbt", type=float, default=1.0, help="seconds per output token")
    ap.add_argument("--cache-blocks", type=int, default=None, help="per prefill instance without events")
    ap.add_argument("--kv-bytes-per-token", type=int, default=2048)
    ap.add_argument("--prefill-model", help="overhead_s,linear_s,attention_s to start from")
    ap.add_argument("--decode-model", help="step_s,per_request_s,per_context_token_s to start from")
    ap.add_argument("--tokenizer", help="the model's tokenizer (folder or name): tokenize here, not at a server")
    ap.add_argument("--calibrate", action="store_true", help="time a few prefills of each instance first")
    st = ap.add_argument_group("the global KVCache pool (python -m kvflow.cli.router)")
    st.add_argument("--store", metavar="ADDR", help="a kvflow.store master: host:port, host:port,host:port "
                                                     "or etcd://host:port/cluster")
    st.add_argument("--store-keys", default="vllm", choices=SCHEMES,
                    help="how the servers name pages: vLLM's MooncakeStoreConnector, SGLang HiCache, kvflow's")
    st.add_argument("--store-model", help="vllm keys: the servers' model (path or name; default: what the "
                                          "first prefill instance's /v1/models says)")
    st.add_argument("--store-key-prefix", default="", help="vLLM's cache_prefix, SGLang's key_prefix, "
                                                           "kvflow's namespace (default kv/)")
    st.add_argument("--store-rank", default="0", help="the TP rank whose pages are looked up (SGLang MLA: mla)")
    st.add_argument("--store-hash-seed", help="vllm keys: the servers' PYTHONHASHSEED, if they set one")
    st.add_argument("--store-timeout", type=float, default=0.5, help="seconds a lookup may take")
    st.add_argument("--store-read-bandwidth", type=float, default=2e9,
                    help="bytes/s one pool node reads at (the fetch estimate)")
    st.add_argument("--store-segments", type=int, default=1, help="pool nodes a fetch spreads over")
    return ap


#: makes a started store client of the pool's address (kvflow/cli/router.py's)
StoreConnect = Callable[[str], Callable[[], Awaitable[Any]]]


async def _pool(args: argparse.Namespace, connect_store: StoreConnect, prefill: Sequence[Instance]) -> RouterPool:
    model = args.store_model
    if args.store_keys == "vllm" and not model:
        import aiohttp

        url = prefill[0].url + "/v1/models"
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                model = (await r.json())["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise SystemExit(f"--store-keys vllm: give --store-model (asking {url}: {exc!r})") from None
    try:
        scheme = make_scheme(args.store_keys, model=model, key_prefix=args.store_key_prefix,
                             rank=args.store_rank, hash_seed=args.store_hash_seed)
    except ValueError as exc:
        raise SystemExit(f"--store-keys: {exc}") from None
    return RouterPool(connect_store(args.store), scheme, address=args.store, timeout_s=args.store_timeout,
                      read_Bps=args.store_read_bandwidth, segments=args.store_segments)


async def _serve(args: argparse.Namespace, connect_store: StoreConnect | None = None) -> None:
    prefill = [parse_instance(t, Role.PREFILL) for t in args.prefill]
    pool = await _pool(args, connect_store, prefill) if args.store and connect_store else None
    router = PDRouter(prefill, [parse_instance(t, Role.DECODE) for t in args.decode],
                      block_tokens=args.block_tokens, policy=args.policy, rejection=RejectionMode(args.reject),
                      slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt, cache_blocks=args.cache_blocks,
                      kv_bytes_per_token=args.kv_bytes_per_token,
                      prefill_model=_parse_model(args.prefill_model, PrefillModel),
                      decode_model=_parse_model(args.decode_model, DecodeModel), tokenizer=args.tokenizer,
                      pool=pool)
    url = await router.start(args.host, args.port)
    try:
        if args.calibrate:
            await router.calibrate()
        print(f"kvflow router ready on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await router.close()


def main(argv: list[str] | None = None, connect_store: StoreConnect | None = None) -> int:
    """The router's command line. `connect_store`: how to reach the store
    of ``--store`` (kvflow/cli/router.py gives it; the conductor imports
    nothing of the store)."""
    args = build_parser().parse_args(argv)
    if args.store and connect_store is None:
        raise SystemExit("--store: run python -m kvflow.cli.router (the same flags), which connects the store")
    try:
        for t in args.prefill:
            parse_instance(t, Role.PREFILL)
        for t in args.decode:
            parse_instance(t, Role.DECODE)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve(args, connect_store))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
