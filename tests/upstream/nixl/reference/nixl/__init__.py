"""Not upstream: `nixl` for the installed nixl-cu12 wheel (which installs
its module as nixl_cu12; NIXL's `nixl` meta package is not installed), so
that the same upstream files run against the real NIXL for reference."""
import importlib
import sys

for _name in ("_api", "_bindings", "_utils", "logging"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nixl_cu12.{_name}")
from nixl_cu12 import *  # noqa: E402,F401,F403
