"""The await-based API: Engine (lifecycle and composition), Peer (a
connected remote engine and its batch API), Transfer (one batch in flight)
and EngineThread (an engine on its own loop thread, for blocking callers)."""
from kvflow.engine.engine import Engine
from kvflow.engine.peer import Peer
from kvflow.engine.transfer import Transfer

__all__ = ["Engine", "Peer", "Transfer"]
