"""Router: where each batch of a Peer goes. The one place in engine/ that
decides a batch's path, once per batch, from what the engine has (GPU
memory, a relay group) and what the peer's provider declares it can do
(Caps.remote, Caps.same_host, Caps.memory), never from which provider it
is: Mooncake's MultiTransport::selectTransport, for kvflow's paths."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvflow.engine.gpu import GpuMemory
    from kvflow.engine.relay import Relay
    from kvflow.providers.base import Provider

__all__ = ["Router"]


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
