"""kvflow's stand-in for the `nixl` package (kvflow.compat.nixl)."""
from kvflow.compat.nixl import *  # noqa: F401,F403
from kvflow.compat.nixl import __all__  # noqa: F401
