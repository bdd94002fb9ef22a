"""Mooncake Transfer Engine's Python API, backed by kvflow.

Code written against `mooncake.engine.TransferEngine` (SGLang's and vLLM's
Mooncake connectors, Mooncake's own examples) runs on kvflow by changing one
import::

    from kvflow.compat.mooncake import TransferEngine

    engine = TransferEngine()
    engine.initialize("10.0.0.1", "P2PHANDSHAKE", "tcp", "")
    engine.register_memory(buf_ptr, buf_len)
    peer = f"10.0.0.2:{peer_rpc_port}"          # the peer's get_rpc_port()
    rc = engine.transfer_sync_write(peer, buf_ptr, peer_ptr, 4096)   # 0 or -1

Method names, argument names and order, and return conventions are
Mooncake's (checked against mooncake-transfer-engine 0.3.13): int-returning
calls give 0 on success and a negative code on failure and never raise;
failures are logged at warning level on the "kvflow.compat.mooncake" logger
and kept, as the typed kvflow exception, in `TransferEngine.last_error`.
Codes: -1 for failed transfers and invalid arguments, -3 unregistering an
address that is not registered, -7 registering memory that overlaps a
registered region, -102 `send_probe` to a peer that does not answer;
`batch_transfer_async_*` and `transfer_submit_write` return a batch id, 0 if
it could not be submitted; `transfer_check_status` returns 1 done, 0 in
flight, -1 failed, -2 timed out.

How it runs: one kvflow `Engine` on an `EngineThread` (its own event loop on
a daemon thread); all engine state is touched only on that loop, and any
number of threads may call at once. A transfer is one hand-off each way: the
caller queues its coroutine (connect if needed, then write or read) and wakes
the loop once per burst of queued calls; the loop starts it at once and,
when the batch completed, wakes the caller, which sleeps on its thread's
eventfd meanwhile. Mooncake's sync calls instead poll for completion on the
caller's thread: a core kept busy, and no wake-up at the end.

Code that imports `mooncake.engine` itself (Mooncake's own tests and
examples, SGLang's and vLLM's connectors) runs on kvflow unchanged with the
stand-in package on its path::

    PYTHONPATH=$(python -m kvflow.compat.mooncake.shim) python their_script.py

Every difference from Mooncake is listed in docs/mooncake.md.
"""
from kvflow.compat.mooncake.codes import (P2PHANDSHAKE, SUPPORT_CUDA, SUPPORT_EFA, SUPPORT_HIP,
                                          SUPPORT_INTRA_NVLINK, SUPPORT_MNNVL, SUPPORT_MUSA, Read,
                                          TransferNotify, TransferOpcode, Write)
from kvflow.compat.mooncake.engine import TransferEngine
from kvflow.compat.mooncake.shim import shim_path

__all__ = ["P2PHANDSHAKE", "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL",
           "SUPPORT_MUSA", "TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write", "shim_path"]
