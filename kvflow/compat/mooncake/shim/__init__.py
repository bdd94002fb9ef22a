"""A stand-in `mooncake` package (`mooncake.engine`, `mooncake.engine.
TransferEngine`) backed by kvflow.compat.mooncake, for code that imports
Mooncake itself: put `shim_path()` first on sys.path (or PYTHONPATH), or
run `python -m kvflow.compat.mooncake.shim` to print it. `bin_path()` (`...shim
--bin`) holds stand-in executables for PATH: `mooncake_master` (kvflow's
store master with mooncake_master's flags, kvflow.compat.mooncake.master),
`mooncake_client` (the standalone real client dummy clients forward to,
kvflow.compat.mooncake.client) and `mooncake_http_metadata_server`."""
from __future__ import annotations

import os

__all__ = ["bin_path", "shim_path"]


def shim_path() -> str:
    """The directory holding the stand-in `mooncake` package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "root")


def bin_path() -> str:
    """The directory holding the stand-in `mooncake_master` and `mooncake_client`."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")
