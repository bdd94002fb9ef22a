"""The conductor's PD router with the global KVCache pool:

    python -m kvflow.cli.router --store 10.0.0.1:50051 --store-keys vllm \\
        --store-model /models/Llama-3-8B --block-tokens 128 \\
        --prefill p0=http://10.0.0.2:8100 --decode d0=http://10.0.0.3:8200

`python -m kvflow.conductor.router`'s flags, and ``--store`` connects a
kvflow.store client to the pool: it contributes no memory and only asks
``batch_exists`` (kvflow/conductor/router_pool.py). It lives here, in an
outer layer, because the conductor imports nothing of the store
(tests/test_layers.py).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvflow.conductor.router import main as router_main
from kvflow.store import StoreClient

__all__ = ["store_connect", "main"]


def store_connect(address: str, *, timeout_s: float = 5.0) -> Callable[[], Awaitable[StoreClient]]:
    """A coroutine function that returns a started client of the store at
    `address` ("host:port", "host:port,host:port" or
    "etcd://host:port/cluster"), one with no segment and no staging buffer:
    the router only looks keys up. Raises MasterUnavailableError when the
    master cannot be reached."""
    master: str | list[str] = address
    if "," in address and "://" not in address:
        master = [a.strip() for a in address.split(",") if a.strip()]

    async def connect() -> StoreClient:
        client = StoreClient(master, segment_size=0, local_buffer_size=0, protocols=("tcp",), timeout=timeout_s)
        try:
            return await client.start()
        except BaseException:
            await client.close()
            raise

    return connect


def main(argv: list[str] | None = None) -> int:
    return router_main(argv, connect_store=store_connect)


if __name__ == "__main__":
    raise SystemExit(main())
