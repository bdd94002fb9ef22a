"""How a MooncakeDistributedStore joins the pool and leaves it (store.py's
setup() and close()): the engine it runs on, its SSD tier's options from
Mooncake's, Mooncake's human-readable sizes, and the shutdown its
finalizer runs."""
from __future__ import annotations

import logging
import os
import random
import re
from typing import Any

from kvflow.config import env_str
from kvflow.engine.thread import EngineThread
from kvflow.errors import InvalidArgumentError, KVFlowError
from kvflow.store import StoreClient

from .codes import PROTOCOLS

__all__ = ["PORT_RANGE", "attach_root_fs", "engine_thread", "shutdown", "size_value", "ssd_options"]

log = logging.getLogger("kvflow.compat.mooncake")

# Mooncake picks the store's transfer-engine port in this range when
# local_hostname has none (its test checks the range).
PORT_RANGE = (12300, 14300)


def shutdown(thread: EngineThread, client: StoreClient, buffers: dict, own_thread: bool) -> None:
    """close()'s work, also run by the store's finalizer: the client leaves
    the pool on its loop, then the engine thread stops (or, when the engine
    was a TransferEngine's, the buffers registered here are deregistered)."""
    try:
        thread.call(client.close(), timeout=30)
        if not own_thread:
            for region in buffers.values():
                thread.call_sync(thread.engine.deregister, region)
    except Exception as e:  # noqa: BLE001 - closing goes on
        log.debug("kvflow.compat.mooncake: close: %s", e)
    if own_thread:
        thread.close()


def ssd_options(path: str) -> dict:
    """StoreClient's SSD options from Mooncake's: the directory is
    `ssd_offload_path`, else $MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, else
    Mooncake's default /data/file_storage; the capacity
    $MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES, else 90% of the free space
    there now (Mooncake's default limit is 2 TB whatever the disk holds).
    Offload is "eager", as Mooncake's enable_ssd_offload (every put is
    queued for the SSD at put end); $KVFLOW_SSD_OFFLOAD=evict copies only
    the objects nearest eviction (Mooncake's master-side offload_on_evict)."""
    path = str(path or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH") or "/data/file_storage")
    limit = os.environ.get("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES")
    if limit is not None:
        cap = size_value(limit)
        if not cap:
            raise InvalidArgumentError(f"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES={limit!r} is not a size")
    else:
        try:
            os.makedirs(path, exist_ok=True)
            st = os.statvfs(path)
        except OSError as e:
            raise InvalidArgumentError(f"ssd_offload_path {path!r}: {os.strerror(e.errno)}") from None
        cap = max(int(st.f_bavail * st.f_frsize * 0.9), 1 << 20)
    mode = env_str("KVFLOW_SSD_OFFLOAD") or "eager"
    if mode not in ("eager", "evict"):
        raise InvalidArgumentError(f"KVFLOW_SSD_OFFLOAD={mode!r}: eager or evict")
    return {"ssd_path": path, "ssd_capacity": cap, "ssd_offload": mode}


async def attach_root_fs(client: StoreClient, host: str) -> None:
    root = client.root_fs_dir
    opts = ssd_options(root)
    last: Exception | None = None
    for n in range(64):
        try:
            await client.attach_ssd(os.path.join(root, f"{host}-{n}"), opts["ssd_capacity"],
                                    offload=opts["ssd_offload"])
            return
        except InvalidArgumentError as e:      # held by another client: the next one
            last = e
    raise InvalidArgumentError(f"no free SSD directory under {root}: {last}")


def size_value(value: Any) -> int | None:
    """Mooncake's try_string_to_byte_size for config-dict values: bytes, or
    "1.5 GB" / "16MB" / "64 K" (binary units), "infinite"; None if not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    s = str(value).strip()
    if s == "infinite":
        return (1 << 64) - 1
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)", s)
    if not m:
        return None
    mult = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
            "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}.get(m.group(2).upper())
    return None if mult is None else int(float(m.group(1)) * mult)


def engine_thread(engine: Any, host: str, port: str, protocol: str, devices: str) -> tuple[EngineThread, bool, str]:
    """The engine a store runs on: an initialized TransferEngine's (shared,
    not owned), else a new EngineThread listening on host:port (a port
    drawn from PORT_RANGE when none is given). Returns (thread, owned,
    hostname). InvalidArgumentError when no engine could listen."""
    if engine is not None:
        # a kvflow.compat.mooncake.TransferEngine that is initialized: its
        # engine and loop carry the store too (Mooncake's shared engine)
        thread = getattr(engine, "_thread", None)
        if not isinstance(thread, EngineThread) or thread.engine is None:
            raise InvalidArgumentError("engine must be an initialized kvflow.compat.mooncake.TransferEngine")
        return thread, False, f"{host}:{thread.engine.address.rpartition(':')[2]}"
    options: dict[str, Any] = {"protocols": PROTOCOLS[protocol]}
    if protocol == "rdma" and devices:
        options["rdma_devices"] = [d.strip() for d in devices.split(",") if d.strip()]
    # SystemRandom: the host application may have seeded `random` (vLLM
    # seeds it with --seed), and two processes must not draw the same ports
    ports = [int(port)] if port.isdigit() else random.SystemRandom().sample(range(*PORT_RANGE), 8)
    last: Exception | None = None
    for p in ports:
        thread = EngineThread(thread_name="kvflow-mooncake-store", listen=f"{host}:{p}", **options)
        try:
            thread.start()
        except (KVFlowError, OSError) as e:       # the port is taken: try another
            last = e                # (a thread whose engine failed to start has ended itself)
            continue
        if protocol == "rdma" and thread.call_sync(lambda: thread.engine.descriptor().rdma) is None:
            # no RDMA device could be opened: tcp, as Mooncake falls back
            # (SGLang's MOONCAKE_PROTOCOL defaults to "rdma")
            log.warning("kvflow.compat.mooncake: protocol 'rdma': no RDMA device could be opened; "
                        "falling back to tcp")
            thread.close()
            thread = EngineThread(thread_name="kvflow-mooncake-store", listen=f"{host}:{p}",
                                  protocols=PROTOCOLS["tcp"])
            try:
                thread.start()
            except (KVFlowError, OSError) as e:
                raise InvalidArgumentError(f"no tcp engine could listen on {host}:{p} ({e})") from None
        return thread, True, f"{host}:{p}"
    raise InvalidArgumentError(f"no engine could listen on {host} ({last})")
