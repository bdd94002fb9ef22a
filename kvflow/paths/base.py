"""PathContext: what a path (staging, CUDA IPC, the relay) may use of its
engine, as a ProviderContext is what a provider may use
(kvflow.providers.base) and a PeerContext what a Peer may
(kvflow.engine.context); and PathPeer, what a path may use of a peer."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

from kvflow.errors import KVFlowError
from kvflow.memory import Access, Region

__all__ = ["PathContext", "PathPeer"]

RW = Access.READ | Access.WRITE


class PathPeer(Protocol):
    """A connected peer as a path uses it: its address, its control link
    (lease requests, forwards), host-memory batches (the legs of a staged
    transfer, a relayed slot's hop, a forward to its destination) and
    whether a range lies in one of its host regions."""

    address: str
    link: Any

    async def write(self, local_addrs: Any, remote_addrs: Any, lengths: Any) -> None: ...

    def holds_host(self, addr: int, n: int, write: bool) -> bool: ...


class PathContext:
    """What a path may use of its engine, and nothing else: paths/ never
    imports engine/ (tests/test_layers.py), it gets these callables, bound
    methods of the engine's (as ProviderContext's are). One per engine,
    built by the engine; its router hands it to each path it makes.

    register_host(addr, n, name, access=READ|WRITE) -> Region: memory of
    the path's own (staging slots, an inbox, lanes) registered as a host
    region, so the providers write into it and send from it;
    register_device(addr, n, name) -> Region: device lanes (a GPU region
    peers may not touch); deregister(region); holds_host(addr, n): whether
    a range lies in one of the engine's host regions; host_spans(): those
    regions as sorted (start, end) pairs; gpu_regions(): the engine's GPU
    regions' table (kvflow.regions.RegionTable; None: none yet);
    connect(address) -> PathPeer (a relay's members and destinations).
    copier(device) and allocate(nbytes) -> (addr, keepalive) make copy
    engines and staging memory; None: CUDA's (kvflow.gpu.copy's
    CudaCopyEngine, pinned host memory): tests give host ones."""

    __slots__ = ("register_host", "register_device", "deregister", "holds_host", "host_spans", "gpu_regions",
                 "connect", "copier", "allocate")

    def __init__(self, *, register_host: Callable[..., Region], deregister: Callable[[Region], None],
                 holds_host: Callable[[int, int], bool],
                 host_spans: Callable[[], list[tuple[int, int]]] = list,
                 gpu_regions: Callable[[], Any] = lambda: None,
                 register_device: Callable[[int, int, str], Region] | None = None,
                 connect: Callable[[str], Awaitable[PathPeer]] | None = None,
                 copier: Callable[[int], Any] | None = None,
                 allocate: Callable[[int], tuple[int, Any]] | None = None) -> None:
        self.register_host = register_host
        self.register_device = register_device
        self.deregister = deregister
        self.holds_host = holds_host
        self.host_spans = host_spans
        self.gpu_regions = gpu_regions
        self.connect = connect
        self.copier = copier
        self.allocate = allocate

    def let_go(self, regions: list[Region], deregister: bool) -> None:
        """A path's own regions, deregistered (deregister=False: the engine's
        core closed and they went with it) and forgotten; one already gone
        is no error (the engine may be closing)."""
        if deregister:
            for r in regions:
                try:
                    self.deregister(r)
                except KVFlowError:
                    pass
        regions.clear()
