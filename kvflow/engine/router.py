"""Router: where each batch of a Peer goes. The one place in engine/ that
decides a batch's path, once per batch, from what the engine has (GPU
memory, a relay group) and what the peer's provider declares it can do
(Caps.remote, Caps.same_host, Caps.memory), never from which provider it
is: Mooncake's MultiTransport::selectTransport, for kvflow's paths.

It is also engine/'s one door into kvflow.paths (tests/test_layers.py):
it makes the paths (GPU memory, the relay member) with the engine's
PathContext, answers their control messages and closes them; the
engine composes through it."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvflow._core import OP_WRITE
from kvflow.errors import InvalidArgumentError
from kvflow.memory import CUDA, Access, Region
from kvflow.paths.base import PathContext
from kvflow.paths.ipc import ipc_handle
from kvflow.paths.lease import REPLIES as INBOX_REPLIES, Inbox, inbox_handlers
from kvflow.paths.relay import INBOX as RELAY_INBOX, Relay, RelayGroup
from kvflow.paths.staged import INBOX as GPU_INBOX, STAGING_BYTES, STAGING_SLOT, GpuMemory

if TYPE_CHECKING:
    from kvflow.providers.base import Provider

# (PathContext, RelayGroup, STAGING_BYTES, STAGING_SLOT, INBOX_REPLIES: what
# the engine composes with, through this module)
__all__ = ["INBOX_REPLIES", "NATIVE", "Path", "PathContext", "RelayGroup", "Route", "Router", "STAGING_BYTES",
           "STAGING_SLOT"]


class Path(enum.Enum):
    """How a batch travels."""
    NATIVE = "native"       # the peer's provider channel, through the native core (kvf_submit)
    STAGED = "staged"       # GPU memory on either side, through host bounce slots (kvflow.paths.staged)
    IPC = "ipc"             # GPU memory, the peer on this host: CUDA IPC copies where its handles
                            # map, the rest staged (kvflow.paths.ipc)
    RELAYED = "relayed"     # a write to another rail, through a relay member (kvflow.paths.relay)


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
    them. It makes `gpu` (when GPU memory is first registered, or first
    moved toward a peer's) and `relay` (join(), when the engine joins a
    relay group), each with the engine's PathContext; peers ask."""

    __slots__ = ("_gpu", "_relay", "rerouting", "_ctx", "_same_process", "_staging_bytes")

    def __init__(self, ctx: PathContext, same_process: Callable[[str, Any], bool],
                 staging_bytes: int = STAGING_BYTES) -> None:
        self._gpu: GpuMemory | None = None
        self._relay: Relay | None = None
        # whether a batch may leave the native path at all (GPU memory here,
        # a relay group): one attribute the write path tests before asking
        self.rerouting = False
        self._ctx = ctx                        # what the paths may use of the engine
        self._same_process = same_process      # (address, descriptor) -> an engine of this very process?
        self._staging_bytes = staging_bytes

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
        if self._gpu is None:
            self.gpu = GpuMemory(self._ctx, staging_bytes=self._staging_bytes, slot_bytes=STAGING_SLOT)
        assert self._gpu is not None
        return self._gpu

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

    # ------------------------------------------------------------ composition
    def add_gpu_region(self, span: Any, name: str | None, access: Access, rid: int) -> Region:
        """A GPU region (kept out of the native tables: batches that reach it
        are staged or copied), with its CUDA IPC handle for peers on this
        host. Raises InvalidArgumentError where it overlaps one."""
        region = Region(span.addr, span.length, name, access, rid, span.keep, kind=CUDA, device=span.device,
                        ipc=ipc_handle(span))
        if not self.staging().local.add(region):
            raise InvalidArgumentError(f"region {span.addr:#x}+{span.length} overlaps a registered GPU region")
        return region

    def remove_gpu_region(self, region: Region) -> None:
        assert self._gpu is not None
        self._gpu.local.remove(region)

    def join(self, group: RelayGroup, address: str) -> None:
        """Joins a relay group as `address` (its lanes, then its file)."""
        self.relay = Relay(group, address, self._ctx)
        self.relay.publish()

    def relay_stats(self) -> dict[str, int] | None:
        return self._relay.stats() if self._relay is not None else None

    def staging_stats(self) -> dict[str, dict[str, int] | None]:
        """The host slots the paths hold (Engine.staging_stats()): GPU
        memory's outgoing pool and inbox, the relay member's inbox; None
        for a path this engine has not made."""
        gpu = self._gpu.readout() if self._gpu is not None else {"outgoing": None, "inbox": None}
        return {**gpu, "relay_inbox": self._relay.inbox.readout() if self._relay is not None else None}

    def control_handlers(self, address: str) -> dict[str, Callable[[str, Any, dict[str, Any]], Any]]:
        """The paths' control messages: leases of an inbox, a relay member's
        forwards, a staged GPU transfer's landings and fetches; refused
        (with why) where this engine has no such path."""
        def inbox(name: Any) -> "Inbox | str":
            if name == GPU_INBOX:
                if self._gpu is None or not self._gpu.local:
                    return f"{address} has no GPU memory registered"
                return self._gpu.inbox
            if name == RELAY_INBOX:
                if self._relay is None:
                    return f"{address} is in no relay group"
                return self._relay.inbox
            return f"{address} has no inbox {name!r}"

        def forward(peer: str, session: Any, msg: dict[str, Any]) -> Any:
            if self._relay is None:
                return {"t": "stage_error", "message": f"{address} is in no relay group"}
            return self._relay.on_forward(peer, session, msg)

        def on_gpu(name: str) -> Callable[[str, Any, dict[str, Any]], Any]:
            def handle(peer: str, session: Any, msg: dict[str, Any]) -> Any:
                if self._gpu is None:
                    return {"t": "stage_error", "message": f"{address} has no GPU memory registered"}
                return getattr(self._gpu, name)(peer, session, msg)
            return handle

        return {**inbox_handlers(inbox), "relay_forward": forward, "stage_land": on_gpu("on_land"),
                "stage_fetch": on_gpu("on_fetch")}

    def drop_session(self, session: Any) -> None:
        """A control session ended: the leases it held end with it."""
        if self._gpu is not None:
            self._gpu.inbox.drop_session(session)
        if self._relay is not None:
            self._relay.inbox.drop_session(session)

    async def stop(self) -> None:
        """Before the engine closes its peers and core: no member routes
        through this engine any more, and its lanes stop."""
        if self._relay is not None:
            await self._relay.stop()

    def close(self) -> None:
        """Frees the staging and relay memory: the engine calls this after
        its native core closed, until when its channels could be receiving
        into it or sending from it (so nothing is deregistered)."""
        if self._gpu is not None:
            gpu, self.gpu = self._gpu, None
            gpu.close(deregister=False)
        if self._relay is not None:
            relay, self.relay = self._relay, None
            relay.close(deregister=False)
