"""What this build of kvflow contains. Absent features are False, and using
one raises ProviderUnavailableError."""
from __future__ import annotations

from kvflow import _core

features: dict[str, bool] = {
    "tcp": True,
    "local": True,
    "verbs": False,     # RDMA provider: not built yet (issue 3)
    "cuda": False,      # CUDA module: not built yet
    "debug": bool(getattr(_core, "DEBUG", False)),
}
