"""A pool member in a process of its own (tests/test_store_process.py):
mounts a segment with the given master, puts one object whose bytes come
from a seed, prints one JSON line once ready, and serves until stdin
closes. Optional after the seed: the client's timeout (s), its segment's
name."""
import asyncio
import json
import sys

import numpy as np

from kvflow.store import StoreClient


async def main(master: str, segment_size: int, key: str, size: int, seed: int, timeout: float = 10.0,
               name: str | None = None) -> None:
    async with StoreClient(master, segment_size=segment_size, protocols=("tcp",), timeout=timeout,
                           segment_name=name) as c:
        data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        reg = c.register_buffer(data)
        n = await c.put_from(key, reg.addr, size)
        print(json.dumps({"ready": True, "client": c.client_id, "segment": c.segment_id,
                          "engine": c.engine.address, "replicas": n}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    m, seg, key, size, seed = sys.argv[1:6]
    extra = sys.argv[6:]        # optional: the client's timeout, its segment's name
    asyncio.run(main(m, int(seg), key, int(size), int(seed), float(extra[0]) if extra else 10.0,
                     extra[1] if len(extra) > 1 else None))
