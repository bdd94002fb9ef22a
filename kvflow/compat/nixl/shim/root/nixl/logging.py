"""`nixl.logging` as kvflow.compat.nixl provides it."""
import sys

from kvflow.compat.nixl import logging as _impl

sys.modules[__name__] = _impl
