"""`nixl._bindings` as kvflow.compat.nixl provides it."""
import sys

from kvflow.compat.nixl import _bindings as _impl

sys.modules[__name__] = _impl
