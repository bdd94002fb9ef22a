"""The provider contract: what every provider (local, tcp, rdma, and the
cuda and relay providers to come) offers its engine, and what the engine
hands down to it.

Modelled on NIXL's backend interface: capabilities plus a lifecycle. A
provider declares what it can do (`caps`), keeps its own part of the
engine's descriptor (`describe`), says whether it reaches a peer
(`reaches`), connects a native channel to it (`connect`), and may register
memory (`register`, keys per region) and handle control messages of its
own (`control`). The engine walks its providers in preference order and
never asks one for its name to decide what to do: it asks its caps.

A provider never sees the Engine or the Peer: it gets a ProviderContext
(what it may use of its engine) and, per peer, a PeerLink (what it may use
of that peer's control connection).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Protocol

from kvflow.memory import Access

if TYPE_CHECKING:
    from kvflow.control.descriptor import Descriptor
    from kvflow.topology import Topology

__all__ = ["BatchSink", "Caps", "PeerLink", "Provider", "ProviderContext", "RegionKeys"]


@dataclass(frozen=True)
class Caps:
    """What a provider can do.

    remote: reaches engines on other hosts; same_host: reaches engines on
    this host; data_notify: notifications travel on the data path, ordered
    after the data (else on the control connection); memory: the memory
    kinds it moves ("host" now; "cuda" next); detached: a thread may submit
    a batch and wait for it itself (Peer.write_blocking), the loop taking
    no part; lifeline: the control connection is the only sign of the
    peer's life (no data socket of its own notices a death), so the channel
    closes when the control connection ends."""

    remote: bool
    same_host: bool
    data_notify: bool = False
    memory: frozenset[str] = frozenset({"host"})
    detached: bool = False
    lifeline: bool = False


@dataclass(frozen=True)
class RegionKeys:
    """What registering a region with a provider gave: local keys for the
    native table, remote keys for the descriptor (one per device), and how
    long it took."""

    lkeys: tuple[int, ...]
    rkeys: tuple[int, ...]
    seconds: float = 0.0


class BatchSink(Protocol):
    """The engine's batch table, as a provider sees it: batches it posts
    itself (probes, notifications) are tracked here and awaited, and
    batches it completed on the loop's thread (tcp write acks) are
    finished with on_completions()."""

    def track(self, batch_id: int, peer: str, op: int, nbytes: int,
              timeout: float | None) -> Awaitable[None]: ...

    def on_completions(self) -> None: ...


class PeerLink(Protocol):
    """What a provider may use of one peer: its address, its descriptor
    (refreshed when the peer pushes a new one), its region table (native),
    whether it is alive, a request/reply on its control connection, and
    closing it (a provider that finds nothing can reach it any more)."""

    address: str

    @property
    def descriptor(self) -> "Descriptor": ...

    @property
    def table(self) -> Any: ...

    @property
    def alive(self) -> bool: ...

    async def request(self, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@dataclass
class ProviderContext:
    """What a provider may use of its engine, handed down instead of the
    Engine: the native core, the loop, the batch table, where
    notifications that arrive on the data path go (`deliver(peer, data)`),
    whom to tell when regions got new keys (`rekeyed`: region id -> (lkeys,
    rkeys), after a device came back), the host topology and the memory
    location, the peer-liveness keepalive, whether this process's
    engine at an address is that very engine (`same_process`), the native
    core of this process's engine at an address (`process_core`: None when
    there is none; a same-process local channel enters its region fence),
    and its receive window (`receive_window`, bytes; 0: none)."""

    core: Any
    loop: asyncio.AbstractEventLoop
    batches: BatchSink
    deliver: Callable[[str, bytes], None]
    rekeyed: Callable[[dict[int, tuple[list[int], list[int]]]], None]
    topology: "Topology | None"
    location: str
    keepalive: float
    same_process: Callable[[str, "Descriptor"], bool] = field(default=lambda address, desc: False)
    process_core: Callable[[str], Any] = field(default=lambda address: None)
    receive_window: int = 0


class Provider:
    """The contract (see the module doc). Subclasses set `name` and `caps`
    and implement `describe`, `reaches` and `connect`; the rest has
    defaults for providers that need nothing there.

    `control` maps the control messages a provider answers (on the
    target's side) to the reply type sent when the provider does not run
    on that engine; `replies` are the reply types the initiator's control
    reader routes back to a waiting request()."""

    name: ClassVar[str]
    caps: ClassVar[Caps]
    control: ClassVar[dict[str, str]] = {}
    replies: ClassVar[frozenset[str]] = frozenset()
    pushed: ClassVar[bool] = False      # its part of the descriptor changes at run time (pushed to peers)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Opens what the provider serves (listeners); after the context is set."""

    async def close(self) -> None:
        """Closes everything the provider opened. Idempotent."""

    # ------------------------------------------------------------ memory
    def register(self, region_id: int, addr: int, length: int, access: Access,
                 writable: bool) -> RegionKeys | None:
        """Makes a region reachable through this provider: its keys, or
        None where the provider needs no registration."""
        return None

    def deregister(self, region_id: int) -> None:
        """Undoes register(); no-op where nothing was registered."""

    # ------------------------------------------------------------ descriptor
    def describe(self) -> dict[str, Any]:
        """What this provider sets of the descriptor's shared fields (tcp:
        its data endpoints; local: the process identity), as Descriptor
        fields (the wire encodes them under the same names)."""
        raise NotImplementedError

    def part(self) -> Any:
        """This provider's own part of the descriptor (Descriptor.providers[
        name], on the wire under its name), or None; a provider with a part
        registers its decoder (kvflow.control.descriptor.register_part)."""
        return None

    def reaches(self, address: str, remote: "Descriptor") -> str | None:
        """None if this provider can connect to the peer at `address` (the
        address this engine dialled, never one the descriptor claims) that
        `remote` describes, else why not (said when no provider reaches it)."""
        raise NotImplementedError

    # ------------------------------------------------------------ peers
    async def connect(self, link: PeerLink, remote: "Descriptor", token: bytes) -> Any:
        """A native channel to the peer (`token`: the session token the
        handshake gave). Raises ProviderUnavailableError when the peer
        turns out not to be reachable this way (the engine tries the next
        provider), PeerUnreachableError or ProtocolError."""
        raise NotImplementedError

    def started(self, link: PeerLink, channel: Any) -> None:
        """The peer is in service over `channel` (tcp starts its rail watcher)."""

    def closed(self, channel: Any) -> None:
        """The peer's channel was closed; forget what belongs to it."""

    def remote_changed(self, link: PeerLink, channel: Any) -> None:
        """The peer pushed a new part of its descriptor for this provider."""

    def abort_batch(self, channel: Any, batch_id: int) -> bool:
        """A cancelled batch is still on the wire after its drain grace:
        make sure none of its bytes lands later (tcp resets the connections
        carrying it). True if something was reset; the other providers
        finish or fail their slices in bounded time (the native channel's
        ops say which: kvf_provider_ops.abort_batch)."""
        return bool(channel.abort_batch(batch_id))

    def connections(self, channel: Any) -> list[dict[str, Any]]:
        """Per-connection statistics of a channel (tcp: one per data connection)."""
        return []

    def device_rows(self) -> list[dict[str, Any]]:
        """One row per device this provider opened (rdma: per verbs
        device; Engine.devices()); [] for providers with none."""
        return []

    def ibgda_endpoints(self, channel: Any) -> list[Any]:
        """The channel's endpoints a GPU can drive itself (rdma with
        Engine(rdma_ibgda=True): kvflow.providers.rdma.ibgda); [] elsewhere."""
        return []

    async def notify(self, link: PeerLink, channel: Any, data: bytes) -> bool:
        """Sends a notification on the data path (caps.data_notify): True
        once sent, False when it must go on the control connection."""
        return False

    # ------------------------------------------------------------ target side
    def on_control(self, peer: str, session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Answers a control message of this provider's (see `control`)."""
        raise NotImplementedError

    def drop_session(self, session: Any) -> None:
        """A control session ended: drop what was made for its peer."""

    # ------------------------------------------------------------ scheduling
    def estimate(self, nbytes: int, entries: int) -> float:
        """Seconds a batch of `entries` entries and `nbytes` bytes takes
        on an idle link (QoS and the conductor's transfer-time estimate)."""
        raise NotImplementedError

    def poller(self, channel: Any) -> "Callable[[int, float], object] | None":
        """What a thread polling its own detached batches (PostedTransfer)
        calls to move them on without the loop (tcp: read the write acks
        itself), as progress(batch_id, budget): it may keep at it for up to
        `budget` seconds until that batch finished; None: the loop's work
        finishes them."""
        return None

    def device_names(self) -> list[str] | None:
        """Names of the devices whose index a native status may carry."""
        return None

    def __repr__(self) -> str:
        return f"<kvflow provider {self.name}>"
