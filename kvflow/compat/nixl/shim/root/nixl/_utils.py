"""`nixl._utils` as kvflow.compat.nixl provides it."""
import sys

from kvflow.compat.nixl import _utils as _impl

sys.modules[__name__] = _impl
