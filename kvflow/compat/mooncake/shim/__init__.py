"""A stand-in `mooncake` package (`mooncake.engine`, `mooncake.engine.
TransferEngine`) backed by kvflow.compat.mooncake, for code that imports
Mooncake itself: put `shim_path()` first on sys.path (or PYTHONPATH), or
run `python -m kvflow.compat.mooncake.shim` to print it."""
from __future__ import annotations

import os

__all__ = ["shim_path"]


def shim_path() -> str:
    """The directory holding the stand-in `mooncake` package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "root")
