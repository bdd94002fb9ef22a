"""Moved to kvflow.gpu.proxy (issue 41): this name keeps working for code
that imported the put proxy from here (docs/gpu.md showed it)."""
from kvflow.gpu.proxy import OP_GET, OP_PUT, PutProxy, PutRing, PutRingError, ring_bytes, status_of

__all__ = ["OP_GET", "OP_PUT", "PutProxy", "PutRing", "PutRingError", "ring_bytes", "status_of"]
