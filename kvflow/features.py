"""What this build of kvflow contains. Absent features are False, and using
one raises ProviderUnavailableError."""
from __future__ import annotations

from kvflow import _core
from kvflow._cuda import built as _cuda_built

try:
    from kvflow import _verbs  # noqa: F401
    _HAVE_VERBS = True
except ImportError:             # built without libibverbs headers
    _HAVE_VERBS = False

features: dict[str, bool] = {
    "tcp": True,
    "local": True,
    "verbs": _HAVE_VERBS,       # the rdma provider was built (devices are found at run time)
    "rdma": _HAVE_VERBS,
    "cuda": _cuda_built(),  # the CUDA module was built (nvcc); kvflow.cuda.available(): a device here
    "debug": bool(getattr(_core, "DEBUG", False)),
}
