"""The bootstrap server: where prefill ranks publish their engines and
decode ranks find them (HTTP, aiohttp), and its client.

Routes:
  PUT    /route   JSON rank record (dp_rank, tp_rank, tp_size, address, mla,
                  incarnation); a newer record for the same rank replaces it.
  GET    /route?dp_rank=N   {"tp_size": T, "ranks": {"0": record, ...}}; 404
                  until every rank of that dp group has registered.
  DELETE /route?dp_rank=N&tp_rank=M&address=A   a prefill rank leaving.
  GET    /health  200 "OK".
Only the address of a kvflow engine travels here; the page layouts and
page indices go engine to engine (kvflow notifications).
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from kvflow.errors import KVFlowError, PeerUnreachableError

_RANK_FIELDS = {"dp_rank": int, "tp_rank": int, "tp_size": int, "address": str,
                "mla": bool, "incarnation": int}
MAX_BODY = 64 << 10


def _import_web() -> Any:
    try:
        from aiohttp import web
    except ImportError as e:  # pragma: no cover - aiohttp is a declared extra
        raise KVFlowError("the bootstrap server needs aiohttp (pip install aiohttp)") from e
    return web


def check_record(rec: Any) -> dict[str, Any]:
    """A rank record with the right fields and types, else KVFlowError."""
    if not isinstance(rec, dict):
        raise KVFlowError("rank record is not a JSON object")
    out = {}
    for key, typ in _RANK_FIELDS.items():
        v = rec.get(key)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise KVFlowError(f"rank record field {key!r} must be {typ.__name__}")
        out[key] = v
    if not 0 <= out["tp_rank"] < out["tp_size"] <= 4096 or out["dp_rank"] < 0:
        raise KVFlowError("rank record: need 0 <= tp_rank < tp_size <= 4096 and dp_rank >= 0")
    return out


class BootstrapServer:
    """HTTP bootstrap server. `await start()` on a running loop, or
    `start_in_thread()` from plain code (SGLang starts it in a thread);
    `address` is "host:port" once started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.address = ""
        self._groups: dict[int, dict[int, dict[str, Any]]] = {}
        self._runner: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _app(self) -> Any:
        web = _import_web()
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_put("/route", self._put)
        app.router.add_get("/route", self._get)
        app.router.add_delete("/route", self._delete)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> None:
        web = _import_web()
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])   # port 0 → the bound one
        self.address = f"{self.host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self, timeout: float = 10.0) -> "BootstrapServer":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as e:  # noqa: BLE001 - reported to the starter
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.close())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvflow-bootstrap", daemon=True)
        self._thread.start()
        ready.wait(timeout)
        if errors:
            raise errors[0]
        if not self.address:
            raise KVFlowError(f"bootstrap server on {self.host}:{self.port} did not start in {timeout} s")
        return self

    def stop_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    # ------------------------------------------------------------ handlers
    async def _put(self, request: Any) -> Any:
        web = _import_web()
        try:
            rec = check_record(await request.json())
        except (KVFlowError, ValueError) as e:
            return web.Response(status=400, text=str(e))
        group = self._groups.setdefault(rec["dp_rank"], {})
        if any(r["tp_size"] != rec["tp_size"] for r in group.values() if r["tp_rank"] != rec["tp_rank"]):
            # A restarted group with another TP size replaces the old one whole.
            group.clear()
        group[rec["tp_rank"]] = rec
        return web.Response(text="OK")

    async def _get(self, request: Any) -> Any:
        web = _import_web()
        try:
            dp = int(request.query.get("dp_rank", "0"))
        except ValueError:
            return web.Response(status=400, text="dp_rank must be an integer")
        group = self._groups.get(dp, {})
        sizes = {r["tp_size"] for r in group.values()}
        if len(sizes) != 1 or len(group) != next(iter(sizes)):
            return web.Response(status=404, text=f"prefill dp group {dp} is not fully registered")
        return web.json_response({"tp_size": next(iter(sizes)),
                                  "ranks": {str(k): v for k, v in group.items()}})

    async def _delete(self, request: Any) -> Any:
        web = _import_web()
        q = request.query
        try:
            dp, tp = int(q.get("dp_rank", "")), int(q.get("tp_rank", ""))
        except ValueError:
            return web.Response(status=400, text="dp_rank and tp_rank must be integers")
        group = self._groups.get(dp, {})
        rec = group.get(tp)
        if rec is not None and rec["address"] == q.get("address"):
            del group[tp]
        return web.Response(text="OK")

    async def _health(self, request: Any) -> Any:
        return _import_web().Response(text="OK")

    def __repr__(self) -> str:
        return f"<BootstrapServer {self.address or 'not started'} groups={sorted(self._groups)}>"


class BootstrapClient:
    """The HTTP calls a KVManager makes, on the engine's loop."""

    def __init__(self, timeout: float = 5.0) -> None:
        self._timeout = timeout
        self._session: Any = None

    async def _http(self) -> Any:
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        return self._session

    async def register(self, bootstrap_addr: str, record: dict[str, Any]) -> None:
        await self._call("PUT", bootstrap_addr, json=record)

    async def unregister(self, bootstrap_addr: str, record: dict[str, Any]) -> None:
        await self._call("DELETE", bootstrap_addr, params={
            "dp_rank": str(record["dp_rank"]), "tp_rank": str(record["tp_rank"]),
            "address": record["address"]})

    async def lookup(self, bootstrap_addr: str, dp_rank: int) -> dict[str, Any] | None:
        """The prefill group's records, or None while it is not complete."""
        status, text = await self._call("GET", bootstrap_addr, params={"dp_rank": str(dp_rank)},
                                        ok=(200, 404))
        if status == 404:
            return None
        body = json.loads(text)
        ranks = {int(k): check_record(v) for k, v in body["ranks"].items()}
        return {"tp_size": int(body["tp_size"]), "ranks": ranks}

    async def _call(self, method: str, addr: str, *, ok: tuple[int, ...] = (200,),
                    **kw: Any) -> tuple[int, str]:
        import aiohttp
        session = await self._http()
        url = f"http://{addr}/route"
        try:
            async with session.request(method, url, **kw) as resp:
                text = await resp.text()
                if resp.status not in ok:
                    raise KVFlowError(f"bootstrap server {addr}: {method} /route → {resp.status} {text}")
                return resp.status, text
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise PeerUnreachableError(f"bootstrap server {addr} unreachable: {e!r}", peer=addr) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
