"""A stand-in `nixl` package (`nixl._api`, `nixl._bindings`, `nixl._utils`,
`nixl.logging`) backed by kvflow.compat.nixl, for code that imports NIXL
itself: put `shim_path()` first on sys.path (or PYTHONPATH), or run
`python -m kvflow.compat.nixl.shim` to print it."""
from __future__ import annotations

import os

__all__ = ["shim_path"]


def shim_path() -> str:
    """The directory holding the stand-in `nixl` package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "root")
