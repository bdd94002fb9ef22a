"""Same-process peers copy with memcpy against their copy of the target's
region table: deregister() must update that copy at once, so a write
submitted right after it (before any pushed update could arrive) is refused
and lands nowhere."""
from __future__ import annotations

import numpy as np
import pytest

import kvflow

from _batches import bounded


async def test_write_after_deregister_in_same_process_is_refused():
    async with kvflow.Engine(protocols=("local",)) as a, kvflow.Engine(protocols=("local",)) as b:
        src = np.full(1 << 20, 7, np.uint8)
        a.register(src)
        dst = np.zeros(1 << 20, np.uint8)
        region = b.register(dst)
        peer = await bounded(a.connect(b.address))
        assert peer.transport == "local"
        b.deregister(region)                      # no await: no pushed frame was read yet
        with pytest.raises(kvflow.RemoteAccessError):
            peer.write_nowait([src.ctypes.data], [region.addr], [1 << 20])
        with pytest.raises(kvflow.RemoteAccessError):
            await bounded(peer.write([src.ctypes.data], [region.addr], [4096]))
        assert not dst.any()
        region = b.register(dst)                  # and registering again makes it usable at once
        await bounded(peer.write([src.ctypes.data], [region.addr], [4096]))
        assert (dst[:4096] == 7).all() and not dst[4096:].any()
