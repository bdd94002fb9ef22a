"""The local provider falls back to tcp, with a logged reason, when the
kernel does not let the initiator use process_vm_writev on the target.

The initiator is a child process that drops to uid `nobody` after importing
kvflow: it may not ptrace (hence not process_vm_readv/writev) our root-owned
process, which is exactly the situation of two services run by different
users on one host."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import pytest

import kvflow

from _batches import bounded

CHILD = r"""
import asyncio, json, logging, os, sys
import numpy as np
import kvflow

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("kvflow").addHandler(Keep())
logging.getLogger("kvflow").setLevel(logging.INFO)

os.setgroups([]); os.setgid(65534); os.setuid(65534)      # now "nobody"
address, raddr = sys.argv[1], int(sys.argv[2])

async def main():
    out = {}
    async with kvflow.Engine(protocols=("local",)) as eng:
        try:
            await eng.connect(address)
            out["local_only"] = "connected"
        except kvflow.ProviderUnavailableError as e:
            out["local_only"] = str(e)
    async with kvflow.Engine() as eng:                       # auto: local, else tcp
        src = np.frombuffer(b"fallback works!!" * 256, dtype=np.uint8).copy()
        s = eng.register(src)
        peer = await eng.connect(address)
        await peer.write([s.addr], [raddr], [src.nbytes])
        out["transport"] = peer.transport
    out["log"] = records
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start an initiator as another user")
async def test_local_falls_back_to_tcp_when_not_permitted():
    async with kvflow.Engine() as target:
        buf = np.zeros(1 << 16, dtype=np.uint8)
        region = target.register(buf, name="rw")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, target.address, str(region.addr),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        out, err = await bounded(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        result = json.loads(out)
        # local only: a typed error that says why
        assert "not permitted" in result["local_only"], result
        # auto: tcp, the reason logged, and the bytes landed
        assert result["transport"] == "tcp"
        assert any("local provider unavailable" in m and "not permitted" in m for m in result["log"]), result
        assert bytes(buf[:4096]) == b"fallback works!!" * 256
