"""A pool member in a process of its own (tests/test_store_process.py):
mounts a segment with the given master, puts one object whose bytes come
from a seed, prints one JSON line once ready, and serves until stdin
closes."""
import asyncio
import json
import sys

import numpy as np

from kvflow.store import StoreClient


async def main(master: str, segment_size: int, key: str, size: int, seed: int) -> None:
    async with StoreClient(master, segment_size=segment_size, protocols=("tcp",)) as c:
        data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        reg = c.register_buffer(data)
        n = await c.put_from(key, reg.addr, size)
        print(json.dumps({"ready": True, "client": c.client_id, "segment": c.segment_id,
                          "engine": c.engine.address, "replicas": n}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    m, seg, key, size, seed = sys.argv[1:]
    asyncio.run(main(m, int(seg), key, int(size), int(seed)))
