"""`nixl._api` on kvflow: `nixl_agent`, `nixl_agent_config`,
`nixl_thread_sync_t` and the handle classes, with NIXL's method names,
arguments and return conventions (see the package docstring for every
difference). The agent core is `_bindings.nixlAgent` (kvflow's, in
_agent.py), looked up when an agent is made, as NIXL's layer does."""
from __future__ import annotations

import enum
import logging
import pickle
import sys
from typing import Any, Optional, Union

import numpy as np

from kvflow.compat.nixl import _bindings as nixlBind

log = logging.getLogger("kvflow.compat.nixl")

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
           "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle"]


def _is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")          # never imports torch itself
    return torch is not None and isinstance(obj, torch.Tensor)


class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = int(nixlBind.NIXL_THREAD_SYNC_NONE)
    NIXL_THREAD_SYNC_STRICT = int(nixlBind.NIXL_THREAD_SYNC_STRICT)
    NIXL_THREAD_SYNC_RW = int(nixlBind.NIXL_THREAD_SYNC_RW)
    NIXL_THREAD_SYNC_DEFAULT = int(nixlBind.NIXL_THREAD_SYNC_DEFAULT)


class nixl_agent_config:
    """An agent's configuration (NIXL's arguments, in NIXL's order)."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False, num_threads: int = 0,
                 backends: list[str] = ["UCX"], sync_mode: Optional[nixl_thread_sync_t] = None) -> None:  # noqa: B006
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class _Handle:
    """An integer handle of the agent core, released once."""

    __slots__ = ("_agent", "_handle", "_released", "__weakref__")
    _release = ""

    def __init__(self, agent: Any, value: int) -> None:
        self._agent = agent
        self._handle = value
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            getattr(self._agent, self._release)(self._handle)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._handle}{' released' if self._released else ''}>"


class nixl_xfer_handle(_Handle):
    __slots__ = ()
    _release = "releaseXferReq"


class nixl_prepped_dlist_handle(_Handle):
    __slots__ = ()
    _release = "releasedDlistH"


nixl_backend_handle = Any


MEMS = {"DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG, "FILE": nixlBind.FILE_SEG,
        "BLOCK": nixlBind.BLK_SEG, "OBJ": nixlBind.OBJ_SEG, "cpu": nixlBind.DRAM_SEG, "cuda": nixlBind.VRAM_SEG}
OPS = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
_STATES = {int(nixlBind.NIXL_SUCCESS): "DONE", int(nixlBind.NIXL_IN_PROG): "PROC"}


def _tensor_span(t: Any) -> tuple[int, int, int, str] | None:
    """(address, bytes, device ID, memory kind) of a contiguous tensor."""
    if not t.is_contiguous():
        return None
    dev = t.get_device()
    return t.data_ptr(), t.numel() * t.element_size(), max(dev, 0), "DRAM" if dev == -1 else "VRAM"


class nixl_agent:
    """A NIXL agent on a kvflow Engine (its own event-loop thread)."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        conf = nixl_conf or nixl_agent_config()
        sync = conf.sync_mode or (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen
                                  else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = conf.enable_pthread
        cfg.useListenThread = conf.enable_listen
        cfg.listenPort = conf.port
        cfg.syncMode = sync.value
        cfg.captureTelemetry = conf.capture_telemetry
        self.agent = nixlBind.nixlAgent(agent_name, cfg)
        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, Any] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        for plugin in self.plugin_list:
            self.plugin_b_options[plugin], self.plugin_mem_types[plugin] = self.agent.getPluginParams(plugin)
        for backend in (self.plugin_list if instantiate_all and nixl_conf is None else conf.backends):
            if backend in self.plugin_list:
                self.create_backend(backend)
            else:
                log.warning("kvflow.compat.nixl: no backend %r here (kvflow provides %s): skipped",
                            backend, ", ".join(self.plugin_list))
        self.nixl_mems = MEMS
        self.nixl_ops = OPS

    # ------------------------------------------------------------ plugins and backends
    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return list(self.plugin_mem_types.get(backend, []))

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return dict(self.plugin_b_options.get(backend, {}))

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return list(self.backend_mems.get(backend, []))

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return dict(self.backend_options.get(backend, {}))

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006
        handle = self.agent.createBackend(backend, dict(initParams))
        self.backends[backend] = handle
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(handle)

    def _handles(self, backends: list[str]) -> list[Any]:
        return [self.backends[b] for b in backends] if backends else []

    # ------------------------------------------------------------ memory
    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> Optional[nixlBind.nixlRegDList]:  # noqa: B006
        descs = self._reg_descs(reg_list, mem_type, "register_memory")
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def _reg_descs(self, reg_list: Any, mem_type: Optional[str], what: str) -> nixlBind.nixlRegDList:
        """get_reg_descs, or nixlInvalidParamError naming what it takes (NIXL's
        own goes on with None and fails in its bindings with a TypeError)."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise nixlBind.nixlInvalidParamError(
                f"{what}: no registration descriptors from {type(reg_list).__name__} (it takes a nixlRegDList, "
                "(address, length, device ID, metadata) tuples or an Nx3 integer array with a mem_type, "
                "or contiguous tensors on one device)")
        return descs

    def deregister_memory(self, dereg_list: nixlBind.nixlRegDList, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list[Any]:
        descs = self._reg_descs(reg_list, mem_type, "query_memory")
        if backend not in self.backends:
            raise ValueError(f"Backend {backend!r} not found. Available backends: {list(self.backends)}")
        return self.agent.queryMem(descs, self.backends[backend])

    # ------------------------------------------------------------ transfers
    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.makeConnection(remote_agent, self._handles(backends))

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixl_prepped_dlist_handle:  # noqa: B006
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            raise nixlBind.nixlNotSupportedError("strided (Nx5) descriptor lists are not supported by "
                                                 "kvflow.compat.nixl yet")
        local = agent_name in ("", "NIXL_INIT_AGENT", b"", b"NIXL_INIT_AGENT")
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise nixlBind.nixlInvalidParamError("prep_xfer_dlist: the descriptors could not be made")
        handle = self.agent.prepXferDlist(nixlBind.NIXL_INIT_AGENT if local else agent_name, descs,
                                          self._handles(backends))
        return nixl_prepped_dlist_handle(self.agent, handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        return duration, margin, ("ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND
                                  else "UNKNOWN")

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Union[list[int], np.ndarray], remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Union[list[int], np.ndarray], notif_msg: bytes = b"",
                          backends: list[str] = [], skip_desc_merge: bool = False) -> nixl_xfer_handle:  # noqa: B006
        handle = self.agent.makeXferReq(self.nixl_ops[operation], local_xfer_side._handle, local_indices,
                                        remote_xfer_side._handle, remote_indices, notif_msg,
                                        self._handles(backends) if backends else (), skip_desc_merge)
        return nixl_xfer_handle(self.agent, handle)

    def initialize_xfer(self, operation: str, local_descs: nixlBind.nixlXferDList,
                        remote_descs: nixlBind.nixlXferDList, remote_agent: str, notif_msg: bytes = b"",
                        backends: list[str] = []) -> nixl_xfer_handle:  # noqa: B006
        op = self.nixl_ops[operation]
        handle = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg,
                                          self._handles(backends))
        return nixl_xfer_handle(self.agent, handle)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")   # IntEnum keys hash as ints

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        backend = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h is backend)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends or []))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # ------------------------------------------------------------ notifications
    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: list[str] = [],
                               tag_is_prefix: bool = True) -> bool:  # noqa: B006
        self.update_notifs(backends)
        if isinstance(remote_agent_name, (bytes, bytearray)):   # as add_remote_agent returns it
            remote_agent_name = remote_agent_name.decode()
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if (msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        self.agent.genNotif(remote_agent_name, notif_msg, None if backend is None else self.backends[backend])

    # ------------------------------------------------------------ metadata
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: nixlBind.nixlRegDList, inc_conn_info: bool = False,
                                   backends: list[str] = []) -> bytes:  # noqa: B006
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs: nixlBind.nixlRegDList, inc_conn_info: bool = False,
                                    backends: list[str] = [], ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                                    label: str = "") -> None:  # noqa: B006
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                              label: str = "") -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Optional[nixlBind.nixlXferDList] = None) -> bool:
        descs = descs if descs is not None else nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # ------------------------------------------------------------ descriptors
    def _dlist(self, cls: type, width: int, descs: Any, mem_type: Optional[str]) -> Any:
        """The descriptor list of kind `cls` from tuples, an array, a tensor
        or a list of tensors; None (logged) for what cannot be one."""
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, nixlBind._DList):
            log.error("kvflow.compat.nixl: a %s where a %s is needed", type(descs).__name__, cls.__name__)
            return None
        if _is_tensor(descs):
            span = _tensor_span(descs)
            if span is None:
                log.error("kvflow.compat.nixl: please use contiguous tensors")
                return None
            return cls(self.nixl_mems[span[3]], [span[:3] + (("",) if width == 4 else ())])
        if isinstance(descs, np.ndarray):
            # Nx3 (address, length, device ID) rows; a registration list gets
            # empty metadata for each, as NIXL's does. Remote lists take tuples.
            if mem_type is None:
                log.error("kvflow.compat.nixl: please give a mem_type with a descriptor array")
                return None
            if cls is nixlBind.nixlRemoteDList or descs.ndim != 2 or descs.shape[1] != 3:
                log.error("kvflow.compat.nixl: an Nx3 array is needed for a %s, not %s", cls.__name__, descs.shape)
                return None
            return cls(self.nixl_mems[mem_type], descs)
        if isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0]):
            spans = [_tensor_span(t) for t in descs]
            if any(s is None for s in spans) or len({t.device for t in descs}) != 1:
                log.error("kvflow.compat.nixl: please use contiguous tensors on one device")
                return None
            rows = [s[:3] + (("",) if width == 4 else ()) for s in spans]  # type: ignore[index]
            return cls(self.nixl_mems[spans[0][3]], rows)  # type: ignore[index]
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                log.error("kvflow.compat.nixl: please give a mem_type with descriptor tuples")
                return None
            kind = self.nixl_mems[mem_type]
            if len(descs[0]) != width:
                log.error("kvflow.compat.nixl: %d-tuples are needed here", width)
                return None
            return cls(kind, list(descs))
        if isinstance(descs, (list, tuple)) and not descs and mem_type is not None:
            return cls(self.nixl_mems[mem_type])
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlBind.nixlXferDList]:
        return self._dlist(nixlBind.nixlXferDList, 3, descs, mem_type)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlBind.nixlRegDList]:
        return self._dlist(nixlBind.nixlRegDList, 4, descs, mem_type)

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlBind.nixlRemoteDList]:
        return self._dlist(nixlBind.nixlRemoteDList, 4, descs, mem_type)

    def get_serialized_descs(self, descs: Any) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)
