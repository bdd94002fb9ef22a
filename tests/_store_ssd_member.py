"""A pool member with an SSD tier in a process of its own
(tests/test_store_ssd.py): `put` puts N objects (bytes from a seed), copies
them to its SSD and prints one JSON line; `serve` only starts (adopting its
directory's files) and prints one. Both serve until stdin closes."""
import asyncio
import json
import sys

import numpy as np

from kvflow.store import StoreClient


async def main(master: str, directory: str, mode: str, n: int, size: int, seed: int) -> None:
    async with StoreClient(master, segment_size=4 << 20, protocols=("tcp",), ssd_path=directory,
                           ssd_offload="eager") as c:
        if mode == "put":
            for i in range(n):
                data = np.random.default_rng(seed + i).integers(0, 256, size, dtype=np.uint8)
                await c.put(f"ssd/{i}", data)
                await c.ssd_flush()
        print(json.dumps({"ready": True, "client": c.client_id, "adopted": c.ssd.adopted,
                          "written": c.ssd.written, "direct": c.ssd.tier.direct}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    m, d, mode, n, size, seed = sys.argv[1:]
    asyncio.run(main(m, d, mode, int(n), int(size), int(seed)))
