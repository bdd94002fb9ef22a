"""A Peer's faces toward the layers below it: Link, what providers (and a
path's lease requests) may use of a peer (kvflow.providers.base.PeerLink),
never the Peer itself; ClosedChannel, the channel a Peer has while it has
none (before connect() finished, after close() or a lapse)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from kvflow.control.descriptor import Descriptor
from kvflow.status import ECLOSED

__all__ = ["ClosedChannel", "Link"]


class ClosedChannel:
    """Stands in for the provider channel before connect() finished and after
    close(): every submission fails with PeerLostError."""

    alive = False

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def submit(self, op: int, *columns: Any) -> tuple[int, int, int]:
        return ECLOSED, 0, 0

    def submit_poll(self, op: int, *columns: Any) -> tuple[int, int, int, int]:
        return ECLOSED, 0, 0, 0

    def close(self) -> None:
        pass


class Link:
    """What providers may use of a peer (kvflow.providers.base.PeerLink).
    Its hooks read the Peer's state when asked (a lapsed peer that comes
    back has a new session): descriptor(), table() (the native RemoteTable),
    alive() (not closed, the control connection up: the channel may be
    down), session() (its ControlSession), close()."""

    __slots__ = ("address", "_descriptor", "_table", "_alive", "_session", "_close")

    def __init__(self, address: str, *, descriptor: Callable[[], Descriptor], table: Callable[[], Any],
                 alive: Callable[[], bool], session: Callable[[], Any],
                 close: Callable[[], Awaitable[None]]) -> None:
        self.address = address
        self._descriptor = descriptor
        self._table = table
        self._alive = alive
        self._session = session
        self._close = close

    @property
    def descriptor(self) -> Descriptor:
        return self._descriptor()

    @property
    def table(self) -> Any:
        return self._table()

    @property
    def alive(self) -> bool:
        """Not closed, and the control connection is up (the channel may be down)."""
        return self._alive()

    async def request(self, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        return await self._session().request(msg, timeout)

    def send(self, msg: dict[str, Any]) -> None:
        """A control message that needs no reply."""
        self._session().send(msg)

    async def close(self) -> None:
        await self._close()

    def __repr__(self) -> str:
        return f"<kvflow peer link {self.address}>"
