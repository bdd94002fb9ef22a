"""NIXL's Python API (`nixl._api`, the `nixl._bindings` names API-level code
touches, `nixl._utils`, `nixl.logging`), backed by kvflow.

Code written for NIXL runs unchanged with the stand-in `nixl` package on
its path::

    PYTHONPATH=$(python -m kvflow.compat.nixl.shim) python their_script.py

or by importing `kvflow.compat.nixl` in place of `nixl`. Each `nixl_agent`
is one kvflow Engine on its own event-loop thread; agents exchange metadata
(`get_agent_metadata` / `add_remote_agent`, or through the metadata
listener), then transfers are kvflow batches over whichever provider
reaches the peer (same process: memcpy; same host: process_vm_writev;
else rdma or tcp).

Differences from NIXL 1.5 (every one known):
- Backends: the one plugin is "UCX" (what NIXL code asks for); kvflow picks
  the transport per peer, so "UCX" means local, tcp or rdma here. Other
  names (GDS, POSIX, OBJ, UCCL, ...) are not available:
  `create_backend` raises nixlNotFoundError, as NIXL does for a missing
  plugin.
- Memory: DRAM, and VRAM where CUDA is usable on this machine (kvflow's
  GPU paths: a direct or CUDA-IPC copy on one host, else staged through
  pinned host memory; docs/gpu.md; built, not yet run on a GPU). VRAM
  without a usable CUDA driver, FILE, BLOCK and OBJ descriptors raise
  nixlNotSupportedError when registered or transferred; `prep_mem_view`
  raises it too.
- Metadata is kvflow's (an agent's name and its engine's address; the
  registered memory comes from the engine's handshake), so kvflow agents
  and NIXL agents do not talk to each other. The listener's frames are
  kvflow's own as well.
- Metadata without an ip_addr goes through etcd (NIXL_ETCD_ENDPOINTS: the
  first endpoint; kvflow's etcd store, keys under kvflow/engines/nixl/,
  kept for an hour unless sent again), with labels for partial metadata.
  An invalidation removes the agent's keys, but agents that loaded them
  keep them (there is no watch). Without either, those calls raise
  nixlInvalidParamError. Partial metadata adds the listed memory to what
  the peer knows.
- The engine listens on 127.0.0.1, or on KVFLOW_NIXL_HOST: set it to an
  address other hosts reach for agents on several hosts. The metadata
  listener binds 0.0.0.0 as NIXL's does, and prints
  "MD listener is listening on port N".
- `transfer()` returns "DONE" when the batch completed inside the post
  (a small same-host write), else "PROC", as NIXL does. Reposting a
  transfer still in progress raises nixlRepostActiveError. Strided (Nx5)
  descriptor arrays raise nixlNotSupportedError.
- Prepared lists are kvflow.Blocks (engine.blocks / peer.blocks) and
  make_prepped_xfer picks from their kvflow.Prepared pair, merging adjacent
  descriptors unless skip_desc_merge (NIXL merges too); a descriptor of
  length 0 is refused at prep_xfer_dlist (nixlInvalidParamError).
- `estimate_xfer_cost` is the provider's idle-link estimate.
- Telemetry (`get_xfer_telemetry`, when NIXL_TELEMETRY_ENABLE or
  capture_telemetry turns it on) is measured per post; no telemetry sink
  is written (NIXL_TELEMETRY_DIR is not read).
- `_bindings.nixlAgent` is kvflow's agent core, with the methods,
  arguments and return values of NIXL's bindings (NIXL's
  test_nixl_bindings.py runs on it); the strided prepXferDlist overload
  (an Nx5 array) is not there.
- Registration: descriptor lists, (address, length, device ID, metadata)
  tuples or an Nx3 integer array with a mem_type, a contiguous tensor, or
  a list or tuple of them on one device, as NIXL takes them. Input that
  makes no registration list raises nixlInvalidParamError in
  register_memory and query_memory (NIXL's fails later with a TypeError);
  an array of another dtype than an integer one, or with a negative value,
  raises ValueError. Registering memory that overlaps memory already
  registered by the agent (the same buffer twice, too) raises
  nixlInvalidParamError; NIXL registers it again.
- Descriptor lists also take arrays of any integer dtype and any layout
  (NIXL's: uint64/int64, C-contiguous), tuples of tuples, and negative
  indices; nixlRemoteDList pickles too.
- `nixl._utils` checks its arguments (ValueError/TypeError, where NIXL's
  writes through a null address), raises MemoryError when malloc_passthru
  gets no memory (NIXL's returns 0), and verify_transfer raises
  AssertionError at the first differing byte (NIXL's is a C assert,
  compiled out of its release builds).
"""
from kvflow.compat.nixl._api import (DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config, nixl_backend_handle,
                                     nixl_prepped_dlist_handle, nixl_thread_sync_t, nixl_xfer_handle)
from kvflow.compat.nixl.shim import shim_path

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
           "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle", "shim_path"]
