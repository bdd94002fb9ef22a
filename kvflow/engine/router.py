"""Router: where each batch of a Peer goes. The one place in engine/ that
decides a batch's path, once per batch, from what the engine has (GPU
memory, a relay group) and what the peer's provider declares it can do
(Caps.remote, Caps.same_host, Caps.memory), never from which provider it
is: Mooncake's MultiTransport::selectTransport, for kvflow's paths."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvflow._core import OP_WRITE
from kvflow.memory import CUDA

if TYPE_CHECKING:
    from kvflow.engine.gpu import GpuMemory
    from kvflow.engine.relay import Relay
    from kvflow.providers.base import Provider

__all__ = ["NATIVE", "Path", "Route", "Router"]


class Path(enum.Enum):
    """How a batch travels."""
    NATIVE = "native"       # the peer's provider channel, through the native core (kvf_submit)
    STAGED = "staged"       # GPU memory on either side, through host bounce slots (kvflow.engine.gpu)
    IPC = "ipc"             # GPU memory, the peer on this host: CUDA IPC copies where its handles
                            # map, the rest staged (kvflow.engine.gpu: GpuMemory._direct)
    RELAYED = "relayed"     # a write to another rail, through a relay member (kvflow.engine.relay)


class Route:
    """The router's answer for one batch: its path, the relay member a
    relayed write goes through (`via`), how far the peer is for GPU
    memory (`reach`: "process", "host", "remote")."""

    __slots__ = ("path", "via", "reach")

    def __init__(self, path: Path, via: str | None = None, reach: str = "remote") -> None:
        self.path = path
        self.via = via
        self.reach = reach

    def __repr__(self) -> str:
        return f"<kvflow route {self.path.value}{' via ' + self.via if self.via else ''} ({self.reach})>"


NATIVE = Route(Path.NATIVE)     # the one answer the hot path gets: compared with `is`


class Router:
    """The engine's paths besides the native one and the decision between
    them. The engine sets `gpu` (when GPU memory is first registered) and
    `relay` (when it joins a relay group); peers ask."""

    __slots__ = ("_gpu", "_relay", "rerouting", "_gpu_memory", "_same_process")

    def __init__(self, gpu_memory: Callable[[], "GpuMemory"],
                 same_process: Callable[[str, Any], bool]) -> None:
        self._gpu: GpuMemory | None = None
        self._relay: Relay | None = None
        # whether a batch may leave the native path at all (GPU memory here,
        # a relay group): one attribute the write path tests before asking
        self.rerouting = False
        self._gpu_memory = gpu_memory          # makes the engine's GpuMemory (staging toward a peer's GPU)
        self._same_process = same_process      # (address, descriptor) -> an engine of this very process?

    @property
    def gpu(self) -> "GpuMemory | None":
        return self._gpu

    @gpu.setter
    def gpu(self, gpu: "GpuMemory | None") -> None:
        self._gpu = gpu
        self.rerouting = self._gpu is not None or self._relay is not None

    @property
    def relay(self) -> "Relay | None":
        return self._relay

    @relay.setter
    def relay(self, relay: "Relay | None") -> None:
        self._relay = relay
        self.rerouting = self._gpu is not None or self._relay is not None

    def path(self, op: int, la: Any, ra: Any, *, address: str, descriptor: Any, remote: Any,
             provider: "Provider | None", relay: bool = True) -> Route:
        """The one decision of a batch's path (Peer asks it once per batch,
        where `rerouting` or the peer's GPU regions say it may leave the
        native path). op, la, ra: the batch (local and remote addresses);
        the peer: its address, its descriptor (its relay group), `remote`
        (its GPU regions' table), `provider` (its channel's, by its caps);
        relay=False: a relayed batch's parts written around a lost member,
        never relayed again.

        1. A write to a destination on another rail, with a relay group:
           RELAYED through the member Relay.route() names (GPU memory too:
           the relay copies or stages it).
        2. GPU memory on either side, and the provider moves no GPU memory
           (Caps.memory): IPC where the provider reaches only this host
           (reach "process" or "host"), else STAGED.
        3. Else NATIVE."""
        if relay and op == OP_WRITE and self._relay is not None:
            via = self._relay.route(descriptor)
            if via is not None:
                return Route(Path.RELAYED, via=via)
        if self._touches_gpu(la, ra, remote) and (provider is None or CUDA not in provider.caps.memory):
            reach = self.reach(provider, address, descriptor)
            return Route(Path.STAGED if reach == "remote" else Path.IPC, reach=reach)
        return NATIVE

    def _touches_gpu(self, la: Any, ra: Any, remote: Any) -> bool:
        """Whether a batch reads or writes GPU memory: this engine's (local
        addresses) or the peer's (remote addresses, `remote` its table)."""
        if self._gpu is None:
            return bool(remote) and remote.any_in(np.asarray(ra, dtype=np.uint64))
        return self._gpu.touches(la, ra, remote)

    def staging(self) -> "GpuMemory":
        """The engine's GPU memory, made if it has none yet (host memory
        here, GPU memory there: the staging slots are still needed)."""
        return self._gpu if self._gpu is not None else self._gpu_memory()

    def reach(self, provider: "Provider | None", address: str, descriptor: Any) -> str:
        """How far a peer is, for GPU memory: "process" (an engine of this
        process), "host" (another process of this host), else "remote".
        Decided by the provider's caps: one that reaches no other host
        (Caps.remote False) connects only peers on this host."""
        if provider is None or provider.caps.remote or not provider.caps.same_host:
            return "remote"
        return "process" if self._same_process(address, descriptor) else "host"

    def forget_peer(self, address: str) -> None:
        """A peer's GPU regions changed or it closed: its CUDA IPC mappings go."""
        if self._gpu is not None:
            self._gpu.forget_peer(address)
