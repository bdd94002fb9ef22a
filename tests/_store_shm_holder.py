"""A holder in a process of its own for tests/test_store_shmseg.py: mounts
a segment with the given master on an engine that may use kvflow's
same-host transport (protocols=None: its segment in shared memory, served
to same-host readers, unless KVFLOW_STORE_SHM=0), prints one JSON line
once ready, and serves until stdin closes."""
import asyncio
import json
import sys

from kvflow.store import StoreClient


async def main(master: str, segment_size: int) -> None:
    async with StoreClient(master, segment_size=segment_size, local_buffer_size=0) as c:
        print(json.dumps({"ready": True, "client": c.client_id, "segment": c.segment_id,
                          "engine": c.engine.address}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
