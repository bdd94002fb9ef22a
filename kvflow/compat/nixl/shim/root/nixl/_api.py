"""`nixl._api` as kvflow.compat.nixl provides it."""
import sys

from kvflow.compat.nixl import _api as _impl

sys.modules[__name__] = _impl
