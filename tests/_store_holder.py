"""A pool member in a process of its own that puts pages as a server
would (tests/test_router_pool.py): mounts a segment with the given master,
prints one JSON line once ready, then for each line on stdin (a JSON list
of keys) puts each key with `size` bytes and prints {"put": replicas}; it
leaves the pool when stdin closes (its pages go with it)."""
import asyncio
import json
import sys

from kvflow.store import StoreClient


async def main(master: str, segment_size: int, size: int) -> None:
    async with StoreClient(master, segment_size=segment_size, protocols=("tcp",)) as c:
        print(json.dumps({"ready": True, "client": c.client_id}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            keys = json.loads(line)
            put = await c.batch_put(keys, [bytes([i % 251]) * size for i in range(len(keys))])
            print(json.dumps({"put": [p if isinstance(p, int) else repr(p) for p in put]}), flush=True)


if __name__ == "__main__":
    m, seg, size = sys.argv[1:]
    asyncio.run(main(m, int(seg), int(size)))
