"""A reader in a process of its own (tests/test_store_leases.py): joins
the pool with no segment, reads one object once (so its connection to the
holder is made), prints one JSON line once ready, then for each line on
stdin (a key) gets it and prints {"got": size} or {"error": repr}."""
import asyncio
import json
import sys

from kvflow.errors import KVFlowError
from kvflow.store import StoreClient


async def main(master: str, key: str) -> None:
    async with StoreClient(master, segment_size=0, protocols=("tcp",), timeout=30.0) as c:
        await c.get(key)
        print(json.dumps({"ready": True, "client": c.client_id}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            try:
                print(json.dumps({"got": len(await c.get(line.strip()))}), flush=True)
            except KVFlowError as e:
                print(json.dumps({"error": repr(e)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
