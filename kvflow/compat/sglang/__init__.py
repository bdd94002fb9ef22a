"""kvflow as an SGLang transfer backend: `--disaggregation-transfer-backend kvflow`.

    import kvflow.compat.sglang
    kvflow.compat.sglang.install()      # before SGLang's schedulers start

`install()` registers the name with SGLang (a `TransferBackend` member, an
entry in the server's choices, and `get_kv_class` answering for it), so
SGLang's prefill and decode schedulers build kvflow's classes and drive them
unchanged. Run it in every process that builds a scheduler (SGLang spawns
them: put it in a `sitecustomize.py`, or in the launcher before
`sglang.launch_server`'s main when the processes fork).

What the classes are: SGLang's own disaggregation protocol (its bootstrap
server, its zmq control messages, its KV layouts, heterogeneous TP, state
pools, staging, aborts and heartbeats: everything its schedulers call on a
manager, sender and receiver) as SGLang's Mooncake backend implements it,
with kvflow's engine moving the bytes (`kvflow.compat.mooncake`, kvflow's
Mooncake-compatible TransferEngine: its tcp, rdma and same-host providers,
rails, failover and QoS). SGLang's protocol moves with SGLang's releases;
reusing its code is what keeps the schedulers' many calls right (0.5.23
calls about fifty methods and attributes beyond the abstract base).

Not used by SGLang here: kvflow.connector's own request protocol (layer-wise
sends, completion notices through the data path), which serves asyncio
servers that are not SGLang. The transport is chosen as SGLang's Mooncake
backend chooses it (MOONCAKE_PROTOCOL, default rdma; kvflow falls back to tcp
with a warning on a host without a usable RDMA device). The KV pool must be
in host memory until kvflow moves GPU memory.
"""
from __future__ import annotations

import threading
from typing import Any

import kvflow.compat.mooncake as kvflow_mooncake

BACKEND = "kvflow"

_lock = threading.Lock()
_engine: Any = None
_installed: dict[str, Any] = {}


def _sglang() -> Any:
    try:
        from sglang.srt.disaggregation import utils
    except ImportError as e:  # a clear message, not SGLang's import chain
        raise ImportError("kvflow.compat.sglang needs SGLang (pip install sglang)") from e
    return utils


def _classes() -> dict[str, type]:
    """The backend's classes, built on first use (they subclass SGLang's)."""
    if "classes" in _installed:
        return _installed["classes"]
    from sglang.srt.disaggregation.mooncake import conn as mc
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
    from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

    class KVFlowTransferEngine(mte.MooncakeTransferEngine):
        """SGLang's TransferEngine wrapper around kvflow's engine (only the
        construction differs: the wrapper imports mooncake.engine itself)."""

        def __init__(self, hostname: str, gpu_id: int | None = None, ib_device: str | None = None) -> None:
            self.engine = kvflow_mooncake.TransferEngine()
            self.hostname = hostname
            self.gpu_id = gpu_id if gpu_id is not None else 0
            self.ib_device = ib_device or ""
            self.initialize(hostname=hostname, device_name=self.ib_device)
            self.session_id = NetworkAddress(hostname, self.engine.get_rpc_port()).to_host_port_str()

    class KVFlowKVManager(mc.MooncakeKVManager):
        """SGLang's Mooncake manager on kvflow's engine (one per process,
        shared by the ranks' managers as SGLang shares Mooncake's)."""

        def init_engine(self) -> None:
            global _engine
            with _lock:
                if _engine is None:
                    _engine = KVFlowTransferEngine(get_local_ip_auto(), self.kv_args.gpu_id,
                                                   self.kv_args.ib_device)
            self.engine = _engine

    class KVFlowKVSender(mc.MooncakeKVSender):
        pass

    class KVFlowKVReceiver(mc.MooncakeKVReceiver):
        pass

    class KVFlowKVBootstrapServer(mc.MooncakeKVBootstrapServer):
        pass

    _installed["classes"] = {"manager": KVFlowKVManager, "sender": KVFlowKVSender,
                             "receiver": KVFlowKVReceiver, "bootstrap_server": KVFlowKVBootstrapServer}
    return _installed["classes"]


def _add_member(enum_cls: Any, name: str) -> Any:
    """Adds `name` to SGLang's TransferBackend (an Enum, closed to
    subclassing): TransferBackend("kvflow") and TransferBackend.KVFLOW work."""
    existing = enum_cls._value2member_map_.get(name)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name.upper()
    member._value_ = name
    member.__init__(name)
    enum_cls._member_map_[member._name_] = member
    enum_cls._value2member_map_[name] = member
    enum_cls._member_names_.append(member._name_)
    type.__setattr__(enum_cls, member._name_, member)
    return member


def install(name: str = BACKEND) -> Any:
    """Registers kvflow with SGLang as transfer backend `name` and returns
    its TransferBackend member (idempotent). Raises ImportError without SGLang."""
    import sys

    utils = _sglang()
    with _lock:
        if "member" in _installed:
            return _installed["member"]
        member = _add_member(utils.TransferBackend, name)
        original = utils.get_kv_class
        kinds = {utils.KVClassType.MANAGER: "manager", utils.KVClassType.SENDER: "sender",
                 utils.KVClassType.RECEIVER: "receiver",
                 utils.KVClassType.BOOTSTRAP_SERVER: "bootstrap_server"}

        def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
            if transfer_backend is member and class_type in kinds:
                return _classes()[kinds[class_type]]
            return original(transfer_backend, class_type)

        get_kv_class.__doc__ = original.__doc__
        get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
        # Modules that imported the function by name before now (the
        # schedulers' prefill and decode mixins) get the new one too.
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("sglang") and \
                    getattr(mod, "get_kv_class", None) is original:
                mod.get_kv_class = get_kv_class
        try:
            from sglang.srt.arg_groups import choices
        except ImportError:
            choices = None
        if choices is not None and name not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.DISAGG_TRANSFER_BACKEND_CHOICES.append(name)
        _installed["member"] = member
        return member


def installed() -> bool:
    return "member" in _installed
